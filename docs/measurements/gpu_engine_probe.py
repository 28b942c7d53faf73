"""The GPU engine's design choices, measured (issue 38, items 2 and 4): one CUDA graph per forward
built from the model's own Hugging Face modules, on random weights of the SmolLM2-135M and
Llama-2-7B shapes in bfloat16.

    python docs/measurements/gpu_engine_probe.py --out OUTDIR [--budget SECONDS] [--parts ...]

Each part prints one JSON line (and appends it to OUTDIR/probe.jsonl) as soon as it is done, so a
run cut short keeps what it measured. Parts, in order (most decisive first):

- ``engine``: our engine itself (`framework.engine`): a plain step, a half-skip draft and an
  8-token verification through the decode state's forwards, host work included, with one graph
  per forward (``--cuda-graph-route forward``), the same in exact mode, and one graph per branch.
- ``whole``: a plain step (T=1), a draft skipping half the sub-layers, and verifications of 4, 8
  and 16 tokens, each as ONE graph of embed -> rotary -> blocks -> norm -> head -> argmax over a
  static KV pool (per-layer write slots from a device vector, the mask computed inside the graph);
  against eager, and against one graph per block chained through one in-place residual buffer
  (the per-block "pattern" route for plans that change every round). Attention spans 256 / 1024 /
  2048 price the bucketing.
- ``exact``: per SDPA backend (the default dispatch, math, memory-efficient, cuDNN, flash), whether
  verifying 9 tokens in one forward gives each row's logits bit for bit as decoding them one at a
  time does, and what the step and the 9-token verification cost as graphs under that backend.
- ``compiled``: the same whole step through ``torch.compile`` (inductor's fused kernels, no
  CUDA graphs of its own), then captured as one graph: compile seconds, step and half-draft.
- ``cond``: whether ``torch.cond`` with device-side skip flags captures into a graph, and its cost.
- ``7b``: the Llama-2-7B shape: plain step, a 45% draft and an 8-token verification as one graph,
  against the bandwidth floor (a 1 GiB copy).
- ``hf``: Hugging Face ``generate`` with a static cache (which transformers compiles) on the
  SmolLM2 shape: tokens/s for 128 new tokens, against our whole-graph plain loop.

On a CPU it runs a 4-layer shape without capturing (a check of the script, no numbers).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from framework.engine.architecture import architecture_for  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
DT = torch.bfloat16 if CUDA else torch.float32
T0 = time.perf_counter()


def shape_config(name: str):
    from transformers import LlamaConfig

    if name == "smollm2" and CUDA:
        return LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
        )
    if name == "llama2-7b" and CUDA:
        return LlamaConfig(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
        )
    return LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )


def build(name: str):
    from transformers import LlamaForCausalLM

    cfg = shape_config(name)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to(DT).to_empty(device=DEV)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02 if "embed" in n else p.shape[-1] ** -0.5)
        inv = model.model.rotary_emb
        # buffers made on meta: recompute RoPE's inverse frequencies
        base = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
        dim = cfg.hidden_size // cfg.num_attention_heads
        inv.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=DEV, dtype=torch.float32) / dim))
        if hasattr(inv, "original_inv_freq"):
            inv.original_inv_freq = inv.inv_freq
    model.eval()
    return model


def sync():
    if CUDA:
        torch.cuda.synchronize()


def timed(fn, n=50, groups=5):
    """Median over ``groups`` of the mean of ``n`` calls, in ms, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    sync()
    out = []
    for _ in range(groups):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        out.append((time.perf_counter() - t) / n * 1e3)
    return statistics.median(out)


class Slots:
    """The KV pool as an HF attention module calls it: writes at ``slots`` (device), reads ``span``."""

    def __init__(self, keys, values, slots, span):
        self.keys, self.values, self.slots, self.span = keys, values, slots, span

    def update(self, key, value, layer_idx, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_copy_(2, self.slots, key)
        v.index_copy_(2, self.slots, value)
        return k[:, :, : self.span], v[:, :, : self.span]


class Static:
    """Static inputs and the one-forward function of a model: ids (1, T), positions (T,), the
    per-layer first write slot (L,), a KV pool of ``cap`` slots."""

    def __init__(self, model, cap=4096):
        self.arch = architecture_for(model)
        a = self.arch
        self.L = a.num_layers
        shape = (self.L, 1, a.num_kv_heads, cap, a.head_dim)
        self.keys = torch.zeros(shape, dtype=DT, device=DEV)
        self.values = torch.zeros(shape, dtype=DT, device=DEV)
        self.base = torch.zeros(self.L, dtype=torch.long, device=DEV)
        self.ids, self.pos = {}, {}
        self.arange = torch.arange(cap, device=DEV)

    def inputs(self, t):
        if t not in self.ids:
            self.ids[t] = torch.zeros(1, t, dtype=torch.long, device=DEV)
            self.pos[t] = torch.zeros(t, dtype=torch.long, device=DEV)
        return self.ids[t], self.pos[t]

    def forward(self, t, span, skip=frozenset(), logits=False):
        a = self.arch
        ids, pos = self.inputs(t)
        h = a.embed(ids)
        pe = a.rotary(h, pos[None])
        off = self.arange[:t]
        ar = self.arange[:span]
        for i in range(self.L):
            if ("a", i) not in skip:
                slots = self.base[i] + off
                mask = torch.zeros(t, span, dtype=DT, device=DEV).masked_fill(
                    ar[None, :] > slots[:, None], torch.finfo(DT).min
                )[None, None]
                h = h + a.attention_branch(i, h, pe, mask, Slots(self.keys, self.values, slots, span))
            if ("m", i) not in skip:
                h = h + a.mlp_branch(i, h)
        out = a.lm_head(a.final_norm(h))
        return out if logits else out.argmax(-1)

    def set(self, t, start, tokens=None):
        ids, pos = self.inputs(t)
        if tokens is not None:
            ids.copy_(tokens.view(1, t))
        pos.copy_(torch.arange(start, start + t, device=DEV))
        self.base.fill_(start)


_KEEP = []  # every graph stays alive: a private pool freed while others live cannot record again


def graph(fn):
    """Capture ``fn`` into its own pool (after two warm-ups on a side stream); on a CPU return
    ``fn`` itself."""
    if not CUDA:
        fn()
        return fn, None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        out = fn()
    _KEEP.append((g, out))
    return g.replay, out


def half_skip(L):
    """Half the sub-layers: every other attention and every other MLP, first and last kept."""
    return frozenset({("a", i) for i in range(1, L - 1, 2)} | {("m", i) for i in range(2, L - 1, 2)})


def emit(out, name, rec):
    rec = {"part": name, "t_s": round(time.perf_counter() - T0, 1), **rec}
    line = json.dumps(rec)
    print(line, flush=True)
    with open(out / "probe.jsonl", "a") as f:
        f.write(line + "\n")


def part_whole(st, out):
    L = st.L
    rec = {"layers": L}
    with torch.inference_mode():
        st.set(1, 200)
        rec["eager_step_ms"] = timed(lambda: st.forward(1, 256), n=5 if CUDA else 2, groups=3)
        for span in (256, 1024, 2048):
            st.set(1, 200)
            replay, _ = graph(lambda span=span: st.forward(1, span))
            rec[f"step_ms_span{span}"] = timed(replay, n=100)
        st.set(1, 200)
        replay, _ = graph(lambda: st.forward(1, 256, half_skip(L)))
        rec["draft_half_ms"] = timed(replay, n=100)
        rec["draft_half_frac"] = rec["draft_half_ms"] / rec["step_ms_span256"]
        for t in (4, 8, 9, 16):
            st.set(t, 200)
            replay, _ = graph(lambda t=t: st.forward(t, 256))
            rec[f"verify{t}_ms"] = timed(replay, n=100)
            rec[f"verify{t}_steps"] = rec[f"verify{t}_ms"] / rec["step_ms_span256"]
        # per-block graphs on one in-place residual buffer (the pattern route for adaptive plans)
        a = st.arch
        ids, pos = st.inputs(1)
        hbuf = torch.zeros(1, 1, a.hidden_size, dtype=DT, device=DEV)
        pe_static = [None]

        def head_in():
            hbuf.copy_(a.embed(ids))
            pe_static[0] = a.rotary(hbuf, pos[None])

        replay_in, _ = graph(head_in)
        ar, off = st.arange[:256], st.arange[:1]

        def block(i, attn, mlp):
            def f():
                if attn:
                    slots = st.base[i] + off
                    mask = torch.zeros(1, 256, dtype=DT, device=DEV).masked_fill(
                        ar[None, :] > slots[:, None], torch.finfo(DT).min
                    )[None, None]
                    hbuf.add_(
                        a.attention_branch(i, hbuf, pe_static[0], mask, Slots(st.keys, st.values, slots, 256))
                    )
                if mlp:
                    hbuf.add_(a.mlp_branch(i, hbuf))

            return f

        blocks = {}
        for i in range(L):
            for pat in ((True, True), (False, True), (True, False)):
                blocks[i, pat] = graph(block(i, *pat))[0]
        replay_out, _ = graph(lambda: a.lm_head(a.final_norm(hbuf)).argmax(-1))
        skip = half_skip(L)
        full = [blocks[i, (True, True)] for i in range(L)]
        half = []
        for i in range(L):
            pat = (("a", i) not in skip, ("m", i) not in skip)
            if pat != (False, False):
                half.append(blocks[i, pat])

        def chain(seq):
            def f():
                replay_in()
                for r in seq:
                    r()
                replay_out()

            return f

        rec["pattern_step_ms"] = timed(chain(full), n=50)
        rec["pattern_half_ms"] = timed(chain(half), n=50)
        rec["pattern_graphs"] = len(blocks) + 2
    return rec


def _backends():
    from torch.nn.attention import SDPBackend

    return {
        "default": None,
        "math": SDPBackend.MATH,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
    }


def exact_check(st, be, wrap=lambda f: f):
    """Decode 9 tokens one at a time, then verify them in one forward (SDPA backend ``be``; each
    forward through ``wrap``, e.g. ``torch.compile``): differing logits, differing argmaxes, and
    the step's and the 9-row verification's graph times."""
    from torch.nn.attention import sdpa_kernel

    gen = torch.Generator(device="cpu").manual_seed(1)
    V = st.arch.config.vocab_size
    prompt = torch.randint(0, V, (150,), generator=gen).to(DEV)
    toks = torch.randint(0, V, (9,), generator=gen).to(DEV)
    ctx = sdpa_kernel(be) if be is not None else contextlib.nullcontext()
    with torch.inference_mode(), ctx:
        # the prompt's KV (eager prefill: the same for both sides)
        st.set(150, 0, prompt)
        st.forward(150, 256, logits=True)
        st.set(1, 150)
        t = time.perf_counter()
        f1 = wrap(lambda: st.forward(1, 256, logits=True))
        step, step_out = graph(f1)
        f9 = wrap(lambda: st.forward(9, 256, logits=True))
        st.set(9, 150, toks)
        ver, ver_out = graph(f9)
        build_s = time.perf_counter() - t
        one = []
        for j in range(9):
            st.set(1, 150 + j, toks[j : j + 1])
            step()
            one.append(step_out.clone() if CUDA else f1().clone())
        one = torch.cat(one, 1)
        st.set(9, 150, toks)
        ver()
        nine = (ver_out if CUDA else f9()).clone()
        diff = (one != nine).sum().item()
        argmax_diff = (one.argmax(-1) != nine.argmax(-1)).sum().item()
        st.set(1, 200)
        ms = timed(step, n=100)
        st.set(9, 200)
        ms9 = timed(ver, n=100)
    return {
        "logit_diffs": diff,
        "argmax_diffs": argmax_diff,
        "step_ms": ms,
        "verify8_ms": ms9,
        "build_s": build_s,
    }


def part_exact(st, out):
    """Decoding 9 tokens one at a time against verifying them in one forward, per SDPA backend."""
    rec = {}
    for name, be in _backends().items():
        if not CUDA and name in ("cudnn", "flash"):
            continue
        try:
            rec[name] = exact_check(st, be)
        except Exception as e:  # a backend this GPU or shape refuses
            rec[name] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
    return rec


def part_compiled_exact(st, out):
    """`exact_check` with every forward through torch.compile, default dispatch and efficient."""
    rec = {}
    for name in ("efficient", "default"):
        try:
            rec[name] = exact_check(st, _backends()[name], lambda f: torch.compile(f, dynamic=False))
        except Exception as e:
            rec[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return rec


def part_7b_compiled(out):
    model = build("llama2-7b")
    st = Static(model, cap=1024)
    rec = {}
    with torch.inference_mode():
        st.set(1, 400)
        t = time.perf_counter()
        fn = torch.compile(lambda: st.forward(1, 512), dynamic=False)
        fn()
        sync()
        rec["compile_s"] = time.perf_counter() - t
        replay, _ = graph(fn)
        rec["step_ms"] = timed(replay, n=20)
        replay, _ = graph(lambda: st.forward(1, 512))
        rec["step_uncompiled_ms"] = timed(replay, n=20)
    return rec


def part_compiled(st, out):
    rec = {}
    L = st.L
    with torch.inference_mode():
        st.set(1, 200)
        t = time.perf_counter()
        fn = torch.compile(lambda: st.forward(1, 256), dynamic=False)
        fn()
        sync()
        rec["compile_s"] = time.perf_counter() - t
        replay, _ = graph(fn)
        rec["step_ms"] = timed(replay, n=100)
        t = time.perf_counter()
        fh = torch.compile(lambda: st.forward(1, 256, half_skip(L)), dynamic=False)
        fh()
        sync()
        rec["compile_half_s"] = time.perf_counter() - t
        replay, _ = graph(fh)
        rec["draft_half_ms"] = timed(replay, n=100)
        st.set(9, 200)
        t = time.perf_counter()
        f9 = torch.compile(lambda: st.forward(9, 256), dynamic=False)
        f9()
        sync()
        rec["compile_verify8_s"] = time.perf_counter() - t
        replay, _ = graph(f9)
        rec["verify8_ms"] = timed(replay, n=100)
    return rec


def part_cond(st, out):
    """Skip flags on the device through torch.cond, captured in one graph."""
    a, L = st.arch, st.L
    flags = torch.ones(L, 2, dtype=torch.bool, device=DEV)
    rec = {}
    ar, off = st.arange[:256], st.arange[:1]
    ids, pos = st.inputs(1)

    def fwd():
        h = a.embed(ids)
        pe = a.rotary(h, pos[None])
        for i in range(L):
            slots = st.base[i] + off
            mask = torch.zeros(1, 256, dtype=DT, device=DEV).masked_fill(
                ar[None, :] > slots[:, None], torch.finfo(DT).min
            )[None, None]

            def att(x, i=i, mask=mask, slots=slots):
                return x + a.attention_branch(i, x, pe, mask, Slots(st.keys, st.values, slots, 256))

            def mlp(x, i=i):
                return x + a.mlp_branch(i, x)

            h = torch.cond(flags[i, 0], att, lambda x: x.clone(), (h,))
            h = torch.cond(flags[i, 1], mlp, lambda x: x.clone(), (h,))
        return a.lm_head(a.final_norm(h)).argmax(-1)

    with torch.inference_mode():
        st.set(1, 200)
        try:
            replay, _ = graph(fwd)
            rec["captured"] = True
            rec["step_all_on_ms"] = timed(replay, n=100)
            for i in range(L):
                flags[i, 0] = ("a", i) not in half_skip(L)
                flags[i, 1] = ("m", i) not in half_skip(L)
            rec["half_flags_ms"] = timed(replay, n=100)
        except Exception as e:
            rec["captured"] = False
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return rec


def part_7b(out):
    model = build("llama2-7b")
    st = Static(model, cap=1024)
    L = st.L
    rec = {"layers": L}
    with torch.inference_mode():
        st.set(1, 400)
        replay, _ = graph(lambda: st.forward(1, 512))
        rec["step_ms"] = timed(replay, n=20)
        skip = frozenset({("a", i) for i in range(2, L - 1, 3)} | {("m", i) for i in range(1, L - 1, 2)})
        rec["draft_skip_frac"] = len(skip) / (2 * L)
        replay, _ = graph(lambda: st.forward(1, 512, skip))
        rec["draft_ms"] = timed(replay, n=20)
        rec["draft_steps"] = rec["draft_ms"] / rec["step_ms"]
        st.set(9, 400)
        replay, _ = graph(lambda: st.forward(9, 512))
        rec["verify8_ms"] = timed(replay, n=20)
        rec["verify8_steps"] = rec["verify8_ms"] / rec["step_ms"]
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    a = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    bw = 2 * a.numel() / (timed(lambda: b.copy_(a), n=10) / 1e3)
    rec["weights_GB"] = nbytes / 1e9
    rec["copy_GBps"] = bw / 1e9
    rec["floor_ms"] = nbytes / bw * 1e3
    rec["step_x_floor"] = rec["step_ms"] / rec["floor_ms"]
    return rec


def _engine_route(model, prompt, plan, route: str, exact: bool) -> dict:
    """One route of `part_engine`: its graphs recorded before timing, then each forward timed."""
    from framework.engine.adapter import adapter_for
    from framework.engine.state import DecodeState

    a = adapter_for(model)
    a.set_exact(exact)
    a.executor.set_cuda_graphs(True, route=route)
    t = time.perf_counter()
    n, _ = a.executor.prepare_graphs(1024, chain=(1, 9))
    state = DecodeState(a, prompt, 600)
    state.append(state.prefill().argmax(-1)[:, None])
    block = torch.cat([state.pending, prompt[:, :8]], dim=1)

    def step():
        state.forward_verify(state.pending, logits_at="last")

    def draft():
        state.forward_draft(state.pending, plan)
        state.discard_draft()

    def verify():
        state.forward_verify(block)

    with torch.inference_mode():
        for f in (step, draft, verify):  # records the draft's graph before timing
            f()
        r = {"recorded": n, "prepare_s": time.perf_counter() - t}
        r["step_ms"] = timed(step, n=50)
        r["draft_half_ms"] = timed(draft, n=50)
        r["verify8_ms"] = timed(verify, n=50)
    r["draft_half_steps"] = r["draft_half_ms"] / r["step_ms"]
    r["verify8_steps"] = r["verify8_ms"] / r["step_ms"]
    r["captures"] = a.executor.graphs.store.captures
    state.cache.release()
    a.set_exact(False)
    a.set_fast_kernels(False)  # the model as it came (a CPU's exact mode installs the kernels)
    return r


def part_engine(model, out):
    """Our engine itself (framework.engine), the SmolLM2 shape: a plain step, a draft skipping
    half the sub-layers and an 8-token verification through `DecodeState`'s forwards, host work
    included, with the forward route, the forward route in exact mode, and the branch route."""
    from framework import LayerPlan

    L = model.config.num_hidden_layers
    skip = half_skip(L)
    plan = LayerPlan.from_indices(
        L, attn=[i for k, i in skip if k == "a"], mlp=[i for k, i in skip if k == "m"]
    )
    gen = torch.Generator(device="cpu").manual_seed(3)
    prompt = torch.randint(0, model.config.vocab_size, (1, 200), generator=gen).to(DEV)
    routes = (("forward", "forward", False), ("forward_exact", "forward", True), ("branch", "branch", False))
    return {name: _engine_route(model, prompt, plan, route, exact) for name, route, exact in routes}


def part_hf(model, st, out):
    rec = {}
    ids = torch.randint(0, model.config.vocab_size, (1, 120), device=DEV)
    times = []
    for _ in range(3):
        sync()
        t = time.perf_counter()
        g = model.generate(
            ids, max_new_tokens=128, min_new_tokens=128, do_sample=False, cache_implementation="static"
        )
        sync()
        times.append(time.perf_counter() - t)
    rec["generate_s"] = times
    rec["hf_static_tok_s"] = 128 / min(times[1:])
    # our whole-graph plain loop for the same 128 tokens (argmax fed back on the device)
    with torch.inference_mode():
        st.set(120, 0, ids[0])
        st.forward(120, 256)
        st.set(1, 120, g[0, 120:121])
        ids1, pos1 = st.inputs(1)
        step, tok = graph(lambda: st.forward(1, 256))

        def loop():
            for k in range(128):
                pos1.fill_(120 + k)
                st.base.fill_(120 + k)
                step()
                ids1.copy_(tok)
                tok.view(-1).tolist()  # one host read per token, as a decoding loop does

        loop()
        sync()
        t = time.perf_counter()
        loop()
        sync()
        rec["ours_whole_graph_tok_s"] = 128 / (time.perf_counter() - t)
    rec["ours_over_hf"] = rec["ours_whole_graph_tok_s"] / rec["hf_static_tok_s"]
    return rec


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--budget", type=float, default=400.0, help="seconds; parts not started by then are skipped"
    )
    p.add_argument("--parts", default="engine,whole,exact,7b,compiled,cond,hf")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    env = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if CUDA else "cpu",
        "dtype": str(DT),
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    emit(args.out, "env", env)
    model = build("smollm2")
    st = Static(model)
    # rough minimum seconds each part needs, so a part that cannot finish is not started
    need = {
        "whole": 20,
        "exact": 20,
        "7b": 40,
        "compiled": 90,
        "cond": 30,
        "hf": 90,
        "compiled_exact": 90,
        "7b_compiled": 60,
    }
    for part in args.parts.split(","):
        left = args.budget - (time.perf_counter() - T0)
        if left < need.get(part, 30):
            emit(args.out, part, {"skipped": f"{left:.0f} s left of the budget"})
            continue
        try:
            if part == "whole":
                rec = part_whole(st, args.out)
            elif part == "exact":
                rec = part_exact(st, args.out)
            elif part == "compiled":
                rec = part_compiled(st, args.out)
            elif part == "cond":
                rec = part_cond(st, args.out)
            elif part == "7b":
                rec = part_7b(args.out) if CUDA else {"skipped": "no CUDA"}
            elif part == "compiled_exact":
                rec = part_compiled_exact(st, args.out)
            elif part == "7b_compiled":
                rec = part_7b_compiled(args.out) if CUDA else {"skipped": "no CUDA"}
            elif part == "engine":
                rec = part_engine(model, args.out)
            elif part == "hf":
                rec = part_hf(model, st, args.out)
            else:
                raise ValueError(f"unknown part {part!r}")
        except Exception as e:
            rec = {"error": f"{type(e).__name__}: {str(e)[:300]}", "trace": traceback.format_exc()[-800:]}
        emit(args.out, part, rec)
        if CUDA:
            torch.cuda.empty_cache()  # a part's model (the 7B shape) is gone once it returns


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
