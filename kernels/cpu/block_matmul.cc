// y = x @ w for a weight kept in GGUF blocks (models/quant.py), called from a jitted step
// through XLA's FFI.
//
// The jnp path expands the whole weight to float32 in memory (q * scale + min) and then runs the
// dot, so each step writes and reads 4 bytes per weight on top of the 1.25 it streams. Here the
// weight is expanded 32 rows at a time into a small buffer that stays in L1, right before the
// rows of x use it: the expansion costs one fused multiply-add per weight and no memory traffic.
//
// Shapes:
//   x      (M, K) float32
//   q      (K, N) int8      w[k, n] = q[k, n] * scale[k / 32, n] + min[k / 32, n]
//   scale  (K / 32, N) float32
//   min    (K / 32, N) float32
//   y      (M, N) float32
// A work item is a panel of 32 columns of y: its weight columns are expanded once per block
// of 32 rows of k and used by every row of x, in tiles of up to MR rows whose accumulators stay
// in registers over the block.
//
// The expansion is exact (q * scale is exact in float32 and the fused "+ min" rounds once, as
// the loader's dequantization does), so the weights are the ones the jnp path uses; only the
// order of the sums over k differs.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));
constexpr int V = 16;       // floats per vector
constexpr int NP = 2 * V;   // columns per panel
constexpr int KB = 32;      // rows of k per block (GGUF's block length)
// Rows of x per register tile: 2 * MR accumulators and 2 weight vectors must fit the register
// file (32 vector registers with AVX-512, 16 half-width ones without).
#if defined(__AVX512F__)
constexpr int MR = 12;
#else
constexpr int MR = 3;
#endif

inline v16 load(const float* p) {
  v16 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
inline void store(float* p, v16 x) { std::memcpy(p, &x, sizeof x); }

// 16 int8 -> 16 floats. GCC turns the portable __builtin_convertvector of int8 lanes into
// scalar code, so the x86 widening conversions are spelled out.
inline v16 load_q(const int8_t* p) {
  v16 r;
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&r, &f, sizeof r);
#elif defined(__AVX2__)
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  std::memcpy(&r, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&r) + sizeof lo, &hi, sizeof hi);
#else
  for (int i = 0; i < V; ++i) r[i] = p[i];
#endif
  return r;
}

// c[R, NP] += x[R, KB] @ w[KB, NP]; x rows `ldx` apart, w and c dense.
template <int R>
void tile(const float* x, int64_t ldx, const float* w, float* c) {
  v16 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = load(c + r * NP), a1[r] = load(c + r * NP + V);
  for (int k = 0; k < KB; ++k) {
    const v16 w0 = load(w + k * NP), w1 = load(w + k * NP + V);
    for (int r = 0; r < R; ++r) {
      const float xs = x[r * ldx + k];
      a0[r] += xs * w0;
      a1[r] += xs * w1;
    }
  }
  for (int r = 0; r < R; ++r) store(c + r * NP, a0[r]), store(c + r * NP + V, a1[r]);
}

using TileFn = void (*)(const float*, int64_t, const float*, float*);

template <int... R>
constexpr std::array<TileFn, sizeof...(R)> tile_fns(std::integer_sequence<int, R...>) {
  return {tile<R + 1>...};
}
constexpr auto kTiles = tile_fns(std::make_integer_sequence<int, MR>{});  // [r - 1]: r rows

struct Problem {
  const float* x;
  const int8_t* q;
  const float* scale;
  const float* min;
  float* y;
  int64_t m, k, n;
};

void panel(const Problem& pr, int64_t p, std::vector<float>& acc, std::vector<float>& w) {
  const int64_t n0 = p * NP, N = pr.n;
  acc.assign(pr.m * NP, 0.f);
  w.resize(KB * NP);
  for (int64_t kb = 0; kb < pr.k / KB; ++kb) {
    const float* s = pr.scale + kb * N + n0;
    const float* m = pr.min + kb * N + n0;
    const v16 s0 = load(s), s1 = load(s + V), m0 = load(m), m1 = load(m + V);
    const int8_t* q = pr.q + kb * KB * N + n0;
    for (int k = 0; k < KB; ++k) {
      store(w.data() + k * NP, load_q(q + k * N) * s0 + m0);
      store(w.data() + k * NP + V, load_q(q + k * N + V) * s1 + m1);
    }
    for (int64_t r = 0; r < pr.m; r += MR) {
      const int64_t rows = std::min<int64_t>(MR, pr.m - r);
      kTiles[rows - 1](pr.x + r * pr.k + kb * KB, pr.k, w.data(), acc.data() + r * NP);
    }
  }
  for (int64_t r = 0; r < pr.m; ++r)
    std::memcpy(pr.y + r * N + n0, acc.data() + r * NP, NP * sizeof(float));
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                  ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> min,
                  ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), qd = q.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || xd[1] != qd[0] || qd[0] % KB || qd[1] % NP ||
      scale.element_count() != qd[0] / KB * qd[1] || min.element_count() != qd[0] / KB * qd[1])
    return ffi::Error::InvalidArgument(
        "block matmul: x must be (M, K) and q (K, N), with K a multiple of 32, N of 32, and "
        "scale and min (K / 32, N)");
  const Problem pr{x.typed_data(), q.typed_data(), scale.typed_data(), min.typed_data(),
                   y->typed_data(), xd[0], qd[0], qd[1]};
  if (pr.m == 0) return ffi::Error::Success();
  jaxserve::parallel_for(pool, pr.n / NP, [pr](int64_t p) {
    thread_local std::vector<float> acc, w;
    panel(pr, p, acc, w);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::S8>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // min
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y
