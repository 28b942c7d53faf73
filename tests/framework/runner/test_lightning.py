"""The Lightning predict loop: resume, interruption, DDP across two CPU processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from framework.config_fields import ConfigError
from framework.results.records import prompt_key, read_records
from framework.runner.lightning import append_records
from framework.runner.pipeline import launch_rank, resolve_output, run
from framework.session.run_config import RunConfig
from framework.session.session import Session
from framework.testing import plain_table, tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[3]
VOCAB = 128


def cfg_for(data, out, **kw):
    base = dict(
        data=str(data),
        output=None if out is None else str(out),
        max_new_tokens=8,
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


def keys(records):
    return sorted((r["question_id"], r["method"]) for r in records)


def test_resume_decodes_only_missing_prompts(tiny, data, tmp_path):
    model, tok = tiny
    out = tmp_path / "r"
    run(cfg_for(data, out, limit=1), log=lambda s: None, model=model, tokenizer=tok)
    assert keys(read_records(out)) == [
        (1, "static+fixed"),
        (1, "vanilla"),
        (3, "static+fixed"),
        (3, "vanilla"),
    ]
    lines: list[str] = []
    res = run(cfg_for(data, out, resume=True), log=lines.append, model=model, tokenizer=tok)
    assert any("--resume: 2 of 5 prompts already in" in s for s in lines)
    decoded = [s for s in lines if "lossless yes" in s]
    assert len(decoded) == 3  # q2, q4, q5 only
    assert keys(read_records(out)) == sorted((q, m) for q in range(1, 6) for m in ("vanilla", "static+fixed"))
    assert _whole(res, 5)
    # Nothing left: a second resume decodes nothing and still reports the whole file.
    lines.clear()
    res = run(cfg_for(data, out, resume=True), log=lines.append, model=model, tokenizer=tok)
    assert not [s for s in lines if "lossless" in s and "q" in s.split(":")[0]]
    assert _whole(res, 5)


def test_resume_refuses_a_file_from_another_configuration(tiny, data, tmp_path):
    model, tok = tiny
    out = tmp_path / "r"
    run(cfg_for(data, out, limit=1), log=lambda s: None, model=model, tokenizer=tok)
    other = cfg_for(data, out, resume=True, selector="static", **{"selector.skip_ratio": 0.5})
    with pytest.raises(
        ConfigError, match=r"same configuration \(it differs in selector: file .*0\.3.*now .*0\.5"
    ):
        run(other, log=lambda s: None, model=model, tokenizer=tok)
    with pytest.raises(ConfigError, match="it differs in max_new_tokens"):
        run(cfg_for(data, out, resume=True, max_new_tokens=9), log=lambda s: None, model=model, tokenizer=tok)
    # Fields that do not change a prompt's result may differ (warm-up, limit, logger, threads).
    run(
        cfg_for(data, out, resume=True, warmup=1, limit=2, threads=1),
        log=lambda s: None,
        model=model,
        tokenizer=tok,
    )


def test_resume_needs_an_output_file_and_its_metadata(tiny, data, tmp_path):
    model, tok = tiny
    with pytest.raises(
        ConfigError, match="--output must be the run folder to continue when --resume is given"
    ):
        run(cfg_for(data, None, resume=True), log=lambda s: None, model=model, tokenizer=tok)
    stray = tmp_path / "stray.jsonl"
    stray.write_text(json.dumps({"question_id": 1, "category": "qa", "method": "vanilla"}) + "\n")
    lines: list[str] = []
    with pytest.raises(
        ConfigError, match=r"a run folder written by run.py or bench.py \(its metadata meta\.json is missing"
    ):
        run(cfg_for(data, stray, resume=True), log=lines.append, model=model, tokenizer=tok)
    assert any("an earlier run.py's results file) continues in the folder" in s for s in lines)


def test_interrupted_run_then_resume_completes_without_duplicates(tiny, data, tmp_path, monkeypatch):
    model, tok = tiny
    out = tmp_path / "r"
    real = Session.decode_prompt

    def interrupt_at_q3(self, decoder, prompt, max_new_tokens=None):
        if prompt.question_id == 3:
            raise KeyboardInterrupt
        return real(self, decoder, prompt, max_new_tokens)

    monkeypatch.setattr(Session, "decode_prompt", interrupt_at_q3)
    with pytest.raises(KeyboardInterrupt):
        run(cfg_for(data, out), log=lambda s: None, model=model, tokenizer=tok)
    assert keys(read_records(out)) == [
        (1, "static+fixed"),
        (1, "vanilla"),
        (2, "static+fixed"),
        (2, "vanilla"),
    ]
    # A kill in the middle of a write leaves a torn line: resume cuts it and goes on.
    with (out / "records.jsonl").open("a") as fh:
        fh.write('{"question_id": 3, "categ')
    monkeypatch.setattr(Session, "decode_prompt", real)
    lines: list[str] = []
    run(cfg_for(data, out, resume=True), log=lines.append, model=model, tokenizer=tok)
    assert any("dropped an incomplete last line" in s for s in lines)
    recs = read_records(out)
    assert keys(recs) == sorted((q, m) for q in range(1, 6) for m in ("vanilla", "static+fixed"))
    assert all(r["lossless"] for r in recs if r["method"] != "vanilla")


def test_append_records_is_one_line_per_record(tmp_path):
    p = tmp_path / "x.jsonl"
    append_records(
        p, [{"question_id": 1, "category": "qa", "method": "a"}, {"question_id": 1, "category": "qa"}]
    )
    append_records(p, [{"question_id": 2, "category": "qa", "method": "a"}])
    recs = read_records(p)
    assert len(recs) == 3 and [prompt_key(r) for r in recs] == [("qa", "1"), ("qa", "1"), ("qa", "2")]


def test_records_carry_the_per_round_plans(tiny, data, tmp_path):
    model, tok = tiny
    res = run(cfg_for(data, tmp_path / "p", limit=1), log=lambda s: None, model=model, tokenizer=tok)
    spec = [r for r in res["records"] if r["method"] != "vanilla"]
    for r in spec:
        for t in r["turns"]:
            drafting_rounds = sum(1 for k in t["draft_lengths"] if k)
            assert len(t["plans"]) == len(t["exit_layers"]) == drafting_rounds
            # static skip_ratio 0.3 over the 2 middle blocks x 2 sub-layers of a 4-block model
            assert all(len(p) == 8 and set(p) <= {"0", "1"} and "1" in p for p in t["plans"])


def _saved_tiny(tmp_path: Path) -> Path:
    """A tiny model saved to a folder, for a run in another process."""
    model_dir = tmp_path / "tiny"
    tiny_model("llama", num_layers=4, vocab_size=VOCAB, max_position_embeddings=256).save_pretrained(
        model_dir
    )
    tiny_tokenizer().save_pretrained(model_dir)
    return model_dir


@pytest.mark.slow
def test_ddp_two_cpu_processes_split_the_prompts(tmp_path, data):
    """``--devices 2`` on CPU: Lightning starts a second process; each decodes its share, both
    append to one file, and rank 0 reports the whole run."""
    model_dir = _saved_tiny(tmp_path)
    out = tmp_path / "ddp" / "r"
    cmd = [
        sys.executable,
        str(ROOT / "experiments" / "run.py"),
        "--model",
        str(model_dir),
        "--data",
        str(data),
        "--devices",
        "2",
        "--threads",
        "1",
        "--logger",
        "none",
        "--no-plots",
        "--max-new-tokens",
        "8",
        "--output",
        str(out),
        "--selector",
        "static",
        "--selector.skip_ratio",
        "0.3",
        "--length",
        "fixed",
        "--length.k",
        "3",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = read_records(out)
    assert keys(recs) == sorted((q, m) for q in range(1, 6) for m in ("vanilla", "static+fixed"))
    assert {r["rank"] for r in recs} == {0, 1}
    assert {r["question_id"] for r in recs if r["rank"] == 1} == {2, 4}  # prompts[1::2]
    assert all(r["lossless"] for r in recs if r["method"] != "vanilla")
    assert "| static+fixed | " in plain_table(proc.stdout) and "| 0/5 |" in plain_table(proc.stdout)


@pytest.mark.slow
def test_ddp_two_cpu_processes_split_the_prompts_of_a_benchmark_too(tmp_path, data):
    """Issue 48: bench.py is the same pipeline, so ``--devices 2`` splits its prompts the same way:
    every method of a prompt on one rank, one records file, one report by rank 0."""
    model_dir = _saved_tiny(tmp_path)
    out = tmp_path / "bench"
    cmd = [
        sys.executable,
        str(ROOT / "experiments" / "bench.py"),
        "--model",
        str(model_dir),
        "--data",
        str(data),
    ]
    cmd += ["--devices", "2", "--threads", "1", "--logger", "none", "--no-plots", "--max-new-tokens", "8"]
    cmd += [
        "--methods",
        "vanilla,static_confidence,hf_generate",
        "--cost-model",
        "none",
        "--output",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = read_records(out / "records.jsonl")
    methods = ("vanilla", "static_confidence", "hf_generate")
    assert keys(recs) == sorted((q, m) for q in range(1, 6) for m in methods)
    assert {r["question_id"] for r in recs if r["rank"] == 1} == {2, 4}  # prompts[1::2], every method
    assert all(r["lossless"] for r in recs if r["method"] != "vanilla")
    assert (out / "bench.md").is_file() and (out / "config.yaml").is_file()


def test_launch_rank_and_output_rules_for_external_launchers(data, monkeypatch):
    for var in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "NODE_RANK",
        "SLURM_NTASKS",
        "SLURM_PROCID",
        "TORCHELASTIC_RUN_ID",
        "SLURM_JOB_NAME",
        "SLURM_NTASKS_PER_NODE",
    ):
        monkeypatch.delenv(var, raising=False)
    cfg = cfg_for(data, None, devices=2, num_nodes=2)
    assert launch_rank(cfg) == 0
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launch_rank(cfg) == 3  # Lightning's launcher: node 1, local 1, 2 devices per node
    monkeypatch.setenv("SLURM_NTASKS", "4")  # srun, as Lightning's SLURM environment reads it
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    monkeypatch.setenv("SLURM_PROCID", "2")
    assert launch_rank(cfg) == 2
    monkeypatch.delenv("SLURM_NTASKS")
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE")
    monkeypatch.setenv("RANK", "1")  # torchrun
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launch_rank(cfg) == 3  # RANK alone is no launcher Lightning knows: its own ranks
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert launch_rank(cfg) == 1
    # Every torchrun/srun process would pick its own timestamped file: the output must be named.
    with pytest.raises(ConfigError, match="--output must be a folder named explicitly"):
        resolve_output(cfg)
    assert resolve_output(cfg_for(data, "x", devices=2)) == Path("x")
    assert resolve_output(cfg_for(data, "x.jsonl", devices=2)) == Path("x")  # an earlier run.py's name


def test_one_named_gpu_cannot_host_several_processes(data):
    with pytest.raises(ConfigError, match="cuda:N names one GPU"):
        cfg_for(data, None, device="cuda:1", devices=2)


def _whole(res, prompts: int) -> bool:
    """The report covers every prompt of the folder, each method's output lossless."""
    methods = res["summary"]["methods"]
    return (
        all(e["prompts"] == prompts for e in methods.values()) and not methods["static+fixed"]["mismatches"]
    )
