"""Batch-invariant CPU kernels (C++ compiled on first use) and the fused attention/MLP branches."""
