// Ragged paged attention for CPUs, called from a jitted step through XLA's FFI.
//
// The jnp backends gather every row's K/V out of the pool into a dense array, transpose it for
// the dots and read it again: on a CPU that traffic, not the arithmetic, is the cost of
// attention. Here each work item (a query tile: up to `block_q` consecutive rows of one
// sequence; a decode is a tile of one row) walks its sequence's blocks in place, reads each
// key and value row once for all of its rows and query heads, and stops at the tile's last
// position, so neither the block bucket's padding nor a copy of the context costs anything.
// Tiles are shared out between threads by parallel_for (parallel.h).
//
// Shapes (the axis legend of the Python side):
//   q            (T, N, H) float32     N = K * G query heads
//   k/v pool     (L, P, B, K, H) float32, float16, bfloat16, float8_e4m3fn or float8_e5m2
//                                    (widened to float32 as they load; the arithmetic is
//                                    float32 either way; an fp8 pool's scales are folded into
//                                    `scale` and the output by the Python side)
//   layer        () int32              the layer whose pages are read
//   block_tables (S, MB) int32
//   positions    (T,) int32            a row sees keys 0..position of its sequence
//   window       (1,) int32            ... and of those only the newest `window` (a sliding-
//                                      window layer; a window past every position: all)
//   query_start  (S + 1,) int32        sequence s owns rows [query_start[s], query_start[s+1])
//   out          (T, N, H) float32     rows no sequence owns (padding) are zero
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
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

// Eight floats: AVX registers where the compiler has them, pairs of SSE (or NEON, or scalars)
// elsewhere. Head dims are whole numbers of these (the Python side checks).
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
constexpr int W = 8;

inline v8 load(const float* p) {
  v8 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
inline void store(float* p, v8 x) { std::memcpy(p, &x, sizeof x); }
inline v8 splat(float a) { return v8{a, a, a, a, a, a, a, a}; }
// a * b + c, rounded once where the CPU has FMA. Spelled out, not left to the compiler's
// contraction, which may pair a pool type's loads with different adds: a float16 pool must give
// the numbers of a float32 pool holding the same values.
inline v8 fma8(v8 a, v8 b, v8 c) {
#if defined(__FMA__)
  return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}
inline float hsum(v8 x) {
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

// exp(x) for x <= 0 (scores minus their maximum), to ~2 ulp: Cody-Waite reduction by ln 2 and
// a degree-6 polynomial (the Cephes coefficients); below -87 it flushes to ~1e-38.
inline v8 exp_nonpositive(v8 x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  const v8 round = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  v8 k = (x * splat(1.44269504088896341f) + round) - round;
  v8 r = x - k * splat(0.693359375f) + k * splat(2.12194440e-4f);
  v8 p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  v8i bits = (__builtin_convertvector(k, v8i) + 127) << 23;
  v8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// How the pool's rows are stored: float32, or the bits of float16, bfloat16 or an 8-bit float. A
// page row is read eight values at a time, as floats; a narrower pool streams fewer bytes.
// Eight half-precision values widened one at a time, where the CPU lacks the vector form.
template <float (*Widen)(uint16_t)>
inline v8 widen_each(const uint16_t* p) {
  v8 x;
  for (int i = 0; i < W; ++i) x[i] = Widen(p[i]);
  return x;
}

struct F32Pages {
  using T = float;
  static v8 load8(const float* p) { return load(p); }
};
struct F16Pages {
  using T = uint16_t;
  static v8 load8(const uint16_t* p) {
#if defined(__F16C__)
    return (v8)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    return widen_each<jaxserve::half_to_float>(p);
#endif
  }
};
struct BF16Pages {
  using T = uint16_t;
  static v8 load8(const uint16_t* p) {
#if defined(__AVX2__)
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return (v8)_mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
#else
    return widen_each<jaxserve::bfloat16_to_float>(p);
#endif
  }
};

// 8-bit float pools: each byte's value looked up in a table of all 256, eight at a time.
template <float (*Widen)(uint8_t)>
const std::array<float, 256> kFp8Values = [] {
  std::array<float, 256> t;
  for (int i = 0; i < 256; ++i) t[i] = Widen(static_cast<uint8_t>(i));
  return t;
}();

template <float (*Widen)(uint8_t)>
struct Fp8Pages {
  using T = uint8_t;
  static v8 load8(const uint8_t* p) {
    const float* values = kFp8Values<Widen>.data();
#if defined(__AVX2__)
    const __m256i i = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return (v8)_mm256_i32gather_ps(values, i, 4);
#else
    v8 x;
    for (int i = 0; i < W; ++i) x[i] = values[p[i]];
    return x;
#endif
  }
};
using E4M3Pages = Fp8Pages<jaxserve::e4m3fn_to_float>;
using E5M2Pages = Fp8Pages<jaxserve::e5m2_to_float>;

struct Problem {
  const float* q;
  const void* k_pages;  // the layer's (P, B, K, H), of the pool's element type
  const void* v_pages;
  const int32_t* tables;
  const int32_t* positions;
  float* out;
  int64_t n, kv_heads, groups, pages, block, max_blocks, window;
  float scale;
};

struct Tile {
  int64_t seq, row0, rows;
};

// Scratch reused across calls by each thread: scaled queries, scores (then probabilities),
// output accumulators and softmax normalizers of every (kv head, row, group head).
struct Scratch {
  std::vector<float> p, acc, q, norm;
};

// Two vectors' lanes picked by index (0-7 the first's, 8-15 the second's).
#if defined(__clang__) || __GNUC__ >= 12
#define PICK(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PICK(a, b, ...) __builtin_shuffle(a, b, v8i{__VA_ARGS__})
#endif

// Lane j of the result is the sum of x[j]'s lanes: eight horizontal sums in 7 steps of two
// shuffles and an add, where one at a time would take 8 of about 5 steps each.
inline v8 sum_lanes(const v8 (&x)[W]) {
  v8 pair[4], quad[2];
  for (int i = 0; i < 4; ++i)  // [a0+a1, b0+b1, a2+a3, b2+b3, ...] of a = x[2i], b = x[2i+1]
    pair[i] = PICK(x[2 * i], x[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
              PICK(x[2 * i], x[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  for (int i = 0; i < 2; ++i)  // [a0-3, b0-3, c0-3, d0-3, a4-7, b4-7, c4-7, d4-7]
    quad[i] = PICK(pair[2 * i], pair[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
              PICK(pair[2 * i], pair[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return PICK(quad[0], quad[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         PICK(quad[0], quad[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// Walks key rows of a sequence's pages (its keys or values, all kv heads: K * H contiguous
// values per key) in order, one page lookup per page rather than a division per key.
template <typename T>
class KeyRows {
 public:
  KeyRows(const Problem& pr, const void* pages, const int32_t* table, int64_t c,
          int64_t row_floats)
      : pr_(pr), pages_(static_cast<const T*>(pages)), table_(table), row_floats_(row_floats),
        index_(c / pr.block), offset_(c % pr.block) {
    row_ = page_start() + offset_ * row_floats_;
  }
  const T* row() const { return row_; }
  void next() {
    if (++offset_ < pr_.block) {
      row_ += row_floats_;
    } else {
      offset_ = 0;
      index_ = std::min(index_ + 1, pr_.max_blocks - 1);  // never past the table's row
      row_ = page_start();
    }
  }

 private:
  const T* page_start() const {
    const int64_t page = std::clamp<int64_t>(table_[index_], 0, pr_.pages - 1);
    return pages_ + page * pr_.block * row_floats_;
  }
  const Problem& pr_;
  const T* pages_;
  const int32_t* table_;
  int64_t row_floats_, index_, offset_;
  const T* row_;
};

// Probabilities times values of keys [c0, c1) for U units of one kv head that share a row (so
// its keys): their U * HV output vectors stay in registers while each value row is read once.
template <typename Pages, int HV, int U>
void weigh_values(const Problem& pr, const int32_t* table, int64_t kh, int64_t c0, int64_t c1,
                  const float* const* probs, float* const* acc) {
  using T = typename Pages::T;
  constexpr int64_t H = HV * W;
  const int64_t row_floats = pr.kv_heads * H;
  v8 a[U][HV];
  for (int k = 0; k < U; ++k)
    for (int i = 0; i < HV; ++i) a[k][i] = load(acc[k] + i * W);
  KeyRows<T> rows(pr, pr.v_pages, table, c0, row_floats);
  for (int64_t c = c0; c < c1; ++c, rows.next()) {
    const T* vr = rows.row() + kh * H;
    for (int i = 0; i < HV; ++i) {
      const v8 vv = Pages::load8(vr + i * W);
      for (int k = 0; k < U; ++k) a[k][i] = fma8(splat(probs[k][c]), vv, a[k][i]);
    }
  }
  for (int k = 0; k < U; ++k)
    for (int i = 0; i < HV; ++i) store(acc[k] + i * W, a[k][i]);
}

// Units of one row weighed together: as many as leave room in the registers for the loads.
template <int HV>
constexpr int kUnits = std::clamp(24 / HV, 1, 4);

template <typename Pages, int HV, int U = kUnits<HV>>
void weigh_values_n(int count, const Problem& pr, const int32_t* table, int64_t kh, int64_t c0,
                    int64_t c1, const float* const* probs, float* const* acc) {
  if constexpr (U > 1)
    if (count < U)
      return weigh_values_n<Pages, HV, U - 1>(count, pr, table, kh, c0, c1, probs, acc);
  weigh_values<Pages, HV, U>(pr, table, kh, c0, c1, probs, acc);
}

// Keys a tile takes at a time in its value pass: all kv heads' value rows of so many keys (24 KB
// of float32 at K * H = 192) stay in L1 while every head and row of the tile reads them.
constexpr int64_t kKeyChunk = 32;

template <typename Pages, int HV>  // head dim = HV * 8
void attend_tile(const Problem& pr, const Tile& tile, Scratch& sc) {
  using T = typename Pages::T;
  constexpr int64_t H = HV * W;
  const int64_t G = pr.groups, K = pr.kv_heads, B = pr.block;
  const int64_t rows = tile.rows, rg = rows * G;
  const int32_t* table = pr.tables + tile.seq * pr.max_blocks;
  const int64_t cap = pr.max_blocks * B;
  // Keys each row sees, [first, seen) (positions rise through a tile; clamped to the table's
  // reach). The tile reads from its first row's first key, rounded down to a whole vector.
  int64_t seen[64], first[64];
  int64_t n_keys = 1;
  for (int64_t r = 0; r < rows; ++r) {
    seen[r] = std::clamp<int64_t>(int64_t{pr.positions[tile.row0 + r]} + 1, 1, cap);
    first[r] = std::max<int64_t>(seen[r] - pr.window, 0);
    n_keys = std::max(n_keys, seen[r]);
  }
  const int64_t begin = first[0] / W * W;
  const int64_t stride = (n_keys + W - 1) / W * W;  // a row of scores, padded to whole vectors
  const int64_t row_floats = K * H;  // one token's keys (or values), all kv heads
  // Every buffer is laid out (kv head, row, head of the group, ...): u = (kh * rows + r) * G + g.
  const int64_t units = K * rg;
  sc.p.resize(units * stride);
  sc.acc.assign(units * H, 0.f);
  sc.q.resize(units * H);
  sc.norm.resize(units);
  for (int64_t kh = 0; kh < K; ++kh)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const float* src = pr.q + ((tile.row0 + r) * pr.n + kh * G + g) * H;
        float* dst = sc.q.data() + ((kh * rows + r) * G + g) * H;
        for (int64_t h = 0; h < H; ++h) dst[h] = src[h] * pr.scale;
      }
  // Scores, eight keys at a time, in the order they lie in the pages (memory, not arithmetic,
  // bounds a long context): their key rows stay in L1 for every head and row of the tile, and
  // each key's dot product is left as eight partial sums, added up for all eight at once.
  // Keys past the last (to a whole vector) repeat it; the softmax masks them.
  KeyRows<T> keys(pr, pr.k_pages, table, begin, row_floats);
  for (int64_t c0 = begin; c0 < n_keys; c0 += W) {
    const T* chunk[W];
    for (int j = 0; j < W; ++j) {
      chunk[j] = keys.row();
      if (c0 + j + 1 < n_keys) keys.next();
    }
    for (int64_t kh = 0; kh < K; ++kh) {
      const T* kr[W];
      for (int j = 0; j < W; ++j) kr[j] = chunk[j] + kh * H;
      for (int64_t r = 0; r < rows; ++r) {
        if (c0 >= seen[r] || c0 + W <= first[r]) continue;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t u = (kh * rows + r) * G + g;
          v8 qv[HV];
          for (int i = 0; i < HV; ++i) qv[i] = load(sc.q.data() + u * H + i * W);
          v8 part[W];
          for (int j = 0; j < W; ++j) {
            part[j] = qv[0] * Pages::load8(kr[j]);
            for (int i = 1; i < HV; ++i)
              part[j] = fma8(qv[i], Pages::load8(kr[j] + i * W), part[j]);
          }
          store(sc.p.data() + u * stride + c0, sum_lanes(part));
        }
      }
    }
  }
  // Softmax over each row's own keys. The rest of its scores (the keys only the tile's later
  // rows see, those that left its window, and the padding to whole vectors) become exact
  // zeros before the sum, so adding them changes nothing: a row sums alike whatever the other
  // rows of its tile reach.
  const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
  for (int64_t u = 0; u < units; ++u) {
    float* s = sc.p.data() + u * stride;
    const int64_t n = seen[(u / G) % rows], f = first[(u / G) % rows];
    for (int64_t c = begin; c < f; ++c) s[c] = -1e30f;
    for (int64_t c = n; c < stride; ++c) s[c] = -1e30f;
    v8 m8 = splat(-1e30f);
    for (int64_t c = begin; c < stride; c += W) {
      v8 x = load(s + c);
      m8 = x > m8 ? x : m8;
    }
    float m = m8[0];
    for (int i = 1; i < W; ++i) m = std::max(m, m8[i]);
    v8 sum = splat(0.f);
    for (int64_t c = begin; c < stride; c += W) {
      v8 e = exp_nonpositive(load(s + c) - splat(m));
      const v8i at = lane + static_cast<int32_t>(c);
      const v8i own = (at < static_cast<int32_t>(n)) & (at >= static_cast<int32_t>(f));
      e = (v8)(own & (v8i)e);
      store(s + c, e);
      sum += e;
    }
    sc.norm[u] = hsum(sum);
  }
  // Probabilities times values, kKeyChunk keys at a time, a row's group heads a few at a time
  // (weigh_values).
  constexpr int U = kUnits<HV>;
  for (int64_t c0 = begin; c0 < n_keys; c0 += kKeyChunk)
    for (int64_t kh = 0; kh < K; ++kh)
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t lo = std::max(c0, first[r]), c1 = std::min(c0 + kKeyChunk, seen[r]);
        if (c1 <= lo) continue;
        for (int64_t g0 = 0; g0 < G; g0 += U) {
          const int count = static_cast<int>(std::min<int64_t>(U, G - g0));
          const float* probs[U];
          float* acc[U];
          for (int k = 0; k < count; ++k) {
            const int64_t u = (kh * rows + r) * G + g0 + k;
            probs[k] = sc.p.data() + u * stride;
            acc[k] = sc.acc.data() + u * H;
          }
          weigh_values_n<Pages, HV>(count, pr, table, kh, lo, c1, probs, acc);
        }
      }
  for (int64_t kh = 0; kh < K; ++kh)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t u = (kh * rows + r) * G + g;
        const float inv = 1.0f / sc.norm[u];
        const float* a = sc.acc.data() + u * H;
        float* o = pr.out + ((tile.row0 + r) * pr.n + kh * G + g) * H;
        for (int64_t h = 0; h < H; ++h) o[h] = a[h] * inv;
      }
}

using TileFn = void (*)(const Problem&, const Tile&, Scratch&);

// The head dims compiled, in vectors of 8: 8, 16, 32, 48, 64, 80, 96, 128, 160, 192, 256.
using HeadVectors = std::integer_sequence<int, 1, 2, 4, 6, 8, 10, 12, 16, 20, 24, 32>;

template <typename Pages, int... HV>
TileFn tile_fn(int64_t head_dim, std::integer_sequence<int, HV...>) {
  TileFn fn = nullptr;
  ((fn = head_dim == HV * W ? attend_tile<Pages, HV> : fn), ...);
  return fn;
}

// The tile function for this pool's element type and head dim, or nullptr.
TileFn tile_fn(ffi::DataType pages, int64_t head_dim) {
  switch (pages) {
    case ffi::DataType::F32: return tile_fn<F32Pages>(head_dim, HeadVectors{});
    case ffi::DataType::F16: return tile_fn<F16Pages>(head_dim, HeadVectors{});
    case ffi::DataType::BF16: return tile_fn<BF16Pages>(head_dim, HeadVectors{});
    case ffi::DataType::F8E4M3FN: return tile_fn<E4M3Pages>(head_dim, HeadVectors{});
    case ffi::DataType::F8E5M2: return tile_fn<E5M2Pages>(head_dim, HeadVectors{});
    default: return nullptr;
  }
}

ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pool,
                     ffi::AnyBuffer v_pool,
                     ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> block_tables,
                     ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> query_start,
                     ffi::Buffer<ffi::S32> window, ffi::ResultBuffer<ffi::F32> out, float scale,
                     int64_t block_q) {
  const auto qd = q.dimensions();
  const auto pd = k_pool.dimensions();
  if (qd.size() != 3 || pd.size() != 5 || block_tables.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("paged attention: q must be (T, N, H), the pools "
                                       "(L, P, B, K, H) and block_tables (S, MB)");
  const int64_t t = qd[0], n = qd[1], h = qd[2];
  const int64_t num_layers = pd[0], kv_heads = pd[3];
  const int64_t s = block_tables.dimensions()[0];
  const TileFn fn = tile_fn(k_pool.element_type(), h);
  if (fn == nullptr || num_layers < 1 || v_pool.element_type() != k_pool.element_type() ||
      v_pool.dimensions().size() != 5 || !std::equal(pd.begin(), pd.end(),
                                                     v_pool.dimensions().begin()) ||
      pd[4] != h || n % kv_heads != 0 || n / kv_heads > 16 || block_q < 1 ||
      block_q > 64 || query_start.element_count() != s + 1 || window.element_count() != 1 ||
      window.typed_data()[0] < 1)
    return ffi::Error::InvalidArgument(
        "paged attention: unsupported shapes or pool types (k and v pools alike, float32, "
        "float16, bfloat16, float8_e4m3fn or float8_e5m2)");
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, num_layers - 1);
  const int64_t layer_bytes = k_pool.size_bytes() / num_layers;
  Problem pr{q.typed_data(), static_cast<const char*>(k_pool.untyped_data()) + l * layer_bytes,
             static_cast<const char*>(v_pool.untyped_data()) + l * layer_bytes,
             block_tables.typed_data(),
             positions.typed_data(), out->typed_data(), n, kv_heads, n / kv_heads,
             pd[1], pd[2], block_tables.dimensions()[1], window.typed_data()[0], scale};

  // Padding rows (past the last sequence's) come out as zeros.
  const int32_t* qsl = query_start.typed_data();
  const int64_t used = std::clamp<int64_t>(qsl[s], 0, t);
  std::memset(pr.out + used * n * h, 0, (t - used) * n * h * sizeof(float));
  auto tiles = std::make_shared<std::vector<Tile>>();
  for (int64_t i = 0; i < s; ++i) {
    const int64_t lo = std::clamp<int64_t>(qsl[i], 0, t);
    const int64_t hi = std::clamp<int64_t>(qsl[i + 1], lo, t);
    for (int64_t r = lo; r < hi; r += block_q) tiles->push_back({i, r, std::min(block_q, hi - r)});
  }
  jaxserve::parallel_for(pool, static_cast<int64_t>(tiles->size()), [pr, fn, tiles](int64_t i) {
    thread_local Scratch scratch;
    fn(pr, (*tiles)[i], scratch);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RaggedPagedAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k_pool
                                  .Arg<ffi::AnyBuffer>()  // v_pool
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("block_q"));

// The head dims this build handles, for the Python side to check before it calls: writes up to
// `capacity` of them and returns how many there are.
extern "C" int64_t RaggedPagedAttentionHeadDims(int64_t* out, int64_t capacity) {
  int64_t count = 0;
  auto put = [&](int64_t h) { if (count < capacity) out[count] = h; ++count; };
  [&]<int... HV>(std::integer_sequence<int, HV...>) { (put(HV * W), ...); }(HeadVectors{});
  return count;
}
