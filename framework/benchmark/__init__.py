"""The Spec-Bench-style benchmark: several methods, interleaved, against HF baselines."""
