"""Tutorial script: structured output (a JSON schema) under self-speculative decoding.

The page ``docs/tutorials/structured_output.md`` includes this file section by section. Run it:

    python docs/tutorials/structured_output.py

Its grammar engine, llguidance, is a base dependency. Nothing is
downloaded: the model is a random Llama built in-process, with a byte-level tokenizer that spells
JSON (the real model is a flag away: see the page). The text a random model writes means nothing;
what the script checks holds for any model: the answer matches the schema, the grammar forced
some tokens that no forward drafted, and the tokens equal plain constrained decoding's and
``transformers``' ``generate`` with the same grammar engine's mask.
"""

from __future__ import annotations

import json

import torch

import selfspec
from framework.testing import tiny_json_tokenizer, tiny_model

MODEL = tiny_model("llama", num_layers=6, seed=1, dtype=torch.float32)
TOKENIZER = tiny_json_tokenizer()
PROMPT = "Fill in the form as JSON."

# --8<-- [start:schema]
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "in_stock": {"type": "boolean"},
    },
    "required": ["color", "size", "in_stock"],
    "additionalProperties": False,
}
# --8<-- [end:schema]


def main() -> None:
    # --8<-- [start:generate]
    dec = selfspec.Decoder.from_preset(
        "hybrid_forced", model=MODEL, tokenizer=TOKENIZER, max_new_tokens=48, log=None
    )
    out = dec.generate(PROMPT, json_schema=SCHEMA)
    answer = json.loads(out.text)  # the schema holds: this parses, with the three keys
    drafter = out.stats.strategies["drafter"]
    print(answer)
    print(f"{drafter['forced']} of {len(out.tokens)} tokens forced by the grammar (no draft forward)")
    # --8<-- [end:generate]
    assert set(answer) == {"color", "size", "in_stock"} and drafter["forced"] > 0

    # --8<-- [start:lossless]
    plain = selfspec.Decoder.from_preset(
        "vanilla", model=MODEL, tokenizer=TOKENIZER, max_new_tokens=48, log=None
    )
    want = plain.generate(PROMPT, json_schema=SCHEMA)
    assert out.tokens == want.tokens  # constrained speculative output = constrained plain decoding
    # --8<-- [end:lossless]

    # --8<-- [start:hf]
    from framework.engine.grammar import CompiledGrammar, Grammar, GrammarProcessor

    ids = dec.encode(PROMPT)
    grammar = CompiledGrammar(Grammar.json_schema(SCHEMA), TOKENIZER, MODEL.config.vocab_size)
    with torch.inference_mode():
        hf = MODEL.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=48,
            eos_token_id=TOKENIZER.eos_token_id,
            pad_token_id=0,
            logits_processor=[GrammarProcessor(grammar.start(ids.shape[1]))],
        )
    assert hf[0, ids.shape[1] :].tolist() == out.tokens  # the same engine's mask in generate
    # --8<-- [end:hf]

    # --8<-- [start:compose]
    from strategies.drafters.grammar_forced import GrammarForcedDrafter, GrammarForcedDrafterConfig

    forced_then_copy = GrammarForcedDrafter(GrammarForcedDrafterConfig(then="prompt_lookup"))
    mine = selfspec.Decoder.from_strategies(
        drafter=forced_then_copy,
        length="fixed",
        model=MODEL,
        tokenizer=TOKENIZER,
        max_new_tokens=48,
        log=None,
    )
    assert mine.generate(PROMPT, json_schema=SCHEMA).tokens == want.tokens
    # --8<-- [end:compose]
    print("ok")


if __name__ == "__main__":
    main()
