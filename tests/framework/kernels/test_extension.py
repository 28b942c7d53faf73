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
    for op in ("linear", "linear_lowp", "attention", "attn_branch", "mlp_branch"):
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


def _int4_case(n: int, k: int, rows: int, seed: int):
    """An int4 copy, its reference product, and the arguments of ``linear_lowp`` (code 3)."""
    import torch

    from framework.kernels.lowbit import int4_reference, quantize_int4

    g = torch.Generator().manual_seed(seed)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    x[0, : min(k, 64)] = 0.0  # an all-zero activation group
    packed, scale = quantize_int4(w)
    want = int4_reference(x, packed, scale) + b
    return x, packed, scale, b, want


def _run_int4(ext, x, packed, scale, b, n, threads=2):
    import torch

    y = torch.empty(x.shape[0], n)
    ext.linear_lowp(x.data_ptr(), x.stride(0), packed.data_ptr(), x.shape[1], 3, scale.data_ptr(), b.data_ptr(),
                    y.data_ptr(), y.stride(0), x.shape[0], n, x.shape[1], threads)  # fmt: skip
    return y


# ragged K (tails of a group and of a 128-block), N not a multiple of 4, several rows, two threads
INT4_SHAPES = [(96, 200, 1), (37, 45, 3), (13, 7, 6), (40, 576, 2), (200, 896, 1)]


def test_the_int4_kernel_computes_its_reference():
    """The 4-bit x 8-bit kernel (VNNI where the CPU has it) against the float32 reference of the
    same quantisation: each group's product is an exact integer in both, so they agree to float32
    rounding of the scaled sums."""
    import torch

    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason}")
    ext = extension.compiled
    assert ext.int4_kernel in ("avx512_vnni", "scalar")
    for i, (n, k, rows) in enumerate(INT4_SHAPES):
        x, packed, scale, b, want = _int4_case(n, k, rows, i)
        for threads in (1, 2):
            got = _run_int4(ext, x, packed, scale, b, n, threads)
            tol = 1e-5 * float(want.abs().max())
            assert float((got - want).abs().max()) <= tol, (n, k, rows, threads)
    # batch invariance: a row's output does not depend on the other rows of the call
    x, packed, scale, b, _ = _int4_case(96, 200, 5, 9)
    assert torch.equal(
        _run_int4(ext, x, packed, scale, b, 96)[2], _run_int4(ext, x[2:3], packed, scale, b, 96)[0]
    )


@pytest.mark.slow
def test_the_avx2_variant_computes_every_weight_format(tmp_path: Path):
    """The AVX2 build (``-DSELFSPEC_NO_AVX512``, what a CPU without AVX-512 compiles) of the linear
    kernel, for float32 weights and for a draft's bfloat16, int8 and int4 copies, against references."""
    import torch
    from torch.utils.cpp_extension import load

    if not kernels.available() or kernels.isa() != "avx512":
        pytest.skip("needs the AVX-512 build to be the default (the AVX2 one is then the variant)")
    ext = load(
        name="selfspec_kernels_avx2_test",
        sources=[str(extension.SOURCE_PATH)],
        build_directory=str(tmp_path),
        extra_cflags=[*extension._FLAGS, "-DSELFSPEC_NO_AVX512"],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )
    assert ext.isa == "avx2" and ext.vector_width == 8

    def linear(x, w, code, scale, b):
        y = torch.empty(x.shape[0], w.shape[0])
        ptr = 0 if scale is None else scale.data_ptr()
        ext.linear_lowp(x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), code, ptr, b.data_ptr(),
                        y.data_ptr(), y.stride(0), x.shape[0], w.shape[0], x.shape[1], 2)  # fmt: skip
        return y

    g = torch.Generator().manual_seed(0)
    for n, k, rows in [(96, 200, 1), (37, 45, 3), (13, 7, 6)]:  # tails of every length
        w, x, b = (
            torch.randn(n, k, generator=g),
            torch.randn(rows, k, generator=g),
            torch.randn(n, generator=g),
        )
        scale = w.abs().amax(1) / 127
        q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        for code, stored, dense, sc in [
            (0, w, w, None),
            (1, w.to(torch.bfloat16), w.to(torch.bfloat16).float(), None),
            (2, q, q.float() * scale[:, None], scale),
        ]:
            want = x.double() @ dense.double().T + b.double()
            assert torch.allclose(linear(x, stored, code, sc, b).double(), want, atol=1e-4, rtol=1e-4), (
                n,
                k,
                code,
            )
    assert ext.int4_kernel == "scalar"  # no VNNI in this build: the scalar loop
    for i, (n, k, rows) in enumerate(INT4_SHAPES):
        x, packed, scale, b, want = _int4_case(n, k, rows, i)
        got = _run_int4(ext, x, packed, scale, b, n)
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()), (n, k, rows)
