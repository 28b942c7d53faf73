"""Fast CPU kernels for decoding: a batch-invariant "skinny" linear layer and attention (float32).

Why: on a CPU, stock PyTorch runs a forward over a few new tokens through BLAS kernels tuned for
large matrices, so verifying K + 1 tokens costs about twice a one-token step, and the result of a
row depends on how many rows share the call (``x[:1] @ W.T`` and ``(x @ W.T)[:1]`` differ in the
last bits). Both hurt self-speculative decoding: the first its speed, the second the token-for-token
equality of greedy speculative and greedy plain decoding (a near-tie can flip an argmax).

What: two small C++ kernels, compiled on first use with ``torch.utils.cpp_extension.load``:

- ``linear``: ``y = x @ W.T (+ b)`` for ``x`` with few rows (1 .. `MAX_ROWS`). Each weight row is
  streamed from memory once for all rows, so a forward over 5 tokens costs little more than over
  one. Every output element has its own vector accumulator fed in a fixed order, so row ``r`` of the
  result is bit-identical whatever the number of rows and threads.
- ``attention``: softmax attention of each query row over the keys it may see (additive float or
  boolean masks, tree masks included; GQA), visiting keys in order and skipping masked ones; a
  row's result depends only on that row's query and visible keys.

With both in place (`install`), and with the elementwise and row-wise PyTorch ops of the model
(RMSNorm, RoPE, SiLU, residual adds) being row-invariant already, a verification forward over T
tokens gives bit-identical logits to T successive one-token steps, so greedy speculative decoding
reproduces greedy decoding exactly, in float32, by construction (for T <= `MAX_ROWS`; a longer
forward, in practice only a long prompt's prefill, takes the BLAS path and SDPA, the same in every
decoder).

How it plugs in: `install(model)` changes the class of the model's ``nn.Linear`` modules to
`FastLinear` (same parameters, no copies; tied embeddings stay tied) and switches the model's
attention implementation to ``"selfspec"``, registered with transformers' ``AttentionInterface``.
It also points RMSNorm modules at ``F.rms_norm`` where that reproduces their forward bit for bit
(one ATen call instead of about eight small ops). Everything falls back to the stock path for what
it does not cover: another device (CUDA) or dtype, more than `MAX_ROWS` rows, autograd, dropout,
soft-capping, attention sinks. `uninstall` restores the stock modules.
`framework.engine.adapter.adapter_for` installs them by default (float32 models on a CPU).

Control: ``SELFSPEC_KERNEL=0`` disables the kernels. The build goes to
``$SELFSPEC_CACHE/kernels`` (default ``~/.cache/selfspec/kernels``), one directory per source,
compiler flags, CPU and torch version, and is reused silently. Without a compiler, a CPU with
neither AVX2+FMA nor AVX-512, or on a failed build, one line on stderr says so and plain PyTorch
is used.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from framework.utils import cache_dir

#: Environment variable: ``0`` (or ``false``, ``off``, ``no``) disables the kernels.
ENV_VAR = "SELFSPEC_KERNEL"
#: Name of the attention implementation registered with transformers.
ATTN_IMPLEMENTATION = "selfspec"
#: Largest number of rows (tokens) `linear` sends to the kernel; more go to ``F.linear`` (BLAS
#: is faster there). Verification blocks are far smaller; a larger block loses batch invariance.
MAX_ROWS = 64

_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fopenmp")

_SOURCE = r"""
// selfspec CPU kernels: batch-invariant skinny linear and attention (float32).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// ---- a tiny vector abstraction: every reduction below has ONE fixed operation order -------------
// (-DSELFSPEC_NO_AVX512 builds the AVX2 variant on an AVX-512 machine, for testing it.)
#if defined(__AVX512F__) && !defined(SELFSPEC_NO_AVX512)
constexpr int VL = 16;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset(float a) { return _mm512_set1_ps(a); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload_n(const float* p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p); }
inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
inline void vstore_n(float* p, vf a, int n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1u), a); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vf a) {
  __m256 lo = _mm512_castps512_ps256(a);
  __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
  __m256 s8 = _mm256_add_ps(lo, hi);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
}
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vclamp(vf a, float lo, float hi) { return _mm512_min_ps(_mm512_max_ps(a, vset(lo)), vset(hi)); }
inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vexp2i(vf y, vf n) { return _mm512_scalef_ps(y, n); }  // y * 2^n, n integral
// Attention scores, VL keys at a time: acc[p] holds the dot-product accumulator of key kslot(p) of
// a block of VL keys; vsum_keys returns the VL scores in key order. Every key's lanes are summed by
// the same tree (upper half onto lower half: 16 -> 8 -> 4 -> 2 -> 1 lanes) whatever its place in
// the block, so a key's score does not depend on which block it is in.
inline int kslot(int p) { return 4 * (p % 4) + p / 4; }
__attribute__((always_inline)) inline vf vsum_keys(const vf* a) {
  vf b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i) {
    const __m512d x = _mm512_castps_pd(c[2 * i]), y = _mm512_castps_pd(c[2 * i + 1]);
    d[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline float vmax_all(vf a) { return _mm512_reduce_max_ps(a); }
constexpr int RMAX = 8, TILE = 12;  // up to 8 rows share a pass; 4 or 3 features per block
constexpr int nb_for(int r) { return r <= 6 ? 4 : 3; }  // r * nb + nb + 1 <= 32 zmm registers
const char* kIsa = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int VL = 8;
using vf = __m256;
alignas(32) const int32_t kMaskTable[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
inline __m256i tail_mask(int n) { return _mm256_loadu_si256((const __m256i*)(kMaskTable + 8 - n)); }
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset(float a) { return _mm256_set1_ps(a); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload_n(const float* p, int n) { return _mm256_maskload_ps(p, tail_mask(n)); }
inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
inline void vstore_n(float* p, vf a, int n) { _mm256_maskstore_ps(p, tail_mask(n), a); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vf a) {
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
  return _mm_cvtss_f32(s1);
}
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vclamp(vf a, float lo, float hi) { return _mm256_min_ps(_mm256_max_ps(a, vset(lo)), vset(hi)); }
inline vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vexp2i(vf y, vf n) {  // y * 2^n, n integral in [-127, 128]
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
// Attention scores, VL keys at a time (see the AVX-512 variant): 8 -> 4 -> 2 -> 1 lanes per key.
inline int kslot(int p) { return 4 * (p % 2) + p / 2; }
__attribute__((always_inline)) inline vf vsum_keys(const vf* a) {
  vf b[4], c[2];
  for (int i = 0; i < 4; ++i)
    b[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i) {
    const __m256d x = _mm256_castps_pd(b[2 * i]), y = _mm256_castps_pd(b[2 * i + 1]);
    c[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  return _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x88), _mm256_shuffle_ps(c[0], c[1], 0xDD));
}
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline float vmax_all(vf a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
constexpr int RMAX = 4, TILE = 4;
constexpr int nb_for(int r) { return r <= 2 ? 4 : 2; }  // r * nb + nb + 1 <= 16 ymm registers
const char* kIsa = "avx2";
#else  // portable fallback (correct and batch-invariant, but too slow to be worth installing)
constexpr int VL = 1;
using vf = float;
inline vf vzero() { return 0.0f; }
inline vf vset(float a) { return a; }
inline vf vload(const float* p) { return *p; }
inline vf vload_n(const float* p, int) { return *p; }
inline void vstore(float* p, vf a) { *p = a; }
inline void vstore_n(float* p, vf a, int) { *p = a; }
inline vf vfma(vf a, vf b, vf c) { return std::fma(a, b, c); }
inline float vsum(vf a) { return a; }
inline vf vadd(vf a, vf b) { return a + b; }
inline vf vsub(vf a, vf b) { return a - b; }
inline vf vmul(vf a, vf b) { return a * b; }
inline vf vdiv(vf a, vf b) { return a / b; }
inline vf vclamp(vf a, float lo, float hi) { return std::min(std::max(a, lo), hi); }
inline vf vround(vf a) { return std::nearbyint(a); }
inline vf vexp2i(vf y, vf n) { return std::ldexp(y, (int)n); }
inline int kslot(int) { return 0; }
inline vf vsum_keys(const vf* a) { return a[0]; }
inline vf vmax(vf a, vf b) { return std::max(a, b); }
inline float vmax_all(vf a) { return a; }
constexpr int RMAX = 4, TILE = 4;
constexpr int nb_for(int) { return 4; }
const char* kIsa = "scalar";
#endif

// exp(x) for float32 lanes, Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two
// parts), exp(r) by a degree-7 polynomial, times 2^n. About 1 ulp; a fixed sequence of lane-wise
// operations, so every lane's result depends on that lane's input only.
inline vf vexp(vf x) {
  x = vclamp(x, -87.3365f, 88.7228f);
  const vf n = vround(vmul(x, vset(1.44269504088896341f)));
  vf r = vfma(n, vset(-0.693359375f), x);
  r = vfma(n, vset(2.12194440e-4f), r);
  vf p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset(1.0f)));
  return vexp2i(p, n);
}

// silu(g) * u over n elements, in place in g.
inline void silu_mul(float* g, const float* u, int64_t n) {
  int64_t j = 0;
  const vf one = vset(1.0f), zero = vzero();
  for (; j + VL <= n; j += VL) {
    const vf gv = vload(g + j);
    const vf s = vdiv(gv, vadd(one, vexp(vsub(zero, gv))));
    vstore(g + j, vmul(s, vload(u + j)));
  }
  if (j < n) {
    const int rem = (int)(n - j);
    const vf gv = vload_n(g + j, rem);
    const vf s = vdiv(gv, vadd(one, vexp(vsub(zero, gv))));
    vstore_n(g + j, vmul(s, vload_n(u + j, rem)), rem);
  }
}

inline int threads_for(int requested, int64_t work, int64_t min_work) {
  if (requested <= 1 || work < 2 * min_work) return 1;
  return (int)std::min<int64_t>(requested, work / min_work);
}

// y[r, n] = sum_k x[r, k] w[n, k] (+ b[n]) for an R x N block. Every output has its own
// accumulator, fed in k order: the result of (r, n) does not depend on R, N or the blocking.
// ``pf`` (or nullptr): weights to prefetch into L2 meanwhile, one cache line per row and k-step,
// spread over the pass so that the memory stream keeps going while the arithmetic runs.
template <int R, int N>
inline void linear_block(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K,
                         const float* bias, float* y, int64_t ldy, const float* pf) {
  vf acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) acc[r][n] = vzero();
  int64_t k = 0;
  for (; k + VL <= K; k += VL) {
    if (pf != nullptr && (k * 4) % 64 == 0)
      for (int n = 0; n < N; ++n) __builtin_prefetch(pf + n * ldw + k, 0, 2);  // into L2
    vf wv[N];
    for (int n = 0; n < N; ++n) wv[n] = vload(w + n * ldw + k);
    for (int r = 0; r < R; ++r) {
      vf xv = vload(x + r * ldx + k);
      for (int n = 0; n < N; ++n) acc[r][n] = vfma(xv, wv[n], acc[r][n]);
    }
  }
  if (k < K) {
    const int rem = (int)(K - k);
    vf wv[N];
    for (int n = 0; n < N; ++n) wv[n] = vload_n(w + n * ldw + k, rem);
    for (int r = 0; r < R; ++r) {
      vf xv = vload_n(x + r * ldx + k, rem);
      for (int n = 0; n < N; ++n) acc[r][n] = vfma(xv, wv[n], acc[r][n]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) {
      float s = vsum(acc[r][n]);
      if (bias) s += bias[n];
      y[r * ldy + n] = s;
    }
}

// Rows are taken RMAX at a time and all rows of a chunk share one pass over the weights: every
// weight vector loaded feeds all of them, and a tile of TILE weight rows is read from memory once.
// The features of a tile are visited in sub-blocks whose width suits the chunk's register budget.
template <int R>
inline void linear_chunk(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K,
                         const float* bias, float* y, int64_t ldy, int64_t n0, int64_t n1, int64_t pf_rows,
                         int64_t n_end) {
  constexpr int N = nb_for(R);
  int64_t n = n0;
  for (; n + N <= n1; n += N) {
    const float* pf = (pf_rows > 0 && n + pf_rows + N <= n_end) ? w + (n + pf_rows) * ldw : nullptr;
    linear_block<R, N>(x, ldx, w + n * ldw, ldw, K, bias ? bias + n : nullptr, y + n, ldy, pf);
  }
  for (; n < n1; ++n)
    linear_block<R, 1>(x, ldx, w + n * ldw, ldw, K, bias ? bias + n : nullptr, y + n, ldy, nullptr);
}

template <int R>
inline void linear_chunk_dispatch(int r, const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K,
                                  const float* bias, float* y, int64_t ldy, int64_t n0, int64_t n1,
                                  int64_t pf_rows, int64_t n_end) {
  if constexpr (R >= 1) {
    if (r == R) {
      linear_chunk<R>(x, ldx, w, ldw, K, bias, y, ldy, n0, n1, pf_rows, n_end);
      return;
    }
    linear_chunk_dispatch<R - 1>(r, x, ldx, w, ldw, K, bias, y, ldy, n0, n1, pf_rows, n_end);
  }
}

// The weights of the next tile are prefetched while a tile is computed. Without it the
// arithmetic of several rows does not overlap the memory stream (measured: a 5-row pass cost
// 1.25x a 1-row pass; with it 1.1x).
void linear_features(const float* x, int64_t ldx, const float* w, int64_t ldw, const float* bias,
                     float* y, int64_t ldy, int64_t rows, int64_t K, int64_t n0, int64_t n1) {
  const int64_t pf_rows = TILE;
  for (int64_t t0 = n0; t0 < n1; t0 += TILE) {
    const int64_t t1 = std::min(n1, t0 + TILE);
    for (int64_t r = 0; r < rows; r += RMAX) {
      const int rr = (int)std::min<int64_t>(RMAX, rows - r);
      // only the first chunk of rows prefetches; later chunks find the tile in cache
      linear_chunk_dispatch<RMAX>(rr, x + r * ldx, ldx, w, ldw, K, bias, y + r * ldy, ldy, t0, t1,
                                  r == 0 ? pf_rows : 0, n1);
    }
  }
}

}  // namespace

// y (rows, N, row stride ldy) = x (rows, K, row stride ldx) @ w (N, K, row stride ldw).T + b.
void linear(uintptr_t x, int64_t ldx, uintptr_t w, int64_t ldw, uintptr_t b, uintptr_t y, int64_t ldy,
            int64_t rows, int64_t N, int64_t K, int nthreads) {
  const float* xp = reinterpret_cast<const float*>(x);
  const float* wp = reinterpret_cast<const float*>(w);
  const float* bp = reinterpret_cast<const float*>(b);
  float* yp = reinterpret_cast<float*>(y);
  // Threads split the output features into contiguous tile-aligned ranges (~16K weights at least).
  const int64_t blocks = (N + TILE - 1) / TILE;
  const int nt = threads_for(nthreads, N * K, 16384);
  if (nt == 1) {
    linear_features(xp, ldx, wp, ldw, bp, yp, ldy, rows, K, 0, N);
    return;
  }
#pragma omp parallel num_threads(nt)
  {
#ifdef _OPENMP
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
    const int t = 0, T = 1;
#endif
    const int64_t per = (blocks + T - 1) / T;
    const int64_t n0 = std::min(N, t * per * TILE), n1 = std::min(N, (t + 1) * per * TILE);
    if (n0 < n1) linear_features(xp, ldx, wp, ldw, bp, yp, ldy, rows, K, n0, n1);
  }
}

namespace {

struct AttnArgs {
  const float *q, *k, *v;
  int64_t qs_b, qs_h, qs_t;          // q strides (elements); the last dim is contiguous
  int64_t ks_b, ks_h, ks_s;          // k strides
  int64_t vs_b, vs_h, vs_s;          // v strides
  const void* mask;                  // nullptr, float additive, or bool (uint8)
  int mask_kind;                     // 0 none, 1 additive float, 2 bool
  int64_t ms_b, ms_h, ms_t, ms_s;    // mask strides
  float* out;                        // (B, T, Hq, D) contiguous
  int64_t B, Hq, Hkv, T, S, D;
  float scale;
  bool causal;                       // without a mask: query t sees keys [0, S - T + t]
};

// How many position ranges the T query positions of each KV head are split into: enough work items
// for every thread, and at most 16 positions (x G heads) per item so the scratch stays small.
inline int64_t group_split(int64_t T, int nthreads, int64_t Hkv) {
  const int64_t want = std::max<int64_t>((2 * nthreads + Hkv - 1) / Hkv, (T + 15) / 16);
  return std::min<int64_t>(T, std::max<int64_t>(1, want));
}

struct GroupScratch {
  std::vector<float> sc;     // R x S: per row, the scores (then the weights) of the keys it sees
  std::vector<int32_t> idx;  // R x S: their key indices (masked calls; otherwise entry i is key i)
  std::vector<float> acc;    // R x 2 x ld: weighted value sums over even and odd entries
  std::vector<int64_t> cnt, lim, ptr;
  std::vector<float> inv;
};

// The VL scores q.k of keys kb[0 .. nk) (row stride ks), in key order; lanes >= nk are 0. D is nd
// vectors, the last one of `rem` lanes when rem > 0. ND > 0: nd == ND, known at compile time (the
// dot products of all VL keys stay in registers); ND == 0: any nd.
template <int ND>
__attribute__((always_inline)) inline vf score_block(const float* q, const float* kb, int64_t ks, int nk, int64_t nd, int rem) {
  constexpr int NR = ND > 0 ? ND : 1;
  const int64_t n = ND > 0 ? ND : nd;
  vf qv[NR];
  if (ND > 0)
    for (int c = 0; c < NR; ++c) qv[c] = (rem > 0 && c == NR - 1) ? vload_n(q + c * VL, rem) : vload(q + c * VL);
  vf acc[VL];
  if (nk == VL && (ND > 0 && rem == 0)) {  // the common case: a full block, no tail lanes
#pragma GCC unroll 16
    for (int p = 0; p < VL; ++p) {
      const float* kr = kb + kslot(p) * ks;
      vf s = vzero();
#pragma GCC unroll 8
      for (int c = 0; c < NR; ++c) s = vfma(qv[c], vload(kr + c * VL), s);
      acc[p] = s;
    }
    return vsum_keys(acc);
  }
  for (int p = 0; p < VL; ++p) {
    const int kj = kslot(p);
    vf s = vzero();
    if (kj < nk) {
      const float* kr = kb + kj * ks;
      for (int64_t c = 0; c < n; ++c) {
        const bool tail = rem > 0 && c == n - 1;
        const vf x = tail ? vload_n(kr + c * VL, rem) : vload(kr + c * VL);
        const vf y = ND > 0 ? qv[ND > 0 ? c : 0] : (tail ? vload_n(q + c * VL, rem) : vload(q + c * VL));
        s = vfma(y, x, s);
      }
    }
    acc[p] = s;
  }
  return vsum_keys(acc);
}

inline vf score_any(const float* q, const float* kb, int64_t ks, int nk, int64_t nd, int rem) {
  switch (nd) {
    case 1: return score_block<1>(q, kb, ks, nk, nd, rem);
    case 2: return score_block<2>(q, kb, ks, nk, nd, rem);
    case 4: return score_block<4>(q, kb, ks, nk, nd, rem);
    case 8: return score_block<8>(q, kb, ks, nk, nd, rem);
    default: return score_block<0>(q, kb, ks, nk, nd, rem);
  }
}

// acc[0 .. nd) (even entries) and acc[ld .. ld + nd) (odd entries) += w[i] * value(key of entry i)
// for the entries i in [i0, i1). Entry parity, not the call's range, picks the sum, so the result
// after all calls depends only on the sequence of entries.
template <int ND>
inline void value_range(const float* w, const int32_t* idx, int64_t i0, int64_t i1, const float* vb, int64_t vs,
                        float* acc, int64_t ld, int64_t nd, int rem) {
  constexpr int NR = ND > 0 ? ND : 1;
  const int64_t n = ND > 0 ? ND : nd;
  vf e[NR], o[NR];  // ND > 0: the sums stay in registers over the range
  if (ND > 0)
    for (int c = 0; c < NR; ++c) {
      e[c] = vload(acc + c * VL);
      o[c] = vload(acc + ld + c * VL);
    }
  auto add = [&](int64_t i, vf* reg, float* mem) {
    const float* vr = vb + (idx ? (int64_t)idx[i] : i) * vs;
    const vf p = vset(w[i]);
    for (int64_t c = 0; c < n; ++c) {
      const vf x = (rem > 0 && c == n - 1) ? vload_n(vr + c * VL, rem) : vload(vr + c * VL);
      if (ND > 0)
        reg[c] = vfma(p, x, reg[c]);
      else
        vstore(mem + c * VL, vfma(p, x, vload(mem + c * VL)));
    }
  };
  int64_t i = i0;
  if (i < i1 && (i & 1)) add(i++, o, acc + ld);
  for (; i + 1 < i1; i += 2) {
    add(i, e, acc);
    add(i + 1, o, acc + ld);
  }
  if (i < i1) add(i, e, acc);
  if (ND > 0)
    for (int c = 0; c < NR; ++c) {
      vstore(acc + c * VL, e[c]);
      vstore(acc + ld + c * VL, o[c]);
    }
}

inline void value_any(const float* w, const int32_t* idx, int64_t i0, int64_t i1, const float* vb, int64_t vs,
                      float* acc, int64_t ld, int64_t nd, int rem) {
  switch (nd) {
    case 1: return value_range<1>(w, idx, i0, i1, vb, vs, acc, ld, nd, rem);
    case 2: return value_range<2>(w, idx, i0, i1, vb, vs, acc, ld, nd, rem);
    case 4: return value_range<4>(w, idx, i0, i1, vb, vs, acc, ld, nd, rem);
    case 8: return value_range<8>(w, idx, i0, i1, vb, vs, acc, ld, nd, rem);
    default: return value_range<0>(w, idx, i0, i1, vb, vs, acc, ld, nd, rem);
  }
}

// softmax(q k^T * scale + mask) v for the query rows t in [t0, t1) of the G query heads that share
// KV head hk, together. Keys are read in blocks of VL (scores) and chunks of kChunk (values) that
// stay in L1 for all rows of the item. Batch invariance: a row's result is a fixed function of its
// query and the sequence of keys it sees, whatever its position, the other rows of the call and the
// thread split. A key's score has the same chain of operations in every lane (score_block); masked
// keys are dropped (their weight would be exactly 0), so the visible keys form a sequence of
// "entries"; the maximum is exact in any order; the exponentials are lane-wise; the softmax
// denominator sums entries lane-wise by entry index, then by vsum's tree; the value sums split by
// entry parity. A tree row and a single query over the same keys laid out contiguously agree bit
// for bit.
constexpr int64_t kChunk = 64;

void attend_group(const AttnArgs& a, int64_t b, int64_t hk, int64_t t0, int64_t t1, GroupScratch& w) {
  const int64_t G = a.Hq / a.Hkv, D = a.D, S = a.S, R = (t1 - t0) * G;
  const int64_t nd = (D + VL - 1) / VL, ld = nd * VL;
  const int rem = (int)(D % VL);
  const bool masked = a.mask_kind != 0;
  w.sc.resize(R * S);
  if (masked) w.idx.resize(R * S);
  w.acc.assign(R * 2 * ld, 0.0f);
  w.cnt.assign(R, 0);
  w.lim.resize(R);
  w.ptr.assign(R, 0);
  w.inv.assign(R, 0.0f);
  const float* kb = a.k + b * a.ks_b + hk * a.ks_h;
  const float* vb = a.v + b * a.vs_b + hk * a.vs_h;
  int64_t top = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + r / G;
    w.lim[r] = (a.mask_kind == 0 && a.causal) ? std::min<int64_t>(S, S - a.T + t + 1) : S;
    top = std::max(top, w.lim[r]);
  }
  const vf vscale = vset(a.scale);
  // 1. scores of the visible keys, in key order
  for (int64_t j0 = 0; j0 < top; j0 += VL) {
    const int nk = (int)std::min<int64_t>(VL, top - j0);
    for (int64_t r = 0; r < R; ++r) {
      if (j0 >= w.lim[r]) continue;
      const int64_t t = t0 + r / G, h = hk * G + r % G;
      const float* q = a.q + b * a.qs_b + h * a.qs_h + t * a.qs_t;
      alignas(64) float sv[VL];
      vstore(sv, vmul(score_any(q, kb + j0 * a.ks_s, a.ks_s, nk, nd, rem), vscale));
      const int nvis = (int)std::min<int64_t>(nk, w.lim[r] - j0);
      float* out = w.sc.data() + r * S;
      if (!masked) {
        std::copy(sv, sv + nvis, out + j0);
        w.cnt[r] = j0 + nvis;
        continue;
      }
      int32_t* ix = w.idx.data() + r * S;
      int64_t c = w.cnt[r];
      const int64_t m0 = b * a.ms_b + h * a.ms_h + t * a.ms_t;
      if (a.mask_kind == 1 && a.ms_s == 1) {  // a float mask row: all of the block visible?
        const float* mp = static_cast<const float*>(a.mask) + m0 + j0;
        bool all = true;
        for (int i = 0; i < nvis; ++i) all &= mp[i] > -0.5f * FLT_MAX;
        if (all) {
          for (int i = 0; i < nvis; ++i) {
            out[c + i] = sv[i] + mp[i];
            ix[c + i] = (int32_t)(j0 + i);
          }
          w.cnt[r] = c + nvis;
          continue;
        }
      }
      for (int i = 0; i < nvis; ++i) {
        const int64_t j = j0 + i, mo = m0 + j * a.ms_s;
        float add = 0.0f;
        if (a.mask_kind == 1) {
          add = static_cast<const float*>(a.mask)[mo];
          if (!(add > -0.5f * FLT_MAX)) continue;
        } else if (!static_cast<const uint8_t*>(a.mask)[mo]) {
          continue;
        }
        out[c] = sv[i] + add;
        ix[c++] = (int32_t)j;
      }
      w.cnt[r] = c;
    }
  }
  // 2. softmax weights (unnormalised) and 1 / their sum
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = w.cnt[r];
    if (n == 0) continue;
    float* sc = w.sc.data() + r * S;
    int64_t i = 0;
    float mx = -INFINITY;
    if (n >= VL) {
      vf m = vload(sc);
      for (i = VL; i + VL <= n; i += VL) m = vmax(m, vload(sc + i));
      mx = vmax_all(m);
    }
    for (; i < n; ++i) mx = std::max(mx, sc[i]);
    const vf vmx = vset(mx);
    vf tot = vzero();
    for (i = 0; i + VL <= n; i += VL) {
      const vf e = vexp(vsub(vload(sc + i), vmx));
      vstore(sc + i, e);
      tot = vadd(tot, e);
    }
    if (i < n) {
      const int k = (int)(n - i);
      const vf e = vexp(vsub(vload_n(sc + i, k), vmx));
      vstore_n(sc + i, e, k);
      tot = vadd(tot, vload_n(sc + i, k));
    }
    w.inv[r] = 1.0f / vsum(tot);
  }
  // 3. weighted sums of the values, a chunk of keys at a time for all rows
  for (int64_t c0 = 0; c0 < top; c0 += kChunk) {
    const int64_t c1 = c0 + kChunk;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t n = w.cnt[r], i0 = w.ptr[r];
      if (i0 >= n) continue;
      const int32_t* ix = masked ? w.idx.data() + r * S : nullptr;
      int64_t i1 = i0;
      if (ix == nullptr) {
        i1 = std::min(n, c1);
      } else {
        while (i1 < n && ix[i1] < c1) ++i1;
      }
      value_any(w.sc.data() + r * S, ix, i0, i1, vb, a.vs_s, w.acc.data() + r * 2 * ld, ld, nd, rem);
      w.ptr[r] = i1;
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + r / G, h = hk * G + r % G;
    float* o = a.out + ((b * a.T + t) * a.Hq + h) * D;
    const float* even = w.acc.data() + r * 2 * ld;
    const float* odd = even + ld;
    for (int64_t d = 0; d < D; ++d) o[d] = (even[d] + odd[d]) * w.inv[r];
  }
}

}  // namespace

void attention(uintptr_t q, int64_t qs_b, int64_t qs_h, int64_t qs_t, uintptr_t k, int64_t ks_b, int64_t ks_h,
               int64_t ks_s, uintptr_t v, int64_t vs_b, int64_t vs_h, int64_t vs_s, uintptr_t mask, int mask_kind,
               int64_t ms_b, int64_t ms_h, int64_t ms_t, int64_t ms_s, uintptr_t out, int64_t B, int64_t Hq,
               int64_t Hkv, int64_t T, int64_t S, int64_t D, double scale, bool causal, int nthreads) {
  AttnArgs a{reinterpret_cast<const float*>(q), reinterpret_cast<const float*>(k), reinterpret_cast<const float*>(v),
             qs_b, qs_h, qs_t, ks_b, ks_h, ks_s, vs_b, vs_h, vs_s, reinterpret_cast<const void*>(mask), mask_kind,
             ms_b, ms_h, ms_t, ms_s, reinterpret_cast<float*>(out), B, Hq, Hkv, T, S, D, (float)scale, causal};
  const int64_t rows = B * Hq * T;
  const int nt = threads_for(nthreads, rows * S * D, 32768);
  const int64_t split = group_split(T, nt, B * Hkv), per = (T + split - 1) / split;
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    GroupScratch w;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < B * Hkv * split; ++item) {
      const int64_t b = item / (Hkv * split), hk = (item / split) % Hkv;
      const int64_t t0 = (item % split) * per, t1 = std::min(T, t0 + per);
      if (t0 < t1) attend_group(a, b, hk, t0, t1, w);
    }
  }
}

// ---- fused decoder sub-layers (Llama family, batch 1, few rows) ----------------------------------
// One call runs a whole residual branch: RMSNorm -> projections -> (RoPE, KV write, attention) ->
// output projection -> residual add, with one OpenMP team and barriers between the phases, instead
// of ~25 small PyTorch ops and Python module calls per branch. Every phase is row-wise with a fixed
// operation order (the linear and attention kernels above), so the result of a row is the same
// whatever the number of rows in the call.

namespace {

// y = (x * rsqrt(mean(x^2) + eps)) * w for one row, in the order of HF's LlamaRMSNorm.
void rms_row(const float* x, const float* w, float eps, float* y, int64_t d) {
  vf s = vzero();
  int64_t k = 0;
  for (; k + VL <= d; k += VL) {
    const vf xv = vload(x + k);
    s = vfma(xv, xv, s);
  }
  if (k < d) {
    const vf xv = vload_n(x + k, (int)(d - k));
    s = vfma(xv, xv, s);
  }
  const float inv = 1.0f / std::sqrt(vsum(s) / (float)d + eps);
  for (int64_t j = 0; j < d; ++j) y[j] = (x[j] * inv) * w[j];
}

// The tile-aligned share [n0, n1) of N output features of thread t out of T.
inline void feature_share(int64_t N, int t, int T, int64_t& n0, int64_t& n1) {
  const int64_t blocks = (N + TILE - 1) / TILE, per = (blocks + T - 1) / T;
  n0 = std::min(N, t * per * TILE);
  n1 = std::min(N, (t + 1) * per * TILE);
}

inline void team(int& t, int& T) {
#ifdef _OPENMP
  t = omp_get_thread_num();
  T = omp_get_num_threads();
#else
  t = 0;
  T = 1;
#endif
}

// x @ w.T + b for this thread's share of the features.
inline void linear_share(const float* x, int64_t rows, int64_t K, const float* w, const float* b, float* y,
                         int64_t N, int t, int T) {
  int64_t n0, n1;
  feature_share(N, t, T, n0, n1);
  if (n0 < n1) linear_features(x, K, w, K, b, y, N, rows, K, n0, n1);
}

}  // namespace

// h_out = h + o_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n))), n = rms_norm(h), for
// T rows of one sequence. The new keys and values are written to the layer's cache at slots
// [base, base + T) of every KV head; the queries see keys [0, S) of the cache through ``mask``
// (additive float (T, S) with strides, or none: causal). cos/sin: (T, D), HF's rotary embedding.
void attn_branch(uintptr_t h, uintptr_t h_out, int64_t T, int64_t d, uintptr_t norm_w, double eps,
                 uintptr_t wq, uintptr_t bq, uintptr_t wk, uintptr_t bk, uintptr_t wv, uintptr_t bv,
                 uintptr_t wo, uintptr_t bo, int64_t Hq, int64_t Hkv, int64_t D, uintptr_t cos,
                 uintptr_t sin, uintptr_t kc, uintptr_t vc, int64_t kv_hs, int64_t kv_ss, int64_t base,
                 int64_t S, uintptr_t mask, int64_t ms_t, int64_t ms_s, double scale, int nthreads) {
  const float* hp = reinterpret_cast<const float*>(h);
  float* out = reinterpret_cast<float*>(h_out);
  const float* cp = reinterpret_cast<const float*>(cos);
  const float* sp = reinterpret_cast<const float*>(sin);
  float* kcp = reinterpret_cast<float*>(kc);
  float* vcp = reinterpret_cast<float*>(vc);
  const int64_t nq = Hq * D, nk = Hkv * D, half = D / 2;
  std::vector<float> x(T * d), q(T * nq), k(T * nk), v(T * nk), att(T * nq), y(T * d);
  AttnArgs a{q.data(), kcp, vcp, T * nq, D, nq, 0, kv_hs, kv_ss, 0, kv_hs, kv_ss,
             reinterpret_cast<const void*>(mask), mask ? 1 : 0, 0, 0, ms_t, ms_s, att.data(),
             1, Hq, Hkv, T, S, D, (float)scale, mask == 0 && T > 1};
  const int nt = threads_for(nthreads, (2 * nq + 2 * nk) * d, 16384);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    int t, NT;
    team(t, NT);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < T; ++r)
      rms_row(hp + r * d, reinterpret_cast<const float*>(norm_w), (float)eps, x.data() + r * d, d);
    linear_share(x.data(), T, d, reinterpret_cast<const float*>(wq), reinterpret_cast<const float*>(bq), q.data(), nq, t, NT);
    linear_share(x.data(), T, d, reinterpret_cast<const float*>(wk), reinterpret_cast<const float*>(bk), k.data(), nk, t, NT);
    linear_share(x.data(), T, d, reinterpret_cast<const float*>(wv), reinterpret_cast<const float*>(bv), v.data(), nk, t, NT);
#pragma omp barrier
    // RoPE as HF computes it: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1).
#pragma omp for schedule(static)
    for (int64_t r = 0; r < T * (Hq + Hkv); ++r) {
      const int64_t row = r / (Hq + Hkv), head = r % (Hq + Hkv);
      const float* c = cp + row * D;
      const float* s = sp + row * D;
      float* p = head < Hq ? q.data() + row * nq + head * D : k.data() + row * nk + (head - Hq) * D;
      float tmp[1024];
      for (int64_t j = 0; j < half; ++j) {
        tmp[j] = p[j] * c[j] + (-p[j + half]) * s[j];
        tmp[j + half] = p[j + half] * c[j + half] + p[j] * s[j + half];
      }
      for (int64_t j = 0; j < D; ++j) p[j] = tmp[j];
      if (head >= Hq) {
        const int64_t hk = head - Hq, slot = base + row;
        std::copy(p, p + D, kcp + hk * kv_hs + slot * kv_ss);
        const float* vr = v.data() + row * nk + hk * D;
        std::copy(vr, vr + D, vcp + hk * kv_hs + slot * kv_ss);
      }
    }
    {
      // Work items: a KV head and a contiguous range of query positions (split so that every
      // thread gets work: each item reads its head's keys and values once).
      const int64_t split = group_split(T, NT, Hkv), per = (T + split - 1) / split;
      GroupScratch w;
#pragma omp for schedule(static)
      for (int64_t item = 0; item < Hkv * split; ++item) {
        const int64_t hk = item / split, t0 = (item % split) * per, t1 = std::min(T, t0 + per);
        if (t0 < t1) attend_group(a, 0, hk, t0, t1, w);
      }
    }
    int64_t n0, n1;
    feature_share(d, t, NT, n0, n1);
    if (n0 < n1) {
      linear_features(att.data(), nq, reinterpret_cast<const float*>(wo), nq, reinterpret_cast<const float*>(bo),
                      y.data(), d, T, nq, n0, n1);
      for (int64_t r = 0; r < T; ++r)
        for (int64_t j = n0; j < n1; ++j) out[r * d + j] = hp[r * d + j] + y[r * d + j];
    }
  }
}

// h_out = h + down(silu(gate(n)) * up(n)), n = rms_norm(h), for T rows.
void mlp_branch(uintptr_t h, uintptr_t h_out, int64_t T, int64_t d, uintptr_t norm_w, double eps,
                uintptr_t wg, uintptr_t bg, uintptr_t wu, uintptr_t bu, uintptr_t wd, uintptr_t bd, int64_t F,
                int nthreads) {
  const float* hp = reinterpret_cast<const float*>(h);
  float* out = reinterpret_cast<float*>(h_out);
  std::vector<float> x(T * d), g(T * F), u(T * F), y(T * d);
  const int nt = threads_for(nthreads, 3 * F * d, 16384);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    int t, NT;
    team(t, NT);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < T; ++r)
      rms_row(hp + r * d, reinterpret_cast<const float*>(norm_w), (float)eps, x.data() + r * d, d);
    int64_t n0, n1;
    feature_share(F, t, NT, n0, n1);
    if (n0 < n1) {
      linear_features(x.data(), d, reinterpret_cast<const float*>(wg), d, reinterpret_cast<const float*>(bg),
                      g.data(), F, T, d, n0, n1);
      linear_features(x.data(), d, reinterpret_cast<const float*>(wu), d, reinterpret_cast<const float*>(bu),
                      u.data(), F, T, d, n0, n1);
      for (int64_t r = 0; r < T; ++r) silu_mul(g.data() + r * F + n0, u.data() + r * F + n0, n1 - n0);
    }
#pragma omp barrier
    feature_share(d, t, NT, n0, n1);
    if (n0 < n1) {
      linear_features(g.data(), F, reinterpret_cast<const float*>(wd), F, reinterpret_cast<const float*>(bd),
                      y.data(), d, T, F, n0, n1);
      for (int64_t r = 0; r < T; ++r)
        for (int64_t j = n0; j < n1; ++j) out[r * d + j] = hp[r * d + j] + y[r * d + j];
    }
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "y = x @ w.T + b for few rows (float32, batch-invariant)");
  m.def("attention", &attention, "batch-invariant attention (float32)");
  m.def("attn_branch", &attn_branch, "a Llama attention branch with residual, batch 1 (float32)");
  m.def("mlp_branch", &mlp_branch, "a Llama MLP branch with residual (float32)");
  m.attr("isa") = kIsa;
  m.attr("vector_width") = VL;
}
"""

_ext: ModuleType | None = None
_tried = False
#: Why the kernels are not in use (``None`` while they are, or before the first attempt).
unavailable_reason: str | None = None


# ------------------------------------------------------------------------------------------
# Building and loading
# ------------------------------------------------------------------------------------------


def enabled_by_env() -> bool:
    """False when ``SELFSPEC_KERNEL`` is ``0``, ``false``, ``off`` or ``no``."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")


def _cpu_signature() -> str:
    """The CPU model and feature flags (a ``-march=native`` build is valid only on such a CPU)."""
    sig = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    sig += line
                if line.strip() == "":
                    break  # the first processor is enough
    except OSError:
        sig += platform.processor()
    return sig


def build_dir() -> Path:
    """Where the compiled kernels live: ``$SELFSPEC_CACHE/kernels/<name>``."""
    return cache_dir() / "kernels" / _module_name()


def _module_name() -> str:
    key = "|".join(
        [
            _SOURCE,
            " ".join(_FLAGS),
            torch.__version__,
            sys.version,
            _cpu_signature(),
            os.environ.get("CXX", ""),
        ]
    )
    return "selfspec_kernels_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _import_built(name: str, directory: Path) -> ModuleType | None:
    path = directory / f"{name}.so"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str, directory: Path) -> ModuleType:
    from torch.utils.cpp_extension import load

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} not found)")
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > 900:
        lock.unlink(missing_ok=True)  # left by a build that was killed; torch would wait forever
    src = directory / f"{name}.cpp"
    if not src.exists() or src.read_text() != _SOURCE:
        tmp = src.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(_SOURCE)
        os.replace(tmp, src)
    print(f"[selfspec] compiling the CPU kernels once into {directory} (~30 s)", file=sys.stderr)
    return load(
        name=name,
        sources=[str(src)],
        build_directory=str(directory),
        extra_cflags=list(_FLAGS),
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


def load_extension() -> ModuleType | None:
    """The compiled kernels, building them on first use; ``None`` if disabled or unavailable.

    A failure is reported once per process, in one line on stderr, and `unavailable_reason` says
    why; later calls return ``None`` at once.
    """
    global _ext, _tried, unavailable_reason
    if _ext is not None or _tried:
        return _ext
    _tried = True
    if not enabled_by_env():
        unavailable_reason = f"disabled by {ENV_VAR}"
        return None
    try:
        name, directory = _module_name(), build_dir()
        try:
            ext = _import_built(name, directory)
        except ImportError:
            ext = None  # a broken earlier build: rebuild
        if ext is None:
            ext = _build(name, directory)
        if ext.isa == "scalar":
            raise RuntimeError("the CPU has neither AVX2+FMA nor AVX-512")
    except Exception as err:  # noqa: BLE001 - any build problem means: use plain PyTorch
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        unavailable_reason = first
        print(
            f"[selfspec] fast CPU kernels unavailable ({first}); using plain PyTorch "
            f"(set {ENV_VAR}=0 to skip the attempt)",
            file=sys.stderr,
        )
        return None
    _ext = ext
    unavailable_reason = None
    return ext


def available() -> bool:
    """Whether the kernels are compiled and enabled (builds them on first call)."""
    return load_extension() is not None


def isa() -> str | None:
    """The vector instruction set the kernels were compiled for (``avx512``, ``avx2``), or ``None``."""
    ext = load_extension()
    return None if ext is None else ext.isa


# ------------------------------------------------------------------------------------------
# The ops
# ------------------------------------------------------------------------------------------


_F32 = torch.float32
_grad_enabled = torch.is_grad_enabled
_num_threads = torch.get_num_threads


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the kernel for float32 CPU inputs of at most
    `MAX_ROWS` rows (``x.numel() // in_features``), through ``F.linear`` otherwise.

    Row ``r`` of the kernel's result is bit-identical whatever the number of rows or threads.
    """
    ext = _ext
    # The checks are ordered and written for speed: this runs ~200 times per decoded token.
    if (
        ext is None
        or x.dtype is not _F32
        or weight.dtype is not _F32
        or not x.is_cpu
        or not weight.is_cpu
        or weight.dim() != 2
        or (_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return F.linear(x, weight, bias)
    n, k = weight.shape
    rows = x.numel() // k if k else 0
    if not 0 < rows <= MAX_ROWS or x.shape[-1] != k:
        return F.linear(x, weight, bias)
    if bias is not None:
        if (
            bias.dtype is not _F32
            or not bias.is_cpu
            or bias.dim() != 1
            or (_grad_enabled() and bias.requires_grad)
        ):
            return F.linear(x, weight, bias)
        if not bias.is_contiguous():
            bias = bias.contiguous()
    if weight.is_contiguous():
        ldw = k
    elif weight.stride(1) == 1:
        ldw = weight.stride(0)
    else:
        return F.linear(x, weight, bias)
    out = torch.empty(*x.shape[:-1], n, dtype=_F32)
    if x.is_contiguous():
        ldx = k
    else:
        x = x.reshape(rows, k)
        if x.stride(1) != 1:
            x = x.contiguous()
        ldx = x.stride(0)
    ext.linear(
        x.data_ptr(),
        ldx,
        weight.data_ptr(),
        ldw,
        0 if bias is None else bias.data_ptr(),
        out.data_ptr(),
        n,
        rows,
        n,
        k,
        _num_threads(),
    )
    return out


class FastLinear(nn.Linear):
    """``nn.Linear`` whose forward goes through `linear` (the kernel where it applies).

    `install` switches existing ``nn.Linear`` modules to this class in place; the parameters are
    the module's own.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias)


# Keyword arguments of an attention call that change its result and the kernel does not implement.
_UNSUPPORTED = ("softcap", "s_aux", "sinks", "position_bias", "cache")


def _sdpa(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)


def attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An attention function for transformers' ``AttentionInterface`` (registered as
    ``"selfspec"``): the kernel for float32 CPU inputs of at most `MAX_ROWS` query rows, SDPA for
    everything else (longer blocks, in practice a long prompt's prefill, included).

    Args:
        module: the HF attention module (for ``is_causal``, ``training``).
        query: (B, H, T, D). key, value: (B, H_kv, S, D), H a multiple of H_kv (GQA).
        attention_mask: ``None``, an additive float mask or a boolean mask (True = attend),
            broadcastable from (B or 1, H or 1, T, S). Positions at ``finfo.min`` (or ``-inf``) are
            masked out.
        dropout, scaling, is_causal: as for ``sdpa_attention_forward``.

    Returns:
        (output (B, T, H, D), None).
    """
    ext = _ext
    plan = (
        None
        if ext is None
        else _attention_plan(module, query, key, value, attention_mask, dropout, is_causal, kwargs)
    )
    if plan is None:
        return _sdpa(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    b, h, t, d, hkv, s, causal = plan
    if query.stride(3) != 1:
        query = query.contiguous()
    if key.stride(3) != 1:
        key = key.contiguous()
    if value.stride(3) != 1:
        value = value.contiguous()
    qs, ks, vs = query.stride(), key.stride(), value.stride()
    if attention_mask is None:
        mask_kind, mask_ptr, ms = 0, 0, (0, 0, 0, 0)
    else:
        m = attention_mask.expand(b, h, t, s)
        mask_kind = 2 if m.dtype is torch.bool else 1
        mask_ptr, ms = m.data_ptr(), m.stride()
    out = torch.empty(b, t, h, d, dtype=_F32)
    ext.attention(
        query.data_ptr(), qs[0], qs[1], qs[2],
        key.data_ptr(), ks[0], ks[1], ks[2],
        value.data_ptr(), vs[0], vs[1], vs[2],
        mask_ptr, mask_kind, ms[0], ms[1], ms[2], ms[3],
        out.data_ptr(), b, h, hkv, t, s, d,
        d**-0.5 if scaling is None else float(scaling), causal, _num_threads(),
    )  # fmt: skip
    return out, None


def _attention_plan(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    dropout: float,
    is_causal: bool | None,
    kwargs: dict[str, Any],
) -> tuple[int, int, int, int, int, int, bool] | None:
    """``(B, H, T, D, H_kv, S, causal)`` if the kernel applies to this call, else ``None``."""
    if (
        query.dtype is not _F32
        or key.dtype is not _F32
        or value.dtype is not _F32
        or not query.is_cpu
        or not key.is_cpu
        or not value.is_cpu
        or query.dim() != 4
        or key.dim() != 4
        or value.shape != key.shape
        or (dropout and module.training)
        or (
            kwargs
            and (kwargs.get("output_attentions") or any(kwargs.get(n) is not None for n in _UNSUPPORTED))
        )
        or (_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))
    ):
        return None
    b, h, t, d = query.shape
    kb, hkv, s, kd = key.shape
    if kb != b or kd != d or hkv == 0 or h % hkv or t == 0 or t > MAX_ROWS:
        # More rows than a verification block (a long prompt's prefill): SDPA's blocked matrix
        # products are faster there, and like the linear layers' BLAS path for such blocks, every
        # decoder takes the same path for them.
        return None
    causal = False
    if mask is None:
        if t > 1:
            causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
            if causal and s != t:  # SDPA's is_causal aligns the mask top-left: leave that case to it
                return None
    elif (
        not mask.is_cpu
        or (mask.dtype is not torch.bool and mask.dtype is not _F32)
        or mask.dim() != 4
        or mask.shape[2] != t
        or mask.shape[3] != s
        or mask.shape[0] not in (1, b)
        or mask.shape[1] not in (1, h)
    ):
        return None
    return b, h, t, d, hkv, s, causal


def register_attention() -> None:
    """Register ``"selfspec"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


# ------------------------------------------------------------------------------------------
# Installing into a model
# ------------------------------------------------------------------------------------------

_INSTALLED = "_selfspec_kernels"  # model attribute: the attention implementation it had before


class _FusedRMSNorm:
    """Mixin of the RMSNorm subclasses `install` creates: ``F.rms_norm`` (one ATen call instead of
    about eight small ops) for float32 CPU inputs, the HF module's own forward otherwise."""

    _selfspec_base: type[nn.Module]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w = self.weight  # type: ignore[attr-defined]
        if hidden_states.dtype is _F32 and w.dtype is _F32 and hidden_states.is_cpu:
            return F.rms_norm(hidden_states, (hidden_states.shape[-1],), w, self.variance_epsilon)  # type: ignore[attr-defined]
        return self._selfspec_base.forward(self, hidden_states)  # type: ignore[arg-type]


_FUSED_NORM_CLASSES: dict[type, type] = {}


def _fused_norm_class(mod: nn.Module) -> type | None:
    """The fused subclass for an RMSNorm module, or ``None`` if ``F.rms_norm`` does not reproduce
    its forward bit for bit (checked on random float32 inputs: a norm with other semantics, such as
    Gemma's ``1 + weight``, is left alone)."""
    cls = type(mod)
    if cls in _FUSED_NORM_CLASSES:
        return _FUSED_NORM_CLASSES[cls]
    weight = getattr(mod, "weight", None)
    eps = getattr(mod, "variance_epsilon", None)
    if (
        not cls.__name__.endswith("RMSNorm")
        or not isinstance(weight, torch.Tensor)
        or weight.dim() != 1
        or not isinstance(eps, float)
        or weight.dtype is not _F32
        or not weight.is_cpu
    ):
        return None
    fused = type(f"Fused{cls.__name__}", (_FusedRMSNorm, cls), {"_selfspec_base": cls})
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, weight.shape[0], generator=g, dtype=_F32) * 3.0
    with torch.inference_mode():
        ok = torch.equal(cls.forward(mod, x), fused.forward(mod, x))  # type: ignore[arg-type]
    _FUSED_NORM_CLASSES[cls] = fused if ok else None  # type: ignore[assignment]
    return _FUSED_NORM_CLASSES[cls]


def is_installed(model: nn.Module) -> bool:
    return hasattr(model, _INSTALLED)


def install(model: nn.Module) -> bool:
    """Route ``model``'s linear layers, attention and RMSNorms through fast paths (idempotent).

    Every module whose class is exactly ``nn.Linear`` becomes a `FastLinear` (the same object and
    parameters, so nothing is copied and tied weights stay tied); the model's attention
    implementation becomes ``"selfspec"`` if it was ``"sdpa"`` or ``"eager"``; and every RMSNorm
    module for which ``F.rms_norm`` gives bit-identical results (checked here) gets a subclass that
    calls it (saving per-op overhead; the numbers do not change). All of them fall back to the
    stock code wherever they do not apply, so the model keeps working on any device and dtype.

    Returns:
        ``False`` (and changes nothing) when the kernels are disabled or could not be built.
    """
    if is_installed(model):
        return True
    if load_extension() is None:
        return False
    register_attention()
    for mod in model.modules():
        if type(mod) is nn.Linear:
            mod.__class__ = FastLinear
        elif type(mod).__name__.endswith("RMSNorm") and not isinstance(mod, _FusedRMSNorm):
            fused = _fused_norm_class(mod)
            if fused is not None:
                mod.__class__ = fused
    config = getattr(model, "config", None)
    before = getattr(config, "_attn_implementation", None)
    if before in ("sdpa", "eager") and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    setattr(model, _INSTALLED, before)
    return True


def uninstall(model: nn.Module) -> None:
    """Undo `install`: the stock module classes and the previous attention implementation."""
    if not is_installed(model):
        return
    before = getattr(model, _INSTALLED)
    for mod in model.modules():
        if type(mod) is FastLinear:
            mod.__class__ = nn.Linear
        elif isinstance(mod, _FusedRMSNorm):
            mod.__class__ = mod._selfspec_base
    config = getattr(model, "config", None)
    if before is not None and getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION:
        model.set_attn_implementation(before)
    delattr(model, _INSTALLED)


@contextlib.contextmanager
def stock(model: nn.Module) -> Iterator[None]:
    """The stock PyTorch modules inside the block, the kernels again after it (if they were
    installed): e.g. to time Hugging Face's own ``generate`` as users run it."""
    was = is_installed(model)
    uninstall(model)
    try:
        yield
    finally:
        if was:
            install(model)
