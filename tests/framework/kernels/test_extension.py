"""framework.kernels.extension: the C++ source ships as a file, the build's name follows its content,
and framework.kernels.cpu re-exports the loader's names (the live ``unavailable_reason`` included)."""

from __future__ import annotations

from pathlib import Path

import pytest

from framework.kernels import cpu as kernels
from framework.kernels import extension


def test_the_source_is_a_file_of_the_package():
    assert extension.SOURCE_PATH == Path(extension.__file__).parent / "csrc" / "selfspec_kernels.cpp"
    text = extension.SOURCE_PATH.read_text()
    assert "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)" in text
    for op in ("linear", "attention", "attn_branch", "mlp_branch"):
        assert f'm.def("{op}"' in text


def test_the_build_name_follows_the_source_content(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    text = extension.SOURCE_PATH.read_text()
    name = extension._module_name(text)
    assert name.startswith("selfspec_kernels_") and extension._module_name(text) == name
    assert extension._module_name(text + "// edited\n") != name
    monkeypatch.setenv("CXX", "another-compiler")
    assert extension._module_name(text) != name
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    assert extension.build_dir() == tmp_path / "kernels" / name


@pytest.mark.parametrize(("value", "enabled"), [("0", False), (" Off ", False), ("no", False), ("1", True)])
def test_enabled_by_env(monkeypatch: pytest.MonkeyPatch, value: str, enabled: bool):
    monkeypatch.setenv(extension.ENV_VAR, value)
    assert kernels.enabled_by_env() is enabled


def test_cpu_reexports_the_loader():
    for name in ("ENV_VAR", "enabled_by_env", "load_extension", "available", "isa", "build_dir"):
        assert getattr(kernels, name) is getattr(extension, name)
    kernels.available()  # loads (or fails to): the reason is read where the loader sets it
    assert kernels.unavailable_reason == extension.unavailable_reason
    with pytest.raises(AttributeError):
        _ = kernels.no_such_name


def test_a_build_holds_the_source_it_was_named_after():
    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason}")
    built = Path(extension.compiled.__file__).with_suffix(".cpp")
    assert built.read_text() == extension.SOURCE_PATH.read_text()
    assert kernels.isa() in ("avx512", "avx2")
