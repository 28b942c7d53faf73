"""The command line: --list, --print-config, and every bad input exits 2 with a clear message."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from framework import REGISTRIES
from framework.runner.cli import main
from framework.session.run_config import FLAT_KEYS
from framework.utils import MissingDependencyError, require
from strategies.length.fixed import FixedLengthConfig

ROOT = Path(__file__).resolve().parents[3]


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_list_prints_every_registered_strategy(capsys):
    code, out, _ = run_cli(capsys, "--list")
    assert code == 0
    for kind, reg in REGISTRIES.items():
        assert f"{kind}s (--{kind}):" in out
        for entry in reg.entries():
            assert entry.name in out and entry.description in out


def test_run_py_entry_point_lists(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "run.py"), "--list"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "static" in proc.stdout and "greedy" in proc.stdout


def test_print_config_resolves_strategy_flags(capsys):
    code, out, _ = run_cli(
        capsys,
        "--print-config",
        "--length",
        "fixed",
        "--length.k",
        "6",
        "--selector.skip_attn",
        "3,5",
        "--categories",
        "qa,rag",
    )
    assert code == 0
    cfg = yaml.safe_load(out)
    assert cfg["method"]["length"] == {"name": "fixed", **dataclasses.asdict(FixedLengthConfig()), "k": 6}
    assert cfg["method"]["selector"]["skip_attn"] == [3, 5]
    assert cfg["data"]["categories"] == ["qa", "rag"]
    assert cfg["runner"]["logger"] == "wandb"  # the one default, as documented


def test_every_documented_flag_keeps_its_meaning(capsys, tmp_path):
    argv = [
        "--model", "tiny-random", "--dtype", "float64", "--device", "cpu", "--threads", "2",
        "--no-kernels", "--data", "q.jsonl", "--categories", "qa,rag", "--limit", "3",
        "--max-new-tokens", "16", "--stop", "User: ", "--stop", "###",
        "--selector", "selfsd_bo", "--skip-set", "s.json", "--calib-data", "c.jsonl", "--calib-limit", "2",
        "--length", "fixed", "--length.k", "5", "--drafter", "early_exit", "--drafter.exit_layer", "3",
        "--verifier", "greedy", "--gate.enabled", "--gate.margin", "0.1",
        "--output", "o.jsonl", "--name", "mine", "--seed", "7", "--warmup", "0", "--resume",
        "--logger", "csv", "--wandb-project", "p", "--no-plots", "--devices", "2", "--num-nodes", "3",
    ]  # fmt: skip
    code, out, err = run_cli(capsys, *argv, "--print-config")
    assert code == 0, err
    saved = yaml.safe_load(out)  # by section; each flag's value where its key says
    cfg = {key: saved[section][name] for key, (section, name) in FLAT_KEYS.items()} | saved["method"]
    want = {
        "model": "tiny-random", "dtype": "float64", "device": "cpu", "threads": 2, "kernels": False,
        "data": "q.jsonl", "categories": ["qa", "rag"], "limit": 3, "max_new_tokens": 16,
        "stop_strings": ["User: ", "###"], "output": "o.jsonl", "name": "mine", "seed": 7, "warmup": 0,
        "resume": True, "logger": "csv", "wandb_project": "p", "plots": False, "devices": 2, "num_nodes": 3,
    }  # fmt: skip
    assert {k: cfg[k] for k in want} == want
    sel = cfg["selector"]
    assert (sel["name"], sel["skip_set"], sel["calib_data"], sel["calib_limit"]) == (
        "selfsd_bo",
        "s.json",
        "c.jsonl",
        2,
    )
    assert (cfg["length"]["name"], cfg["length"]["k"]) == ("fixed", 5)
    assert (cfg["drafter"]["name"], cfg["drafter"]["exit_layer"]) == ("early_exit", 3)
    assert cfg["gate"]["enabled"] is True and cfg["gate"]["margin"] == 0.1


def test_print_config_file_then_config_file_reproduces_the_config(capsys, tmp_path):
    saved = tmp_path / "c.yaml"
    flags = ["--length", "fixed", "--length.k", "6", "--gate.enabled", "true", "--stop", "###"]
    assert run_cli(capsys, "--method", "swift", *flags, "--print-config", str(saved))[0] == 0
    code, out, _ = run_cli(capsys, "--config", str(saved), "--print-config")
    assert code == 0
    printed, first = yaml.safe_load(out), yaml.safe_load(saved.read_text())
    # each records the command line that wrote it (the report's), as bench.py's configurations do
    assert first["compare"].pop("command").endswith("--stop '###' --print-config " + str(saved))
    assert printed["compare"].pop("command") == f"python experiments/run.py --config {saved} --print-config"
    assert printed == first
    # Flags override the file; a strategy named as in the file keeps the file's fields.
    code, out, _ = run_cli(
        capsys, "--config", str(saved), "--length", "fixed", "--max-new-tokens", "9", "--print-config"
    )
    cfg = yaml.safe_load(out)
    method = cfg["method"]
    assert (
        method["length"]["k"] == 6 and cfg["generation"]["max_new_tokens"] == 9 and method["name"] == "swift"
    )
    code, _, err = run_cli(capsys, "--config", str(tmp_path / "missing.yaml"), "--print-config")
    assert code == 2 and "--config must be a saved RunConfig file" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--selector", "statik"], "unknown selector 'statik'. Did you mean 'static'? Registered selectors:"),
        (["--length", "confidance"], "Did you mean 'confidence'?"),
        (["--drafter", "nope"], "unknown drafter 'nope'"),
        (["--verifier", "nope"], "unknown verifier 'nope'"),
        (["--selector.skip_ratio", "1.0"], "--selector.skip_ratio must be in [0, 1), got 1.0"),
        (["--selector.skip_ratio", "-0.1"], "--selector.skip_ratio must be in [0, 1), got -0.1"),
        (["--selector.skip_ratio", "abc"], "--selector.skip_ratio must be a number (float), got 'abc'"),
        (["--length.threshold", "1"], "--length.threshold must be in (0, 1), got 1.0"),
        (["--length.threshold", "0"], "--length.threshold must be in (0, 1), got 0.0"),
        (["--length", "fixed", "--length.k", "0"], "--length.k must be an integer in [1, 64], got 0"),
        (
            ["--length", "fixed", "--length.threshold", "0.5"],
            "--length.threshold must be a field of FixedLengthConfig",
        ),
        (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1, got 0"),
        (
            ["--dtype", "float8"],
            "--dtype must be one of float32, float16, bfloat16, float64, auto, got 'float8'",
        ),
        (["--logger", "tensorboard"], "--logger must be one of wandb, csv, none, got 'tensorboard'"),
        (["--limit", "abc"], "--limit must be a number (int), got 'abc'"),
        (["--gate.margin", "0.9"], "--gate.margin must be in [-0.5, 0.5], got 0.9"),
        (["--gate.enabled", "maybe"], "--gate.enabled must be a boolean (true/false), got 'maybe'"),
        (["--limit", "0"], "--limit must be an integer >= 1, got 0"),
        (["--import", "no_such_module_xyz"], "--import must be an importable module"),
        (["--stop", ""], "--stop must be a non-empty string, got ''"),
        (["--bad-word", ""], "--bad-word must be a non-empty string, got ''"),
    ],
)
def test_bad_flags_exit_2_with_a_clear_message(capsys, argv, message):
    code, _, err = run_cli(capsys, *argv, "--print-config")
    assert code == 2
    assert message in err


def test_bad_data_exits_2_before_loading_the_model(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "category": "qa", "turns": ["ok"]}\n{"question_id": 2,\n')
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "--data", str(bad), "--output", str(out))
    assert code == 2 and f"{bad}:2: not valid JSON" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    code, _, err = run_cli(capsys, "--data", str(empty), "--output", str(out))
    assert code == 2 and "contains no prompts" in err
    code, _, err = run_cli(capsys, "--categories", "poetry", "--output", str(out))
    assert code == 2 and "unknown 'poetry'; available:" in err
    assert not out.exists()


def test_model_that_is_not_a_causal_lm_exits_2(capsys, tmp_path):
    from transformers import T5Config

    T5Config(d_model=16, num_layers=1, num_heads=2, d_kv=8, d_ff=32, vocab_size=32).save_pretrained(
        tmp_path / "t5"
    )
    code, _, err = run_cli(
        capsys, "--model", str(tmp_path / "t5"), "--limit", "1", "--output", str(tmp_path / "o.jsonl")
    )
    assert code == 2 and "is a 't5' model, not a causal language model" in err
    (tmp_path / "empty_dir").mkdir()
    code, _, err = run_cli(capsys, "--model", str(tmp_path / "empty_dir"), "--limit", "1")
    assert code == 2 and "has no config.json" in err


def test_missing_optional_dependency_names_the_install_command():
    with pytest.raises(MissingDependencyError, match="pip install no-such-pkg"):
        require("no_such_pkg_xyz", "no-such-pkg")
    with pytest.raises(MissingDependencyError, match=r"pip install -e '\.\[experiments\]'"):
        require("no_such_pkg_xyz", extra="experiments")


@pytest.mark.parametrize(
    "argv, module, flag",
    [
        (["--regex", "[ab]+"], "llguidance", "--regex must be used with llguidance installed"),
        (["--selector", "swift"], "botorch", "--selector must be used with botorch installed"),
        (["--logger", "wandb"], "wandb", "--logger must be used with wandb installed"),
    ],
)
def test_a_missing_dependency_is_one_line_and_exit_2_before_the_model_loads(
    capsys, monkeypatch, tmp_path, argv, module, flag
):
    """Issue 55, item 3: a package the configuration needs and the environment lacks is found
    when the configuration is checked: one line with the install command, exit 2, no model loaded."""
    import framework.runner.lightning as lightning
    import framework.session.dependencies as deps
    import framework.session.session as session

    real = deps.installed
    monkeypatch.setattr(deps, "installed", lambda m: m != module and real(m))
    for where in (lightning, session):
        monkeypatch.setattr(where, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    code, _, err = run_cli(capsys, *argv, "--limit", "1", "--output", str(tmp_path / "o"))
    assert code == 2, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and flag in lines[0] and f"pip install {module}" in lines[0], err
    assert "Traceback" not in err and not (tmp_path / "o").exists()


def test_dtype_takes_the_short_spellings_torch_users_write(capsys):
    """Issue 55, item 5: ``--dtype bf16`` is ``--dtype bfloat16`` (and fp16, fp32, fp64)."""
    for short, name in (("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32"), ("fp64", "float64")):
        code, out, err = run_cli(capsys, "--dtype", short, "--print-config")
        assert code == 0, err
        assert yaml.safe_load(out)["model"]["dtype"] == name
    from framework.session.run_config import RunConfig

    assert RunConfig.of(dtype="bf16").model.dtype == "bfloat16"  # the Python API too


def test_run_py_writes_the_folder_its_output_names(capsys, tmp_path):
    """Issue 56: run.py writes bench.py's folder; a results file's name (``o.jsonl``, what run.py
    wrote before) names the folder ``o``."""
    argv = [
        "--model",
        "tiny-random",
        "--limit",
        "1",
        "--max-new-tokens",
        "4",
        "--output",
        str(tmp_path / "o.jsonl"),
    ]
    code, _, err = run_cli(capsys, *argv)
    assert code == 0, err
    written = {p.name for p in (tmp_path / "o").iterdir()}
    assert {"records.jsonl", "meta.json", "config.yaml", "bench.md"} <= written
    assert not (tmp_path / "o.jsonl").exists()
    assert (
        "- command: `python experiments/run.py --model tiny-random"
        in (tmp_path / "o" / "bench.md").read_text()
    )
