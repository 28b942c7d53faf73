"""Host work per round outside the forwards (issue 38, item 3): operations dispatched (each an eager
kernel launch on a GPU) and device-to-host reads (each a synchronisation), counted on the CPU with
`framework.testing.host_work.count_host_work` for every preset on a tiny model.

The issue's limits are 20 operations and 1 read a round. The presets listed in `WITHIN_LIMITS`
meet them here; every preset is held to its recorded budget (`BUDGETS`, what it measured on
2026-11-28 with a margin), so that a change adding work to a round fails a test. The presets over
the limits and why are in docs/performance.md ("Host work per round").
"""

from __future__ import annotations

import pytest
import torch

from framework.engine.adapter import adapter_for
from framework.engine.decoding import StopCondition
from framework.testing import FAST_OVERRIDES, prepare_context, random_prompt, tiny_model
from framework.testing.host_work import count_host_work

LIMIT_OPS, LIMIT_READS = 20, 1.0

#: (operations, reads) per round measured on 2026-11-28 (8-block tiny Llama, two prompts, 32
#: tokens), each with about 15% headroom (more for the gated presets' reads: their gate's
#: decisions follow measured costs, so how often they draft varies a little from run to run): a
#: preset may not do more work per round than this.
BUDGETS = {
    "cascade": (16, 1.2),
    "clasp": (52, 2.4),
    "clasp_safe": (18, 1.3),
    "del": (152, 22.2),
    "del_safe": (21, 2.6),
    "hybrid": (15, 1.2),
    "layerskip_dv": (23, 2.3),
    "layerskip_fs": (20, 1.0),
    "layerskip_static": (25, 1.1),
    "layerskip_static_safe": (14, 1.0),
    "prompt_lookup": (14, 1.0),
    "selfsd": (19, 2.3),
    "selfsd_safe": (14, 1.2),
    "selfsd_sampling": (81, 2.8),
    "static_confidence": (14, 1.25),
    "swift": (43, 4.6),
    "swift_safe": (8, 1.3),
}
#: The presets within the issue's limits here.
WITHIN_LIMITS = ("layerskip_fs", "layerskip_static_safe", "prompt_lookup")


def _per_round(name: str) -> tuple[float, float, int]:
    from framework.session.presets import load_preset
    from framework.session.run_config import RunConfig
    from framework.session.session import build_decoder

    preset = load_preset(name)
    fast = {
        f"{kind}.{field}": value
        for (kind, strategy), fields in FAST_OVERRIDES.items()
        if preset.get(kind, {}).get("name") == strategy
        for field, value in fields.items()
    }
    adapter = adapter_for(tiny_model("llama", num_layers=8, seed=0))
    dec = build_decoder(adapter, RunConfig.from_preset(name, **fast))
    dec.prepare(prepare_context(adapter))
    with torch.inference_mode(), count_host_work() as work:
        for seed in (0, 1):
            dec.generate(random_prompt(8, 128, seed=seed), StopCondition(32))
    ops, reads = work.per_round()
    return ops, reads, work.rounds


def test_every_speculative_preset_has_a_budget():
    from framework.session.presets import list_presets, load_preset

    presets = {n for n in list_presets() if not load_preset(n).get("baseline_only")}
    assert presets == set(BUDGETS), "a new preset needs its host-work budget here (measure it)"
    for ops, reads in BUDGETS.values():
        assert ops > 0 and reads >= LIMIT_READS


@pytest.mark.parametrize(
    "name",
    # the quick check measures the presets within the limits; CI measures every one
    [pytest.param(n, marks=() if n in WITHIN_LIMITS else pytest.mark.slow) for n in sorted(BUDGETS)],
)
def test_host_work_per_round_stays_within_the_presets_budget(name):
    ops, reads, rounds = _per_round(name)
    assert rounds >= 10
    budget_ops, budget_reads = BUDGETS[name]
    assert ops <= budget_ops, (
        f"{name}: {ops:.1f} operations a round outside the forwards (budget {budget_ops})"
    )
    assert reads <= budget_reads, f"{name}: {reads:.2f} host reads a round (budget {budget_reads})"
    if name in WITHIN_LIMITS:
        assert ops <= LIMIT_OPS and reads <= LIMIT_READS, (name, ops, reads)


def test_the_count_excludes_the_forwards_and_counts_what_a_round_adds():
    """The counter itself: a forward's own operations are the executor's; work around it counts,
    by operator and by line; reads are counted where they are made."""
    adapter = adapter_for(tiny_model("llama", num_layers=2, seed=0))
    ids, positions = random_prompt(4, seed=0), torch.arange(4)[None]
    cache = adapter.new_cache(8)
    with torch.inference_mode(), count_host_work() as work:
        out = adapter.forward(ids, positions, cache)  # the forward's operations: not counted
        top = out.logits.argmax(-1)  # 1 operation
        m = (top == 3).long().sum()  # 3 operations
        _ = m.item()  # 1 read
    assert work.ops == 4 and work.reads == 1, (work.by_op, work.reads)
    assert work.by_op["aten.argmax"] == 1 and work.by_op["aten.sum"] == 1
