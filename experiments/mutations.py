"""The mutation suite: plant the bugs that matter, one at a time, and check that a test catches each.

Each `Mutation` names a rule that decides correctness (the acceptance rules, the KV cache, the
token tree) or a search that decides speed (the Bayesian optimisations, the draft gate, the
compressed drafts), the exact source text it changes and the tests that must catch it. The script
copies the repository's tracked files to a temporary directory once, then for each mutation applies
the change there, runs its tests (``pytest -x``; the copy's own packages, not the installed ones),
restores the file, and prints the kill table. A mutation is *killed* when a test fails, *survives*
when its tests pass, and is an *error* when its text is no longer in the source (the rule moved:
update the mutation) or its tests cannot run. The exit status is 0 only when every mutation is
killed.

    python experiments/mutations.py                      # every mutation (about 5 minutes on 2 cores)
    python experiments/mutations.py --only swift_bo_random,gate_optimism_sign
    python experiments/mutations.py --list

A new rule adds its mutations here (CONTRIBUTING.md); ``tests/test_mutations.py`` (slow) runs the
whole list in CI. The mechanics are ours (a string replacement per mutation): the list of
meaningful mutations is the point, not mutation testing in bulk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    """One planted bug: in ``path`` replace ``old`` (which must occur exactly once) with ``new``;
    ``tests`` (pytest node ids or files) must fail. ``needs``: what the host must run for the
    mutated code to run at all (``"avx512_vnni"``: the kernels' VNNI int4 path, compiled only
    where the CPU has it); elsewhere the mutation is skipped, and its twin for that host's path
    is planted instead."""

    name: str
    why: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    needs: str | None = None


def host_runs(needs: str | None) -> bool:
    """Whether this host runs the code a mutation with ``needs`` plants its bug in."""
    if needs is None:
        return True
    if needs == "avx512_vnni":
        from framework.kernels import extension

        ext = extension.load_extension() if extension.available() else None
        return getattr(ext, "int4_kernel", "scalar") == "avx512_vnni"
    raise ValueError(f"unknown mutation requirement {needs!r} (known: 'avx512_vnni')")


V = "tests/strategies/verifiers/"
MUTATIONS: tuple[Mutation, ...] = (
    # ---- correctness: acceptance rules, cache, tree ------------------------------------------
    Mutation(
        "sampling_off_by_one",
        "the target distribution of draft j read one position late",
        "strategies/verifiers/sampling.py",
        "p_d = p[:, :k].gather(-1, idx).squeeze(-1)",
        "p_d = p[:, 1 : k + 1].gather(-1, idx).squeeze(-1)",
        (V + "test_sampling_rule.py",),
    ),
    Mutation(
        "sampling_inverted_ratio",
        "accept with q/p instead of p/q",
        "strategies/verifiers/sampling.py",
        "torch.lt(u * q_d, p_d)",
        "torch.lt(u * p_d, q_d)",
        (V + "test_sampling_rule.py",),
    ),
    Mutation(
        "sampling_replacement_from_p",
        "a rejected draft token is replaced by a sample of p, not of the residual max(0, p - q)",
        "strategies/verifiers/sampling.py",
        "torch.where(use_residual[:, None], residual, p_m)",
        "p_m",
        (V + "test_sampling_rule.py", V + "test_sampling.py"),
    ),
    Mutation(
        "greedy_accepts_one_more",
        "the greedy verifier accepts one token past the first mismatch",
        "strategies/verifiers/greedy.py",
        '    return {"target": target, "accepted": ok.cumprod(dim=1).sum(dim=1)}',
        '    return {"target": target, "accepted": (ok.cumprod(dim=1).sum(dim=1) + 1).clamp(max=target.shape[1] - 1)}',
        (V + "test_greedy.py", "tests/strategies/test_combinations.py"),
    ),
    Mutation(
        "kv_commit_one_too_many",
        "a commit keeps one position more than verified",
        "framework/engine/kv_cache.py",
        "        self.committed = c + num\n",
        "        self.committed = c + num + (1 if num else 0)\n",
        ("tests/framework/engine/test_kv_cache.py::test_committed_kv_matches_fresh_prefill",),
    ),
    Mutation(
        "tree_wrong_parents",
        "token-tree nodes hang off the previous chain node's parent",
        "strategies/verifiers/tree.py",
        "        parents += [chain_idx] * w\n",
        "        parents += [max(0, chain_idx - 1)] * w\n",
        (V + "test_tree.py",),
    ),
    Mutation(
        "tree_nodes_keep_the_chain_token",
        "the device-built tree offers the chain token again as its own alternative",
        "strategies/verifiers/tree.py",
        "torch.sort(is_chain, dim=1, stable=True)",
        "torch.sort(is_chain, dim=1, stable=True, descending=True)",
        (V + "test_tree.py",),
    ),
    # ---- issue 54, class 1: every key that picks a recorded graph, term by term ---------------
    Mutation(
        "graph_key_drops_the_span",
        "a whole forward's key leaves out the attention span (past 2k tokens a graph of the short span replays)",
        "framework/engine/execution/spec.py",
        "            rows,\n            span,\n",
        "            rows,\n            0,\n",
        (
            "tests/framework/engine/execution/test_graph_keys.py::test_a_forward_past_the_first_span_records_a_graph_of_its_own",
        ),
    ),
    Mutation(
        "graph_key_drops_the_hidden_states",
        "a whole forward's key leaves out whether it returns every block's residual",
        "framework/engine/execution/spec.py",
        "            self.capture_hidden,\n",
        "            False,\n",
        (
            "tests/framework/engine/execution/test_graph_keys.py::test_two_forwards_that_differ_in_one_term_record_two_graphs",
        ),
    ),
    Mutation(
        "graph_key_drops_the_pick",
        "a whole forward's key leaves out which token pick its graph holds",
        "framework/engine/execution/spec.py",
        '            self.pick if logits != "none" else None,',
        '            None if self.pick is None or logits == "none" else TokenPick(),',
        ("tests/framework/engine/execution/test_graph_keys.py::test_every_pick_records_a_graph_of_its_own",),
    ),
    Mutation(
        "graph_key_one_lowbit_format",
        "a whole forward's key tells the model's weights from a low-bit copy, not one format from another",
        "framework/engine/execution/executor.py",
        '                "model" if lowbit is None else lowbit.weights,',
        '                "model" if lowbit is None else "low-bit",',
        (
            "tests/framework/engine/execution/test_graph_keys.py::test_every_draft_weights_format_records_graphs_of_its_own",
        ),
    ),
    Mutation(
        "head_key_drops_the_tokens",
        "a reduced draft head's key is its size and name, not which tokens it scores",
        "framework/engine/draft_head.py",
        "        return (self.key, self.size, self.digest)",
        "        return (self.key, self.size)",
        (
            "tests/framework/engine/execution/test_graph_keys.py::test_two_forwards_that_differ_in_one_term_record_two_graphs",
            "tests/framework/engine/execution/test_graph_keys.py::test_device_work_is_keyed_by_the_draft_head_it_reads",
        ),
    ),
    Mutation(
        "head_key_drops_the_room",
        "a growing head's key leaves out its room (a graph recorded before the room doubled replays)",
        "framework/engine/draft_head.py",
        '        return (*self.base.graph_key, "room", self.capacity, self._slot)',
        '        return (*self.base.graph_key, "room", self._slot)',
        (
            "tests/framework/engine/execution/test_graph_keys.py::test_a_growing_heads_room_and_buffer_set_are_in_the_key",
        ),
    ),
    Mutation(
        "head_key_drops_the_buffer_set",
        "a growing head's key leaves out its buffer set (a second live head replays the first one's rows)",
        "framework/engine/draft_head.py",
        '        return (*self.base.graph_key, "room", self.capacity, self._slot)',
        '        return (*self.base.graph_key, "room", self.capacity)',
        (
            "tests/framework/engine/execution/test_graph_keys.py::test_a_growing_heads_room_and_buffer_set_are_in_the_key",
        ),
    ),
    Mutation(
        "branch_key_drops_the_format",
        "a branch graph's key tells the model's weights from a low-bit copy, not one format from another",
        "framework/engine/execution/branches.py",
        "        return self.store.run((*key, active_format()), fn)",
        "        return self.store.run((*key, active_format() is not None), fn)",
        (
            "tests/framework/engine/execution/test_graph_keys.py::test_branch_graphs_are_keyed_by_kind_block_rows_span_and_the_drafts_format",
        ),
    ),
    Mutation(
        "branch_key_drops_the_span",
        "a branch attention's key leaves out its span",
        "framework/engine/execution/branches.py",
        '            return self._run(("attn", i, t, s), hidden, lambda: self._static_attention(i, t, False, s))',
        '            return self._run(("attn", i, t, 0), hidden, lambda: self._static_attention(i, t, False, s))',
        (
            "tests/framework/engine/execution/test_graph_keys.py::test_branch_graphs_are_keyed_by_kind_block_rows_span_and_the_drafts_format",
        ),
    ),
    Mutation(
        "work_key_drops_the_head",
        "a device function's key leaves out the draft head it scores (another head replays its rows)",
        "framework/engine/execution/work.py",
        "            key = dataclasses.replace(key, engine=head.graph_key)",
        "            pass",
        (
            "tests/framework/engine/execution/test_graph_keys.py::test_device_work_is_keyed_by_the_draft_head_it_reads",
        ),
    ),
    Mutation(
        "dp_key_drops_the_span",
        "the key of a device function with blocks (CLaSp's DP) leaves out its span: past 2k tokens it no longer sees the context",
        "framework/engine/execution/work.py",
        '            gkey = ("work", ("blocks", key, s))',
        '            gkey = ("work", ("blocks", key, 0))',
        (
            "tests/framework/engine/execution/test_graph_keys.py::test_block_graphs_past_the_first_span_are_graphs_of_their_own",
        ),
    ),
    Mutation(
        "precapture_key_at_the_pools_span",
        "the graphs recorded before timing are keyed at the pool's whole span, whatever span they read (each is recorded again while timed)",
        "framework/engine/execution/forward_graph.py",
        '                    t, s, "model", rule=rkey\n                )',
        '                    t, self.pool.capacity, "model", rule=rkey\n                )',
        (
            "tests/framework/engine/execution/test_graph_keys.py::test_the_graphs_recorded_before_timing_are_those_the_forwards_of_every_span_replay",
        ),
    ),
    # ---- issue 54, class 2: what the logits processors see (against HF generate) ---------------
    Mutation(
        "first_token_processed_without_the_prompts_last_token",
        "the first new token's processors see the prompt without its last token (plain decoding too)",
        "framework/engine/state.py",
        "            return self.processing.next(self.tokens, out.logits[:, -1])",
        "            return self.processing.next(self.tokens[:, : p - 1], out.logits[:, -1])",
        (
            "tests/framework/engine/test_processing.py::test_speculative_decoding_with_processors_equals_hf_generate_with_them",
        ),
    ),
    Mutation(
        "min_new_tokens_boundary_one_early",
        "min_new_tokens counts the new tokens from one before the prompt's end (an EOS is let through one token early)",
        "framework/engine/decoding.py",
        "            state.processing = LogitsProcessing(self.controls.processors_for(state.prompt_len))",
        "            state.processing = LogitsProcessing(self.controls.processors_for(state.prompt_len - 1))",
        (
            "tests/framework/engine/test_processing.py::test_min_new_tokens_holds_an_eos_back_up_to_the_boundary_generate_keeps",
        ),
    ),
    Mutation(
        "head_draft_rows_unprocessed",
        "draft rows scored through a reduced draft head skip the processors (lossless, but acceptance falls)",
        "framework/engine/processing.py",
        "        if out.logits is None:\n            return out\n        fed = ",
        "        if out.logits is None or out.head is not None:\n            return out\n        fed = ",
        (
            "tests/framework/engine/test_processing.py::test_draft_rows_are_processed_so_the_target_as_its_own_draft_is_always_accepted",
        ),
    ),
    # ---- issue 54, class 3: a draft is never longer than its max_tokens -------------------------
    Mutation(
        "forced_lead_past_the_cap",
        "the grammar-forced drafter's leading run is cut at max_forced only, not at the round's max_tokens",
        "strategies/drafters/grammar_forced.py",
        "        lead = grammar.forced(generated, min(max_tokens, self.config.max_forced))",
        "        lead = grammar.forced(generated, self.config.max_forced)",
        ("tests/strategies/drafters/test_grammar_forced.py",),
    ),
    Mutation(
        "forced_inserted_run_fills_the_cap",
        "a forced run inside a draft may fill the round's cap, and the drafted token after it takes the round past it",
        "strategies/drafters/grammar_forced.py",
        "        room = min(self._max_forced, self._cap - len(self.seq) - 1)  # one drafted token must follow",
        "        room = min(self._max_forced, self._cap - len(self.seq))",
        ("tests/strategies/drafters/test_grammar_forced.py",),
    ),
    Mutation(
        "forced_round_not_capped",
        "the drafter after a forced run is stopped by its length controller only, not by the round's cap",
        "strategies/drafters/grammar_forced.py",
        "        return not self._forcing.full() and self._length.should_continue(drafted, confidence)",
        "        return self._length.should_continue(drafted, confidence)",
        ("tests/strategies/drafters/test_grammar_forced.py",),
    ),
    Mutation(
        "forced_then_drafter_given_the_whole_cap",
        "the drafter after a forced run is given the round's whole max_tokens, the run's tokens not counted",
        "strategies/drafters/grammar_forced.py",
        "            draft = self.then.draft(state, plan, _Capped(length, forcing), max_tokens - len(lead))",
        "            draft = self.then.draft(state, plan, _Capped(length, forcing), max_tokens)",
        ("tests/strategies/drafters/test_grammar_forced.py",),
    ),
    Mutation(
        "round_budget_one_past_the_generation",
        "a round's draft may reach the generation's last token (the bonus token then runs past max_new_tokens)",
        "framework/engine/decoding.py",
        "            draft, result = self._round(state, stop.max_new_tokens - len(new) - 1, timer)",
        "            draft, result = self._round(state, stop.max_new_tokens - len(new), timer)",
        ("tests/strategies/drafters/test_layer_skip.py", "tests/strategies/drafters/test_grammar_forced.py"),
    ),
    # ---- issue 54, class 4: resume, repeats, seeds and the prompt split -----------------------
    Mutation(
        "resume_keeps_a_partly_recorded_prompt",
        "--resume keeps the records of a prompt only some methods recorded, and decodes it again (counted twice)",
        "framework/results/records.py",
        "    if partial and repair:",
        "    if False:",
        (
            "tests/framework/runner/test_resume_and_seeds.py::test_a_prompt_only_some_methods_recorded_is_decoded_again_and_counted_once",
        ),
    ),
    Mutation(
        "resume_ignores_the_repeat",
        "--resume takes a prompt of the first repeat for the same prompt of every repeat",
        "framework/results/records.py",
        '    return (rec.get("repeat", 0), *prompt_key(rec))',
        "    return (0, *prompt_key(rec))",
        (
            "tests/framework/runner/test_resume_and_seeds.py::test_resume_with_repeats_decodes_each_repeat_of_each_prompt_once",
        ),
    ),
    Mutation(
        "seed_misses_the_strategies_streams",
        "--seed leaves a strategy's own random stream (a sampling verifier's, a search's) at its default",
        "framework/session/sections.py",
        "        if seed and seeded:",
        "        if False:",
        (
            "tests/framework/runner/test_resume_and_seeds.py::test_the_seed_reaches_every_random_stream_a_strategy_keeps",
            "tests/framework/runner/test_resume_and_seeds.py::test_the_same_seed_repeats_a_run_and_another_seed_reaches_its_stream",
        ),
    ),
    Mutation(
        "synthetic_acceptance_unseeded",
        "the synthetic acceptance stream starts from seed 0 whatever --seed says",
        "framework/session/session.py",
        "        else SyntheticAcceptance(cfg.method.synthetic_acceptance, cfg.generation.seed),",
        "        else SyntheticAcceptance(cfg.method.synthetic_acceptance, 0),",
        (
            "tests/framework/runner/test_resume_and_seeds.py::test_the_same_seed_repeats_a_run_and_another_seed_reaches_its_stream",
        ),
    ),
    Mutation(
        "pipeline_unseeded",
        "a run never seeds Python's, NumPy's or torch's generators (its draws differ from run to run)",
        "framework/runner/pipeline.py",
        "        seed_everything(cfg.generation.seed)",
        "        pass",
        (
            "tests/framework/runner/test_resume_and_seeds.py::test_the_pipeline_seeds_python_numpy_and_torch_from_the_seed",
        ),
    ),
    Mutation(
        "prompt_split_drops_the_remainder",
        "the prompts are split over ranks in equal blocks: the remainder is decoded by no rank",
        "framework/runner/lightning.py",
        "        return self.items[t.global_rank :: t.world_size]",
        "        n = len(self.items) // t.world_size\n        return self.items[t.global_rank * n : (t.global_rank + 1) * n]",
        (
            "tests/framework/runner/test_resume_and_seeds.py::test_the_prompts_split_over_ranks_once_each_with_a_remainder",
        ),
    ),
    # ---- the selectors' rules ----------------------------------------------------------------
    Mutation(
        "clasp_argmin",
        "CLaSp's DP keeps the least similar candidate",
        "strategies/selectors/clasp_dp.py",
        'better = torch.gt if objective == "max_cosine" else torch.lt',
        'better = torch.lt if objective == "max_cosine" else torch.gt',
        ("tests/strategies/selectors/test_clasp_dp.py",),
    ),
    Mutation(
        "clasp_first_row_not_the_full_model",
        "CLaSp's DP takes g(i, 0) from the previous layer instead of x_i",
        "strategies/selectors/clasp_dp.py",
        "cand = torch.cat([*parts, x[i : i + 1], prev[:m]])",
        "cand = torch.cat([*parts, prev[:1], prev[:m]])",
        ("tests/strategies/selectors/test_clasp_dp.py",),
    ),
    Mutation(
        "swift_inverted_matchness",
        "SWIFT scores the tokens the draft gets wrong",
        "strategies/selectors/swift.py",
        "return float((predicted == target).float().mean())",
        "return float((predicted != target).float().mean())",
        (
            "tests/strategies/selectors/test_swift.py::test_matchness_of_the_full_model_is_one_and_leaves_the_cache_intact",
            "tests/strategies/selectors/test_swift.py::test_matchness_counts_next_token_agreement",
        ),
    ),
    Mutation(
        "del_exit_off_by_one",
        "DEL exits one layer after the one its TPL chose",
        "strategies/selectors/del_tpl.py",
        "best, e, d = row[length], int(ell), length\n",
        "best, e, d = row[length], int(ell) + 1, length\n",
        ("tests/strategies/selectors/test_del_tpl.py",),
    ),
    Mutation(
        "del_window_drops_the_first_disagreement",
        "DEL's window ends before the first position where layer E disagrees with the target",
        "strategies/selectors/del_tpl.py",
        "return diff.cumsum(dim=0) <= diff",
        "return diff.cumsum(dim=0) < 1",
        ("tests/strategies/selectors/test_del_tpl.py",),
    ),
    Mutation(
        "del_sums_count_outside_the_window",
        "DEL's mismatched confidence also sums the positions past the window",
        "strategies/selectors/del_tpl.py",
        "conf * (w - hit)",
        "conf * (1 - hit)",
        ("tests/strategies/selectors/test_del_tpl.py",),
    ),
    Mutation(
        "selfsd_flipped_objective",
        "Self-SD's search maximises minus tokens/s",
        "strategies/selectors/selfsd_bo.py",
        "bo.observe(bits, score[key])",
        "bo.observe(bits, -score[key])",
        ("tests/strategies/selectors/test_selfsd_bo.py", "tests/strategies/selectors/test_bo_proposals.py"),
    ),
    # ---- the searches: their Bayesian proposals must be used -----------------------------------
    Mutation(
        "swift_bo_random",
        "SWIFT fits its GP, then drafts a random set instead of the GP-UCB proposal",
        "strategies/selectors/swift.py",
        "            x = self.bo.suggest()\n",
        "            x = self.bo.suggest()\n            x = self._random_candidate()\n",
        ("tests/strategies/selectors/test_bo_proposals.py",),
    ),
    Mutation(
        "selfsd_gp_random",
        "Self-SD's 'gp' iterations propose a random point",
        "strategies/selectors/selfsd_bo.py",
        'bits, source = bo.suggest(), "gp"',
        'bits, source = bo.random_point(), "gp"',
        ("tests/strategies/selectors/test_bo_proposals.py::test_selfsd_scores_the_gp_proposals",),
    ),
    Mutation(
        "sweep_bayes_argmin",
        "the local bayes sweep runs the candidate of least expected improvement",
        "framework/sweep/bayes.py",
        "return pool[int(torch.argmax(scores))]",
        "return pool[int(torch.argmin(scores))]",
        ("tests/framework/sweep/test_sweep_bayes.py",),
    ),
    # ---- compressed drafts: exact output, but acceptance must not collapse ----------------------
    Mutation(
        "int8_scale_fused",
        "the CPU kernels' int8 copy saturates (a scale four times too small)",
        "framework/kernels/fused.py",
        "scale = (w.abs().amax(dim=1) / 127.0)",
        "scale = (w.abs().amax(dim=1) / 508.0)",
        ("tests/framework/kernels/test_fused.py",),
    ),
    Mutation(
        "fp8_scale_lowbit",
        "the fp8 copy is scaled for int8's range (a quarter of e4m3's)",
        "framework/kernels/lowbit.py",
        'top = FP8_MAX if fmt == "fp8" else 127.0',
        'top = 127.0 if fmt == "fp8" else 127.0',
        ("tests/framework/kernels/test_lowbit.py",),
    ),
    Mutation(
        "int8_scale_lowbit",
        "the low-bit int8 copy saturates (a scale four times too small)",
        "framework/kernels/lowbit.py",
        'top = FP8_MAX if fmt == "fp8" else 127.0',
        'top = FP8_MAX if fmt == "fp8" else 508.0',
        (
            "tests/framework/drafting/test_draft_vocab.py::test_low_bit_drafts_differ_from_the_target_only_by_rounding",
        ),
    ),
    Mutation(
        "lowbit_never_switched_on",
        "draft passes keep the model's own weights: the copy never runs",
        "framework/kernels/lowbit.py",
        "    fmt = _ACTIVE[0]\n    if fmt is not None:\n",
        "    fmt = _ACTIVE[0]\n    if fmt is None:\n",
        (
            "tests/framework/drafting/test_draft_vocab.py::test_low_bit_copies_run_in_drafts_only_and_the_output_is_unchanged",
        ),
    ),
    # ---- the draft gate and the run's messages ---------------------------------------------------
    Mutation(
        "gate_optimism_sign",
        "the gate decides on a lower bound of the acceptance instead of an upper one",
        "framework/drafting/gate.py",
        "return min(1.0, alpha + self.optimism * sd)",
        "return min(1.0, alpha - self.optimism * sd)",
        ("tests/framework/drafting/test_gate.py",),
    ),
    Mutation(
        "user_valueerror_as_bad_input",
        "a ValueError in the user's own strategy is reported as a bad flag",
        "framework/session/errors.py",
        "if isinstance(err, ValueError) and not frames:",
        "if isinstance(err, ValueError):",
        ("tests/framework/session/test_errors.py",),
    ),
    Mutation(
        "gate_cap_on_bound",
        "the gate caps a drafting round's length at the optimistic bound instead of the point estimate",
        "framework/drafting/gate.py",
        "        alpha = self.alpha\n        assert alpha is not None and self.plan is not None",
        "        alpha = self.alpha_bound\n        assert alpha is not None and self.plan is not None",
        ("tests/framework/drafting/test_gate.py",),
    ),
    Mutation(
        "summary_timed",
        "the strategies' summaries run before the clock stops (reporting timed as decoding)",
        "framework/engine/decoding.py",
        "phases=phases, summarise=summarise)",
        "phases=phases, strategy_summary=summarise())",
        ("tests/framework/engine/test_decoding.py::test_the_strategies_summaries_are_not_timed",),
    ),
    Mutation(
        "int4_nibbles_swapped",
        "the int4 copy packs a block's second 64 inputs into the low nibbles",
        "framework/kernels/lowbit.py",
        "    packed = u[:, :, 0, :] | (u[:, :, 1, :] << 4)",
        "    packed = u[:, :, 1, :] | (u[:, :, 0, :] << 4)",
        ("tests/framework/kernels/test_lowbit.py",),
    ),
    Mutation(
        "int4_zero_point_dropped",
        "the int4 kernel forgets that a stored nibble is q + 8",
        "framework/kernels/csrc/selfspec_kernels.cpp",
        "const __m512i d0 = _mm512_dpbusd_epi32(z0,",
        "const __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(),",
        ("tests/framework/kernels/test_extension.py",),
        needs="avx512_vnni",
    ),
    Mutation(
        "int4_zero_point_dropped_without_vnni",
        "the int4 kernel without VNNI (AVX2 hosts; the AVX2 variant built on AVX-512 ones) forgets the q + 8",
        "framework/kernels/csrc/selfspec_kernels.cpp",
        "d += (((p[k] >> shift) & 0x0F) - 8) * xq[g * kQ4Group + k];",
        "d += ((p[k] >> shift) & 0x0F) * xq[g * kQ4Group + k];",
        ("tests/framework/kernels/test_extension.py",),
    ),
    Mutation(
        "head_scored_in_float32",
        "a draft with compressed fused weights still streams the float32 rows of the reduced head",
        "framework/engine/execution/executor.py",
        "        fmt = weights.head if isinstance(weights, FusedBlocks) else None",
        "        fmt = None",
        ("tests/framework/engine/test_draft_head.py", "tests/framework/drafting/test_draft_vocab.py"),
    ),
    Mutation(
        "offset_keeps_one_skipped",
        "--offset keeps the last of the prompts it should skip in each category",
        "framework/data/prompts.py",
        "            if counts[cat] > offset and (limit is None or counts[cat] <= offset + limit):",
        "            if counts[cat] >= offset and (limit is None or counts[cat] <= offset + limit):",
        ("tests/framework/data/test_prompts.py",),
    ),
    Mutation(
        "gate_first_round_full_length",
        "the gate's first drafted round drafts the controller's whole length instead of a first probe",
        "framework/drafting/gate.py",
        "                return min(k, self.first_probe)",
        "                return k",
        ("tests/framework/drafting/test_gate.py",),
    ),
    Mutation(
        "long_linear_drops_bias",
        "a long block (prefill) through oneDNN loses the layer's bias",
        "framework/kernels/cpu.py",
        '    out = op(x.reshape(-1, k), weight, bias, "none", [], "")',
        '    out = op(x.reshape(-1, k), weight, None, "none", [], "")',
        ("tests/framework/kernels/test_cpu.py",),
    ),
    Mutation(
        "verification_block_to_onednn",
        "a block of exactly MAX_ROWS rows (a verification's largest) leaves the batch-invariant kernel",
        "framework/kernels/cpu.py",
        "    if rows > MAX_ROWS:\n        return _long_linear(x, weight, bias)",
        "    if rows >= MAX_ROWS:\n        return _long_linear(x, weight, bias)",
        ("tests/framework/kernels/test_cpu.py",),
    ),
    Mutation(
        "gate_ignores_context",
        "the gate prices every round at the cost model's near context",
        "framework/drafting/gate.py",
        "        if costs is not None and state is not None:\n            costs = costs.at_context(",
        "        if False:\n            costs = costs.at_context(",
        ("tests/framework/drafting/test_gate.py::test_the_gate_prices_each_round_at_its_context",),
    ),
    Mutation(
        "context_slope_inverted",
        "a longer context makes attention and verification cheaper",
        "framework/engine/cost_model.py",
        "    f = (tokens - costs.context) / (costs.far_context - costs.context)",
        "    f = (costs.context - tokens) / (costs.far_context - costs.context)",
        ("tests/framework/engine/test_cost_model.py", "tests/framework/results/test_metrics.py"),
    ),
    Mutation(
        "cascade_never_displaces",
        "the cascade never lets the layer-skip draft displace a copy",
        "strategies/drafters/cascade.py",
        "        better = copy is not None and skip is not None and skip >= threshold and skip > copy",
        "        better = False",
        ("tests/strategies/drafters/test_cascade.py",),
    ),
    Mutation(
        "graph_pool_reused",
        "once every graph is dropped, the next capture reuses the freed pool (an allocator assert on CUDA)",
        "framework/engine/execution/store.py",
        "            self._pool = self._stream = None",
        "            pass",
        ("tests/framework/engine/execution/test_store.py",),
    ),
    Mutation(
        "graph_dropped_while_others_live",
        "a graph dropped while others live is destroyed (it clears their shared cuBLAS workspace)",
        "framework/engine/execution/store.py",
        "            self._retired.extend(",
        "            [].extend(",
        ("tests/framework/engine/execution/test_store.py",),
    ),
    Mutation(
        "head_timing_bypasses_split",
        "the cost model times the LM head through the architecture, not the adapter's split-aware path",
        "framework/engine/cost_model.py",
        "    fns = [lambda: adapter.logits_from_hidden(x)]",
        "    fns = [lambda: adapter.arch.lm_head(adapter.arch.final_norm(x))]",
        ("tests/framework/engine/test_cost_model.py",),
    ),
    # ---- one graph per forward (issue 38, items 1-2) --------------------------------------------
    Mutation(
        "graphed_books_every_layer",
        "a whole-forward graph declares every layer written, skipped attentions included",
        "framework/engine/execution/forward_graph.py",
        "        writes = [i for i in range(stop) if plan is None or plan.runs_attn(i)]",
        "        writes = list(range(stop))",
        (
            "tests/framework/engine/execution/test_forward_graph.py::test_a_draft_chain_of_a_skip_plan_keeps_the_books_once_per_forward",
        ),
    ),
    Mutation(
        "graphed_outputs_aliased",
        "a whole forward returns the graph's own logits, which its next replay overwrites",
        "framework/engine/execution/forward_graph.py",
        "            None if logits is None else logits.clone(),",
        "            logits,",
        (
            "tests/framework/engine/execution/test_forward_graph.py::test_a_spec_is_recorded_once_replayed_after_and_its_outputs_are_copies",
        ),
    ),
    Mutation(
        "graphed_cache_fifo",
        "the graph cache drops the oldest recorded graph, not the least recently used",
        "framework/engine/execution/store.py",
        "            used.move_to_end(key)\n",
        "\n",
        (
            "tests/framework/engine/execution/test_forward_graph.py::test_the_cache_is_bounded_least_recently_used_first_and_starts_anew_once_too_many_retire",
        ),
    ),
    Mutation(
        "graphed_tree_as_chain",
        "a token tree's rows attend causally in a whole-forward graph",
        "framework/engine/execution/spec.py",
        "            self.tree_mask is not None,\n            weights,",
        "            False,\n            weights,",
        (
            "tests/framework/engine/execution/test_forward_graph.py::test_speculative_decoding_through_whole_forwards_equals_plain_greedy",
        ),
    ),
    # ---- host work per round (issue 38, item 3) -------------------------------------------------
    Mutation(
        "tree_reads_the_draft_again",
        "the tree verifier reads the draft's confidences from the device although the stop rule "
        "read them (past the engine's host copy)",
        "strategies/verifiers/tree.py",
        'self.widths(state.read(top1=conf[0])["top1"])',
        "self.widths(conf[0].tolist())",
        (
            "tests/framework/engine/test_host_work.py::test_host_work_per_round_stays_within_the_presets_budget[swift]",
        ),
    ),
    Mutation(
        "tree_commit_checks_on_the_device",
        "the tree verifier builds its commit with torch.tensor, which the engine does not know on "
        "the host, so the commit reads the tokens and offsets back",
        "strategies/verifiers/tree.py",
        "        up = state.tensor([m, *(tokens[i - 1] for i in path[1:]), want[node], *path])",
        "        up = torch.tensor([m, *(tokens[i - 1] for i in path[1:]), want[node], *path])",
        (
            "tests/framework/engine/test_host_work.py::test_host_work_per_round_stays_within_the_presets_budget[swift]",
        ),
    ),
    Mutation(
        "stop_rule_reads_forgotten",
        "the draft steps keep no host copy of the confidences the stop rule read, so a strategy "
        "that needs them reads them again",
        "framework/engine/draft_steps.py",
        "            self._state.host_values.remember(draft.confidences[0], self.read_top1)",
        "            pass",
        (
            "tests/framework/engine/test_host_work.py::test_host_work_per_round_stays_within_the_presets_budget[del]",
            "tests/framework/engine/test_host_work.py::test_the_count_leaves_out_what_launches_no_kernel_and_tells_draft_steps_apart",
        ),
    ),
    Mutation(
        "host_values_see_no_views",
        "the engine finds the host values of a tensor it read but not of a slice of it (a greedy "
        "commit's tokens), so the commit reads again",
        "framework/engine/host_values.py",
        "        if entry is None or entry.tensor.dtype != t.dtype:",
        "        if entry is None or entry.tensor.dtype != t.dtype or entry.tensor.shape != t.shape:",
        (
            "tests/framework/engine/test_host_values.py",
            "tests/framework/engine/test_host_work.py::test_host_work_per_round_stays_within_the_presets_budget",
        ),
    ),
    Mutation(
        "host_values_ignore_the_offset",
        "the engine maps a view's elements from the start of the storage, not from the view's own "
        "offset (a slice's host values are the storage's first ones)",
        "framework/engine/host_values.py",
        "    base = t.storage_offset()\n",
        "    base = 0\n",
        ("tests/framework/engine/test_host_values.py",),
    ),
    Mutation(
        "commit_reads_what_it_knows",
        "the commit reads the committed tokens from the device although a read or an upload "
        "brought them to the host",
        "framework/engine/state.py",
        "        host = (known.of(new[0]) or new[0].tolist()) if new.shape[0] == 1 else None",
        "        host = new[0].tolist() if new.shape[0] == 1 else None",
        (
            "tests/framework/engine/test_host_values.py",
            "tests/framework/engine/test_host_work.py::test_host_work_per_round_stays_within_the_presets_budget",
        ),
    ),
    Mutation(
        "sampling_commits_a_draft_in_place_of_the_correction",
        "the sampling rule's committed tokens keep the draft token at position m instead of the "
        "correction (or bonus) token",
        "strategies/verifiers/sampling.py",
        "    committed = torch.cat([tokens, nxt[:, None]], dim=1).scatter(1, m[:, None], nxt[:, None])",
        "    committed = torch.cat([tokens, nxt[:, None]], dim=1)",
        ("tests/strategies/verifiers/test_sampling.py",),
    ),
    Mutation(
        "graph_trees_one_candidate_wide",
        "the engine records trees of one candidate per depth before timing, not as wide as the "
        "verifier's candidates",
        "framework/engine/execution/sizes.py",
        "set(range(2, 2 + max_draft * max(tree_width, 1)))",
        "set(range(2, 2 + max_draft))",
        ("tests/framework/engine/execution/test_branches.py",),
    ),
    Mutation(
        "graph_chains_only_as_seen",
        "the engine records before timing only the chain sizes the warm-up ran, not every draft "
        "length up to the cap",
        "framework/engine/execution/sizes.py",
        "        chain = set(range(1, max_draft + 2)) | self.chain\n",
        "        chain = set(self.chain)\n",
        ("tests/framework/engine/execution/test_branches.py",),
    ),
    Mutation(
        "pick_the_least_likely_token",
        "the pick rule (inside the draft forward and in the draft builder) takes the argmin",
        "framework/types.py",
        "        tok = logits.argmax(dim=-1)\n        return Picked(tok if head is None else head.tokens(tok))",
        "        tok = logits.argmin(dim=-1)\n        return Picked(tok if head is None else head.tokens(tok))",
        ("tests/framework/engine/test_draft_steps.py",),
    ),
    Mutation(
        "draft_token_chosen_after_the_forward",
        "the engine's draft steps ask the forward for no pick: each draft token is chosen by eager "
        "operations after it",
        "framework/engine/draft_steps.py",
        "reusable=reusable, pick=self.pick)",
        "reusable=reusable, pick=None)",
        (
            "tests/framework/engine/test_host_work.py::test_host_work_per_round_stays_within_the_presets_budget",
        ),
    ),
    Mutation(
        "greedy_check_after_the_forward",
        "the greedy verifier applies its rule with eager operations after the verify forward "
        "instead of handing it to the forward",
        "strategies/verifiers/greedy.py",
        'out = state.forward_verify(block, logits_at="all", rule=greedy_rule)\n'
        '        target, m = out.ruled["target"], out.ruled["accepted"]',
        'out = state.forward_verify(block, logits_at="all")\n'
        "        ruled = greedy_rule(None, block, out.logits)\n"
        '        target, m = ruled["target"], ruled["accepted"]',
        (
            "tests/framework/engine/test_host_work.py::test_host_work_per_round_stays_within_the_presets_budget",
        ),
    ),
    Mutation(
        "strategy_reads_past_the_round_view",
        "the greedy verifier reads the state's token buffer, which VerifyView does not declare",
        "strategies/verifiers/greedy.py",
        "block = torch.cat([state.pending, draft.tokens], dim=1)",
        "block = torch.cat([state.committed_tokens.span(state.num_tokens - 1), draft.tokens], dim=1)",
        (
            "tests/framework/test_layering.py::test_strategies_and_their_building_blocks_see_views_not_the_engines_objects",
        ),
    ),
    Mutation(
        "drafter_typed_with_the_selectors_view",
        "the layer-skip drafter's draft takes the selectors' RoundView and still steps the draft",
        "strategies/drafters/layer_skip.py",
        "def draft(self, state: DraftView,",
        "def draft(self, state: RoundView,",
        (
            "tests/framework/test_layering.py::test_strategies_and_their_building_blocks_see_views_not_the_engines_objects",
        ),
    ),
    Mutation(
        "speedup_as_a_mean_of_ratios",
        "the one speedup function averages the per-prompt ratios instead of taking the ratio of the means",
        "framework/results/metrics.py",
        '    return (sum(m) / len(m) if m else 0.0) / mean_b if mean_b > 0 else float("nan")',
        '    return sum(x / y for x, y in zip(m, b)) / len(m) if mean_b > 0 else float("nan")',
        ("tests/framework/results/test_metrics.py::test_speedup_is_the_ratio_of_the_mean_tokens_per_second",),
    ),
    Mutation(
        "legacy_results_file_resumes_without_its_metadata",
        "--resume of an earlier run.py's results file copies its records into the folder but not its metadata",
        "framework/runner/pipeline.py",
        "        shutil.copyfile(old_meta, layout.meta)",
        "        pass",
        ("tests/experiments/test_output_compat.py::test_a_results_file_of_the_previous_version_resumes",),
    ),
    Mutation(
        "strategy_reaches_for_the_adapter",
        "the hybrid drafter's preparation reaches the model adapter through its context",
        "strategies/drafters/hybrid.py",
        "self.gate.prepare(ctx.with_draft(self.layer_skip))",
        "self.gate.prepare(ctx.adapter and ctx.with_draft(self.layer_skip))",
        (
            "tests/framework/test_layering.py::test_strategies_and_their_building_blocks_see_views_not_the_engines_objects",
        ),
    ),
    Mutation(
        "greedy_verify_reads_twice",
        "the greedy verifier reads the accepted count and the target's tokens in two host reads",
        "strategies/verifiers/greedy.py",
        '        k = state.read(accepted=m[:1], target=target[0])["accepted"][0]',
        "        k = m[:1].tolist()[0] + 0 * len(target[0].tolist())",
        (
            "tests/framework/engine/test_host_work.py::test_host_work_per_round_stays_within_the_presets_budget",
        ),
    ),
    # ---- exact mode (issue 38, item 4) ----------------------------------------------------------
    Mutation(
        "exact_bf16_stock_linear",
        "a bfloat16 model's linear layers take the stock matrix product in exact mode (row results "
        "depend on the row count)",
        "framework/kernels/cpu.py",
        "    if x.dtype is _BF16 and ext is not None:",
        "    if x.dtype is _BF16 and ext is None:",
        (
            "tests/framework/engine/test_exact.py::test_exact_mode_runs_bfloat16_linear_layers_through_the_batch_invariant_kernel",
        ),
    ),
    Mutation(
        "exact_bf16_kv_cache",
        "a bfloat16 model keeps a bfloat16 KV cache in exact mode (its attention leaves the "
        "batch-invariant kernel)",
        "framework/engine/adapter.py",
        "            self.kv_dtype = torch.float32",
        "            self.kv_dtype = self.arch.dtype",
        (
            "tests/framework/engine/test_exact.py::test_a_bfloat16_verification_is_bit_identical_to_single_steps_in_exact_mode",
        ),
    ),
    Mutation(
        "exact_backend_not_held",
        "exact mode's SDPA backend is not held around the forward (each attention picks its own)",
        "framework/engine/adapter.py",
        "        if self.sdpa_backend is None:\n            return nullcontext()",
        "        if True:\n            return nullcontext()",
        (
            "tests/framework/engine/test_exact.py::test_the_backend_of_exact_mode_holds_for_every_attention_of_a_forward",
        ),
    ),
    # ---- the engine keys, draws and reads strategies' device work (issue 46) ----------------------
    Mutation(
        "work_key_drops_a_bound_value",
        "the key of a strategy's device function leaves out its keyword values (two configurations share a graph)",
        "framework/engine/execution/work.py",
        "        params_key = tuple((label, canonical(v)) for label, v in values)",
        '        params_key = tuple((label, canonical(v)) for label, v in values if label.startswith("#"))',
        (
            "tests/framework/engine/execution/test_work.py::test_the_key_is_the_functions_name_its_bound_values_and_the_inputs_shapes_and_dtypes",
            "tests/framework/engine/execution/test_work.py::test_a_derived_key_holds_every_bound_value_of_a_shipped_device_function",
        ),
    ),
    Mutation(
        "read_under_the_wrong_name",
        "a strategy's values reach it under each other's names",
        "framework/engine/reads.py",
        '            self._values[strategy] = {k: out.pop(f"{i}.{k}") for k in vals}',
        '            self._values[strategy] = dict(zip(vals, [out.pop(f"{i}.{k}") for k in reversed(list(vals))]))',
        (
            "tests/framework/engine/test_host_reads.py::test_strategies_reads_come_back_with_the_verifiers_read_by_name_and_exact",
        ),
    ),
    Mutation(
        "work_graph_outside_exact_backend",
        "a strategy's device function with blocks (CLaSp's DP graph) runs its attention outside exact mode's backend",
        "framework/engine/execution/work.py",
        "        with torch.inference_mode(), state.adapter.backend():  # attention as the forwards' (exact mode)",
        "        with torch.inference_mode():",
        (
            "tests/framework/engine/execution/test_work.py::test_exact_modes_backend_holds_on_every_graph_route",
        ),
    ),
    Mutation(
        "forward_graph_outside_exact_backend",
        "a whole-forward graph runs its attention outside exact mode's backend",
        "framework/engine/execution/executor.py",
        "        with lowbit.active() if lowbit is not None else nullcontext(), self.resources.backend():\n"
        "            logits, hidden, last, picked, ruled = g.forwards.run(",
        "        with lowbit.active() if lowbit is not None else nullcontext():\n"
        "            logits, hidden, last, picked, ruled = g.forwards.run(",
        (
            "tests/framework/engine/execution/test_work.py::test_exact_modes_backend_holds_on_every_graph_route",
        ),
    ),
    Mutation(
        "precapture_outside_exact_backend",
        "the graphs recorded before timing record their attention outside exact mode's backend",
        "framework/engine/execution/executor.py",
        "        with torch.inference_mode(), lowbit or nullcontext(), self.resources.backend():",
        "        with torch.inference_mode(), lowbit or nullcontext():",
        (
            "tests/framework/engine/execution/test_work.py::test_exact_modes_backend_holds_on_every_graph_route",
        ),
    ),
    Mutation(
        "sampling_accepts_an_unseen_token",
        "the sampling rule accepts a token the verify forward's rows did not see (a reused early-exit draft)",
        "strategies/verifiers/sampling.py",
        "    m = (torch.lt(u * q_d, p_d) & seen).cumprod(dim=1).sum(dim=1)",
        "    m = torch.lt(u * q_d, p_d).cumprod(dim=1).sum(dim=1)",
        (
            "tests/strategies/verifiers/test_sampling_rule.py::test_a_token_no_row_of_the_verify_forward_saw_is_never_accepted",
        ),
    ),
    Mutation(
        "graph_key_drops_the_draft_weights",
        "a whole forward's key leaves out the draft's low-bit weights (a draft replays the model's graph)",
        "framework/engine/execution/spec.py",
        "            self.tree_mask is not None,\n            weights,",
        '            self.tree_mask is not None,\n            "model",',
        ("tests/framework/engine/execution/test_forward_graph.py",),
    ),
    Mutation(
        "graph_key_drops_the_rule",
        "a whole forward's key leaves out the verifier's acceptance rule (two rules share a graph)",
        "framework/engine/execution/spec.py",
        '            rule if logits == "all" else None,',
        '            None if rule is None else "a rule",',
        ("tests/framework/engine/execution/test_forward_graph.py",),
    ),
    Mutation(
        "graph_key_drops_the_head",
        "a whole forward's key leaves out the reduced draft head (another head, or a doubled room, replays a stale graph)",
        "framework/engine/execution/spec.py",
        '            head if logits == "head" else None,',
        '            "a head" if logits == "head" else None,',
        (
            "tests/framework/engine/execution/test_forward_graph.py",
            "tests/framework/engine/execution/test_work.py",
        ),
    ),
    Mutation(
        "route_sends_a_scratch_pass_whole",
        "the route choice forgets that a scratch pass (which must leave the cache as it was) cannot be a whole graph",
        "framework/engine/execution/route.py",
        '    ("it writes the cache", lambda f: f.spec.persist),',
        '    ("it writes the cache", lambda f: True),',
        ("tests/framework/engine/execution/test_route.py",),
    ),
    Mutation(
        "processor_sees_the_previous_rows_prefix",
        "a verify row is processed with the prefix of the row before it (one draft token short)",
        "framework/engine/processing.py",
        "                ahead = block[:, 1 : j + 1]",
        "                ahead = block[:, 1:j]",
        ("tests/framework/engine/test_processing.py",),
    ),
    Mutation(
        "draft_rows_processed_without_the_drafted_tokens",
        "a draft row is processed with the committed tokens only, not the tokens drafted before it",
        "framework/engine/processing.py",
        "        return replace(out, logits=self.rows(committed, fed, logits, rows=rows), head=None, picked=None)",
        "        return replace(out, logits=self.rows(committed, fed[:, :1], logits[:, -1:], rows=[0]), head=None, picked=None)",
        (
            "tests/framework/engine/test_processing.py::test_each_draft_row_is_processed_with_the_tokens_drafted_before_it",
        ),
    ),
    Mutation(
        "stop_string_cut_one_token_late",
        "a stop string completed by token i keeps token i + 1 too",
        "framework/engine/decoding.py",
        '                        return i + 1, "stop_string"',
        '                        return min(i + 2, len(new_tokens)), "stop_string"',
        ("tests/framework/engine/test_decoding.py",),
    ),
    Mutation(
        "stopping_criterion_checked_once_a_round",
        "a stopping criterion is checked only on a round's last token (it cuts late)",
        "framework/engine/processing.py",
        "    for i in range(start, len(new_tokens)):\n        done",
        "    for i in range(len(new_tokens) - 1, len(new_tokens)):\n        done",
        (
            "tests/framework/engine/test_processing.py::test_a_criterion_is_checked_at_every_token_a_round_commits",
        ),
    ),
    Mutation(
        "rule_epilogue_skipped_on_graph_route",
        "a whole-forward graph leaves its acceptance rule out (the rule runs again after the graph)",
        "framework/engine/execution/forward_graph.py",
        "        if key.rule is not None and rule is not None and logits is not None:",
        "        if False:",
        (
            "tests/framework/engine/execution/test_forward_graph.py::test_a_verifiers_rule_is_folded_into_the_whole_forward_graph_after_one_eager_call",
        ),
    ),
    Mutation(
        "work_span_ignores_scratch_rows",
        "a device function with blocks takes the span of the committed context, not of its scratch rows after it",
        "framework/engine/execution/work.py",
        "            s = span(base + rows, pool.capacity)",
        "            s = span(base, pool.capacity)",
        (
            "tests/framework/engine/execution/test_work.py::test_a_dp_graph_near_a_spans_end_sees_its_own_scratch_rows",
        ),
    ),
    Mutation(
        "del_exit_row_from_layer_one",
        "DEL's chain statistics index the exit layer's row as if the candidates started at layer 1",
        "strategies/selectors/del_tpl.py",
        "            rows, exit_row = state.constant(list(layers)), state.constant([layers.index(e)])",
        "            rows, exit_row = state.constant(list(layers)), state.constant([e - 1])",
        (
            "tests/strategies/selectors/test_del_tpl.py::test_a_rounds_statistics_in_one_read_or_two_with_the_same_result",
            "tests/strategies/selectors/test_del_tpl.py::test_the_chain_and_window_ways_decide_alike_over_a_generation_with_strided_exits",
        ),
    ),
    Mutation(
        "sampling_accepts_at_zero_mass",
        "speculative sampling accepts a draft token the target gives no mass when the uniform is exactly 0",
        "strategies/verifiers/sampling.py",
        "torch.lt(u * q_d, p_d)",
        "torch.le(u * q_d, p_d)",
        (
            "tests/strategies/verifiers/test_sampling_rule.py::test_a_draft_token_the_target_gives_no_mass_is_never_accepted_even_at_u_zero",
        ),
    ),
    # ---- low precision (issue 48, item 4) -------------------------------------------------------
    Mutation(
        "bf16_head_check_at_float32_tolerance",
        "the reduced draft head is checked against a bfloat16 model's own head at float32's tolerance "
        "(the default preset's preparation fails in bfloat16)",
        "framework/engine/draft_head.py",
        "    return max(1e-3, HEAD_CHECK_ULPS * torch.finfo(dtype).eps)",
        "    return 1e-3",
        (
            "tests/framework/session/test_low_precision_presets.py::test_every_preset_prepares_and_decodes_in_low_precision[static_confidence-bfloat16-plain]",
        ),
    ),
    Mutation(
        "driver_unseeded",
        "the pipeline's seeding ignores the seed (every run draws the same numbers whatever --seed says)",
        "framework/runner/pipeline.py",
        "    pl.seed_everything(seed, verbose=False)",
        "    pl.seed_everything(0, verbose=False)",
        ("tests/framework/runner/test_pipeline.py::test_seed_everything_seeds_python_numpy_and_torch",),
    ),
    Mutation(
        "bench_error_every_prompt",
        "a failed HF method's error is recorded again for every later prompt",
        "framework/runner/lightning.py",
        "                self.reported.add(s.label)\n",
        "",
        ("tests/framework/benchmark/test_bench_run.py::test_hf_error_is_reported_in_its_row",),
    ),
    Mutation(
        "override_mapping_passes",
        "a strategy given as a mapping slips past the spelling check (the error no longer names the dotted keys)",
        "framework/session/overrides.py",
        "            if not isinstance(value, str):\n                raise _spelling_gone(",
        "            if False:\n                raise _spelling_gone(",
        (
            "tests/framework/session/test_run_config.py::test_the_spellings_that_went_are_refused_with_the_dotted_keys_that_say_the_same",
        ),
    ),
    Mutation(
        "run_file_appended_without_resume",
        "run.py appends a second run's records to a results file that holds an earlier run's (one table of two runs)",
        "framework/runner/pipeline.py",
        "        if not cfg.runner.resume and layout.records.exists() and layout.records.stat().st_size:",
        "        if folder and not cfg.runner.resume and layout.records.exists() and layout.records.stat().st_size:",
        (
            "tests/framework/runner/test_runner.py::test_a_second_run_into_the_same_file_is_refused_unless_it_resumes",
        ),
    ),
    Mutation(
        "sampling_method_refused_late",
        "a compared method whose verifier samples is refused only when it prepares (after the model and the methods before it)",
        "framework/session/methods.py",
        "            _require_greedy(s, overrides.get(",
        "            None and _require_greedy(s, overrides.get(",
        (
            "tests/framework/benchmark/test_bench_config.py::test_a_sampling_method_is_refused_with_the_config_before_any_model_loads",
        ),
    ),
    Mutation(
        "method_kind_key_not_a_name",
        "``method.<kind>`` is taken as a plain field of the method section, not as the strategy's name",
        "framework/session/overrides.py",
        '    if head != "method" or sub.split(".", 1)[0] not in (*REGISTRIES, *NESTED):',
        "    if True:",
        ("tests/framework/session/test_run_config.py::test_strategy_fields_by_dotted_key",),
    ),
    Mutation(
        "reuse_check_uncapped",
        "a verification that keeps an early-exit draft accepts from rows that saw the draft's inputs, "
        "not the block's",
        "framework/engine/execution/spec.py",
        "    return torch.where(torch.cat([same, tail], dim=1), input_ids, -1)",
        "    return input_ids",
        (
            "tests/framework/engine/test_kv_cache.py::test_a_checked_reusing_verification_never_accepts_from_rows_that_saw_the_drafts_inputs",
        ),
    ),
    Mutation(
        "reuse_keeps_the_exit_block",
        "a verification that keeps an early-exit draft keeps the draft's KV of block E too, which "
        "the draft never ran",
        "framework/engine/execution/reuse.py",
        "        state.cache.keep_draft(n, range(e))",
        "        state.cache.keep_draft(n, range(e + 1))",
        ("tests/framework/engine/test_kv_cache.py::test_reuse_verification_equals_full_verification",),
    ),
    Mutation(
        "reuse_without_the_check",
        "a verification without a rule keeps an early-exit draft whose inputs it never compared "
        "with its block",
        "framework/engine/execution/reuse.py",
        "        if torch.equal(input_ids[:, :n], fed):  # one read: a caller that checks itself",
        "        if True:  # one read: a caller that checks itself",
        ("tests/framework/engine/test_kv_cache.py::test_reuse_falls_back_to_recompute",),
    ),
    Mutation(
        "read_values_shifted",
        "the round's one read splits its values one place late (each name gets its neighbour's first number)",
        "framework/engine/reads.py",
        "        part = host[at : at + n]\n",
        "        part = host[at + 1 : at + n + 1]\n",
        (
            "tests/framework/engine/test_host_reads.py::test_strategies_reads_come_back_with_the_verifiers_read_by_name_and_exact",
        ),
    ),
    Mutation(
        "reads_outlive_their_round",
        "a strategy that asks for nothing this round still finds the values of an earlier round",
        "framework/engine/reads.py",
        "            self._values[strategy] = {}\n",
        "",
        (
            "tests/framework/engine/test_host_reads.py::test_strategies_reads_come_back_with_the_verifiers_read_by_name_and_exact",
        ),
    ),
    Mutation(
        "reads_on_a_tree",
        "the strategies' reads run on a token tree's hidden states, whose path is known only after the read",
        "framework/engine/state.py",
        "        self._reads.verified(out.hidden_states if chain else None)",
        "        self._reads.verified(out.hidden_states)",
        (
            "tests/framework/engine/test_host_reads.py::test_a_tree_or_a_verifier_reading_by_itself_gets_its_readers_served_at_the_commit",
        ),
    ),
    Mutation(
        "work_inputs_not_copied",
        "a strategy's device function replays its graph on the inputs of its recording",
        "framework/engine/execution/work.py",
        "            if buf is not None:\n                buf.copy_(t, non_blocking=True)\n",
        "            if buf is not None and not self.store.recorded(gkey):\n                buf.copy_(t, non_blocking=True)\n",
        (
            "tests/framework/engine/execution/test_work.py::test_a_keyed_function_is_learned_eagerly_then_one_graph_per_key_replayed_with_copies",
            "tests/framework/engine/execution/test_work.py::test_del_statistics_through_their_graph_decide_what_they_decide_eagerly",
        ),
    ),
    Mutation(
        "dp_graph_sees_later_slots",
        "CLaSp's DP as one graph lets its candidates attend to committed slots at and after their position",
        "framework/engine/execution/work.py",
        "        hidden_slots = (ar[None, :] >= self._at[0]) & (ar[None, :] != slots[:, None])  # (n, span)",
        "        hidden_slots = (ar[None, :] >= self._at[1]) & (ar[None, :] != slots[:, None])  # (n, span)",
        (
            "tests/framework/engine/execution/test_work.py::test_claspss_dp_as_one_graph_chooses_what_the_eager_dp_chooses",
        ),
    ),
    Mutation(
        "sample_noise_multiplied",
        "sampling multiplies the weights by the exponential noise instead of dividing (not the race)",
        "strategies/verifiers/sampling.py",
        "    return (probs / noise).argmax(dim=-1)",
        "    return (probs * noise).argmax(dim=-1)",
        (
            "tests/strategies/verifiers/test_sampling.py::test_sample_is_torch_multinomial_draw_for_draw",
            "tests/strategies/verifiers/test_sampling_rule.py::test_accept_prefix_samples_the_exact_law",
        ),
    ),
    Mutation(
        "draft_noise_off_the_verifiers_stream",
        "a sampled draft step draws its noise from torch's global generator, not the generation's stream",
        "strategies/verifiers/sampling.py",
        "    return sample_with_noise(q, ops.exponential(*q.shape, dtype=q.dtype)), q",
        "    return sample_with_noise(q, torch.empty_like(q).exponential_(1)), q",
        (
            "tests/strategies/verifiers/test_sampling.py::test_a_sampled_generation_depends_on_its_verifiers_seed_alone",
        ),
    ),
    Mutation(
        "chain_sums_first_exit",
        "DEL's chain statistics end the window where the first candidate layer, not the exit E, leaves the target",
        "strategies/selectors/del_tpl.py",
        "    diff = toks.index_select(0, exit_row)[0] != ref  # layer E against the target",
        "    diff = toks[0] != ref  # layer E against the target",
        (
            "tests/strategies/selectors/test_del_tpl.py::test_chain_sums_take_the_window_of_the_exit_they_are_given",
        ),
    ),
    Mutation(
        "del_budget_refusal_ignored",
        "DEL computes and reads a round's sums although its work budget is spent",
        "strategies/selectors/del_tpl.py",
        "        if not self.budget.allows():\n            return None\n",
        "",
        (
            "tests/strategies/selectors/test_del_tpl.py::test_work_budget_skips_statistics_updates_and_keeps_choosing_from_the_rest",
        ),
    ),
    # ---- grammars (issue 47) ------------------------------------------------------------------
    Mutation(
        "matcher_not_rolled_back",
        "the grammar matcher stays where the last row left it when a row's prefix diverges",
        "framework/engine/grammar.py",
        "        if k <= 0:\n            return\n        self.matcher.rollback(k)",
        "        if True:\n            return\n        self.matcher.rollback(k)",
        (
            "tests/framework/engine/test_grammar.py::test_the_matcher_rolls_back_to_each_prefix_it_is_asked_about",
        ),
    ),
    Mutation(
        "forced_token_not_verified",
        "a forced run is committed as drafted (jump-forward), its bonus token guessed, not verified",
        "framework/engine/decoding.py",
        "        result = self.verifier.verify(view, draft)\n",
        "        result = self.verifier.verify(view, draft) if draft.source != 'forced' else Verification("
        "torch.tensor([draft.length]), torch.cat([draft.tokens, draft.tokens[:, -1:]], dim=1))\n",
        (
            "tests/framework/engine/test_grammar.py::test_speculative_constrained_decoding_equals_plain_constrained_decoding",
        ),
    ),
    Mutation(
        "forced_run_from_a_stale_matcher",
        "the forced run is read from wherever the matcher was left (a draft row further on), not the committed prefix",
        "framework/engine/grammar.py",
        "        if limit <= 0 or not self.sync(generated, exact=True):",
        "        if limit <= 0 or not self.sync(generated):",
        (
            "tests/framework/engine/test_grammar.py::test_forced_tokens_are_verified_and_accepted",
            "tests/framework/engine/test_grammar.py::test_the_matcher_rolls_back_to_each_prefix_it_is_asked_about",
        ),
    ),
    Mutation(
        "forced_lead_left_out_of_a_copy",
        "a copying drafter after a forced run returns its copy without the run (the engine's copied draft)",
        "framework/engine/draft_steps.py",
        "    if steps is None or steps.stepped or not len(steps):\n        return draft",
        "    if True:\n        return draft",
        ("tests/strategies/drafters/test_grammar_forced.py",),
    ),
    Mutation(
        "forced_lead_not_in_the_context",
        "a copying drafter after a forced run matches the committed tokens only, not the run it continues",
        "framework/engine/state.py",
        "        return ids if self._steps is None or not self._steps.context else [*ids, *self._steps.context]",
        "        return ids",
        (
            "tests/framework/engine/test_draft_steps.py::test_forced_tokens_ride_along_in_the_next_draft_forward_and_come_first_in_the_draft",
        ),
    ),
    Mutation(
        "forced_run_inside_a_draft_not_fed",
        "a forced run inserted after a drafted token goes into the draft but not into the draft forward",
        "framework/engine/draft_steps.py",
        "            input_ids, self.queue = torch.cat([input_ids, self.queue], dim=1), None",
        "            self.queue = None",
        (
            "tests/framework/engine/test_grammar.py::test_with_the_target_as_its_own_draft_every_drafted_token_is_accepted",
        ),
    ),
    Mutation(
        "import_not_recorded",
        "a saved configuration leaves out the --import modules (a rerun fails on the unknown strategy)",
        "framework/session/run_config.py",
        "                    out[name][f.name] = recorded_imports(value)",
        "                    out[name][f.name] = []",
        ("tests/framework/session/test_plugins.py",),
    ),
    Mutation(
        "resume_drops_earlier_csv_rows",
        "a resumed run's CSV logger lets Lightning delete the rows the earlier run wrote",
        "framework/session/loggers.py",
        '    metrics.write_text(kept, encoding="utf-8")\n',
        "",
        (
            "tests/framework/runner/test_tracking.py::test_a_resumed_csv_logger_keeps_the_earlier_rows_and_hparams_load_safely",
        ),
    ),
    Mutation(
        "story_calls_a_declined_method_faster",
        "the story calls a method faster although its gate declined nearly every round (it decoded like vanilla)",
        "framework/benchmark/story.py",
        '    if gate and gate.get("rounds") and gate["declined"] / gate["rounds"] >= 0.9:\n        return None\n',
        "",
        (
            "tests/framework/benchmark/test_story.py::test_a_method_is_called_faster_only_when_its_measurement_says_so",
        ),
    ),
    Mutation(
        "synthetic_output_written_as_an_answer_file",
        "Spec-Bench answer files are written from a synthetic acceptance's records",
        "framework/data/specbench.py",
        "    if synthetic:\n        raise AnswerFileError(",
        "    if False:\n        raise AnswerFileError(",
        (
            "tests/framework/engine/test_synthetic.py::test_synthetic_records_are_never_written_as_answer_files",
        ),
    ),
    Mutation(
        "synthetic_output_checked_for_equality",
        "a synthetic acceptance's output is compared with vanilla's as if it were the model's",
        "framework/results/compare.py",
        "        if not self.methods[label].greedy or _synthetic(self.results.get(label, [])):",
        "        if not self.methods[label].greedy:",
        ("tests/framework/engine/test_synthetic.py::test_records_are_marked_and_never_checked_for_equality",),
    ),
    Mutation(
        "synthetic_output_counted_as_mismatches",
        "the benchmark counts an unchecked (synthetic) output as differing from vanilla",
        "framework/benchmark/report.py",
        '        bad = sorted({str(r["question_id"]) for r in mine if r.get("lossless") is False})',
        '        bad = sorted({str(r["question_id"]) for r in mine if not r.get("lossless", True)})',
        (
            "tests/framework/engine/test_synthetic.py::test_the_benchmark_report_marks_a_synthetic_method_and_counts_no_mismatch",
        ),
    ),
    Mutation(
        "synthetic_commit_keeps_the_real_correction",
        "over-accepted rounds commit the verifier's own correction token after the forced-accepted drafts",
        "framework/engine/synthetic.py",
        "            new = torch.cat([draft.tokens[:, :m], result.target_tokens[:, m : m + 1]], dim=1)",
        "            new = torch.cat([draft.tokens[:, :m], result.new_tokens[:, -1:]], dim=1)",
        (
            "tests/framework/engine/test_synthetic.py::test_each_round_ends_with_the_targets_token_after_what_it_committed",
        ),
    ),
    # ---- issue 55: a first run that is bounded, host work at the author's line, HF habits ---------
    Mutation(
        "cost_model_remeasure_unbounded",
        "the cost model's second measurement has no deadline (it ran 7, 14, 28 repetitions on a loaded machine)",
        "framework/engine/cost_model.py",
        "        model = cls._measure_once(*args, deadline=time.perf_counter() + took)",
        "        model = cls._measure_once(*args)",
        (
            "tests/framework/engine/test_cost_model.py::test_a_cost_that_falls_with_the_context_is_measured_again_within_a_budget_then_marked",
        ),
    ),
    Mutation(
        "cost_model_inconsistency_unmarked",
        "a cost model still inconsistent after its second measurement is not marked: its predictions print",
        "framework/engine/cost_model.py",
        "        return replace(monotone_in_context(model), inconsistent=problem)",
        "        return monotone_in_context(model)",
        (
            "tests/framework/engine/test_cost_model.py::test_a_cost_that_falls_with_the_context_is_measured_again_within_a_budget_then_marked",
        ),
    ),
    Mutation(
        "threads_kept_on_a_busy_machine",
        "a CPU run keeps every torch thread while another process holds a core (3.6x slower steps)",
        "framework/benchmark/load.py",
        "    return max(1, min(threads, round(cpu_count - other)))",
        "    return threads",
        (
            "tests/framework/benchmark/test_bench_load.py::test_a_cpu_run_leaves_the_busy_cores_to_their_processes",
        ),
    ),
    Mutation(
        "site_only_inside_the_project",
        "an operation is charged to the first frame inside the project root (an author's own folder is skipped)",
        "framework/testing/syncs.py",
        "        if _library(name) or name in _COUNTERS:",
        "        if _library(name) or name in _COUNTERS or not name.startswith(_ROOT + os.sep):",
        (
            "tests/framework/engine/test_host_work.py::test_a_selector_in_the_authors_own_folder_is_charged_at_its_own_line",
            "tests/framework/runner/test_host_work_report.py",
        ),
    ),
    Mutation(
        "site_at_the_engines_call",
        "an operation is charged to the innermost framework frame (the engine's selector.plan(view) line)",
        "framework/testing/syncs.py",
        "        if first is None:\n            first = f\n        if name == _LOOP:",
        "        if first is None:\n            first = f\n        if True:",
        (
            "tests/framework/engine/test_host_work.py::test_a_selector_in_the_authors_own_folder_is_charged_at_its_own_line",
        ),
    ),
    Mutation(
        "host_work_report_hides_the_authors_line",
        "a method within the limits gets no line of its strategy in the report",
        "framework/testing/host_work.py",
        "        if sites:  # a strategy's lines always; the engine's only when over",
        "        if sites and not self.within_limits:",
        ("tests/framework/runner/test_host_work_report.py",),
    ),
    Mutation(
        "dependency_check_skips_the_strategies",
        "a strategy's own requirements (botorch for swift) are not checked before the model loads",
        "framework/session/dependencies.py",
        '                    yield f"--{kind}", name, module',
        "                    pass",
        (
            "tests/framework/runner/test_cli.py::test_a_missing_dependency_is_one_line_and_exit_2_before_the_model_loads",
        ),
    ),
    Mutation(
        "batch_encoding_padding_kept",
        "a padded row of what a tokenizer returns keeps its padding tokens",
        "selfspec/decoder.py",
        "            rows = [t for t, keep in zip(rows, mask, strict=True) if keep]  # padding left out",
        "            pass",
        ("tests/selfspec/test_decoder.py::test_what_apply_chat_template_returns_is_a_prompt",),
    ),
    Mutation(
        "formatted_prompt_templated_twice",
        "apply_chat_template's text goes through the chat template again",
        "selfspec/decoder.py",
        "            if _formatted(prompt, self.tokenizer):  # apply_chat_template(..., tokenize=False)",
        "            if False:",
        ("tests/selfspec/test_decoder.py::test_what_apply_chat_template_returns_is_a_prompt",),
    ),
    Mutation(
        "compare_ignores_its_controls",
        "compare times and checks vanilla and the method without the processors it was given",
        "selfspec/decoder.py",
        "            res = m.decoder.generate(ids, exp.stop(max_new_tokens, **keywords))",
        "            res = m.decoder.generate(ids, exp.stop(max_new_tokens))",
        (
            "tests/selfspec/test_decoder.py::test_compare_takes_generates_controls_and_a_grammar_and_checks_losslessness_under_them",
        ),
    ),
    Mutation(
        "api_grammar_error_names_the_flag",
        "a grammar error from the Python API names --json-schema",
        "selfspec/decoder.py",
        "                raise GrammarError(arg + text[len(flag) :]) from None",
        "                raise",
        ("tests/selfspec/test_decoder.py::test_api_errors_name_the_python_argument_not_the_flag",),
    ),
    Mutation(
        "config_bool_type_unchecked",
        "a config takes any value for a boolean field (a string 'no' is true)",
        "framework/config_fields.py",
        '        return None if isinstance(value, bool) else "a boolean (true/false)"',
        "        return None",
        (
            "tests/framework/test_config_fields.py::test_check_types_refuses_a_value_of_another_type",
            "tests/framework/test_config_fields.py::test_registered_configs_check_their_types",
        ),
    ),
    Mutation(
        "config_literal_by_equality",
        "a Literal field takes a value equal to a choice but of another type (True for 1)",
        "framework/config_fields.py",
        "        ok = any(value == c and type(value) is type(c) for c in args)",
        "        ok = value in args",
        ("tests/framework/test_config_fields.py::test_check_types_refuses_a_value_of_another_type",),
    ),
    Mutation(
        "empty_stop_string_accepted",
        "an empty stop string is accepted (it would end every turn at once)",
        "framework/session/sections.py",
        "        if not v:  # an empty stop string would end every turn at once; an empty word bans nothing",
        "        if False:",
        ("tests/framework/runner/test_cli.py::test_bad_flags_exit_2_with_a_clear_message",),
    ),
    Mutation(
        "source_warning_every_time",
        "the changed-source warning is given each time the configuration is read (twice a command)",
        "framework/session/plugins.py",
        "        if want and have and want != have and (name, want, have) not in _WARNED:",
        "        if want and have and want != have:",
        (
            "tests/framework/session/test_plugins.py::test_a_changed_source_is_one_warning_line_once_on_the_command_line",
        ),
    ),
    Mutation(
        "full_model_drafts_unsaid",
        "a run whose drafts skipped no sub-layer does not say so",
        "framework/runner/pipeline.py",
        "        if label != BASELINE and m is not None and m.skip_rounds and m.skip_ratio == 0.0 and m.drafted:",
        "        if False:",
        ("tests/framework/runner/test_host_work_report.py::test_a_skip_ratio_that_skips_nothing_is_said",),
    ),
    Mutation(
        "batch_rows_written_at_the_first_rows_base",
        "a merged verification writes every row's block at the first row's slot (one base for a ragged batch)",
        "framework/engine/batch/merge.py",
        '    writes = [RowWrite(r.cache, r.num_new, r.options.get("base")) for r in reqs]',
        '    writes = [RowWrite(r.cache, r.num_new, reqs[0].options.get("base")) for r in reqs]',
        (
            "tests/framework/engine/batch/test_batch_decoding.py::test_each_row_of_a_batch_equals_its_batch_1_output",
        ),
    ),
    Mutation(
        "batch_rows_read_from_row_0",
        "a merged forward of rows 1.. attends to the KV of rows 0.. (a finished row 0 left a gap)",
        "framework/engine/batch/rows.py",
        "        k = self.batch.keys[layer_idx].narrow(0, self.first, n).narrow(2, 0, span)",
        "        k = self.batch.keys[layer_idx].narrow(0, 0, n).narrow(2, 0, span)",
        (
            "tests/framework/engine/batch/test_batch_decoding.py::test_rows_that_finish_early_leave_the_forwards",
        ),
    ),
    Mutation(
        "batch_bonus_token_of_the_next_row",
        "a row of a merged verification reads the next row's logits (its bonus token is another row's)",
        "framework/engine/batch/merge.py",
        '            chosen.append(h[j, n - 1 : n] if at == "last" else h[j, :n])',
        '            chosen.append(h[j, n - 1 : n] if at == "last" else h[(j + 1) % len(reqs), :n])',
        (
            "tests/framework/engine/batch/test_batch_decoding.py::test_each_row_of_a_batch_equals_its_batch_1_output",
        ),
    ),
    Mutation(
        "batch_mask_shows_the_later_tokens",
        "the merged forward's mask lets a row's new tokens see the tokens after them (no causal order)",
        "framework/engine/batch/rows.py",
        "        allowed = (slots < base) | ((slots >= base) & (slots <= base + new))",
        "        allowed = slots < base + t",
        (
            "tests/framework/engine/batch/test_batch_decoding.py::test_vanilla_batched_equals_vanilla_alone_and_merges_every_step",
            "tests/framework/engine/batch/test_batch_decoding.py::test_each_row_of_a_batch_equals_its_batch_1_output",
        ),
    ),
    Mutation(
        "batch_rows_share_one_random_stream",
        "every row of a batch draws from the first row's random stream",
        "framework/interfaces.py",
        "            twin.random = random.for_row(row)  # type: ignore[attr-defined]",
        "            pass",
        (
            "tests/framework/engine/batch/test_batch_decoding.py::test_sampling_rows_draw_from_their_own_streams",
        ),
    ),
    Mutation(
        "batch_verifies_before_the_drafts_end",
        "a row that stopped drafting verifies alone while other rows still draft (a round's verification is not one forward)",
        "framework/engine/batch/lockstep.py",
        "        chosen = drafting or pending",
        "        chosen = pending",
        (
            "tests/framework/engine/batch/test_batch_decoding.py::test_a_rounds_verification_is_one_forward_for_the_batch",
        ),
    ),
)


#: Folders a copy leaves out when the tree is not a git checkout (else git's own ignore rules).
_SKIP = {".git", ".venv", ".venv-ci", "runs", "site", "__pycache__", ".pytest_cache", ".ruff_cache"}

#: What the warm interpreter imports once, before it forks a child per mutation (`WarmRunner`):
#: the test suite's third-party dependencies, the costly part of a fresh interpreter's start.
#: Never the project's own packages: each child imports those from the mutated copy. A module
#: missing here (an optional one) is left out.
WARM_IMPORTS = (
    "torch",
    "numpy",
    "scipy.stats",
    "yaml",
    "safetensors.torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.mistral.modeling_mistral",
    "gpytorch",
    "botorch",
    "botorch.models",
    "botorch.fit",
    "botorch.acquisition",
    "pytorch_lightning",
    "datasets",
    "llguidance",
    "hypothesis",
    "pytest",
)


def tracked_files(root: Path = ROOT) -> list[str]:
    """The repository's files: git's tracked and untracked-not-ignored ones, or a walk of the tree
    without `_SKIP` where it is not a git checkout (a copied snapshot)."""
    proc = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=root, capture_output=True, text=True
    )
    if proc.returncode == 0:
        return proc.stdout.splitlines()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP and not d.endswith(".egg-info")]
        out += [str(Path(dirpath, f).relative_to(root)) for f in filenames]
    return out


def copy_repo(dest: Path, root: Path = ROOT) -> None:
    """Copy the repository's files (`tracked_files`) into ``dest``."""
    for rel in tracked_files(root):
        src = root / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _pytest_args(m: Mutation, basetemp: Path) -> list[str]:
    """A mutation's pytest arguments: its tests, stop at the first failure, nothing cached."""
    return [
        *("-q", "-x", "-p", "no:cacheprovider", "-p", "no:randomly", f"--basetemp={basetemp}"),
        # the warm interpreter imported pytest's plugins already: they cannot be rewritten, and need not be
        *("-W", "ignore::pytest.PytestAssertRewriteWarning"),
        *m.tests,
    ]


def _status(code: int | None, seconds: float, timeout: float, last: str) -> tuple[str, float, str]:
    """``(status, seconds, detail)`` from the exit status of a mutation's tests."""
    if code is None:
        return "error", seconds, f"tests ran over {timeout:.0f} s"
    if code == 1:
        return "killed", seconds, last
    if code == 0:
        return "SURVIVED", seconds, last
    return "error", seconds, f"pytest exit {code}: {last}"


def _last_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[-1]


class _Mutated:
    """Apply ``m`` in ``repo`` for the ``with`` block, then restore the file (also on failure)."""

    def __init__(self, m: Mutation, repo: Path, apply: bool = True) -> None:
        self.path = repo / m.path
        self.text = self.path.read_text()
        self.count = self.text.count(m.old)
        self.m, self.apply = m, apply

    def __enter__(self) -> _Mutated:
        if self.count == 1 and self.apply:
            self.path.write_text(self.text.replace(self.m.old, self.m.new))
        return self

    def __exit__(self, *exc: object) -> None:
        self.path.write_text(self.text)


def _env(repo: Path) -> dict[str, str]:
    """The environment of a mutation's tests: the copy's packages first, no bytecode written (a
    restored file must never be shadowed by the mutant's), no pytest or xdist state inherited."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTEST_XDIST"))}
    env.update(PYTHONPATH=str(repo), PYTHONDONTWRITEBYTECODE="1", SELFSPEC_DEBUG="", SELFSPEC_MUTANT="1")
    return env


def run_mutation(m: Mutation, repo: Path, timeout: float) -> tuple[str, float, str]:
    """``(status, seconds, detail)`` of one mutation applied in ``repo`` (restored afterwards), its
    tests run by a fresh interpreter (`WarmRunner` runs them in a fork of a warm one)."""
    with tempfile.TemporaryDirectory(prefix="selfspec-mutation-") as tmp, _Mutated(m, repo) as mutated:
        if mutated.count != 1:
            return "error", 0.0, f"the text to mutate occurs {mutated.count} times in {m.path}"
        cmd = [sys.executable, "-m", "pytest", *_pytest_args(m, Path(tmp) / "basetemp")]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, cwd=repo, env=_env(repo), capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return _status(None, time.perf_counter() - t0, timeout, "")
        last = _last_line(proc.stdout) or proc.stderr.strip()[-200:]
        return _status(proc.returncode, time.perf_counter() - t0, timeout, last)


# ------------------------------------------------------------------------------- the warm runner
def _serve() -> None:
    """The warm interpreter (``mutations.py --serve``, started by `WarmRunner` in the copy): import
    `WARM_IMPORTS` once, then for each request on stdin (a JSON line: pytest arguments, a log file,
    a timeout) fork a child that runs ``pytest.main`` on them in a session of its own, and answer
    on stdout with its exit status (``null`` when it ran over the timeout and was killed with every
    process it started)."""
    import gc
    import importlib
    import json
    import signal

    for name in WARM_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    import torch

    torch.set_num_threads(1)  # as the tests run; and no thread pool crosses a fork
    answer = sys.stdout
    sys.stdout = sys.stderr  # stray prints of the imports never reach the protocol
    _precompile(Path.cwd())
    # What the imports made never becomes garbage: out of the collector's sight, so that a child's
    # collections (pytest runs two at its end) walk the child's own objects only (0.7 s a child else).
    gc.collect()
    gc.freeze()
    print(json.dumps({"ready": True}), file=answer, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:  # the child: the mutated copy's tests, output to the log
            code = 3
            try:
                os.setsid()
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the requests are the server's alone
                fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                sys.stdout = sys.__stdout__
                sys.path.insert(0, os.getcwd())
                import pytest

                code = int(pytest.main(req["args"]))
            except BaseException:  # noqa: B036 - the child reports whatever ended it
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        code = None
        deadline = t0 + float(req["timeout"])
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                break
            if time.perf_counter() > deadline:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.02)
        try:  # whatever the child's tests started and left behind
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        print(json.dumps({"code": code, "seconds": time.perf_counter() - t0}), file=answer, flush=True)


#: The copy's folders whose modules `_precompile` compiles (the ones mutations change among them).
_SOURCES = ("framework", "strategies", "selfspec", "experiments")


def _precompile(repo: Path) -> None:
    """Bytecode for the copy, made once before any mutation, so that no child compiles the same
    sources again: the project's modules as checked-hash pycs (PEP 552: each import compares the
    source's hash with the pyc's, so a mutated file is compiled afresh, never served stale; the
    children write none), and pytest's rewritten test modules of every mutation's tests (never
    mutated), written by one collection in a child that may write bytecode."""
    import compileall
    import py_compile

    for folder in _SOURCES:
        compileall.compile_dir(
            repo / folder, quiet=2, invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH
        )
    files = sorted({t.split("::")[0] for m in MUTATIONS for t in m.tests})
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
            sys.dont_write_bytecode = False
            sys.path.insert(0, str(repo))
            import pytest

            code = int(pytest.main(["-q", "--collect-only", "-p", "no:cacheprovider", *files]))
        finally:
            os._exit(code)
    os.waitpid(pid, 0)


class WarmRunner:
    """Runs mutations in one copy of the repository, each mutation's tests in a fork of a warm
    interpreter that imported the test suite's dependencies once (`WARM_IMPORTS`): a mutation
    costs its tests, not an interpreter's start. Results are those of `run_mutation` (a fresh
    interpreter per mutation), which ``--cold`` runs instead.

    Args:
        repo: a copy of the repository (`copy_repo`) that this runner alone mutates.
    """

    def __init__(self, repo: Path) -> None:
        import json

        self.repo, self._json = Path(repo), json
        self._logs = Path(tempfile.mkdtemp(prefix="selfspec-mutation-logs-"))
        self.proc = subprocess.Popen(
            [sys.executable, str(self.repo / "experiments" / "mutations.py"), "--serve"],
            cwd=self.repo,
            env=_env(self.repo),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not ready:
            raise RuntimeError(f"the warm interpreter exited with {self.proc.wait()} before it was ready")

    def run(self, m: Mutation, timeout: float = 600.0, *, mutate: bool = True) -> tuple[str, float, str]:
        """``(status, seconds, detail)`` of ``m`` (as `run_mutation`); ``mutate=False`` runs its
        tests on the unchanged copy (the control: they must pass, so a kill is the bug's)."""
        with _Mutated(m, self.repo, apply=mutate) as mutated:
            if mutated.count != 1:
                return "error", 0.0, f"the text to mutate occurs {mutated.count} times in {m.path}"
            log = self._logs / f"{m.name}.log"
            req = {"args": _pytest_args(m, self._logs / m.name), "log": str(log), "timeout": timeout}
            self.proc.stdin.write(self._json.dumps(req) + "\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"the warm interpreter exited with {self.proc.wait()}")
        answer = self._json.loads(line)
        text = log.read_text(errors="replace") if log.exists() else ""
        return _status(answer["code"], answer["seconds"], timeout, _last_line(text))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self._logs, ignore_errors=True)

    def __enter__(self) -> WarmRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated mutation names (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mutation's tests")
    ap.add_argument(
        "--cold", action="store_true", help="a fresh interpreter per mutation (default: forks of a warm one)"
    )
    ap.add_argument(
        "--control",
        action="store_true",
        help="run each mutation's tests on the unchanged copy instead: every one must pass (then a kill "
        "is the planted bug's, not the runner's)",
    )
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        _serve()
        return 0
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only.split(",")]
    unknown = set(filter(None, args.only.split(","))) - {m.name for m in MUTATIONS}
    if unknown:
        print(f"error: unknown mutation(s) {sorted(unknown)}; --list names them", file=sys.stderr)
        return 2
    if args.list:
        for m in chosen:
            print(f"{m.name:<30} {m.path}: {m.why}")
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="selfspec-mutations-") as tmp:
        repo = Path(tmp)
        copy_repo(repo)
        runner = WarmRunner(repo) if args.control or not args.cold else None
        try:
            for m in chosen:
                if not host_runs(m.needs):
                    status, seconds, detail = "skipped", 0.0, f"needs {m.needs}: its code does not run here"
                elif args.control:
                    status, seconds, detail = runner.run(m, args.timeout, mutate=False)  # type: ignore[union-attr]
                    status = {"SURVIVED": "passed", "killed": "FAILED"}.get(status, status)
                elif runner is None:
                    status, seconds, detail = run_mutation(m, repo, args.timeout)
                else:
                    status, seconds, detail = runner.run(m, args.timeout)
                rows.append((m, status, seconds, detail))
                print(f"{m.name:<30} {status:<9} {seconds:6.1f} s  {detail}", flush=True)
        finally:
            if runner is not None:
                runner.close()
    if args.control:
        bad = [m.name for m, status, _, _ in rows if status not in ("passed", "skipped")]
        print(
            f"\n{len(rows) - len(bad)} of {len(rows)} mutations' tests pass unmutated"
            + (f"; not: {', '.join(bad)}" if bad else "")
        )
        return 0 if not bad else 1
    print("\n| mutation | what it plants | file | caught by | result |\n|---|---|---|---|---|")
    for m, status, _, _ in rows:
        print(f"| `{m.name}` | {m.why} | `{m.path}` | {', '.join(f'`{t}`' for t in m.tests)} | {status} |")
    bad = [m.name for m, status, _, _ in rows if status not in ("killed", "skipped")]
    skipped = [m.name for m, status, _, _ in rows if status == "skipped"]
    print(
        f"\n{len(rows) - len(bad) - len(skipped)} of {len(rows) - len(skipped)} mutations killed"
        + (f" ({len(skipped)} skipped: their code does not run on this host)" if skipped else "")
        + (f"; not killed: {', '.join(bad)}" if bad else "")
    )
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
