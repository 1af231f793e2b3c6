// y = x @ w for a weight kept in GGUF blocks (kernels/quant.py), called from a jitted step
// through XLA's FFI.
//
// Shapes (eight handlers, one per form of the codes; kernels/quant.py makes them). Each
// handler takes a group of weights of one form that multiply the same x, one y each (see
// Matmul); per weight:
//   x      (M, K) float32
//   q      (K, N) int8      w[k, n] = q[k, n] * scale[k / 32, n] + min[k / 32, n]
//   scale  (K / 32, N) float32
//   min    (K / 32, N) float32
// or, BlockMatmulQ4, the codes as nibbles (values 0-15) two to a byte, in the order the
// kernel reads them (kernels/quant.py's pack_nibbles makes it):
//   q4     (N / 32, K / 2, 32) bytes  panel p, pair of rows kp: byte j holds, low nibble
//          first, the codes of pair slots j and 32 + j, where slot 2c + e is q[2kp + e, 32p + c]
//   scale  (N / 32, K / 32, 32) float16   scale[p, b, c] of column 32p + c
//   min    (N / 32, K / 32, 32) float16
//   (all three as uint32 words, (N / 32, K / 2, 8) and (N / 32, K / 32, 16))
// or, BlockMatmulQ4F, the same codes with scale and min float32 (N / 32, K / 32, 32)
//   (scales that are d times a 6-bit sub-scale, which float16 does not hold)
// or, BlockMatmulQ4K, the same codes with Q4_K's scales as the file has them (K a multiple
//   of 256): scale (N / 32, K / 256, 192) float32, per panel and super-block d and -dmin
//   for its 32 columns, then each block's 6-bit sc and m, a byte a column (NibbleSuperCodes);
//   min is not read
// or, BlockMatmulQ6 and Q6H, codes in [-32, 31] (Q6_K's, Q5_0's), + 32, in six bits, blocks
//   of 32 or 16 rows of k (kernels/quant.py's pack_six makes it):
//   q6     (N / 32, K / 2, 48) bytes  panel p, pair of rows kp: the low nibbles as q4's,
//          then 16 bytes of top bits: byte j holds those of slots j, 16 + j, 32 + j, 48 + j
//   scale  (N / 32, K / B, 32) float32; min is not read (there is none)
// or, BlockMatmulQ8, int8 codes in pairs of rows (kernels/quant.py's pack_pairs makes it):
//   q8     (N / 32, K / 2, 64) int8   panel p, pair of rows kp: byte 2c + e holds
//          q[2kp + e, 32p + c] (as uint32 words, (N / 32, K / 2, 16))
//   scale  (N / 32, K / 32, 32) float32   scale[p, b, c] of column 32p + c
//   min    (N / 32, K / 32, 32) float32
// or, BlockMatmulQ8H, the same with blocks of 16 rows of k: scale and min (N / 32, K / 16,
// 32), and x scaled per block of 16 alike
//   layer  () int32   every form may hold a stack of L layers' weights (on axis 0: (L K, N),
//                     (L N / 32, K / 2, ...), ...): y is layer `layer`'s product, read in
//                     place (a scanned model's step would otherwise copy each layer's weights
//                     out of the stack, streaming them twice); one layer is a stack of 1
//   y      (M, N) float32
// A panel's codes and scales are contiguous (one stream, no strided rows), and widening a
// pair of rows to int16 pairs is a zero-extension, a mask and a shift. The form streams 0.625
// bytes per weight instead of 1.25; its integer sums and scales are the same numbers as the
// int8 form's, so y is the same.
//
// The products run on integers. Each block of 32 values of a row of x is scaled to int16 by its
// largest magnitude (xq = round(x * 32767 / amax), so x ~ xq * xs with xs = amax / 32767), and
// per block of 32 rows of k
//   y[r, n] += scale[b, n] * xs[r, b] * sum_k xq[r, k] q[k, n]  +  min[b, n] * sum_k x[r, k].
// The integer sums are exact (|xq q| < 2^22, 32 of them), and they run as pairs of int16
// products summed into int32 lanes: one instruction (AVX-512 VNNI's vpdpwssd) does 32 of the
// multiply-adds that take two float FMAs, and the weights never exist as floats. The only
// rounding besides float32's own is xq's: at most amax / 65534 per value, 2^-16 of the block's
// largest (bfloat16 keeps 8 bits; llama.cpp's CPU path quantizes x to int8). The engine's
// greedy tokens still equal HF transformers' float32 ones (tests/models/test_hf_equivalence.py).
//
// A work item is a panel of 32 columns of y, computed one of two ways:
// - rows: up to DR rows of x at a time, each block's codes widened to int16 in registers
//   straight into the products, and the rows' float sums kept in registers across all the
//   blocks. Nothing goes through memory but the codes, the scales and x.
// - tiles: per block of 32 rows of k, the weights widened once, in the pairs the instruction
//   reads, into a buffer that stays in L1, and used by every row of x in tiles of up to MR
//   rows whose int32 sums stay in registers; the float sums go to memory per block.
// With AVX-512, widening the nibble form is a few cheap operations, so it always takes rows;
// so does the pair form, whose widening is one sign extension. Widening the int8 form's codes
// takes two shuffles per pair of rows, so repeating it for every DR rows loses past a few rows:
// that form takes rows up to kFewRows and tiles above. Without AVX-512 the nibble and pair
// forms take rows up to 8 rows and tiles above, the int8 form rows up to DR (see
// kWidenInRegistersUpTo). docs/performance.md has the timings behind these cuts.
// The integer sums are exact on every path (VNNI, AVX-512BW, AVX2, portable) and both
// ways finish a block with the same float operations (`fold`), so a row's result does not
// depend on the way or on the other rows of x (batch invariance).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "half.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16x __attribute__((vector_size(64)));  // 16 int32 lanes
constexpr int V = 16;       // lanes per vector
constexpr int NP = 2 * V;   // columns per panel
constexpr int KB = 32;      // rows of k per block (GGUF's block length)
constexpr int KP = KB / 2;  // pairs of rows of k per block
constexpr float kQMax = 32767.f;
// Rows of x per register tile: 2 * MR int32 sums and 2 weight vectors must fit the register
// file (32 vector registers with AVX-512; AVX2's 16 half-width ones hold 4 * MR sums, and the
// multiplies read the weights from the widened buffer). The rows way keeps 2 float sums per
// row as well, so it takes fewer rows at a time (DR). AVX2 takes 2 rows either way: at 3, the
// 12 sums, the 4 products in flight and the pair outgrow the 16 registers and GCC keeps sums
// on the stack. Widening in registers repeats a block's widening for every DR rows instead of
// once, which still wins at a few rows and loses at many: hence kWidenInRegistersUpTo.
// AVX2 without AVX-512: 16 registers of 8 lanes, which the AVX2 code below keeps its 16-lane
// vectors in explicitly (the compiler would move them through the stack).
#if defined(__AVX2__) && !defined(__AVX512F__)
#define HALF_WIDTH 1
#else
#define HALF_WIDTH 0
#endif
#if defined(__AVX512F__)
constexpr int MR = 12;
constexpr int DR = 6;
constexpr int kChainsUpTo = 2;  // rows the rows way sums in two chains each (see panel_rows)
constexpr int64_t kWidenInRegistersUpTo = INT64_MAX;
#else
constexpr int MR = 2;
constexpr int DR = 2;
constexpr int kChainsUpTo = 1;
constexpr int64_t kWidenInRegistersUpTo = 8;
#endif

template <typename T>
inline T load(const void* p) {
  T x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
template <typename T>
inline void store(void* p, T x) { std::memcpy(p, &x, sizeof x); }

// acc[i] += w[2i] * lo + w[2i + 1] * hi for the 16 lanes i, where w holds 32 int16 and the pair
// (lo, hi) of int16 is packed in `pair`. No sum overflows: see the file comment.
inline i16x dot_pairs(i16x acc, i16x w, int32_t pair) {
#if defined(__AVX512VNNI__)
  return (i16x)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(pair));
#elif defined(__AVX512BW__)
  return (i16x)_mm512_add_epi32((__m512i)acc,
                                _mm512_madd_epi16((__m512i)w, _mm512_set1_epi32(pair)));
#else
  int16_t w16[2 * V];
  std::memcpy(w16, &w, sizeof w16);
  const int32_t lo = int16_t(pair & 0xffff), hi = int16_t(uint32_t(pair) >> 16);
  for (int i = 0; i < V; ++i) acc[i] += w16[2 * i] * lo + w16[2 * i + 1] * hi;
  return acc;
#endif
}

// How many layers a panel form's codes of dims qd hold, stacked as (L N / 32, K / 2, W) words
// of `pair_bytes` bytes a pair of rows of a panel; 0 if they are not that.
inline int64_t panel_layers(ffi::Span<const int64_t> qd, int64_t k, int64_t n,
                            int64_t pair_bytes) {
  return qd.size() == 3 && qd[2] == pair_bytes / 4 && qd[1] == k / 2 && qd[0] % (n / NP) == 0
             ? qd[0] / (n / NP) : 0;
}

// The forms of the codes. Each says how its planes' dimensions give K and N, where block
// kb of panel p starts in the codes and the scales, how pair kp of that block's rows widens to
// int16 pairs (w0, w1: lane c of w0 holds (q[2kp][c], q[2kp + 1][c]) for the panel's first 16
// columns c, w1 the next 16), how a panel's 32 block scales (or minima) load as floats, and up
// to how many rows of x it takes the rows way (see the file comment).
struct Int8Codes {
  using Code = int8_t;
  using Scale = float;
  static constexpr int kBlock = KB;  // rows of k per scale
  static constexpr bool kReadAhead = false;  // see ahead() (its rows are N apart)
  // The planes' FFI types, and how many scales each element of a scale plane holds.
  static constexpr ffi::DataType kCodeType = ffi::S8, kScaleType = ffi::F32;
  static constexpr int64_t kScalesPerElement = 1;
  // (K, N) codes, (K / 32, N) scales: block kb of panel p starts at row 32 kb, column 32 p.
  // How many (K, N) layers codes of dims qd hold, stacked as (L K, N); 0 if they are not that.
  static int64_t layers(ffi::Span<const int64_t> qd, int64_t k, int64_t n) {
    return qd.size() == 2 && qd[1] == n && qd[0] % k == 0 ? qd[0] / k : 0;
  }
  static int64_t per_layer(int64_t k, int64_t n) { return k * n; }  // codes
  static const int8_t* codes(const int8_t* q, int64_t p, int64_t kb, int64_t, int64_t n) {
    return q + kb * kBlock * n + p * NP;
  }
  static int64_t scale_at(int64_t p, int64_t kb, int64_t, int64_t n) { return kb * n + p * NP; }
  static v16 scales(const float* s) { return load<v16>(s); }
  static void pair(const int8_t* q, int64_t n, int kp, i16x& w0, i16x& w1) {  // rows n apart
    const int8_t* even = q + 2 * kp * n;
    const int8_t* odd = even + n;
#if defined(__AVX512BW__)
    const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)even));
    const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)odd));
    // Lane j of the result takes a[j / 2] or b[j / 2] (index 32 + j / 2), alternately.
    const __m512i lo = _mm512_set_epi16(
        47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    w0 = (i16x)_mm512_permutex2var_epi16(a, lo, b);
    w1 = (i16x)_mm512_permutex2var_epi16(a, hi, b);
#else
    int16_t out[2 * NP];
    for (int c = 0; c < NP; ++c) out[2 * c] = even[c], out[2 * c + 1] = odd[c];
    w0 = load<i16x>(out), w1 = load<i16x>(out + NP);
#endif
  }
#if HALF_WIDTH
  static void pair8(const int8_t* q, int64_t n, int kp, __m256i w[4]) {  // as 4 registers
    i16x w0, w1;
    pair(q, n, kp, w0, w1);
    std::memcpy(w, &w0, sizeof w0), std::memcpy(w + 2, &w1, sizeof w1);
  }
#endif
#if defined(__AVX512BW__)
  static constexpr int64_t kFewRows = std::min<int64_t>(8, kWidenInRegistersUpTo);
#else  // pair's interleave is a loop of scalars: worth repeating for one pass of DR rows only
  static constexpr int64_t kFewRows = std::min<int64_t>(DR, kWidenInRegistersUpTo);
#endif
};

// S: the scales' type, float16 bits (uint16_t, held two to a uint32 word) or float (Q4_K's,
// whose scales float16 does not hold); the codes' layout is the same.
template <typename S>
struct NibbleCodesOf {
  using Code = uint8_t;
  using Scale = S;
  static constexpr bool kHalf = std::is_same_v<S, uint16_t>;
  static constexpr int kBlock = KB;
  static constexpr bool kReadAhead = true;
  static constexpr ffi::DataType kCodeType = ffi::U32;  // words
  static constexpr ffi::DataType kScaleType = kHalf ? ffi::U32 : ffi::F32;
  static constexpr int64_t kScalesPerElement = kHalf ? 2 : 1;
  // (N / 32, K / 2, 32) codes, (N / 32, K / 32, 32) scales: see the file comment.
  // Layers stacked as (L N / 32, K / 2, 8) words.
  static int64_t layers(ffi::Span<const int64_t> qd, int64_t k, int64_t n) {
    return panel_layers(qd, k, n, NP);
  }
  static int64_t per_layer(int64_t k, int64_t n) { return k * n / 2; }  // bytes
  static const uint8_t* codes(const uint8_t* q, int64_t p, int64_t kb, int64_t blocks,
                              int64_t) {
    return q + (p * blocks + kb) * KP * NP;
  }
  static int64_t scale_at(int64_t p, int64_t kb, int64_t blocks, int64_t) {
    return (p * blocks + kb) * NP;
  }
  static v16 scales(const S* s) {
    if constexpr (!kHalf) {
      return load<v16>(s);
    } else {
#if defined(__AVX512F__)
      return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)s));
#elif defined(__F16C__)
      __m256 h[2];
      for (int i = 0; i < 2; ++i) h[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s + i));
      return load<v16>(h);
#else
      v16 f;
      for (int i = 0; i < V; ++i) f[i] = jaxserve::half_to_float(s[i]);
      return f;
#endif
    }
  }
  static void pair(const uint8_t* q, int64_t, int kp, i16x& w0, i16x& w1) {  // 32 bytes
    typedef uint8_t u8x32 __attribute__((vector_size(32)));
    typedef int16_t s16x32 __attribute__((vector_size(64)));
#if defined(__AVX512BW__)  // one widening instruction (GCC's generic one takes halves)
    const s16x32 b = (s16x32)_mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + kp * NP)));
#else
    const s16x32 b = __builtin_convertvector(load<u8x32>(q + kp * NP), s16x32);
#endif
    w0 = (i16x)(b & 15), w1 = (i16x)(b >> 4);
  }
#if HALF_WIDTH
  // pair's w0 and w1 as 4 registers of 8 lanes
  static void pair8(const uint8_t* q, int64_t, int kp, __m256i w[4]) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + kp * NP));
    const __m256i lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(b));
    const __m256i hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(b, 1));
    const __m256i low_nibble = _mm256_set1_epi16(15);
    w[0] = _mm256_and_si256(lo, low_nibble), w[1] = _mm256_and_si256(hi, low_nibble);
    w[2] = _mm256_srli_epi16(lo, 4), w[3] = _mm256_srli_epi16(hi, 4);
  }
#endif
  static constexpr int64_t kFewRows = kWidenInRegistersUpTo;
};

// B: rows of k per scale, 32 or 16; the codes' layout is the same.
template <int B>
struct PairCodesOf {
  using Code = int8_t;
  using Scale = float;
  static constexpr int kBlock = B;
  static constexpr bool kReadAhead = false;
  static constexpr ffi::DataType kCodeType = ffi::U32, kScaleType = ffi::F32;  // code words
  static constexpr int64_t kScalesPerElement = 1;
  // (N / 32, K / 2, 64) codes, (N / 32, K / B, 32) scales: see the file comment.
  // Layers stacked as (L N / 32, K / 2, 16) words.
  static int64_t layers(ffi::Span<const int64_t> qd, int64_t k, int64_t n) {
    return panel_layers(qd, k, n, 2 * NP);
  }
  static int64_t per_layer(int64_t k, int64_t n) { return k * n; }  // codes
  static const int8_t* codes(const int8_t* q, int64_t p, int64_t kb, int64_t blocks, int64_t) {
    return q + (p * blocks + kb) * (B / 2) * 2 * NP;
  }
  static int64_t scale_at(int64_t p, int64_t kb, int64_t blocks, int64_t) {
    return (p * blocks + kb) * NP;
  }
  static v16 scales(const float* s) { return load<v16>(s); }
  static void pair(const int8_t* q, int64_t, int kp, i16x& w0, i16x& w1) {  // 64 bytes
    typedef int8_t s8x32 __attribute__((vector_size(32)));
    typedef int16_t s16x32 __attribute__((vector_size(64)));
    w0 = (i16x)__builtin_convertvector(load<s8x32>(q + kp * 2 * NP), s16x32);
    w1 = (i16x)__builtin_convertvector(load<s8x32>(q + kp * 2 * NP + NP), s16x32);
  }
#if HALF_WIDTH
  static void pair8(const int8_t* q, int64_t, int kp, __m256i w[4]) {  // as NibbleCodes'
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + kp * 2 * NP) + i));
  }
#endif
  static constexpr int64_t kFewRows = kWidenInRegistersUpTo;
};

// Six-bit codes (Q6_K's, and Q5_0's: any in [-32, 31] without a minimum) as nibbles plus a
// plane of their top two bits, 0.75 bytes a weight. B: rows of k per scale, 16 or 32.
template <int B>
struct SixCodesOf {
  using Code = uint8_t;
  using Scale = float;
  static constexpr int kBlock = B;
  static constexpr bool kReadAhead = true;
  static constexpr bool kHasMin = false;  // the min argument is not read (y's are 0)
  static constexpr int kPairBytes = NP + NP / 2;  // 32 bytes of nibbles, 16 of top bits
  static constexpr ffi::DataType kCodeType = ffi::U32, kScaleType = ffi::F32;
  static constexpr int64_t kScalesPerElement = 1;
  // (N / 32, K / 2, 48) codes, (N / 32, K / B, 32) scales: see the file comment.
  // Layers stacked as (L N / 32, K / 2, 12) words.
  static int64_t layers(ffi::Span<const int64_t> qd, int64_t k, int64_t n) {
    return panel_layers(qd, k, n, kPairBytes);
  }
  static int64_t per_layer(int64_t k, int64_t n) { return k / 2 * (n / NP) * kPairBytes; }
  static const uint8_t* codes(const uint8_t* q, int64_t p, int64_t kb, int64_t blocks,
                              int64_t) {
    return q + (p * blocks + kb) * (B / 2) * kPairBytes;
  }
  static int64_t scale_at(int64_t p, int64_t kb, int64_t blocks, int64_t) {
    return (p * blocks + kb) * NP;
  }
  static v16 scales(const float* s) { return load<v16>(s); }
  // Byte j of the nibbles as NibbleCodes'; byte j of the top bits holds those of pair slots
  // j, 16 + j, 32 + j and 48 + j, two bits each from the lowest.
  static void pair(const uint8_t* q, int64_t, int kp, i16x& w0, i16x& w1) {
    typedef uint8_t u8x16 __attribute__((vector_size(16)));
    typedef uint8_t u8x32 __attribute__((vector_size(32)));
    typedef int16_t s16x32 __attribute__((vector_size(64)));
    const uint8_t* at = q + kp * kPairBytes;
    const s16x32 b = __builtin_convertvector(load<u8x32>(at), s16x32);
    const u8x16 t = load<u8x16>(at + NP);
    const s16x32 top = __builtin_convertvector(
        __builtin_shufflevector(t, t, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                                0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        s16x32) << 4;
    const s16x32 lo_shift = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                             2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2};
    w0 = (i16x)(((b & 15) | ((top >> lo_shift) & 48)) - 32);
    w1 = (i16x)(((b >> 4) | ((top >> (lo_shift + 4)) & 48)) - 32);
  }
#if HALF_WIDTH
  static void pair8(const uint8_t* q, int64_t n, int kp, __m256i w[4]) {  // as Int8Codes'
    i16x w0, w1;
    pair(q, n, kp, w0, w1);
    std::memcpy(w, &w0, sizeof w0), std::memcpy(w + 2, &w1, sizeof w1);
  }
#endif
  static constexpr int64_t kFewRows = kWidenInRegistersUpTo;
};

// A panel's 32 block minima from `s` where the form has them, else zeros.
template <typename Codes>
inline v16 minima(const typename Codes::Scale* s) {
  if constexpr (requires { Codes::kHasMin; }) {
    if constexpr (!Codes::kHasMin) return v16{};
  }
  return Codes::scales(s);
}

// Q4_K's nibbles with its scales as it keeps them: per panel and super-block of 8 blocks
// (256 rows of k), 192 words: d (32 float32, one a column), -dmin (32 float32), then each
// block's 6-bit sub-scales sc (8 x 32 bytes) and sub-minima m (8 x 32 bytes). A block's scale
// is d * sc and its minimum -dmin * m, formed as the kernel reads them (both products exact in
// float32, so the same numbers as NibbleFloatCodes'), in 0.09 bytes a weight instead of 0.25.
struct NibbleSuperCodes : NibbleCodesOf<float> {
  static constexpr int kSuper = 8;  // blocks per super-block
  static constexpr int64_t kSuperWords = 2 * NP + 2 * kSuper * NP / 4;
  static int64_t layers(ffi::Span<const int64_t> qd, int64_t k, int64_t n) {
    return k % (KB * kSuper) == 0 ? NibbleCodesOf<float>::layers(qd, k, n) : 0;
  }
  static int64_t scale_units(int64_t k, int64_t n) {  // floats of the scale plane a layer
    return n / NP * (k / (KB * kSuper)) * kSuperWords;
  }
  // 16 bytes as floats (GCC's generic conversion of a byte vector goes lane by lane).
  static v16 floats(const uint8_t* b) {
#if defined(__AVX512F__)
    return (v16)_mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b))));
#elif defined(__AVX2__)
    __m256 h[2];
    for (int i = 0; i < 2; ++i)
      h[i] = _mm256_cvtepi32_ps(
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8 * i))));
    return load<v16>(h);
#else
    v16 f;
    for (int i = 0; i < V; ++i) f[i] = b[i];
    return f;
#endif
  }
  // Block kb's scales and minima of panel p, the 16 columns of each half.
  static void block_scales(const float* plane, int64_t p, int64_t kb, int64_t blocks,
                           v16 (&s)[2], v16 (&m)[2]) {
    const float* at = plane + (p * (blocks / kSuper) + kb / kSuper) * kSuperWords;
    const uint8_t* sub = reinterpret_cast<const uint8_t*>(at + 2 * NP) + (kb % kSuper) * NP;
    for (int h = 0; h < 2; ++h) {
      s[h] = load<v16>(at + h * V) * floats(sub + h * V);
      m[h] = load<v16>(at + NP + h * V) * floats(sub + kSuper * NP + h * V);
    }
  }
};

// Block kb's scales and minima of panel p, the 16 columns of each half, from the planes.
template <typename Codes, typename S>
inline void block_scales(const S* scale, const S* min, int64_t p, int64_t kb, int64_t blocks,
                         int64_t n, v16 (&s)[2], v16 (&m)[2]) {
  if constexpr (requires { Codes::kSuper; }) {
    Codes::block_scales(scale, p, kb, blocks, s, m);
  } else {
    const int64_t at = Codes::scale_at(p, kb, blocks, n);
    s[0] = Codes::scales(scale + at), s[1] = Codes::scales(scale + at + V);
    m[0] = minima<Codes>(min + at), m[1] = minima<Codes>(min + at + V);
  }
}

// The scales (of type Codes::Scale) a layer's scale (and min) plane holds.
template <typename Codes>
inline int64_t scale_units(int64_t k, int64_t n) {
  if constexpr (requires { Codes::kSuper; }) {
    return Codes::scale_units(k, n);
  } else {
    return k / Codes::kBlock * n;
  }
}

using NibbleCodes = NibbleCodesOf<uint16_t>;
using NibbleFloatCodes = NibbleCodesOf<float>;
using PairCodes = PairCodesOf<KB>;
using PairHalfCodes = PairCodesOf<KB / 2>;
using SixCodes = SixCodesOf<KB>;
using SixHalfCodes = SixCodesOf<KB / 2>;

// x in the form the tiles read: per row r and block b, xq[r, k] int16, xs[r, b] and the float
// sum of the block's x, sx[r, b].
struct QuantizedRows {
  std::vector<int16_t> xq;
  std::vector<float> xs, sx;
};

// Each block of 32 values of a row of x as int16 codes, its scale and its sum (see the file
// comment). The largest magnitude and the sum reduce as a tree of halves, the same tree on
// every path: (lanes i and i + 8 of the two 16-lane halves' combination), then 4, 2, 1.
#if HALF_WIDTH
// Spelled out in 8-lane registers: GCC's code for the 16-lane form goes through the stack.
inline float reduce8(__m256 a, __m128 (*op)(__m128, __m128)) {
  const __m128 b = op(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = op(b, _mm_movehl_ps(b, b));                 // b0 . b2, b1 . b3
  return _mm_cvtss_f32(op(c, _mm_shuffle_ps(c, c, 1)));
}

// B: values per block, 32 or 16 (the 16-value blocks reduce their two registers directly).
template <int B>
void quantize_row(const float* x, int64_t k, int16_t* xq, float* xs, float* sx) {
  constexpr int R = B / 8;  // 8-lane registers per block
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < k / B; ++b) {
    __m256 v[R];  // values 0-7, 8-15 (, 16-23, 24-31)
    for (int i = 0; i < R; ++i) v[i] = _mm256_loadu_ps(x + b * B + 8 * i);
    __m256 mag, both;
    if constexpr (R == 4) {
      mag = _mm256_max_ps(
          _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[2])),
          _mm256_max_ps(_mm256_andnot_ps(sign, v[1]), _mm256_andnot_ps(sign, v[3])));
      both = _mm256_add_ps(_mm256_add_ps(v[0], v[2]), _mm256_add_ps(v[1], v[3]));
    } else {
      mag = _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1]));
      both = _mm256_add_ps(v[0], v[1]);
    }
    const float amax = reduce8(mag, _mm_max_ps);
    const float sum = reduce8(both, _mm_add_ps);
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? kQMax / amax : 0.f);
    __m256i c[R];
    for (int i = 0; i < R; ++i)
      c[i] = _mm256_cvttps_epi32(_mm256_round_ps(
          _mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    // packs interleaves the 128-bit halves of its operands; the permute puts them in order.
    for (int i = 0; i < R / 2; ++i)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * B + 16 * i),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2 * i], c[2 * i + 1]),
                                                   0xd8));
    xs[b] = amax / kQMax;
    sx[b] = sum;
  }
}
#else
// Each lane rounded to the nearest integer, ties to even. (An add-and-subtract trick would let
// the compiler fuse the product before it into an FMA and round differently.)
inline v16 round_even(v16 v) {
#if defined(__AVX512F__)
  return (v16)_mm512_roundscale_ps((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  for (int i = 0; i < V; ++i) v[i] = std::nearbyint(v[i]);
  return v;
#endif
}

template <typename Op>
inline float reduce(v16 v, Op op) {
  typedef float v8f __attribute__((vector_size(32)));
  typedef float v4f __attribute__((vector_size(16)));
  const v8f a = op(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
  const v4f b = op(__builtin_shufflevector(a, a, 0, 1, 2, 3),
                   __builtin_shufflevector(a, a, 4, 5, 6, 7));
  return op(op(b[0], b[2]), op(b[1], b[3]));
}

// B: values per block, 32 or 16 (a 16-value block is one vector, its `lo`).
template <int B>
void quantize_row(const float* x, int64_t k, int16_t* xq, float* xs, float* sx) {
  typedef int16_t h16 __attribute__((vector_size(32)));
  for (int64_t b = 0; b < k / B; ++b) {
    const v16 lo = load<v16>(x + b * B), hi = B == KB ? load<v16>(x + b * B + V) : v16{};
    const v16 alo = lo < v16{} ? -lo : lo, ahi = hi < v16{} ? -hi : hi;
    const float amax = reduce(alo > ahi ? alo : ahi, [](auto a, auto b) { return a > b ? a : b; });
    const float sum = B == KB ? reduce(lo + hi, [](auto a, auto b) { return a + b; })
                              : reduce(lo, [](auto a, auto b) { return a + b; });
    const float inv = amax > 0.f ? kQMax / amax : 0.f;
    store(xq + b * B, __builtin_convertvector(
        __builtin_convertvector(round_even(lo * inv), i16x), h16));
    if (B == KB)
      store(xq + b * B + V, __builtin_convertvector(
          __builtin_convertvector(round_even(hi * inv), i16x), h16));
    xs[b] = amax / kQMax;
    sx[b] = sum;
  }
}
#endif

// A row's sums c0, c1 (the panel's two halves of 16 columns) += one block's contribution, from
// its int32 sums a0, a1, the block's column scales and minima, and the row's x_scale and x_sum
// (see the file comment). Both ways call this, so they round alike.
// Its products and sums are spelled out as FMAs where the CPU has them (and the library is
// built with -ffp-contract=off), so no compiler pairs them differently in the two ways.
inline v16 fmadd(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
  return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return a * b + c;
#endif
}

inline void fold(v16& c0, v16& c1, i16x a0, i16x a1, v16 s0, v16 s1, v16 m0, v16 m1,
                 float x_scale, float x_sum) {
  const v16 xs = v16{} + x_scale, sx = v16{} + x_sum;
  c0 = fmadd(__builtin_convertvector(a0, v16), s0 * xs, c0);
  c1 = fmadd(__builtin_convertvector(a1, v16), s1 * xs, c1);
  c0 = fmadd(m0, sx, c0);
  c1 = fmadd(m1, sx, c1);
}

#if HALF_WIDTH
// A panel's 32 scales (or minima), given as its two halves, as 4 registers of 8 columns.
inline void quarters(v16 lo, v16 hi, __m256 out[4]) {
  std::memcpy(out, &lo, sizeof lo), std::memcpy(out + 2, &hi, sizeof hi);
}

// fold's arithmetic 8 columns at a time, for the AVX2 tiles and rows: their sums stay in
// half-width registers.
inline __m256 fold8(__m256 c, __m256i a, __m256 s, __m256 m, __m256 x_scale, __m256 x_sum) {
  c = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(s, x_scale), c);
  return _mm256_fmadd_ps(m, x_sum, c);
}
#endif

// c[R, NP] += the block's contribution for R rows of x (see the file comment), a block of P
// pairs of rows. xq rows are `ldx` apart, xs and sx rows `ldb`; w is widen's buffer; c is dense.
template <int R, int P>
void tile(const int16_t* xq, int64_t ldx, const float* xs, const float* sx, int64_t ldb,
          const int16_t* w, v16 s0, v16 s1, v16 m0, v16 m1, float* c) {
#if HALF_WIDTH
  // Half-width registers: the sums as 4 registers of 8 lanes a row (a0's halves, then a1's),
  // and the multiply reads the weights from the buffer, so 4 R sums stay in the 16 registers.
  __m256i a[R][4];
  for (int r = 0; r < R; ++r)
    for (auto& h : a[r]) h = _mm256_setzero_si256();
  for (int kp = 0; kp < P; ++kp) {
    const __m256i* wk = reinterpret_cast<const __m256i*>(w + kp * 2 * NP);
    for (int r = 0; r < R; ++r) {
      const __m256i pair = _mm256_set1_epi32(load<int32_t>(xq + r * ldx + 2 * kp));
      for (int h = 0; h < 4; ++h)
        a[r][h] = _mm256_add_epi32(a[r][h], _mm256_madd_epi16(_mm256_loadu_si256(wk + h), pair));
    }
  }
  __m256 sc[4], mn[4];
  quarters(s0, s1, sc), quarters(m0, m1, mn);
  for (int r = 0; r < R; ++r) {
    float* cr = c + r * NP;
    const __m256 x_scale = _mm256_set1_ps(xs[r * ldb]), x_sum = _mm256_set1_ps(sx[r * ldb]);
    for (int h = 0; h < 4; ++h)
      _mm256_storeu_ps(cr + 8 * h, fold8(_mm256_loadu_ps(cr + 8 * h), a[r][h], sc[h], mn[h],
                                         x_scale, x_sum));
  }
#else
  i16x a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = i16x{}, a1[r] = i16x{};
  for (int kp = 0; kp < P; ++kp) {
    const i16x w0 = load<i16x>(w + kp * 2 * NP), w1 = load<i16x>(w + kp * 2 * NP + NP);
    for (int r = 0; r < R; ++r) {
      const int32_t pair = load<int32_t>(xq + r * ldx + 2 * kp);
      a0[r] = dot_pairs(a0[r], w0, pair);
      a1[r] = dot_pairs(a1[r], w1, pair);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* cr = c + r * NP;
    v16 c0 = load<v16>(cr), c1 = load<v16>(cr + V);
    fold(c0, c1, a0[r], a1[r], s0, s1, m0, m1, xs[r * ldb], sx[r * ldb]);
    store(cr, c0), store(cr + V, c1);
  }
#endif
}

using TileFn = void (*)(const int16_t*, int64_t, const float*, const float*, int64_t,
                        const int16_t*, v16, v16, v16, v16, float*);

template <int P, int... R>
constexpr std::array<TileFn, sizeof...(R)> tile_fns(std::integer_sequence<int, R...>) {
  return {tile<R + 1, P>...};
}
template <int P>  // [r - 1]: r rows, blocks of P pairs of rows
constexpr auto kTiles = tile_fns<P>(std::make_integer_sequence<int, MR>{});

// A block's pairs of rows of codes, widened once into `out` for every tile of rows to read.
template <typename Codes>
void widen(const typename Codes::Code* q, int64_t n, int16_t* out) {
  for (int kp = 0; kp < Codes::kBlock / 2; ++kp) {
#if HALF_WIDTH  // in half-width registers: 16-lane vectors would go through the stack
    __m256i w[4];
    Codes::pair8(q, n, kp, w);
    for (int h = 0; h < 4; ++h)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + kp * 2 * NP) + h, w[h]);
#else
    i16x w0, w1;
    Codes::pair(q, n, kp, w0, w1);
    store(out + kp * 2 * NP, w0), store(out + kp * 2 * NP + NP, w1);
#endif
  }
}

template <typename Codes>
struct Problem {
  const int16_t* xq;  // the problem's first row of x, as QuantizedRows holds it
  const float *xs, *sx;
  const typename Codes::Code* q;
  const typename Codes::Scale* scale;
  const typename Codes::Scale* min;
  float* y;
  int64_t m, k, n;
};

// The rows way's reads run ahead of the stream in the forms that say so (kReadAhead): block
// kb's worth of codes kAhead bytes on. With several operations to widen each pair of rows
// (nibbles, six bits) a core keeps too few reads in flight on its own to reach the memory's
// bandwidth; the pair form's reads reach it unaided, and prefetching them costs.
constexpr int64_t kAhead = 4096;
template <typename Codes>
inline void ahead(const Problem<Codes>& pr, int64_t p, int64_t kb, int64_t blocks) {
  if constexpr (Codes::kReadAhead) {
    const char* at = reinterpret_cast<const char*>(Codes::codes(pr.q, p, kb, blocks, pr.n));
    const int64_t bytes =
        reinterpret_cast<const char*>(Codes::codes(pr.q, p, kb + 1, blocks, pr.n)) - at;
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(at + kAhead + o);
  }
}

// Rows r0 to r0 + R of y's panel p, the rows way (see the file comment).
template <typename Codes, int R>
void panel_rows(const Problem<Codes>& pr, int64_t p, int64_t r0) {
  constexpr int B = Codes::kBlock;
  const int64_t N = pr.n, K = pr.k, blocks = K / B;
  const int16_t* xq = pr.xq + r0 * K;
  const float *xs = pr.xs + r0 * blocks, *sx = pr.sx + r0 * blocks;
#if HALF_WIDTH
  // Half-width registers, as the tiles: 4 int32 sums and 4 float sums a row, 8 columns each.
  __m256 c[R][4];
  for (int r = 0; r < R; ++r)
    for (auto& h : c[r]) h = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const auto* q = Codes::codes(pr.q, p, kb, blocks, N);
    ahead<Codes>(pr, p, kb, blocks);
    __m256i a[R][4];
    for (int r = 0; r < R; ++r)
      for (auto& h : a[r]) h = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int kp = 0; kp < B / 2; ++kp) {
      __m256i w[4];
      Codes::pair8(q, N, kp, w);
      for (int r = 0; r < R; ++r) {
        const __m256i pair = _mm256_set1_epi32(load<int32_t>(xq + r * K + kb * B + 2 * kp));
        for (int h = 0; h < 4; ++h)
          a[r][h] = _mm256_add_epi32(a[r][h], _mm256_madd_epi16(w[h], pair));
      }
    }
    v16 s[2], m[2];
    block_scales<Codes>(pr.scale, pr.min, p, kb, blocks, N, s, m);
    __m256 sc[4], mn[4];
    quarters(s[0], s[1], sc);
    quarters(m[0], m[1], mn);
    for (int r = 0; r < R; ++r) {
      const __m256 x_scale = _mm256_set1_ps(xs[r * blocks + kb]);
      const __m256 x_sum = _mm256_set1_ps(sx[r * blocks + kb]);
      for (int h = 0; h < 4; ++h)
        c[r][h] = fold8(c[r][h], a[r][h], sc[h], mn[h], x_scale, x_sum);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 4; ++h) _mm256_storeu_ps(pr.y + (r0 + r) * N + p * NP + 8 * h, c[r][h]);
#else
  v16 c0[R], c1[R];
  for (int r = 0; r < R; ++r) c0[r] = v16{}, c1[r] = v16{};
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const auto* q = Codes::codes(pr.q, p, kb, blocks, N);
    ahead<Codes>(pr, p, kb, blocks);
    // At a row or two, each sum in two chains (pairs kp taken alternately), added at the end
    // (integers: the same sums): one chain would wait on each product's latency.
    constexpr int CH = R <= kChainsUpTo ? 2 : 1;
    i16x a0[R][CH], a1[R][CH];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < CH; ++c) a0[r][c] = i16x{}, a1[r][c] = i16x{};
#pragma GCC unroll 16
    for (int kp = 0; kp < B / 2; ++kp) {
      i16x w0, w1;
      Codes::pair(q, N, kp, w0, w1);
      for (int r = 0; r < R; ++r) {
        const int32_t pair = load<int32_t>(xq + r * K + kb * B + 2 * kp);
        a0[r][kp % CH] = dot_pairs(a0[r][kp % CH], w0, pair);
        a1[r][kp % CH] = dot_pairs(a1[r][kp % CH], w1, pair);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 1; c < CH; ++c) a0[r][0] += a0[r][c], a1[r][0] += a1[r][c];
    v16 s[2], m[2];
    block_scales<Codes>(pr.scale, pr.min, p, kb, blocks, N, s, m);
    for (int r = 0; r < R; ++r)
      fold(c0[r], c1[r], a0[r][0], a1[r][0], s[0], s[1], m[0], m[1], xs[r * blocks + kb],
           sx[r * blocks + kb]);
  }
  for (int r = 0; r < R; ++r) {
    store(pr.y + (r0 + r) * N + p * NP, c0[r]);
    store(pr.y + (r0 + r) * N + p * NP + V, c1[r]);
  }
#endif
}

template <typename Codes>
using RowsFn = void (*)(const Problem<Codes>&, int64_t, int64_t);

template <typename Codes, int... R>
constexpr std::array<RowsFn<Codes>, sizeof...(R)> rows_fns(std::integer_sequence<int, R...>) {
  return {panel_rows<Codes, R + 1>...};
}

template <typename Codes>
void panel(const Problem<Codes>& pr, int64_t p, std::vector<float>& acc,
           std::vector<int16_t>& w) {
  if (pr.m <= Codes::kFewRows) {
    static constexpr auto fns = rows_fns<Codes>(std::make_integer_sequence<int, DR>{});
    for (int64_t r = 0; r < pr.m; r += DR) fns[std::min<int64_t>(DR, pr.m - r) - 1](pr, p, r);
    return;
  }
  constexpr int B = Codes::kBlock;
  const int64_t n0 = p * NP, N = pr.n, blocks = pr.k / B;
  acc.assign(pr.m * NP, 0.f);
  w.resize(B * NP);
  for (int64_t kb = 0; kb < blocks; ++kb) {
    v16 s[2], m[2];
    block_scales<Codes>(pr.scale, pr.min, p, kb, blocks, N, s, m);
    widen<Codes>(Codes::codes(pr.q, p, kb, blocks, N), N, w.data());
    for (int64_t r = 0; r < pr.m; r += MR) {
      const int64_t rows = std::min<int64_t>(MR, pr.m - r);
      kTiles<B / 2>[rows - 1](pr.xq + r * pr.k + kb * B, pr.k,
                       pr.xs + r * blocks + kb, pr.sx + r * blocks + kb,
                       blocks, w.data(), s[0], s[1], m[0], m[1], acc.data() + r * NP);
    }
  }
  for (int64_t r = 0; r < pr.m; ++r)
    std::memcpy(pr.y + r * N + n0, acc.data() + r * NP, NP * sizeof(float));
}

// One weight of a group (see Matmul): its planes checked against x (M, K) and its y, and
// moved to layer `layer` of their stack.
template <typename Codes>
ffi::Error weigh(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets, size_t i,
                 ffi::Span<const int64_t> xd, int32_t layer, Problem<Codes>& pr) {
  auto q = args.get<ffi::Buffer<Codes::kCodeType>>(3 * i);
  auto scale = args.get<ffi::Buffer<Codes::kScaleType>>(3 * i + 1);
  auto min = args.get<ffi::Buffer<Codes::kScaleType>>(3 * i + 2);
  auto y = rets.get<ffi::Buffer<ffi::F32>>(i);
  if (!q) return q.error();
  if (!scale) return scale.error();
  if (!min) return min.error();
  if (!y) return y.error();
  const auto yd = (*y)->dimensions();
  const int64_t k = xd.size() == 2 ? xd[1] : 0, n = yd.size() == 2 ? yd[1] : 0;
  const int64_t stacked = k > 0 && k % Codes::kBlock == 0 && n > 0 && n % NP == 0 &&
                                  yd[0] == xd[0] ? Codes::layers(q->dimensions(), k, n) : 0;
  const int64_t scales = stacked ? scale_units<Codes>(k, n) : 0;  // per layer
  const int64_t held = Codes::kScalesPerElement;
  if (stacked == 0 || int64_t(scale->element_count()) * held != stacked * scales ||
      int64_t(min->element_count()) * held != stacked * scales)
    return ffi::Error::InvalidArgument(
        "block matmul: x must be (M, K) and each y (M, N), with K a multiple of the block (32; "
        "16 for the half-block pair form) and N of 32, its q L layers of (K, N) codes (the "
        "int8 form as (L K, N); the nibble or pair form in uint32 words, (L N / 32, K / 2, 8 "
        "or 16)), and its scale and min L layers of K / block x N");
  if (layer < 0 || layer >= stacked)
    return ffi::Error::InvalidArgument("block matmul: layer out of range");
  using Code = typename Codes::Code;
  using Scale = typename Codes::Scale;
  pr.q = reinterpret_cast<const Code*>(q->untyped_data()) + layer * Codes::per_layer(k, n);
  pr.scale = reinterpret_cast<const Scale*>(scale->untyped_data()) + layer * scales;
  pr.min = reinterpret_cast<const Scale*>(min->untyped_data()) + layer * scales;
  pr.y = (*y)->typed_data();
  pr.m = xd[0], pr.k = k, pr.n = n;
  return ffi::Error::Success();
}

// x's first m rows (of k values each) scaled to int16, in the calling thread's buffers.
// Rows are scaled on every thread: a 512-token prefill scales 512 rows per product.
// B: values per block of x (the weights' block).
template <int B>
const QuantizedRows& quantize_rows(ffi::ThreadPool& pool, const float* x, int64_t m, int64_t k) {
  const int64_t blocks = k / B;
  thread_local QuantizedRows rows;
  rows.xq.resize(m * k), rows.xs.resize(m * blocks), rows.sx.resize(m * blocks);
  // (The caller's thread_local rows, by pointer: a helper's own would be another.)
  int16_t* xq = rows.xq.data();
  float *xs = rows.xs.data(), *sx = rows.sx.data();
  jaxserve::parallel_for(pool, m, [x, xq, xs, sx, k, blocks](int64_t r) {
    quantize_row<B>(x + r * k, k, xq + r * k, xs + r * blocks, sx + r * blocks);
  });
  return rows;
}

// Every panel of every problem of `group`, shared out over the threads in one pass.
template <typename Codes>
void run_panels(ffi::ThreadPool& pool, const std::vector<Problem<Codes>>& group) {
  // Work item i is panel i - first[j] of problem j, for the last j with first[j] <= i.
  std::vector<int64_t> first(group.size() + 1, 0);
  for (size_t j = 0; j < group.size(); ++j) first[j + 1] = first[j] + group[j].n / NP;
  const Problem<Codes>* problems = group.data();
  const int64_t* starts = first.data();
  jaxserve::parallel_for(pool, first.back(), [problems, starts](int64_t i) {
    thread_local std::vector<float> acc;
    thread_local std::vector<int16_t> w;
    int64_t j = 0;
    while (starts[j + 1] <= i) ++j;
    panel(problems[j], i - starts[j], acc, w);
  });
}

// y_i = x @ w_i for a group of weights stored as `Codes` (the file comment has the layouts)
// that multiply the same x: args are the planes (codes, scale, min) of each w_i, rets the y_i.
// Each w_i is layer `layer` of the stack of layers its planes hold: the step reads a scanned
// model's weights in place instead of slicing (copying) each layer's out of its stack.
// A group (a layer's q, k and v, or its gate and up) scales x once and shares its panels out
// in one pass: at a few rows, where a product is short, separate calls would each scale x and
// wait for the helper threads. A second entry of `layer`, if any, is how many of x's rows
// to compute (a step's real sequences; the padding rows of y are zeros).
template <typename Codes>
ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x_buffer,
                  ffi::Buffer<ffi::S32> layer, ffi::RemainingArgs args,
                  ffi::RemainingRets rets) {
  if (rets.size() == 0 || args.size() != 3 * rets.size())
    return ffi::Error::InvalidArgument(
        "block matmul: the arguments are x, layer, then codes, scale and min of each weight, "
        "one y per weight");
  const auto xd = x_buffer.dimensions();
  std::vector<Problem<Codes>> group(rets.size());
  for (size_t i = 0; i < group.size(); ++i)
    if (auto e = weigh(args, rets, i, xd, layer.typed_data()[0], group[i]); e.failure())
      return e;
  const int64_t m = layer.element_count() > 1
                        ? std::clamp<int64_t>(layer.typed_data()[1], 0, xd[0]) : xd[0];
  const int64_t k = xd[1];
  for (auto& pr : group) {
    std::memset(pr.y + m * pr.n, 0, (pr.m - m) * pr.n * sizeof(float));
    pr.m = m;
  }
  if (m == 0) return ffi::Error::Success();
  const QuantizedRows& rows = quantize_rows<Codes::kBlock>(pool, x_buffer.typed_data(), m, k);
  for (auto& pr : group) pr.xq = rows.xq.data(), pr.xs = rows.xs.data(), pr.sx = rows.sx.data();
  run_panels(pool, group);
  return ffi::Error::Success();
}

// The experts of a mixture (models/moe.py): x's rows sorted by expert, the first sizes[0]
// rows going to expert 0, the next sizes[1] to expert 1, and so on; y_i's rows are those
// rows' products with expert e's weight of w_i (rows past the last group are zeros). Each w_i
// holds a stack of experts (several layers' of them, merged on axis 0); `first` (an int32
// scalar) is the stack entry of expert 0: a layer's E experts are entries first to first + E.
// All the experts' panels are shared out in one pass, a work item being one panel of one
// expert's rows.
template <typename Codes>
ffi::Error GroupedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x_buffer,
                         ffi::Buffer<ffi::S32> first, ffi::Buffer<ffi::S32> sizes,
                         ffi::RemainingArgs args, ffi::RemainingRets rets) {
  if (rets.size() == 0 || args.size() != 3 * rets.size())
    return ffi::Error::InvalidArgument(
        "grouped block matmul: the arguments are x, first, sizes, then codes, scale and min "
        "of each weight, one y per weight");
  const auto xd = x_buffer.dimensions();
  const int64_t experts = sizes.element_count(), base = first.typed_data()[0];
  std::vector<Problem<Codes>> whole(rets.size());
  for (size_t i = 0; i < whole.size(); ++i) {
    if (auto e = weigh(args, rets, i, xd, 0, whole[i]); e.failure()) return e;
    auto q = args.get<ffi::Buffer<Codes::kCodeType>>(3 * i);
    if (base < 0 || base + experts > Codes::layers(q->dimensions(), whole[i].k, whole[i].n))
      return ffi::Error::InvalidArgument("grouped block matmul: experts out of the stack");
  }
  int64_t m = 0;
  const int32_t* sz = sizes.typed_data();
  for (int64_t e = 0; e < experts; ++e) {
    if (sz[e] < 0) return ffi::Error::InvalidArgument("grouped block matmul: a negative size");
    m += sz[e];
  }
  m = std::min<int64_t>(m, xd[0]);
  for (auto& pr : whole) std::memset(pr.y + m * pr.n, 0, (pr.m - m) * pr.n * sizeof(float));
  if (m == 0) return ffi::Error::Success();
  const int64_t k = xd[1], blocks = k / Codes::kBlock;
  const QuantizedRows& rows = quantize_rows<Codes::kBlock>(pool, x_buffer.typed_data(), m, k);
  std::vector<Problem<Codes>> group;  // (weight, expert) pairs with rows
  for (const auto& w : whole) {
    const int64_t scales = scale_units<Codes>(k, w.n);
    for (int64_t e = 0, r0 = 0; e < experts && r0 < m; r0 += sz[e], ++e) {
      const int64_t r = std::min<int64_t>(sz[e], m - r0);
      if (r == 0) continue;
      Problem<Codes> pr = w;
      pr.q += (base + e) * Codes::per_layer(k, w.n);
      pr.scale += (base + e) * scales;
      pr.min += (base + e) * scales;
      pr.xq = rows.xq.data() + r0 * k, pr.xs = rows.xs.data() + r0 * blocks;
      pr.sx = rows.sx.data() + r0 * blocks;
      pr.y += r0 * w.n;
      pr.m = r;
      group.push_back(pr);
    }
  }
  run_panels(pool, group);
  return ffi::Error::Success();
}

// The handlers' arguments: x, the layer of the weights' stacks to read (an int32 scalar), then
// each weight's codes, scale and min (of the form's types); and one y per weight.
auto Binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()  // x
      .Arg<ffi::Buffer<ffi::S32>>()  // layer
      .RemainingArgs()  // (codes, scale, min) per weight
      .RemainingRets();  // y per weight
}

// The grouped handlers': x, the stack entry of expert 0, the experts' row counts, then as
// Binding's.
auto GroupedBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()  // x
      .Arg<ffi::Buffer<ffi::S32>>()  // first
      .Arg<ffi::Buffer<ffi::S32>>()  // sizes
      .RemainingArgs()
      .RemainingRets();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockMatmul, Matmul<Int8Codes>, Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockMatmulQ4, Matmul<NibbleCodes>, Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockMatmulQ4F, Matmul<NibbleFloatCodes>, Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockMatmulQ8, Matmul<PairCodes>, Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockMatmulQ8H, Matmul<PairHalfCodes>, Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockMatmulQ4K, Matmul<NibbleSuperCodes>, Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockMatmulQ6, Matmul<SixCodes>, Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockMatmulQ6H, Matmul<SixHalfCodes>, Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedBlockMatmul, GroupedMatmul<Int8Codes>, GroupedBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedBlockMatmulQ4, GroupedMatmul<NibbleCodes>, GroupedBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedBlockMatmulQ4F, GroupedMatmul<NibbleFloatCodes>,
                              GroupedBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedBlockMatmulQ8, GroupedMatmul<PairCodes>, GroupedBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedBlockMatmulQ8H, GroupedMatmul<PairHalfCodes>,
                              GroupedBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedBlockMatmulQ6, GroupedMatmul<SixCodes>, GroupedBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedBlockMatmulQ6H, GroupedMatmul<SixHalfCodes>,
                              GroupedBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedBlockMatmulQ4K, GroupedMatmul<NibbleSuperCodes>,
                              GroupedBinding());
