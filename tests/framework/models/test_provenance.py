"""framework/models/provenance.py: what produced a run - the model (id, path, the GGUF it was
converted from and its quantisation, a hash of the weights), the code (commit, dirty tree), the
device and dtype - and that every run's meta.json carries it (issue 29)."""

from __future__ import annotations

import hashlib
import json
import subprocess

import pytest
import torch

from framework.models.provenance import git_state, model_provenance, run_provenance, weights_sha256
from framework.testing import tiny_model


def test_a_model_in_memory_is_hashed_from_its_parameters():
    a = tiny_model("llama", num_layers=2, seed=1)
    b = tiny_model("llama", num_layers=2, seed=1)
    first = model_provenance("my-model", a)
    assert first["id"] == "my-model" and first["architecture"] == "llama"
    assert first["parameters"] == sum(p.numel() for p in a.parameters())
    assert first["weights_sha256"] == model_provenance("x", b)["weights_sha256"]  # same weights
    with torch.no_grad():
        next(b.parameters()).view(-1)[0] += 1.0
    assert model_provenance("x", b)["weights_sha256"] != first["weights_sha256"]


def test_a_converted_directory_names_its_gguf_its_quantisation_and_its_file_hash(tmp_path):
    model = tiny_model("llama", num_layers=2, seed=2, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    record = {"gguf": "Some-Model.Q4_K_M.gguf", "sha256": "ab" * 32, "source": "Some-Model (GGUF Q4_K_M)"}
    (tmp_path / "selfspec-source.json").write_text(json.dumps(record))
    model.config._name_or_path = str(tmp_path)
    prov = model_provenance(None, model)
    assert prov["path"] == str(tmp_path)
    assert prov["source"] == {
        "file": "Some-Model.Q4_K_M.gguf",
        "sha256": "ab" * 32,
        "quantisation": "Q4_K_M",
        "conversion": "Some-Model (GGUF Q4_K_M)",
    }
    weights = tmp_path / "model.safetensors"
    assert prov["weights_sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    # computed once per file version: the cached digest is what a second call returns
    side = tmp_path / "model.safetensors.selfspec-sha256.json"
    cached = json.loads(side.read_text())
    side.write_text(json.dumps({**cached, "sha256": "cached"}))
    assert weights_sha256(tmp_path, model) == "cached"
    weights.write_bytes(weights.read_bytes() + b"\0")  # a changed file is hashed again
    assert weights_sha256(tmp_path, model) == hashlib.sha256(weights.read_bytes()).hexdigest()


def _git(root, *args):
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


def test_git_state_names_the_commit_and_whether_the_tree_was_dirty(tmp_path):
    assert git_state(tmp_path) == {"commit": None, "dirty": None}  # not a checkout
    _git(tmp_path, "init", "-q")
    (tmp_path / "f.py").write_text("x = 1\n")
    _git(tmp_path, "add", "f.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout
    assert git_state(tmp_path) == {"commit": head.strip(), "dirty": False}
    (tmp_path / "f.py").write_text("x = 2\n")
    assert git_state(tmp_path)["dirty"] is True


def test_run_provenance_has_model_code_device_and_dtype():
    prov = run_provenance("m", tiny_model("llama", num_layers=2, seed=3), device="cpu", dtype="float64")
    assert set(prov) == {"model", "code", "device", "dtype"}
    assert prov["device"] == "cpu" and prov["dtype"] == "float64" and prov["model"]["id"] == "m"


@pytest.mark.parametrize("entry", ["run", "bench"])
def test_every_run_records_its_provenance(tmp_path, entry):
    from framework.runner.cli import bench_main
    from framework.runner.cli import main as run_main

    common = ["--model", "tiny-random", "--limit", "1", "--categories", "qa", "--max-new-tokens", "4"]
    if entry == "run":
        out = tmp_path / "r"
        assert run_main([*common, "--logger", "none", "--warmup", "0", "--output", str(out)]) == 0
        meta = json.loads((out / "meta.json").read_text())
    else:
        common += ["--methods", "vanilla,static_confidence", "--repeats", "1", "--no-plots"]
        assert bench_main([*common, "--out", str(tmp_path / "b")]) == 0
        meta = json.loads((tmp_path / "b" / "meta.json").read_text())
    prov = meta["provenance"]
    assert prov["model"]["id"] == "tiny-random" and len(prov["model"]["weights_sha256"]) == 64
    assert prov["code"]["commit"] is None or len(prov["code"]["commit"]) == 40
    assert prov["device"] == "cpu" and prov["dtype"] == "float32"


def test_run_and_bench_record_one_environment():
    """Issue 39, item 2: ``environment()`` is written once; the runner's and the benchmark's
    ``meta.json`` come from the one pipeline (`framework.runner.pipeline.run`), which takes it from
    `framework.models.provenance`."""
    from framework.models.provenance import environment
    from framework.runner import pipeline

    assert pipeline.environment is environment
    env = environment()
    assert {
        "cpu",
        "cpu_count",
        "torch_threads",
        "cuda",
        "python",
        "torch",
        "transformers",
        "platform",
    } == set(env)
    assert env["torch"] == torch.__version__
