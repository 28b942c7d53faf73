"""The static branches behind ``--cuda-graphs`` (framework.engine.execution.branches), run without capture on
the CPU: they compute what the eager path computes for one-token steps and chain verifications,
write the same cache, serve every skip plan, leave trees and long blocks to the eager path, and
lend their KV pool to one live cache at a time. Capture itself needs CUDA
(tests/integration/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from framework import LayerPlan
from framework.engine.adapter import adapter_for
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.engine.state import DecodeState
from framework.testing import ARCHS, prepare_context, random_prompt, tiny_model
from strategies.drafters.layer_skip import LayerSkipDrafter
from strategies.length.fixed import FixedLength, FixedLengthConfig
from strategies.selectors.static import StaticSelector, StaticSelectorConfig
from strategies.verifiers.greedy import GreedyVerifier
from strategies.verifiers.tree import TreeVerifier


def _adapters(arch: str = "llama", num_layers: int = 4, seed: int = 0, **overrides):
    """(eager adapter, static-branch adapter) over two copies of one model, no CPU kernels."""
    eager = adapter_for(
        tiny_model(arch, num_layers, seed=seed, dtype=torch.float32, **overrides), fast_kernels=False
    )
    static = adapter_for(
        tiny_model(arch, num_layers, seed=seed, dtype=torch.float32, **overrides), fast_kernels=False
    )
    static.executor.set_cuda_graphs(True, capture=False)
    return eager, static


@pytest.mark.parametrize("arch", ARCHS)
def test_static_one_token_steps_compute_what_the_eager_path_computes(arch):
    eager, static = _adapters(arch)
    prompt = random_prompt(7, seed=3)
    states = [DecodeState(a, prompt, 40) for a in (eager, static)]
    for s in states:
        s.append(s.prefill().argmax(-1)[:, None])
    for _ in range(12):
        outs = [s.forward_verify(s.pending, logits_at="last").logits[:, -1] for s in states]
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
        tok = outs[0].argmax(-1)[:, None]
        for s in states:
            s.cache.commit(1)
            s.append(tok)
    n = states[0].cache.committed
    for layer in range(eager.arch.num_layers):
        for a, b in zip(
            states[0].cache.committed_kv(layer), states[1].cache.committed_kv(layer), strict=True
        ):
            torch.testing.assert_close(b[:, :, :n], a[:, :, :n], rtol=1e-5, atol=1e-5)
    assert static.executor.graphs.store.replays == 12 * 2 * static.arch.num_layers  # the prefill ran eagerly


def test_a_skip_plan_runs_only_its_branches_and_drafts_as_the_eager_path_does():
    eager, static = _adapters(num_layers=6)
    plan = LayerPlan.from_indices(6, attn=[1, 4], mlp=[2])
    prompt = random_prompt(5, seed=1)
    states = [DecodeState(a, prompt, 40) for a in (eager, static)]
    for s in states:
        s.append(s.prefill().argmax(-1)[:, None])
    before = static.executor.graphs.store.replays
    drafts = []
    for s in states:
        toks = []
        for _ in range(4):  # a draft chain: later tokens attend to the earlier draft slots
            logits = s.forward_draft(s.pending if not toks else toks[-1], plan).logits[:, -1]
            toks.append(logits.argmax(-1)[:, None])
        drafts.append((logits, torch.cat(toks, 1)))
        s.discard_draft()
    assert static.executor.graphs.store.replays - before == 4 * (2 * 6 - 3)
    torch.testing.assert_close(drafts[1][0], drafts[0][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(drafts[1][1], drafts[0][1])


def test_chain_and_tree_verifications_take_the_static_branches_and_a_long_block_does_not():
    eager, static = _adapters(num_layers=3)
    static.executor.set_cuda_graphs(True, capture=False, max_tokens=6)
    prompt = random_prompt(9, seed=5)
    states = [DecodeState(a, prompt, 60) for a in (eager, static)]
    for s in states:
        s.append(s.prefill().argmax(-1)[:, None])
    block = random_prompt(5, seed=6)
    before = static.executor.graphs.store.replays
    outs = [s.forward_verify(torch.cat([s.pending, block], 1), logits_at="all").logits for s in states]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert static.executor.graphs.store.replays - before == 2 * 3
    for s in states:  # keep 4 of the 6 verified tokens, then go on from there
        s.cache.commit(4)
        s.append(block[:, :4])
    outs = [s.forward_verify(s.pending, logits_at="last").logits for s in states]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    before = static.executor.graphs.store.replays
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # two siblings
    # Nothing is recorded on a CPU, but each first use of a (branch, T, span) counts, where CUDA
    # would record a graph: T = 6 and T = 1, each block's attention and MLP.
    assert static.executor.graphs.store.captures == 2 * 2 * 3
    outs = [
        s.forward_verify(
            block[:, :3],
            logits_at="all",
            tree_mask=tree,
            position_ids=s.cache.committed + torch.tensor([[0, 1, 1]]),
        ).logits
        for s in states
    ]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert static.executor.graphs.store.replays - before == 2 * 3  # the tree's mask is a static input too
    for s in states:
        s.discard_draft()
    before = static.executor.graphs.store.replays
    scratch = [  # a scratch pass hiding part of the prefix: its attention runs eagerly, its MLP not
        s.adapter.forward(
            block[:, :2],
            s.cache.committed + torch.tensor([[0, 1]]),
            s.cache,
            logits_at="all",
            base=max(s.cache.lengths),
            visible=s.cache.committed - 2,
            persist=False,
        ).logits
        for s in states
    ]
    torch.testing.assert_close(scratch[1], scratch[0], rtol=1e-5, atol=1e-5)
    assert static.executor.graphs.store.replays - before == 3
    before = static.executor.graphs.store.replays
    long = random_prompt(7, seed=7)  # longer than max_tokens: all eager
    outs = [s.forward_verify(long, logits_at="all").logits for s in states]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert static.executor.graphs.store.replays == before


def test_speculative_decoding_through_static_branches_equals_plain_greedy():
    eager, static = _adapters(num_layers=6, seed=2)
    prompt = random_prompt(8, seed=4)
    stop = StopCondition(40)
    expected = VanillaDecoder(eager).generate(prompt, stop).tokens
    assert VanillaDecoder(static).generate(prompt, stop).tokens == expected
    dec = SpeculativeDecoder(
        static,
        StaticSelector(StaticSelectorConfig(skip_ratio=0.3)),
        FixedLength(FixedLengthConfig(k=3)),
        LayerSkipDrafter(),
        GreedyVerifier(),
    )
    dec.prepare(prepare_context(static))
    replays = static.executor.graphs.store.replays
    res = dec.generate(prompt, stop)
    assert res.tokens == expected
    assert static.executor.graphs.store.replays > replays  # the drafts took the static branches


def test_capturing_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    adapter = adapter_for(tiny_model("llama", 2, dtype=torch.float32), fast_kernels=False)
    with pytest.raises(ValueError, match="CUDA device"):
        adapter.executor.set_cuda_graphs(True, capture=True)
    assert adapter.executor.set_cuda_graphs(False) is None and adapter.executor.graphs is None


def _decoders(adapter, verifier=None):
    spec = SpeculativeDecoder(
        adapter,
        StaticSelector(StaticSelectorConfig(skip_ratio=0.3)),
        FixedLength(FixedLengthConfig(k=3)),
        LayerSkipDrafter(),
        verifier or GreedyVerifier(),
    )
    spec.prepare(prepare_context(adapter))
    return VanillaDecoder(adapter), spec


@pytest.mark.parametrize("tree", [False, True])
def test_no_graph_is_recorded_inside_a_timed_decode_once_every_size_was_recorded(tree):
    """``prepare_graphs`` sizes the pool for the longest prompt, and after a short warm-up decode
    the engine knows which forwards the method runs (no strategy declares them): recording every
    (branch, T, span) they can use (`SpeculativeDecoder.graph_sizes`), generations of prompts of
    very different lengths, crossing a span boundary, then record none, and the output is still
    plain greedy's."""
    _, static = _adapters(num_layers=4, seed=3)
    van, spec = _decoders(static, TreeVerifier() if tree else None)
    prompts = [random_prompt(n, seed=n) for n in (5, 300, 40)]  # the long one crosses span 256
    stop = StopCondition(24)
    capacity = 300 + 24 + spec.max_draft + 8
    static.executor.prepare_graphs(capacity)  # the pool first
    spec.generate(random_prompt(7, seed=99), StopCondition(8))  # the warm-up: what runs
    sizes = spec.graph_sizes(static.executor.seen)
    assert sizes.chain == set(range(1, 5))  # pending alone, drafts of one token, verifications of up to 3
    if tree:  # trees of up to 3 depths of 10 candidates
        assert sizes.tree == set(range(2, 32)) and static.executor.seen.tree <= sizes.tree
    else:
        assert not sizes.tree
    static.executor.prepare_graphs(capacity, chain=sizes.chain, tree=sizes.tree, mlp=sizes.scratch)
    assert static.executor.graphs.store.captures > 0  # the warm-up's graphs and the precapture's
    assert static.executor.graphs.pool.capacity >= capacity
    pool = static.executor.graphs.pool.keys
    for prompt in prompts:
        want = van.generate(prompt, stop)
        got = spec.generate(prompt, stop)
        assert (want.graph_captures, got.graph_captures) == (0, 0)
        assert got.tokens == want.tokens and got.drafted > 0
    assert static.executor.graphs.pool.keys is pool  # never regrown: no graph was dropped


def test_without_prepare_graphs_the_timed_decodes_record_them():
    """The control: the first generations record their graphs while they run, and a longer prompt
    later regrows the pool and records again."""
    _, static = _adapters(num_layers=4, seed=3, max_position_embeddings=2048)
    van, spec = _decoders(static)
    stop = StopCondition(16)
    assert spec.generate(random_prompt(5, seed=1), stop).graph_captures > 0
    assert spec.generate(random_prompt(5, seed=2), stop).graph_captures == 0  # the same sizes again
    assert spec.generate(random_prompt(600, seed=3), stop).graph_captures > 0  # a bigger pool


def test_the_experiment_sizes_the_pool_for_the_longest_prompt_and_answer(tmp_path):
    from framework.data.prompts import Prompt
    from framework.session.run_config import RunConfig
    from framework.session.session import Session
    from framework.testing import tiny_tokenizer

    cfg = RunConfig.of(max_new_tokens=20, dtype="float32", kernels=False, logger="none")
    exp = Session(
        cfg, tiny_model("llama", 4, seed=1, dtype=torch.float32), tiny_tokenizer(), log=lambda m: None
    )
    assert exp.prepare_graphs([]) == (0, 0.0)  # no graphs: nothing to record
    exp.adapter.executor.set_cuda_graphs(True, capture=False)
    long_turns = (" ".join(["w7"] * 400), "w3 w4")  # two turns: the second sees the first answer
    prompts = [Prompt(1, "qa", "qa", ("w5 w6",)), Prompt(2, "mt_bench", "writing", long_turns)]
    recorded, _ = exp.prepare_graphs(prompts)
    assert recorded > 0 and exp.adapter.executor.graphs.pool.capacity >= 400 + 2 * 20
    for p in prompts:
        for res, _text in exp.decode_prompt(exp.spec, p):
            assert res.graph_captures == 0
