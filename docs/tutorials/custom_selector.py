"""Tutorial script: write, register and check a custom LayerSelector.

The page ``docs/tutorials/custom_selector.md`` includes this file section by section, so the code
on the page is exactly the code that runs here. Three ways to use it:

    python docs/tutorials/custom_selector.py                  # lossless check on a tiny random model
    python -m pytest -q docs/tutorials/custom_selector.py     # the framework's contract tests
    PYTHONPATH=docs/tutorials python experiments/run.py --import custom_selector --selector middle_mlp

Nothing is downloaded: the model of the lossless check is a random 6-block Llama built in-process.
"""

# --8<-- [start:selector]
from __future__ import annotations

from dataclasses import dataclass

from framework import LayerPlan, LayerSelector, ModelInfo, RoundView, register_selector
from framework.config_fields import check_range, param


@dataclass(frozen=True)
class MiddleMLPConfig:
    fraction: float = param(
        0.5,
        help="fraction of the blocks, centred on the middle block, whose MLP sub-layer is skipped; in (0, 1]",
    )

    def __post_init__(self) -> None:
        # Raise ConfigError naming the field, the value and the allowed range; the CLI prefixes
        # the field with the flag (--selector.fraction).
        check_range("fraction", self.fraction, 0.0, 1.0, lo_open=True)


@register_selector("middle_mlp", config=MiddleMLPConfig)
class MiddleMLPSelector(LayerSelector):
    """Skip the MLP sub-layers of the middle blocks; every attention sub-layer runs.

    A toy static plan for the tutorial, not a published method.
    """

    def setup(self, info: ModelInfo) -> None:
        n = info.num_layers
        count = max(1, round(self.config.fraction * n))
        start = (n - count) // 2
        self._plan = LayerPlan.from_indices(n, mlp=range(start, start + count))

    def plan(self, state: RoundView) -> LayerPlan:
        return self._plan  # the same plan every round

    def summary(self) -> dict:
        return {"plan": self._plan.describe()}


# --8<-- [end:selector]


# --8<-- [start:config]
def show_config_handling() -> None:
    from framework import get_selector
    from framework.config_fields import ConfigError, build_config

    # The registry returns the class for its name; this is what --selector middle_mlp does.
    assert get_selector("middle_mlp") is MiddleMLPSelector

    # The CLI turns "--selector.fraction 0.25" into a config like this.
    cfg = build_config(MiddleMLPConfig, {"fraction": "0.25"}, flag_prefix="--selector.")
    print("parsed config:", cfg)

    # An out-of-range value is rejected with a message that names the flag.
    try:
        build_config(MiddleMLPConfig, {"fraction": "1.5"}, flag_prefix="--selector.")
    except ConfigError as err:
        print("rejected:", err)


# --8<-- [end:config]


# --8<-- [start:model]
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def tiny_llama(num_layers: int = 6, seed: int = 0) -> LlamaForCausalLM:
    """A random Llama with hidden size 64, built in-process, in float64."""
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        initializer_range=0.1,  # HF's 0.02 makes a random model repeat one token forever
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(torch.float64).eval()


# --8<-- [end:model]


# --8<-- [start:check]
def check_lossless(num_prompts: int = 3, max_new_tokens: int = 24) -> None:
    import selfspec
    from framework.testing import random_prompt, tiny_tokenizer

    dec = selfspec.Decoder.from_strategies(
        selector=MiddleMLPSelector(MiddleMLPConfig(fraction=0.5)),  # an instance: registered or not
        length="fixed",  # by name, default config: k = 4
        model=tiny_llama(),
        tokenizer=tiny_tokenizer(),
        max_new_tokens=max_new_tokens,
        log=None,
    )
    print("plan:", dec.strategies["selector"].summary()["plan"])
    for i in range(num_prompts):
        prompt = random_prompt(8, 128, 2 + i)[0].tolist()  # token ids (seeds whose answer is no EOS)
        cmp = dec.compare(prompt, warmup=False)  # vanilla and the method, token for token
        assert cmp.lossless, f"prompt {i}: speculative output differs from vanilla greedy"
        m = cmp.method.stats
        print(
            f"prompt {i}: {len(cmp.method.tokens)} tokens identical to vanilla; "
            f"M = {m.mean_accepted_length:.2f}, alpha = {m.acceptance_rate:.2f}"
        )


# --8<-- [end:check]


# --8<-- [start:contract]
from framework.testing import LayerSelectorContract  # noqa: E402


class TestMiddleMLPSelector(LayerSelectorContract):
    def make(self):
        return MiddleMLPSelector(MiddleMLPConfig(fraction=0.5))


# --8<-- [end:contract]


# --8<-- [start:main]
if __name__ == "__main__":
    show_config_handling()
    check_lossless()
    print("ok")
# --8<-- [end:main]
