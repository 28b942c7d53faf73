"""The Spec-Bench-style benchmark: our vanilla baseline, Hugging Face ``generate`` and any of our
presets, interleaved on the same prompts with one model load (``experiments/bench.py``), through
the one pipeline (`framework.runner.pipeline.run`) with several methods (``RunConfig.compare``).

- `framework.benchmark.hf`: `HFGenerateDecoder` (``hf_generate``, ``hf_prompt_lookup``,
  ``hf_early_exit``);
- `framework.benchmark.report`: `summarize`, the markdown tables, ``bench.md`` and the plots;
- `framework.benchmark.story`: the report's plain-language reading;
- `framework.benchmark.load`: whether the timings can be trusted (the machine's load);

Its command line is `framework.runner.cli` (``main(bench=True)``), below which it sits.

See ``docs/benchmarks.md``.
"""
