"""A multi-row MLP branch against a one-row branch, for two builds of the kernels in one process.

Builds ``framework/kernels/csrc/selfspec_kernels.cpp`` as of git revision ``--old`` and as it is
in the working tree (the project's compiler flags, into a temporary folder), then times each
build's ``mlp_branch`` over ``--layers`` random float32 layers of Qwen2.5-0.5B's MLP shapes
(d 896, F 4,864) at T = 1, 4, 5, 8 rows, interleaved, medians of ``--reps``; prints each T's time
relative to T = 1 of the same build, and whether the two builds' outputs are bit-identical.
The comparison of 2026-11-28 (the aligned scratch) was ``--old 918b03a``.

    python docs/measurements/branch_rows_ab.py --old 918b03a [--threads 2] [--reps 9]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from framework.kernels import extension

SOURCE = "framework/kernels/csrc/selfspec_kernels.cpp"


def build(name: str, text: str, folder: Path):
    d = folder / name
    d.mkdir()
    (d / f"{name}.cpp").write_text(text)
    return load(
        name=name,
        sources=[str(d / f"{name}.cpp")],
        extra_cflags=list(extension._FLAGS),
        extra_ldflags=["-fopenmp"],
        build_directory=str(d),
        verbose=False,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="git revision of the build to compare against")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--layers", type=int, default=24)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    old = subprocess.run(
        ["git", "show", f"{args.old}:{SOURCE}"], check=True, capture_output=True, text=True
    ).stdout
    with tempfile.TemporaryDirectory() as tmp:
        exts = {
            args.old: build("ab_old", old, Path(tmp)),
            "working tree": build("ab_new", Path(SOURCE).read_text(), Path(tmp)),
        }
        d, f = 896, 4864
        g = torch.Generator().manual_seed(0)
        layers = [
            tuple(0.03 * torch.randn(*s, generator=g) for s in ((f, d), (f, d), (d, f)))
            for _ in range(args.layers)
        ]
        norm = torch.ones(d)
        sizes = (1, 4, 5, 8)
        hs = {t: torch.randn(t, d, generator=g) for t in sizes}

        def run(ext, t: int) -> tuple[float, torch.Tensor]:
            h, out = hs[t], torch.empty(t, d)
            start = time.perf_counter()
            for wg, wu, wd in layers:
                ext.mlp_branch(h.data_ptr(), out.data_ptr(), t, d, norm.data_ptr(), 1e-6, wg.data_ptr(), 0,
                               wu.data_ptr(), 0, wd.data_ptr(), 0, f, args.threads, 0, 0, 0, 0)  # fmt: skip
            return (time.perf_counter() - start) / len(layers), out

        times: dict[tuple[str, int], list[float]] = {(e, t): [] for e in exts for t in sizes}
        outs: dict[tuple[str, int], torch.Tensor] = {}
        for rep in range(args.reps + 1):  # rep 0: warm-up
            for t in sizes:
                for e, ext in exts.items():
                    dt, outs[e, t] = run(ext, t)
                    if rep:
                        times[e, t].append(dt)
        print(
            f"torch {torch.__version__}, {args.threads} threads, {args.layers} layers, medians of {args.reps}"
        )
        for e in exts:
            one = statistics.median(times[e, 1])
            cells = [
                f"T={t}: {1e3 * statistics.median(times[e, t]):.3f} ms ({statistics.median(times[e, t]) / one:.2f}x)"
                for t in sizes
            ]
            print(f"{e}: " + ", ".join(cells))
        same = all(torch.equal(outs[args.old, t], outs["working tree", t]) for t in sizes)
        print("outputs bit-identical between the builds:", same)


if __name__ == "__main__":
    main()
