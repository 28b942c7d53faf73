"""The GPU logic that a CPU can check (issue 17): each ``--devices`` rank on its own ``cuda:r``,
``--dtype auto``, loading straight onto the GPU with a clear error when the model does not fit,
and the target's logit margin at a greedy mismatch. Nothing here touches CUDA: the devices are
faked and the CUDA calls monkeypatched."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import framework.models.loading as models
import framework.runner.lightning as experiment_mod
from framework.config_fields import ConfigError
from framework.data.prompts import encode_chat, load_prompts
from framework.engine.adapter import adapter_for
from framework.engine.decoding import StopCondition, VanillaDecoder
from framework.models.loading import ModelLoadError, check_fits, parameter_count, resolve_dtype
from framework.results.compare import NEAR_TIE_ULPS, first_mismatch, mismatch_details, near_tie, ulp
from framework.runner.lightning import DecodeModule
from framework.session.methods import specs as methods_of
from framework.session.run_config import ModelConfig, RunConfig
from framework.testing import synthetic_cost_model, tiny_model, tiny_tokenizer
from strategies.length.fixed import FixedLengthConfig
from strategies.selectors.static import StaticSelectorConfig

GIB = 1024**3


@pytest.fixture
def data(tmp_path):
    rows = [{"question_id": i, "category": "qa", "turns": [f"w{i} w{i + 1} w{i + 2}"]} for i in range(1, 5)]
    p = tmp_path / "q.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def cfg_for(data, out, **kw) -> RunConfig:
    base = dict(
        data=str(data),
        output=str(out),
        max_new_tokens=6,
        warmup=0,
        plots=False,
        logger="none",
    )
    if "selector" not in kw:  # the tests' method: static at 0.3, fixed k = 3
        base |= {"selector": "static", "selector.skip_ratio": 0.3}
    if "length" not in kw:
        base |= {"length": "fixed", "length.k": 3}
    base.update(kw)
    return RunConfig.of(**base)


def fake_trainer(root: torch.device, rank: int = 1, world: int = 2):
    return SimpleNamespace(
        world_size=world, num_nodes=1, global_rank=rank, strategy=SimpleNamespace(root_device=root)
    )


# ---- A: --devices N on GPUs ------------------------------------------------------------------
@pytest.mark.parametrize(("dtype", "want"), [("float32", "float32"), ("auto", "bfloat16")])
def test_a_rank_decodes_on_its_own_cuda_device(data, tmp_path, monkeypatch, dtype, want):
    """``--devices 2`` on GPUs: rank 1's root device is ``cuda:1``; its experiment is configured
    for ``cuda:1`` (with ``--dtype auto`` resolved to bfloat16 there) and nothing raises, although
    the user may not name ``cuda:1`` together with ``--devices 2``."""
    loaded = []

    def fake_load(model, dtype, device, device_map=""):  # stands for the GPU load: a tiny CPU model
        assert device_map == ""
        loaded.append((model, dtype, device))
        return tiny_model("llama", num_layers=4, max_position_embeddings=256), tiny_tokenizer()

    monkeypatch.setattr(experiment_mod, "load_model", fake_load)
    cfg = cfg_for(data, tmp_path / "r", devices=2, dtype=dtype)
    with pytest.raises(ConfigError, match="cuda:N names one GPU"):
        cfg.replace(device="cuda:1")  # the user-facing check stays
    module = _module(cfg, data, tmp_path)
    module.trainer = fake_trainer(torch.device("cuda", 1))
    module.setup("predict")
    assert loaded == [(None, want, "cuda:1")]
    assert module.methods.base.cfg.model.device == "cuda:1" and module.methods.base.cfg.model.dtype == want
    assert (
        module.cfg.runner.devices == 2 and module.cfg.model.dtype == dtype
    )  # the run's own config is unchanged
    assert [p.question_id for _, p in module.shard()] == [2, 4]


def test_a_cpu_rank_keeps_float32_for_auto(data, tmp_path, monkeypatch):
    loaded = []
    monkeypatch.setattr(
        experiment_mod,
        "load_model",
        lambda m, d, dev, dmap="": (
            loaded.append((d, dev)) or (tiny_model("llama", num_layers=4), tiny_tokenizer())
        ),
    )
    cfg = cfg_for(data, tmp_path / "r", devices=2, dtype="auto")
    module = _module(cfg, data, tmp_path)
    module.trainer = fake_trainer(torch.device("cpu"), rank=0)
    module.setup("predict")
    assert loaded == [("float32", "cpu")]
    assert module.methods.base.cfg.model.dtype == "float32"


def test_for_rank_describes_one_process():
    cfg = RunConfig.of(devices=4, num_nodes=2, dtype="auto")
    rank = cfg.for_rank("cuda:3", "bfloat16")
    assert (rank.model.device, rank.model.dtype, rank.runner.devices, rank.runner.num_nodes) == (
        "cuda:3",
        "bfloat16",
        1,
        1,
    )
    assert cfg.for_rank("cpu").model.dtype == "auto"


# ---- B: --dtype auto -------------------------------------------------------------------------
def test_dtype_auto_is_bfloat16_on_cuda_and_float32_on_cpu():
    assert RunConfig.of(dtype="auto").model.dtype == "auto"
    assert resolve_dtype("auto", "cpu") is torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda", 0)) is torch.bfloat16  # no CUDA call
    assert resolve_dtype("auto", "cuda:1") is torch.bfloat16
    assert resolve_dtype("float16", torch.device("cuda", 0)) is torch.float16
    with pytest.raises(ValueError, match="--dtype must be one of"):
        resolve_dtype("half", "cpu")
    with pytest.raises(ConfigError, match="--dtype"):
        RunConfig.of(dtype="float8")
    assert RunConfig.of(dtype="half").model.dtype == "float16"  # torch's other name (issue 55)


def test_load_model_resolves_auto_on_cpu():
    net, _tok = models.load_model("tiny-random", "auto", "cpu")
    assert next(net.parameters()).dtype is torch.float32


# ---- C: straight onto the GPU, or a clear error ----------------------------------------------
def test_parameter_count_counts_a_llama_exactly():
    for tie in (False, True):
        net = tiny_model("llama", num_layers=3, tie_word_embeddings=tie)
        assert parameter_count(net.config) == sum(p.numel() for p in net.parameters())
    assert parameter_count(SimpleNamespace(model_type="x")) is None


def big_config():  # a Llama-2-7B-like config: 6.7e9 parameters
    return SimpleNamespace(
        hidden_size=4096,
        num_hidden_layers=32,
        vocab_size=32000,
        intermediate_size=11008,
        num_attention_heads=32,
        num_key_value_heads=32,
        tie_word_embeddings=False,
    )


def test_a_model_that_does_not_fit_the_gpu_is_refused_with_its_sizes(monkeypatch):
    calls = []

    def mem_get_info(device):
        calls.append(device)
        return 10 * GIB, 80 * GIB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    dev = torch.device("cuda", 0)
    with pytest.raises(ModelLoadError) as err:
        check_fits(big_config(), torch.float32, dev, "llama-7b")
    msg = str(err.value)
    assert "--model 'llama-7b' does not fit one GPU" in msg
    assert "25.1 GiB in float32" in msg and "cuda:0 has 10.0 GiB free of 80.0 GiB" in msg
    assert "bfloat16" in msg
    assert calls == [dev]
    check_fits(big_config(), torch.float32, torch.device("cpu"), "llama-7b")  # CPU: not checked
    assert len(calls) == 1


def test_bfloat16_halves_the_need(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (12 * GIB, 16 * GIB))
    with pytest.raises(ModelLoadError, match="12.6 GiB in bfloat16"):  # 12.55 GiB > 12 GiB
        check_fits(big_config(), torch.bfloat16, torch.device("cuda", 0), "m")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (13 * GIB, 16 * GIB))
    check_fits(big_config(), torch.bfloat16, torch.device("cuda", 0), "m")


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "m"
    tiny_model("llama", num_layers=2).config.save_pretrained(d)
    return d


def test_cuda_loads_straight_onto_the_gpu(model_dir, monkeypatch):
    """On CUDA `from_pretrained` gets ``device_map`` (no full host copy) and the resolved dtype."""
    import transformers

    seen = {}

    class Net:
        def eval(self):
            return self

    def from_pretrained(src, **kw):
        seen.update(kw)
        return Net()

    monkeypatch.setattr(models, "resolve_device", lambda d: torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (70 * GIB, 80 * GIB))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda src: "tok")
    net, tok = models.load_model(str(model_dir), "auto", "cuda:1")
    assert isinstance(net, Net) and tok == "tok"
    assert seen == {"dtype": torch.bfloat16, "device_map": {"": torch.device("cuda", 1)}}
    # too little memory: refused before anything is loaded
    seen.clear()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (0, 80 * GIB))
    with pytest.raises(ModelLoadError, match="does not fit one GPU"):
        models.load_model(str(model_dir), "float32", "cuda:1")
    assert seen == {}


# ---- D: the margin at the first mismatch ----------------------------------------------------
def test_ulp_and_near_tie_rule():
    assert ulp(1.0, torch.float32) == 2.0**-23
    assert ulp(20.0, torch.bfloat16) == 2.0**4 * 2.0**-7
    assert NEAR_TIE_ULPS == 2  # the rule: within two bfloat16 steps of the logit
    assert near_tie(2 * ulp(20.0, torch.bfloat16), 20.0, torch.bfloat16)
    assert not near_tie(3 * ulp(20.0, torch.bfloat16), 20.0, torch.bfloat16)
    assert not near_tie(1.0, 20.0, torch.bfloat16)
    assert not near_tie(1e-4, 20.0, torch.float32)


def test_mismatch_details_give_the_targets_margin_there():
    model, tok = tiny_model("llama", num_layers=4, max_position_embeddings=256), tiny_tokenizer()
    adapter = adapter_for(model)
    turns = ["w7 w8 w9", "w3 w4"]
    van = VanillaDecoder(adapter)
    stop = StopCondition(8, set(), ())
    encode = lambda messages: encode_chat(tok, messages)  # noqa: E731
    want, messages = [], []
    for t in turns:
        messages.append({"role": "user", "content": t})
        res = van.generate(torch.tensor([encode(messages)]), stop)
        text = tok.decode(res.tokens)
        messages.append({"role": "assistant", "content": text})
        want.append((res.tokens, text))
    got = [list(want[0][0]), list(want[1][0])]
    got[1][3] = 5 + (got[1][3] + 1) % 100  # the second turn differs at position 3
    where = first_mismatch(got, [w for w, _ in want])
    assert where == {"turn": 1, "position": 3}
    d = mismatch_details(adapter, encode, turns, want, got, where)
    ctx = encode([*messages[:3]]) + want[1][0][:3]
    with torch.no_grad():
        logits = model(torch.tensor([ctx])).logits[0, -1]
    top = torch.topk(logits, 2)
    assert d["vanilla_token"] == want[1][0][3] == int(top.indices[0])
    assert d["method_token"] == got[1][3]
    assert d["margin"] == pytest.approx(float(top.values[0] - top.values[1]), rel=1e-9)
    assert d["dtype"] == "float64" and d["near_tie"] is False
    # a method that stopped early: no method token, the margin still computed
    short = mismatch_details(adapter, encode, turns, want, [want[0][0][:2]], {"turn": 0, "position": 2})
    assert short["method_token"] is None and short["margin"] > 0


class Broken:
    """Vanilla decoding with the last token of every turn changed: a method that must mismatch."""

    def __init__(self, inner):
        self.inner = inner

    def generate(self, ids, stop):
        res = self.inner.generate(ids, stop)
        res.tokens[-1] = 5 + (res.tokens[-1] + 1) % 100
        return res


def test_run_records_carry_the_margin_at_a_mismatch(data, tmp_path):
    """The runner's records: ``first_mismatch`` is ``None`` for a lossless method, and at a
    mismatch holds the position and the target's top-1/top-2 margin there."""
    model, tok = tiny_model("llama", num_layers=4, max_position_embeddings=256), tiny_tokenizer()
    cfg = cfg_for(data, tmp_path / "r")
    module = _module(cfg, data, tmp_path, model, tok)
    module.trainer = fake_trainer(torch.device("cpu"), rank=0, world=1)
    module.setup("predict")
    prompt = module.prompts[0]
    van, spec = module.predict_step((0, prompt), 0)
    assert van["first_mismatch"] is None and spec["first_mismatch"] is None and spec["lossless"] is True
    module.methods.decoders[cfg.method.label] = Broken(module.methods.base.vanilla)
    _van, bad = module.predict_step((0, prompt), 1)
    fm = bad["first_mismatch"]
    assert bad["lossless"] is False
    assert (fm["turn"], fm["position"]) == (0, len(bad["turns"][0]["tokens"]) - 1)
    assert fm["margin"] > 0 and fm["near_tie"] is False and fm["dtype"] == "float64"
    # the runner's table notes and the W&B summary carry it too
    from framework.benchmark.report import summarize
    from framework.runner.tracking import method_metrics

    records = [van, spec, _van, bad]
    from framework.results.compare import mismatch_note

    note = mismatch_note(str(prompt.question_id), fm)  # what the report's notes say of it
    assert note.startswith(f"q{prompt.question_id} (turn 0, pos ") and "not a near-tie: a bug?" in note
    label = cfg.method.label
    entry = summarize(records, ["vanilla", label])["methods"][label]
    assert (
        entry["mismatches"] == 1 and entry["mismatch_at"][str(prompt.question_id)]["margin"] == fm["margin"]
    )
    assert entry["mismatch_at"][str(prompt.question_id)]["near_tie"] is False
    assert method_metrics(summarize(records, ["vanilla", label]))[f"{label}/mismatches"] == 1
    assert summarize([van, spec], ["vanilla", label])["methods"][label]["mismatches"] == 0


# ---- phase timing (--phase-timing): every phase boundary waits for a CUDA device ------------------


def _fake_cuda(monkeypatch, adapter) -> None:
    monkeypatch.setattr(type(adapter.arch), "device", property(lambda self: torch.device("cuda", 0)))


def _static_decoder(adapter, **kw):
    from framework.engine.decoding import SpeculativeDecoder
    from strategies.drafters.layer_skip import LayerSkipDrafter
    from strategies.length.fixed import FixedLength
    from strategies.selectors.static import StaticSelector
    from strategies.verifiers.greedy import GreedyVerifier

    return SpeculativeDecoder(
        adapter,
        StaticSelector(StaticSelectorConfig(skip_ratio=0.25)),
        FixedLength(FixedLengthConfig(k=3)),
        LayerSkipDrafter(),
        GreedyVerifier(),
        **kw,
    )


def test_phase_timing_is_on_for_a_cpu_and_off_for_cuda_by_default(monkeypatch):
    adapter = adapter_for(tiny_model("llama", num_layers=4, seed=0))
    assert _static_decoder(adapter).times_phases() and adapter.executor.times_lm_head
    _fake_cuda(monkeypatch, adapter)
    assert not _static_decoder(adapter).times_phases() and not adapter.executor.times_lm_head
    assert _static_decoder(adapter, phase_timing=True).times_phases()
    adapter.executor.time_lm_head = True
    assert adapter.executor.times_lm_head


def test_without_phase_timing_a_generation_records_prefill_and_decode_only():
    adapter = adapter_for(tiny_model("llama", num_layers=4, seed=0))
    prompt, stop = torch.tensor([[3, 9, 4, 7, 1]]), StopCondition(16)
    timed = _static_decoder(adapter).generate(prompt, stop)
    assert {"prefill", "draft", "verify", "select", "commit", "lm_head"} <= set(timed.timings)
    adapter.executor.time_lm_head = False
    head0 = adapter.executor.lm_head_seconds
    res = _static_decoder(adapter, phase_timing=False).generate(prompt, stop)
    assert res.tokens == timed.tokens
    assert set(res.timings) == {"prefill", "decode"}
    assert res.timings["decode"] == pytest.approx(res.wall_time - res.timings["prefill"])
    assert adapter.executor.lm_head_seconds == head0  # the head was not timed


def test_a_gate_without_a_cost_model_keeps_the_phase_timers(monkeypatch):
    from framework.drafting.gate import GateConfig, gated
    from framework.engine.decoding import SpeculativeDecoder
    from strategies.drafters.layer_skip import LayerSkipDrafter
    from strategies.length.fixed import FixedLength
    from strategies.selectors.static import StaticSelector
    from strategies.verifiers.greedy import GreedyVerifier

    adapter = adapter_for(tiny_model("llama", num_layers=4, seed=0))
    length = gated(FixedLength(FixedLengthConfig(k=3)), GateConfig(enabled=True))
    dec = SpeculativeDecoder(
        adapter, StaticSelector(), length, LayerSkipDrafter(), GreedyVerifier(), phase_timing=False
    )
    assert dec.times_phases()  # it prices drafts from the phase timings (MeasuredCosts)
    length.gate.set_costs(synthetic_cost_model(4))
    assert not dec.times_phases()


def test_phase_timing_flag_reaches_the_decoder_and_the_adapter(data, tmp_path):
    with pytest.raises(ConfigError, match="--phase-timing"):
        RunConfig.of(phase_timing="sometimes")
    assert [RunConfig.of(phase_timing=v).model.phase_timing_flag for v in ("auto", "on", "off")] == [
        None,
        True,
        False,
    ]
    cfg = cfg_for(data, tmp_path / "r", phase_timing="off")
    exp = experiment_mod.Session(cfg, tiny_model("llama", num_layers=4, seed=0), tiny_tokenizer())
    assert exp.adapter.executor.time_lm_head is False
    assert exp.spec.phase_timing is False


def test_cuda_graphs_flag_is_checked_and_refused_without_cuda(data, tmp_path):
    with pytest.raises(ConfigError, match="--cuda-graphs"):
        ModelConfig(cuda_graphs="yes")  # a typed value is checked, not parsed
    cfg = cfg_for(data, tmp_path / "r", cuda_graphs=True)
    with pytest.raises(ConfigError, match="--cuda-graphs must be used with a CUDA device"):
        experiment_mod.Session(cfg, tiny_model("llama", num_layers=4, seed=0), tiny_tokenizer())
    exp = experiment_mod.Session(
        cfg_for(data, tmp_path / "r"), tiny_model("llama", num_layers=4, seed=0), tiny_tokenizer()
    )
    assert exp.adapter.executor.graphs is None


def test_the_phase_table_says_n_a_for_untimed_phases():
    from framework.results.metrics import time_breakdown

    rec = {
        "method": "m",
        "category": "qa",
        "new_tokens": 10,
        "wall_time": 2.0,
        "timings": {"prefill": 0.5, "decode": 1.5},
        "accept_lengths": [2, 3],
        "drafted": 4,
        "accepted": 3,
        "turns": [],
    }
    table = time_breakdown([rec], ["m"])
    row = next(line for line in table.splitlines() if line.startswith("| m "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "25.0%" and cells[3:] == ["n/a"] * 7  # draft .. commit, other


def _module(cfg, data, tmp_path, model=None, tok=None):
    items = [(0, p) for p in load_prompts(data)]
    specs = methods_of(cfg)
    return DecodeModule(
        cfg, specs, items, lambda _label: tmp_path / "r", lambda s: None, model=model, tokenizer=tok
    )
