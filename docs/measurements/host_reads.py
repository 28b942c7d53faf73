"""Device-to-host reads per decoding round, preset by preset (docs/performance.md, "Host-device
synchronisations").

Every ``.item()``, ``.tolist()``, ``int(t)``, ``float(t)``, ``bool(t)`` or ``.cpu()`` of a CUDA
tensor makes the host wait for the GPU's queue: a synchronisation. This script decodes with every
preset (or ``--presets``) on a tiny random Llama and counts those calls by the line that made them
(`framework.testing.syncs.count_host_reads`). On CUDA only reads of CUDA tensors count; on a CPU
every read counts, including those of statistics a strategy keeps on the host by design (DEL's),
so read the sites, not only the total.

    python docs/measurements/host_reads.py [--presets swift,clasp] [--device cuda] [--new-tokens 64]
"""

from __future__ import annotations

import argparse

import torch

from framework.engine.adapter import adapter_for
from framework.engine.decoding import StopCondition, VanillaDecoder
from framework.session.presets import list_presets
from framework.session.run_config import RunConfig
from framework.session.session import build_decoder
from framework.testing import prepare_context, random_prompt, tiny_model
from framework.testing.syncs import count_host_reads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="", help="comma-separated presets (default: all)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8, help="blocks of the tiny model")
    ap.add_argument("--sites", type=int, default=3, help="busiest call sites shown per preset")
    args = ap.parse_args()
    torch.set_num_threads(1)
    presets = [p for p in args.presets.split(",") if p] or list_presets()
    adapter = adapter_for(tiny_model("llama", num_layers=args.layers, seed=0).to(args.device))
    only = "cuda" if adapter.arch.device.type == "cuda" else None
    print(f"device {adapter.arch.device}, tiny llama ({args.layers} blocks), {args.new_tokens} new tokens\n")
    print("| preset | rounds | drafted | reads per round | busiest sites (reads per round) |")
    print("|---|---:|---:|---:|---|")
    for name in presets:
        cfg = RunConfig.from_preset(name)
        if cfg.method.baseline_only:  # the `vanilla` preset: plain decoding, as the runner does it
            dec = VanillaDecoder(adapter)
        else:
            dec = build_decoder(adapter, cfg)
            dec.prepare(prepare_context(adapter))
        prompt = random_prompt(8, 128, seed=0).to(adapter.arch.device)
        with torch.inference_mode(), count_host_reads(only) as reads:
            res = dec.generate(prompt, StopCondition(args.new_tokens))
        rounds = max(1, len(res.accept_lengths))
        sites = "; ".join(
            f"`{site}` {method} {c / rounds:.2f}"
            for (method, site), c in reads.by_site.most_common(args.sites)
        )
        print(f"| {name} | {rounds} | {res.drafted} | {reads.total / rounds:.2f} | {sites} |")


if __name__ == "__main__":
    main()
