"""Batch-invariant CPU kernels and the fused attention/MLP branches.

``csrc/selfspec_kernels.cpp`` is the C++ source (compiled on first use), `extension` builds and
loads it, `cpu` holds the ops and installs them into a model, `fused` runs whole branches.
"""
