// selfspec CPU kernels: batch-invariant skinny linear and attention (float32).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
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

// ---- scratch on cache-line boundaries --------------------------------------------------------
// The kernels' scratch activations (a branch's normed rows, projections, attention output, the
// quantised activations of 4-bit drafts) live in vectors whose storage starts on a 64-byte
// boundary. From a plain std::vector (16-byte aligned) every 64-byte vector load of an activation
// straddles two cache lines; a pass of several rows loads the activations once per weight vector,
// so that nearly doubled its load traffic. Measured on 24 layers of Qwen2.5-0.5B's MLP shapes, two
// threads, in one process: a 5-row branch cost 1.27x a 1-row one and an 8-row branch 1.83x from
// 16-byte aligned scratch, 1.14x and 1.26x from this (the 1-row branch unchanged). Same results:
// only where the loads start changes.
template <typename T>
struct CacheLineAlloc {
  using value_type = T;
  CacheLineAlloc() = default;
  template <typename U>
  CacheLineAlloc(const CacheLineAlloc<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const CacheLineAlloc<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAlloc<U>&) const { return false; }
};
template <typename T>
using avec = std::vector<T, CacheLineAlloc<T>>;

// ---- weights: float32, or a compressed copy for drafts -------------------------------------------
// bfloat16 (the upper 16 bits of a float32, stored as uint16) or int8 with one float32 scale per
// output row (w = scale[n] * q[n, k]). Loaded VL at a time and widened to float32 lanes; the
// arithmetic is float32 throughout.
using bf16_t = uint16_t;
inline vf wload(const float* p) { return vload(p); }
inline vf wload_n(const float* p, int n) { return vload_n(p, n); }
#if defined(__AVX512F__) && !defined(SELFSPEC_NO_AVX512)
inline vf wload(const bf16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline vf wload(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
#elif defined(__AVX2__) && defined(__FMA__)
inline vf wload(const bf16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline vf wload(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
#else
inline vf wload(const bf16_t* p) {
  const uint32_t u = (uint32_t)*p << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline vf wload(const int8_t* p) { return (float)*p; }
#endif
// The last n < VL weights of a row (zero-padded; rows whose length is a multiple of VL never get here).
template <typename WT>
inline vf wload_n(const WT* p, int n) {
  WT buf[VL] = {};
  for (int i = 0; i < n; ++i) buf[i] = p[i];
  return wload(buf);
}

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
template <typename WT, int R, int N>
inline void linear_block(const float* x, int64_t ldx, const WT* w, int64_t ldw, int64_t K, const float* scale,
                         const float* bias, float* y, int64_t ldy, const WT* pf) {
  vf acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) acc[r][n] = vzero();
  int64_t k = 0;
  for (; k + VL <= K; k += VL) {
    if (pf != nullptr && (k * (int64_t)sizeof(WT)) % 64 == 0)
      for (int n = 0; n < N; ++n) __builtin_prefetch(pf + n * ldw + k, 0, 2);  // into L2
    vf wv[N];
    for (int n = 0; n < N; ++n) wv[n] = wload(w + n * ldw + k);
    for (int r = 0; r < R; ++r) {
      vf xv = vload(x + r * ldx + k);
      for (int n = 0; n < N; ++n) acc[r][n] = vfma(xv, wv[n], acc[r][n]);
    }
  }
  if (k < K) {
    const int rem = (int)(K - k);
    vf wv[N];
    for (int n = 0; n < N; ++n) wv[n] = wload_n(w + n * ldw + k, rem);
    for (int r = 0; r < R; ++r) {
      vf xv = vload_n(x + r * ldx + k, rem);
      for (int n = 0; n < N; ++n) acc[r][n] = vfma(xv, wv[n], acc[r][n]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) {
      float s = vsum(acc[r][n]);
      if (scale) s *= scale[n];
      if (bias) s += bias[n];
      y[r * ldy + n] = s;
    }
}

// Rows are taken RMAX at a time and all rows of a chunk share one pass over the weights: every
// weight vector loaded feeds all of them, and a tile of TILE weight rows is read from memory once.
// The features of a tile are visited in sub-blocks whose width suits the chunk's register budget.
template <typename WT, int R>
inline void linear_chunk(const float* x, int64_t ldx, const WT* w, int64_t ldw, int64_t K, const float* scale,
                         const float* bias, float* y, int64_t ldy, int64_t n0, int64_t n1, int64_t pf_rows,
                         int64_t n_end) {
  constexpr int N = nb_for(R);
  int64_t n = n0;
  for (; n + N <= n1; n += N) {
    const WT* pf = (pf_rows > 0 && n + pf_rows + N <= n_end) ? w + (n + pf_rows) * ldw : nullptr;
    linear_block<WT, R, N>(x, ldx, w + n * ldw, ldw, K, scale ? scale + n : nullptr, bias ? bias + n : nullptr, y + n, ldy, pf);
  }
  for (; n < n1; ++n)
    linear_block<WT, R, 1>(x, ldx, w + n * ldw, ldw, K, scale ? scale + n : nullptr, bias ? bias + n : nullptr, y + n, ldy, nullptr);
}

template <typename WT, int R>
inline void linear_chunk_dispatch(int r, const float* x, int64_t ldx, const WT* w, int64_t ldw, int64_t K,
                                  const float* scale, const float* bias, float* y, int64_t ldy, int64_t n0, int64_t n1,
                                  int64_t pf_rows, int64_t n_end) {
  if constexpr (R >= 1) {
    if (r == R) {
      linear_chunk<WT, R>(x, ldx, w, ldw, K, scale, bias, y, ldy, n0, n1, pf_rows, n_end);
      return;
    }
    linear_chunk_dispatch<WT, R - 1>(r, x, ldx, w, ldw, K, scale, bias, y, ldy, n0, n1, pf_rows, n_end);
  }
}

// The weights of the next tile are prefetched while a tile is computed. Without it the
// arithmetic of several rows does not overlap the memory stream (measured: a 5-row pass cost
// 1.25x a 1-row pass; with it 1.1x).
template <typename WT>
void linear_features(const float* x, int64_t ldx, const WT* w, int64_t ldw, const float* scale, const float* bias,
                     float* y, int64_t ldy, int64_t rows, int64_t K, int64_t n0, int64_t n1) {
  const int64_t pf_rows = TILE;
  for (int64_t t0 = n0; t0 < n1; t0 += TILE) {
    const int64_t t1 = std::min(n1, t0 + TILE);
    for (int64_t r = 0; r < rows; r += RMAX) {
      const int rr = (int)std::min<int64_t>(RMAX, rows - r);
      // only the first chunk of rows prefetches; later chunks find the tile in cache
      linear_chunk_dispatch<WT, RMAX>(rr, x + r * ldx, ldx, w, ldw, K, scale, bias, y + r * ldy, ldy, t0, t1,
                                  r == 0 ? pf_rows : 0, n1);
    }
  }
}

// ---- 4-bit weights times 8-bit activations (a draft's cheapest copy) -----------------------------
// Weights: each output row holds Kp = K rounded up to 128 weights in Kp / 2 bytes; byte i of block
// j (64 bytes) holds u[128 j + i] in its low nibble and u[128 j + 64 + i] in its high nibble, where
// u = q + 8 and q in [-7, 7] (padding: q = 0), w[n, k] ~ scale[n, k / 64] * q[n, k]: a float32
// scale per row and group of 64. Activations are quantised per row and group of 64 in the call,
// x[k] ~ sx[k / 64] * xq[k] with xq = round(x * (127 / amax)) in [-127, 127] (ties to even), so
// a group's dot product is an exact integer and y[n] = sum_g scale[n, g] sx[g] sum_k q xq (+ b).
// With AVX-512 VNNI one `vpdpbusd` multiplies 64 weight nibbles by 64 activation bytes; the +8 of
// u is taken back by starting each group's accumulator at -8 * (its activations' sums).
struct q4_t {
  uint8_t b;
};
constexpr int64_t kQ4Group = 64, kQ4Prefetch = 16;
inline int64_t q4_padded(int64_t K) { return (K + 127) / 128 * 128; }

// One call's quantised activations: per row Kp bytes, Kp / 64 scales and (VNNI) 16 int32 lanes of
// -8 * (the sum of 4 consecutive activations) per group.
struct Q4Acts {
  avec<int8_t> q;
  avec<float> s;
  avec<int32_t> z;
};

inline void q4_quantize(const float* x, int64_t ldx, int64_t rows, int64_t K, Q4Acts& a) {
  const int64_t Kp = q4_padded(K), G = Kp / kQ4Group;
  a.q.assign(rows * Kp, 0);
  a.s.assign(rows * G, 0.0f);
  a.z.assign(rows * G * 16, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t k0 = g * kQ4Group, k1 = std::min(K, k0 + kQ4Group);
      float amax = 0.0f;
      for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(xr[k]));
      if (!(amax > 0.0f)) continue;  // all zero (or past K): q = 0, scale 0
      const float inv = 127.0f / amax;
      a.s[r * G + g] = amax / 127.0f;
      int8_t* q = a.q.data() + r * Kp + k0;
      for (int64_t k = k0; k < k1; ++k)
        q[k - k0] = (int8_t)std::min(127.0f, std::max(-127.0f, std::nearbyint(xr[k] * inv)));
      int32_t* z = a.z.data() + (r * G + g) * 16;
      for (int l = 0; l < 16; ++l) z[l] = -8 * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
    }
  }
}

// y[i] (i < NB, output rows n .. n + NB - 1, weight row stride rb bytes, scale row stride G) for
// activation row r. Each output has its own accumulator over the groups in k order.
template <int NB>
inline void q4_rows(const Q4Acts& a, int64_t r, int64_t Kp, const uint8_t* w, int64_t rb, const float* sc,
                    const float* bias, float* y, const uint8_t* pf) {
  const int64_t G = Kp / kQ4Group;
  const int8_t* xq = a.q.data() + r * Kp;
  const float* sx = a.s.data() + r * G;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(SELFSPEC_NO_AVX512)
  const int32_t* z = a.z.data() + r * G * 16;
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  __m512 acc[NB];
  for (int i = 0; i < NB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < G / 2; ++j) {
    const __m512i x0 = _mm512_loadu_si512(xq + 128 * j), x1 = _mm512_loadu_si512(xq + 128 * j + 64);
    const __m512i z0 = _mm512_loadu_si512(z + 32 * j), z1 = _mm512_loadu_si512(z + 32 * j + 16);
    const __m512 s0 = _mm512_set1_ps(sx[2 * j]), s1 = _mm512_set1_ps(sx[2 * j + 1]);
    for (int i = 0; i < NB; ++i) {
      if (pf) _mm_prefetch((const char*)(pf + i * rb + 64 * j), _MM_HINT_T1);
      const __m512i p = _mm512_loadu_si512(w + i * rb + 64 * j);
      const __m512i d0 = _mm512_dpbusd_epi32(z0, _mm512_and_si512(p, lo4), x0);
      const __m512i d1 = _mm512_dpbusd_epi32(z1, _mm512_and_si512(_mm512_srli_epi16(p, 4), lo4), x1);
      acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(d0), s0), _mm512_set1_ps(sc[i * G + 2 * j]), acc[i]);
      acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(d1), s1), _mm512_set1_ps(sc[i * G + 2 * j + 1]), acc[i]);
    }
  }
  for (int i = 0; i < NB; ++i) y[i] = _mm512_reduce_add_ps(acc[i]) + (bias ? bias[i] : 0.0f);
#else
  for (int i = 0; i < NB; ++i) {
    float acc = 0.0f;
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* p = w + i * rb + (g / 2) * 64;
      const int shift = (g % 2) * 4;
      int32_t d = 0;
      for (int64_t k = 0; k < kQ4Group; ++k) d += (((p[k] >> shift) & 0x0F) - 8) * xq[g * kQ4Group + k];
      acc += ((float)d * sx[g]) * sc[i * G + g];
    }
    y[i] = acc + (bias ? bias[i] : 0.0f);
  }
#endif
}

// The 4-bit counterpart of `linear_features` (same arguments; ``w`` is the packed copy above,
// ``scale`` its (N, Kp / 64) group scales, ``ldw`` unused: a row is Kp / 2 bytes). Each thread
// quantises the activations itself (a few microseconds against the weights' stream).
inline void linear_features(const float* x, int64_t ldx, const q4_t* w, int64_t /*ldw*/, const float* scale,
                            const float* bias, float* y, int64_t ldy, int64_t rows, int64_t K, int64_t n0,
                            int64_t n1) {
  thread_local Q4Acts acts;
  q4_quantize(x, ldx, rows, K, acts);
  const int64_t Kp = q4_padded(K), G = Kp / kQ4Group, rb = Kp / 2;
  const uint8_t* wb = reinterpret_cast<const uint8_t*>(w);
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    // the rows kQ4Prefetch ahead go to L2 meanwhile (a far prefetch keeps enough reads in flight)
    const uint8_t* pf = n + kQ4Prefetch + 4 <= n1 ? wb + (n + kQ4Prefetch) * rb : nullptr;
    for (int64_t r = 0; r < rows; ++r)
      q4_rows<4>(acts, r, Kp, wb + n * rb, rb, scale + n * G, bias ? bias + n : nullptr, y + r * ldy + n,
                 r == 0 ? pf : nullptr);
  }
  for (; n < n1; ++n)
    for (int64_t r = 0; r < rows; ++r)
      q4_rows<1>(acts, r, Kp, wb + n * rb, rb, scale + n * G, bias ? bias + n : nullptr, y + r * ldy + n, nullptr);
}

}  // namespace

namespace {

template <typename WT>
void linear_t(const float* xp, int64_t ldx, const WT* wp, int64_t ldw, const float* sp, const float* bp, float* yp,
              int64_t ldy, int64_t rows, int64_t N, int64_t K, int nthreads) {
  // Threads split the output features into contiguous tile-aligned ranges (~16K weights at least).
  const int64_t blocks = (N + TILE - 1) / TILE;
  const int nt = threads_for(nthreads, N * K, 16384);
  if (nt == 1) {
    linear_features(xp, ldx, wp, ldw, sp, bp, yp, ldy, rows, K, 0, N);
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
    if (n0 < n1) linear_features(xp, ldx, wp, ldw, sp, bp, yp, ldy, rows, K, n0, n1);
  }
}

// Weight storage codes of the compressed-weight entry points (see wload).
constexpr int kFloat32 = 0, kBFloat16 = 1, kInt8 = 2, kInt4 = 3;

}  // namespace

// y (rows, N, row stride ldy) = x (rows, K, row stride ldx) @ w (N, K, row stride ldw).T + b.
void linear(uintptr_t x, int64_t ldx, uintptr_t w, int64_t ldw, uintptr_t b, uintptr_t y, int64_t ldy,
            int64_t rows, int64_t N, int64_t K, int nthreads) {
  linear_t(reinterpret_cast<const float*>(x), ldx, reinterpret_cast<const float*>(w), ldw, nullptr,
           reinterpret_cast<const float*>(b), reinterpret_cast<float*>(y), ldy, rows, N, K, nthreads);
}

// As `linear`, with the weights stored as ``wtype`` (0 float32, 1 bfloat16, 2 int8 times ``scale``,
// one float32 per output row, 3 the packed 4-bit copy with ``scale`` per row and group of 64 and
// 8-bit activations, see q4_t; 0 for the others).
void linear_lowp(uintptr_t x, int64_t ldx, uintptr_t w, int64_t ldw, int wtype, uintptr_t scale, uintptr_t b,
                 uintptr_t y, int64_t ldy, int64_t rows, int64_t N, int64_t K, int nthreads) {
  const float* xp = reinterpret_cast<const float*>(x);
  const float* sp = reinterpret_cast<const float*>(scale);
  const float* bp = reinterpret_cast<const float*>(b);
  float* yp = reinterpret_cast<float*>(y);
  if (wtype == kBFloat16)
    linear_t(xp, ldx, reinterpret_cast<const bf16_t*>(w), ldw, sp, bp, yp, ldy, rows, N, K, nthreads);
  else if (wtype == kInt8)
    linear_t(xp, ldx, reinterpret_cast<const int8_t*>(w), ldw, sp, bp, yp, ldy, rows, N, K, nthreads);
  else if (wtype == kInt4)
    linear_t(xp, ldx, reinterpret_cast<const q4_t*>(w), ldw, sp, bp, yp, ldy, rows, N, K, nthreads);
  else
    linear_t(xp, ldx, reinterpret_cast<const float*>(w), ldw, sp, bp, yp, ldy, rows, N, K, nthreads);
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
  avec<float> sc;           // R x S: per row, the scores (then the weights) of the keys it sees
  std::vector<int32_t> idx;  // R x S: their key indices (masked calls; otherwise entry i is key i)
  avec<float> acc;          // R x 2 x ld: weighted value sums over even and odd entries
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
template <typename WT>
inline void linear_share(const float* x, int64_t rows, int64_t K, const WT* w, const float* s, const float* b,
                         float* y, int64_t N, int t, int T) {
  int64_t n0, n1;
  feature_share(N, t, T, n0, n1);
  if (n0 < n1) linear_features(x, K, w, K, s, b, y, N, rows, K, n0, n1);
}

}  // namespace

namespace {

// h_out = h + o_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n))), n = rms_norm(h), for
// T rows of one sequence. The new keys and values are written to the layer's cache at slots
// [base, base + T) of every KV head; the queries see keys [0, S) of the cache through ``mask``
// (additive float (T, S) with strides, or none: causal). cos/sin: (T, D), HF's rotary embedding.
template <typename WT>
void attn_branch_t(uintptr_t h, uintptr_t h_out, int64_t T, int64_t d, uintptr_t norm_w, double eps,
                   uintptr_t wq, uintptr_t bq, uintptr_t wk, uintptr_t bk, uintptr_t wv, uintptr_t bv,
                   uintptr_t wo, uintptr_t bo, int64_t Hq, int64_t Hkv, int64_t D, uintptr_t cos,
                   uintptr_t sin, uintptr_t kc, uintptr_t vc, int64_t kv_hs, int64_t kv_ss, int64_t base,
                   int64_t S, uintptr_t mask, int64_t ms_t, int64_t ms_s, double scale, int nthreads,
                   uintptr_t sq, uintptr_t sk, uintptr_t sv, uintptr_t so) {
  const float* hp = reinterpret_cast<const float*>(h);
  float* out = reinterpret_cast<float*>(h_out);
  const float* cp = reinterpret_cast<const float*>(cos);
  const float* sp = reinterpret_cast<const float*>(sin);
  float* kcp = reinterpret_cast<float*>(kc);
  float* vcp = reinterpret_cast<float*>(vc);
  const int64_t nq = Hq * D, nk = Hkv * D, half = D / 2;
  avec<float> x(T * d), q(T * nq), k(T * nk), v(T * nk), att(T * nq), y(T * d);
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
    linear_share(x.data(), T, d, reinterpret_cast<const WT*>(wq), reinterpret_cast<const float*>(sq),
                 reinterpret_cast<const float*>(bq), q.data(), nq, t, NT);
    linear_share(x.data(), T, d, reinterpret_cast<const WT*>(wk), reinterpret_cast<const float*>(sk),
                 reinterpret_cast<const float*>(bk), k.data(), nk, t, NT);
    linear_share(x.data(), T, d, reinterpret_cast<const WT*>(wv), reinterpret_cast<const float*>(sv),
                 reinterpret_cast<const float*>(bv), v.data(), nk, t, NT);
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
      linear_features(att.data(), nq, reinterpret_cast<const WT*>(wo), nq, reinterpret_cast<const float*>(so),
                      reinterpret_cast<const float*>(bo),
                      y.data(), d, T, nq, n0, n1);
      for (int64_t r = 0; r < T; ++r)
        for (int64_t j = n0; j < n1; ++j) out[r * d + j] = hp[r * d + j] + y[r * d + j];
    }
  }
}

// h_out = h + down(silu(gate(n)) * up(n)), n = rms_norm(h), for T rows.
template <typename WT>
void mlp_branch_t(uintptr_t h, uintptr_t h_out, int64_t T, int64_t d, uintptr_t norm_w, double eps,
                  uintptr_t wg, uintptr_t bg, uintptr_t wu, uintptr_t bu, uintptr_t wd, uintptr_t bd, int64_t F,
                  int nthreads, uintptr_t sg, uintptr_t su, uintptr_t sd) {
  const float* hp = reinterpret_cast<const float*>(h);
  float* out = reinterpret_cast<float*>(h_out);
  avec<float> x(T * d), g(T * F), u(T * F), y(T * d);
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
      linear_features(x.data(), d, reinterpret_cast<const WT*>(wg), d, reinterpret_cast<const float*>(sg),
                      reinterpret_cast<const float*>(bg),
                      g.data(), F, T, d, n0, n1);
      linear_features(x.data(), d, reinterpret_cast<const WT*>(wu), d, reinterpret_cast<const float*>(su),
                      reinterpret_cast<const float*>(bu),
                      u.data(), F, T, d, n0, n1);
      for (int64_t r = 0; r < T; ++r) silu_mul(g.data() + r * F + n0, u.data() + r * F + n0, n1 - n0);
    }
#pragma omp barrier
    feature_share(d, t, NT, n0, n1);
    if (n0 < n1) {
      linear_features(g.data(), F, reinterpret_cast<const WT*>(wd), F, reinterpret_cast<const float*>(sd),
                      reinterpret_cast<const float*>(bd),
                      y.data(), d, T, F, n0, n1);
      for (int64_t r = 0; r < T; ++r)
        for (int64_t j = n0; j < n1; ++j) out[r * d + j] = hp[r * d + j] + y[r * d + j];
    }
  }
}

}  // namespace

// The exported branches: float32 weights (``wtype`` 0, the model's own parameters) or a draft's
// compressed copy (1 bfloat16, 2 int8 with per-row scales ``s*``, 3 4-bit with group scales ``s*``;
// 0 pointers for the others).
void attn_branch(uintptr_t h, uintptr_t h_out, int64_t T, int64_t d, uintptr_t norm_w, double eps,
                 uintptr_t wq, uintptr_t bq, uintptr_t wk, uintptr_t bk, uintptr_t wv, uintptr_t bv,
                 uintptr_t wo, uintptr_t bo, int64_t Hq, int64_t Hkv, int64_t D, uintptr_t cos,
                 uintptr_t sin, uintptr_t kc, uintptr_t vc, int64_t kv_hs, int64_t kv_ss, int64_t base,
                 int64_t S, uintptr_t mask, int64_t ms_t, int64_t ms_s, double scale, int nthreads, int wtype,
                 uintptr_t sq, uintptr_t sk, uintptr_t sv, uintptr_t so) {
  auto run = [&](auto tag) {
    using WT = decltype(tag);
    attn_branch_t<WT>(h, h_out, T, d, norm_w, eps, wq, bq, wk, bk, wv, bv, wo, bo, Hq, Hkv, D, cos, sin, kc, vc,
                      kv_hs, kv_ss, base, S, mask, ms_t, ms_s, scale, nthreads, sq, sk, sv, so);
  };
  if (wtype == kBFloat16) run(bf16_t{});
  else if (wtype == kInt8) run(int8_t{});
  else if (wtype == kInt4) run(q4_t{});
  else run(float{});
}

void mlp_branch(uintptr_t h, uintptr_t h_out, int64_t T, int64_t d, uintptr_t norm_w, double eps, uintptr_t wg,
                uintptr_t bg, uintptr_t wu, uintptr_t bu, uintptr_t wd, uintptr_t bd, int64_t F, int nthreads,
                int wtype, uintptr_t sg, uintptr_t su, uintptr_t sd) {
  auto run = [&](auto tag) {
    using WT = decltype(tag);
    mlp_branch_t<WT>(h, h_out, T, d, norm_w, eps, wg, bg, wu, bu, wd, bd, F, nthreads, sg, su, sd);
  };
  if (wtype == kBFloat16) run(bf16_t{});
  else if (wtype == kInt8) run(int8_t{});
  else if (wtype == kInt4) run(q4_t{});
  else run(float{});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "y = x @ w.T + b for few rows (float32, batch-invariant)");
  m.def("attention", &attention, "batch-invariant attention (float32)");
  m.def("attn_branch", &attn_branch, "a Llama attention branch with residual, batch 1 (float32 activations)");
  m.def("mlp_branch", &mlp_branch, "a Llama MLP branch with residual (float32 activations)");
  m.def("linear_lowp", &linear_lowp, "linear with float32, bfloat16, int8 (per-row scale) or 4-bit weights");
  m.attr("isa") = kIsa;
  m.attr("vector_width") = VL;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(SELFSPEC_NO_AVX512)
  m.attr("int4_kernel") = "avx512_vnni";
#else
  m.attr("int4_kernel") = "scalar";
#endif
}
