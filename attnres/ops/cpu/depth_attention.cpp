// CPU fast path of the depth-attention operator (math and contract: attnres/ops/depth_attention.py) and of phase 1
// of the two-phase computation (attnres/ops/two_phase.py).
//
// The operator is memory-bound: its floor is one read of its sources. So each kernel reads every source row from
// memory once, one token (or one tile of tokens) at a time, and does the rest of its work while those rows sit in L2:
//  - forward: score a tile of tokens' rows (dot with c and sum of squares, each token's R rows read side by side),
//    softmax them as vectors across the tile, then mix each token's rows in one fused pass that keeps a block of the
//    output in registers while the R rows stream past. When the rows of a token do not fit in L2 they are taken in
//    groups merged by an online softmax (running max, rescaled partial sum);
//  - backward: (with the output norm: mix again, for its gradient), dot each row with c and dm, then write every
//    source gradient in one pass that accumulates dc from the same loads. Tokens whose rows fit are taken in tiles,
//    with the softmax backward as vectors across the tile (dots token by token, gradients source by source); longer
//    rows a token at a time;
//  - phase 1 (forward and backward): the same two passes with S queries at once, so each source row is read from
//    memory once for all of them; the second pass goes through d in L1-sized chunks, each chunk of the rows
//    serving every query;
//  - the fused inference ops of attnres/ops/bank.py (bank_aggregate, bank_merge): one call per aggregation point that
//    does the pending residual add and the bank write in place and mixes through the forward's per-token code.
// Reductions are in fp32 (fp64 for fp64 sources). Tokens are split across threads by at::parallel_for; scratch
// memory is a few d-long rows per thread. Sources are read in place through a row stride (any leading dims that
// flatten, unit stride along d), so views like the bank rows `bank[:, j]` of an [N, NB, d] bank are not copied.
// SIMD is written with GCC/Clang vector extensions at the machine's width (the library is compiled with
// -march=native), with x86 intrinsics where they beat the generic bf16 and fp16 conversions. Large outputs ask for
// transparent huge pages (see new_output).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int64_t kVecBytes = 64;
#elif defined(__AVX__)
constexpr int64_t kVecBytes = 32;
#else
constexpr int64_t kVecBytes = 16;
#endif

template <class T, int64_t N>
struct VecOf {
  typedef T type __attribute__((vector_size(N * sizeof(T))));
  typedef T unaligned __attribute__((vector_size(N * sizeof(T)), aligned(alignof(T))));  // for loads and stores
};
template <class A>
constexpr int64_t kWidth = kVecBytes / sizeof(A);  // lanes of one register
template <class A>
using Vec = typename VecOf<A, kWidth<A>>::type;
constexpr int64_t kUnroll = 4;  // registers per block: independent sums, or a block of a row held across rows

template <class V, class T>
inline V load_bits(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class V, class T>
inline void store_bits(T* p, V v) {
  std::memcpy(p, &v, sizeof v);
}

// Storage formats: `raw` is what memory holds, `acc` the accumulation type; load/store convert one element,
// vload/vstore one register of kWidth<acc> elements.
template <class T>
struct Plain {
  using raw = T;
  using acc = T;
  static T load(T v) { return v; }
  static T store(T v) { return v; }
  // typed by the element rather than through memcpy, which may alias anything: after a memcpy store the compiler
  // reloads every pointer, weight and bound of the loop from memory
  using Unaligned = typename VecOf<T, kWidth<T>>::unaligned;
  static Vec<T> vload(const T* p) { return *reinterpret_cast<const Unaligned*>(p); }
  static void vstore(T* p, Vec<T> v) { *reinterpret_cast<Unaligned*>(p) = v; }
};
using F32 = Plain<float>;
using F64 = Plain<double>;

struct BF16 {
  using raw = uint16_t;
  using acc = float;
  using Bits16 = VecOf<uint16_t, kWidth<float>>::type;
  using Bits32 = VecOf<uint32_t, kWidth<float>>::type;
  static float load(uint16_t v) { return std::bit_cast<float>(uint32_t(v) << 16); }
  static uint16_t store(float v) {  // round to nearest even, NaN to the canonical quiet NaN (as c10::BFloat16)
    uint32_t u = std::bit_cast<uint32_t>(v);
    return v != v ? uint16_t(0x7FC0) : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
#if defined(__AVX512F__)
  static Vec<float> vload(const uint16_t* p) {
    return Vec<float>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load_bits<__m256i>(p)), 16));
  }
#elif defined(__AVX2__)  // one widening load and a shift (the generic form compiles to twice the instructions)
  static Vec<float> vload(const uint16_t* p) {
    return Vec<float>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load_bits<__m128i>(p)), 16));
  }
#else
  static Vec<float> vload(const uint16_t* p) {
    return reinterpret_cast<Vec<float>>(__builtin_convertvector(load_bits<Bits16>(p), Bits32) << 16);
  }
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  // one instruction rounds to nearest even (the bit operations below take about six), NaN made canonical after it;
  // it reads subnormal inputs as zero, as every kernel's thread does anyway (FlushSubnormals)
  static void vstore(uint16_t* p, Vec<float> v) {
    const __m512 f = __m512(v);
    __m256i b = (__m256i)_mm512_cvtneps_pbh(f);
    b = _mm256_mask_mov_epi16(b, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm256_set1_epi16(0x7FC0));
    store_bits(p, b);
  }
#else
  static void vstore(uint16_t* p, Vec<float> v) {
    Bits32 u = reinterpret_cast<Bits32>(v);
    Bits32 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    store_bits(p, __builtin_convertvector(v != v ? Bits32{} + 0x7FC0u : rounded, Bits16));
  }
#endif
};

struct F16 {
  using raw = uint16_t;
  using acc = float;
#ifdef __FLT16_MANT_DIG__
  static float load(uint16_t v) { return float(std::bit_cast<_Float16>(v)); }
  static uint16_t store(float v) { return std::bit_cast<uint16_t>(_Float16(v)); }
#else
  static float load(uint16_t v) { return float(c10::Half(v, c10::Half::from_bits())); }
  static uint16_t store(float v) { return c10::Half(v).x; }
#endif
#if defined(__F16C__) && defined(__AVX512F__)
  static Vec<float> vload(const uint16_t* p) { return Vec<float>(_mm512_cvtph_ps(load_bits<__m256i>(p))); }
  static void vstore(uint16_t* p, Vec<float> v) {
    store_bits(p, _mm512_cvtps_ph(__m512(v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#elif defined(__F16C__) && defined(__AVX__)
  static Vec<float> vload(const uint16_t* p) { return Vec<float>(_mm256_cvtph_ps(load_bits<__m128i>(p))); }
  static void vstore(uint16_t* p, Vec<float> v) {
    store_bits(p, _mm256_cvtps_ph(__m256(v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#else
  static Vec<float> vload(const uint16_t* p) {
    Vec<float> v;
    for (int64_t k = 0; k < kWidth<float>; ++k) v[k] = load(p[k]);
    return v;
  }
  static void vstore(uint16_t* p, Vec<float> v) {
    for (int64_t k = 0; k < kWidth<float>; ++k) p[k] = store(v[k]);
  }
#endif
};

template <class A>
inline Vec<A> splat(A a) {
  return Vec<A>{} + a;
}

// The sum of a register's lanes by halving (log2 of the width in adds, not a chain of one add per lane). The halves
// are shuffles where the compiler has __builtin_shufflevector (GCC 12, Clang): a copy through memory, as GCC 11 takes
// them, takes the register's address, and GCC then keeps a whole tile of sums on the stack (dot_tiles' 4 x 1 tiles,
// 3-4x slower; lane-by-lane copies measured 1.1-1.3x slower than shuffles).
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define ATTNRES_SHUFFLE_HALVES 1
#endif
#endif
template <class V, int64_t N>
inline auto fold_halves(V v) {
  if constexpr (N == 2) {
    return v[0] + v[1];
  } else {
#ifdef ATTNRES_SHUFFLE_HALVES
    return [&]<size_t... I>(std::index_sequence<I...>) {
      return fold_halves<decltype(__builtin_shufflevector(v, v, I...)), N / 2>(
          __builtin_shufflevector(v, v, I...) + __builtin_shufflevector(v, v, (I + N / 2)...));
    }(std::make_index_sequence<N / 2>{});
#else
    using Half = typename VecOf<std::remove_cvref_t<decltype(v[0])>, N / 2>::type;
    Half lo, hi;
    std::memcpy(&lo, &v, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
    return fold_halves<Half, N / 2>(lo + hi);
#endif
  }
}
template <class A>
inline A hsum(Vec<A> v) {
  return fold_halves<Vec<A>, kWidth<A>>(v);
}

// `sum_lanes` shuffles with masks built at run time, which only GCC's __builtin_shuffle takes; other compilers keep
// one hsum per register.
#if defined(__GNUC__) && !defined(__clang__)
#define ATTNRES_FOLD_LANES 1
#endif

#ifdef ATTNRES_FOLD_LANES
// The masks of `sum_lanes`: at level l, lane blocks of b = W / 2^(l+1) lanes; the result's block 2k is the first
// (lo) or second (hi) half of the pair's first register's 2b-lane block k, block 2k + 1 that of its second register.
template <class A>
struct FoldMasks {
  using Lanes = typename VecOf<std::conditional_t<sizeof(A) == 4, int32_t, int64_t>, kWidth<A>>::type;
  static constexpr int64_t W = kWidth<A>, levels = std::bit_width(uint64_t(W)) - 1;
  Lanes lo[levels], hi[levels];
  int64_t order[W];  // order[k]: k's log2(W) bits reversed, the register that feeds slot k
  FoldMasks() {
    for (int64_t l = 0, b = W / 2; l < levels; ++l, b /= 2)
      for (int64_t t = 0; t < W; ++t) {
        const int64_t block = t / b, in = (block % 2) * W + 2 * b * (block / 2) + t % b;
        lo[l][t] = in, hi[l][t] = in + b;
      }
    for (int64_t k = 0; k < W; ++k) {
      order[k] = 0;
      for (int64_t w = W, r = k; w > 1; w /= 2, r /= 2) order[k] = 2 * order[k] + r % 2;
    }
  }
};

// out[k] = the sum of v[k]'s lanes for n registers, W (the lane count) at a time. Each level folds pairs of registers
// into one whose lane blocks hold the two halves of the pair's blocks added: W registers take W - 1 adds where one
// at a time (`hsum`) they take W log2(W). Taken in bit-reversed order, register k's sum ends in lane k.
template <class A>
inline void sum_lanes(const Vec<A>* v, int64_t n, A* out) {
  constexpr int64_t W = kWidth<A>;
  static const FoldMasks<A> masks;
  for (int64_t g = 0; g < n; g += W) {
    Vec<A> r[W];
    for (int64_t k = 0; k < W; ++k) {
      const int64_t src = g + masks.order[k];
      r[k] = src < n ? v[src] : Vec<A>{};
    }
    for (int64_t l = 0, m = W; m > 1; ++l, m /= 2)
      for (int64_t i = 0; i < m / 2; ++i)
        r[i] = __builtin_shuffle(r[2 * i], r[2 * i + 1], masks.lo[l]) +
               __builtin_shuffle(r[2 * i], r[2 * i + 1], masks.hi[l]);
    for (int64_t k = 0; k < W && g + k < n; ++k) out[g + k] = r[0][k];
  }
}

// dot_rows_short with the sums of squares, for rows enough to fill sum_lanes' folds (a forward's keys): the rows'
// registers are kept in `part` (dot_rows' scratch) and their lanes summed all together. The backward's two dots per
// row measured no faster that way, and keep dot_rows_short.
template <class K, int64_t NY, class A = typename K::acc>
inline void dot_rows_folded(const typename K::raw* const* x, int64_t count, const A* const* y, int64_t d, A* out,
                            A* sq, Vec<A>* part) {
  constexpr int64_t w = kWidth<A>, n = NY + 1;
  int64_t i = 0;
  for (int64_t j = 0; j < count; ++j) {
    Vec<A> p[n] = {};
    for (i = 0; i + w <= d; i += w) {
      const Vec<A> xv = K::vload(x[j] + i);
      for (int64_t q = 0; q < NY; ++q) p[q] += xv * Plain<A>::vload(y[q] + i);
      p[NY] += xv * xv;
    }
    for (int64_t q = 0; q < n; ++q) part[j * n + q] = p[q];
  }
  A* sums = reinterpret_cast<A*>(part + count * n);
  sum_lanes<A>(part, count * n, sums);
  for (int64_t j = 0; j < count; ++j)
    for (int64_t q = 0; q < n; ++q) {
      A t = sums[j * n + q];
      for (int64_t e = i; e < d; ++e) t += K::load(x[j][e]) * (q < NY ? y[q][e] : K::load(x[j][e]));
      (q < NY ? out[j * NY + q] : sq[j]) = t;
    }
}
#endif

// dot_rows for rows of at most kFold registers and NY rows y: one row x_j at a time, its NY products and sum of
// squares held in registers (a short row's loads are few, so reading the rows side by side gains nothing, and the
// partial sums stay out of memory).
template <class K, int64_t NY, class A = typename K::acc>
inline void dot_rows_short(const typename K::raw* const* x, int64_t count, const A* const* y, int64_t d, A* out,
                           A* sq) {
  constexpr int64_t w = kWidth<A>;
  for (int64_t j = 0; j < count; ++j) {
    Vec<A> part[NY + 1] = {};
    int64_t i = 0;
    for (; i + w <= d; i += w) {
      const Vec<A> xv = K::vload(x[j] + i);
      for (int64_t q = 0; q < NY; ++q) part[q] += xv * Plain<A>::vload(y[q] + i);
      if (sq != nullptr) part[NY] += xv * xv;
    }
    for (int64_t q = 0; q <= NY; ++q) {
      if (q == NY && sq == nullptr) break;
      A t = hsum<A>(part[q]);
      for (int64_t e = i; e < d; ++e) t += K::load(x[j][e]) * (q < NY ? y[q][e] : K::load(x[j][e]));
      (q < NY ? out[j * NY + q] : sq[j]) = t;
    }
  }
}

// For each of `count` rows x_j of d elements (storage K): out[j * n_y + k] = x_j . y_k for n_y rows y_k (accumulator
// type) and, when `sq` is given, sq[j] = x_j . x_j (a key's sum of squares). The x rows are read side by side, one
// cache line of each in turn: with all of a token's source streams advancing together the memory system keeps more
// loads in flight than when it streams one row after another (10-20% faster from DRAM on a 2-core EPYC; the forward
// is 1.3x slower with 1 KiB of each row in turn). `scratch` holds 2 * count * (n_y + 1) registers of partial sums;
// they are folded into totals every kFold lines, so that no partial sum adds up more than a few dozen terms however
// long the row (fp32 rounding error stays small).
template <class K, class A = typename K::acc>
inline void dot_rows(const typename K::raw* const* x, int64_t count, const std::type_identity_t<A>* const* y,
                     int64_t n_y, int64_t d, Vec<A>* scratch, std::type_identity_t<A>* out,
                     std::type_identity_t<A>* sq) {
  using P = Plain<A>;
  constexpr int64_t w = kWidth<A>, line = 64 / sizeof(typename K::raw), kFold = 32;
  static_assert(line % w == 0, "a cache line of the storage format must fill whole registers");
  if (d <= kFold * w) {  // short rows (already few terms per lane): one row at a time, its sums in registers
#ifdef ATTNRES_FOLD_LANES
    if (sq != nullptr && 2 * count * (n_y + 1) >= w) {
      switch (n_y) {
        case 1: return dot_rows_folded<K, 1>(x, count, y, d, out, sq, scratch);
        case 2: return dot_rows_folded<K, 2>(x, count, y, d, out, sq, scratch);
      }
    }
#endif
    switch (n_y) {
      case 1: return dot_rows_short<K, 1>(x, count, y, d, out, sq);
      case 2: return dot_rows_short<K, 2>(x, count, y, d, out, sq);
    }
  }
  const int64_t n_part = count * (n_y + 1);  // per row x_j: its n_y products, then its sum of squares
  Vec<A>* part = scratch;
  Vec<A>* total = scratch + n_part;
  std::fill(scratch, scratch + 2 * n_part, Vec<A>{});
  int64_t i = 0;
  for (int64_t lines = 1; i + line <= d; i += line, ++lines) {
    for (int64_t j = 0; j < count; ++j) {
      Vec<A> xv[line / w];
      for (int64_t k = 0; k < line / w; ++k) xv[k] = K::vload(x[j] + i + k * w);
      Vec<A>* pj = part + j * (n_y + 1);
      if (sq != nullptr) {
        Vec<A> s = {};
        for (int64_t k = 0; k < line / w; ++k) s += xv[k] * xv[k];
        pj[n_y] += s;
      }
      for (int64_t q = 0; q < n_y; ++q) {
        Vec<A> s = {};
        for (int64_t k = 0; k < line / w; ++k) s += xv[k] * P::vload(y[q] + i + k * w);
        pj[q] += s;
      }
    }
    if (lines % kFold == 0)
      for (int64_t e = 0; e < n_part; ++e) total[e] += part[e], part[e] = Vec<A>{};
  }
  for (int64_t j = 0; j < count; ++j) {
    const Vec<A>* pj = part + j * (n_y + 1);
    const Vec<A>* tj = total + j * (n_y + 1);
    for (int64_t q = 0; q < n_y; ++q) {
      A t = hsum<A>(tj[q] + pj[q]);
      for (int64_t e = i; e < d; ++e) t += K::load(x[j][e]) * y[q][e];
      out[j * n_y + q] = t;
    }
    if (sq != nullptr) {
      A t = hsum<A>(tj[n_y] + pj[n_y]);
      for (int64_t e = i; e < d; ++e) t += K::load(x[j][e]) * K::load(x[j][e]);
      sq[j] = t;
    }
  }
}

// dst = scale * dst + sum_j p[j] x_j over `count` rows (dst is read only when `rescale`): a block of dst stays in
// registers while the rows stream past. Blocks of kUnroll registers, then single registers (d = 96 with 16 fp32
// lanes leaves two), then scalars.
template <class K, class A = typename K::acc>
inline void mix_rows(const typename K::raw* const* x, const A* p, int64_t count, bool rescale, A scale, int64_t d,
                     A* dst) {
  constexpr int64_t w = kWidth<A>;
  auto mix_block = [&]<int64_t U>(int64_t i) {
    Vec<A> blk[U];
    for (int64_t k = 0; k < U; ++k) blk[k] = rescale ? splat(scale) * Plain<A>::vload(dst + i + k * w) : Vec<A>{};
    for (int64_t j = 0; j < count; ++j) {
      const Vec<A> pj = splat(p[j]);
      for (int64_t k = 0; k < U; ++k) blk[k] += pj * K::vload(x[j] + i + k * w);
    }
    for (int64_t k = 0; k < U; ++k) Plain<A>::vstore(dst + i + k * w, blk[k]);
  };
  int64_t i = 0;
  for (; i + kUnroll * w <= d; i += kUnroll * w) mix_block.template operator()<kUnroll>(i);
  for (; i + w <= d; i += w) mix_block.template operator()<1>(i);
  for (; i < d; ++i) {
    A v = rescale ? scale * dst[i] : A(0);
    for (int64_t j = 0; j < count; ++j) v += p[j] * K::load(x[j][i]);
    dst[i] = v;
  }
}

// Complete unrolling of the loops over a register tile (their bounds are template constants): where GCC judged a
// tile's body too large to unroll (with bf16 loads), it kept the tile's sums in an array stored at every step.
#define ATTNRES_UNROLL _Pragma("GCC unroll 16")

// Register tiles of the phase-1 kernels, which multiply small matrices per token (S queries against R sources): a
// tile of sums is held in registers while the rows it needs stream past, each register loaded serving several sums.
// AVX-512's 32 registers hold a 4 x 4 tile with its operands; 16 registers, half of it.
constexpr int64_t kTileRows = kVecBytes == 64 ? 4 : 2;
constexpr int64_t kTileCols = 4;

// f.template operator()<B>() with B = min(n, N), for n >= 1: a full block, or the smaller last one.
template <int64_t N, class F>
inline void with_block(int64_t n, F&& f) {
  if constexpr (N == 1) {
    f.template operator()<1>();
  } else {
    if (n >= N) return f.template operator()<N>();
    with_block<N - 1>(n, f);
  }
}

// Holds v in a vector register from here on (an empty asm that takes it there). A value that several FMAs of a tile
// use is otherwise loaded again at each use, or folded into each FMA as a memory operand, and the loads, up to two
// per FMA, bound the tile.
template <class V>
inline void in_register(V& v) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  asm("" : "+v"(v));
#endif
}

// out[j * ld + k] = x_j . y_k for `count` rows x_j (storage K) and n_y rows y_k (accumulator type), in register
// tiles of kTileRows x kTileCols sums. Each register sum adds at most 32 products before it is added to `out`, so
// that no partial sum adds up more than a few dozen terms however long the row (as in dot_rows).
template <class K, class A = typename K::acc>
inline void dot_tiles(const typename K::raw* const* x, int64_t count, const A* const* y, int64_t n_y, int64_t d,
                      A* out, int64_t ld) {
  constexpr int64_t w = kWidth<A>, span = 32 * w;
  const int64_t dv = d / w * w;
  for (int64_t j = 0; j < count; ++j) std::fill(out + j * ld, out + j * ld + n_y, A(0));
  for (int64_t i0 = 0; i0 < dv; i0 += span) {
    const int64_t i1 = std::min(dv, i0 + span);
    for (int64_t j0 = 0; j0 < count; j0 += kTileRows)
      with_block<kTileRows>(count - j0, [&]<int64_t JB>() {
        for (int64_t k0 = 0; k0 < n_y; k0 += kTileCols)
          with_block<kTileCols>(n_y - k0, [&]<int64_t KB>() {
            constexpr bool shared = JB > 1 && KB > 1;  // each operand serves several FMAs (4 x 1 tiles: faster without)
            Vec<A> acc[JB][KB] = {};
            for (int64_t i = i0; i < i1; i += w) {
              Vec<A> xv[JB], yv[KB];
              ATTNRES_UNROLL for (int64_t a = 0; a < JB; ++a) {
                xv[a] = K::vload(x[j0 + a] + i);
                if constexpr (shared) in_register(xv[a]);
              }
              ATTNRES_UNROLL for (int64_t b = 0; b < KB; ++b) {
                yv[b] = Plain<A>::vload(y[k0 + b] + i);
                if constexpr (shared) in_register(yv[b]);
              }
              ATTNRES_UNROLL for (int64_t a = 0; a < JB; ++a)
                ATTNRES_UNROLL for (int64_t b = 0; b < KB; ++b) acc[a][b] += xv[a] * yv[b];
            }
            ATTNRES_UNROLL for (int64_t a = 0; a < JB; ++a)
              ATTNRES_UNROLL for (int64_t b = 0; b < KB; ++b) out[(j0 + a) * ld + k0 + b] += hsum<A>(acc[a][b]);
          });
      });
  }
  for (int64_t i = dv; i < d; ++i)
    for (int64_t j = 0; j < count; ++j)
      for (int64_t k = 0; k < n_y; ++k) out[j * ld + k] += K::load(x[j][i]) * y[k][i];
}

// For n_out outputs o, the sums sum_k coef[o * ld + k] y_k over n_y rows y_k (storage K), in register tiles of
// kTileRows outputs x kTileCols registers; each sum goes to epi(o, i, v), v a register of elements i.. (Vec<A>),
// then the elements past the last whole register one at a time (v an A).
template <class K, class A = typename K::acc, class Epi>
inline void mix_tiles(const typename K::raw* const* y, int64_t n_y, const A* coef, int64_t ld, int64_t n_out,
                      int64_t d, const Epi& epi) {
  constexpr int64_t w = kWidth<A>;
  const int64_t dv = d / w * w;
  for (int64_t o0 = 0; o0 < n_out; o0 += kTileRows)
    with_block<kTileRows>(n_out - o0, [&]<int64_t OB>() {
      auto tile = [&]<int64_t VB>(int64_t i) {
        Vec<A> acc[OB][VB] = {};
        for (int64_t k = 0; k < n_y; ++k) {
          Vec<A> yv[VB];
          ATTNRES_UNROLL for (int64_t v = 0; v < VB; ++v) yv[v] = K::vload(y[k] + i + v * w);
          ATTNRES_UNROLL for (int64_t o = 0; o < OB; ++o) {
            const Vec<A> cf = splat(coef[(o0 + o) * ld + k]);
            ATTNRES_UNROLL for (int64_t v = 0; v < VB; ++v) acc[o][v] += cf * yv[v];
          }
        }
        ATTNRES_UNROLL for (int64_t o = 0; o < OB; ++o)
          ATTNRES_UNROLL for (int64_t v = 0; v < VB; ++v) epi(o0 + o, i + v * w, acc[o][v]);
      };
      int64_t i = 0;
      for (; i + kTileCols * w <= dv; i += kTileCols * w) tile.template operator()<kTileCols>(i);
      for (; i < dv; i += w) tile.template operator()<1>(i);
      for (; i < d; ++i)
        for (int64_t o = o0; o < o0 + OB; ++o) {
          A t = 0;
          for (int64_t k = 0; k < n_y; ++k) t += coef[o * ld + k] * K::load(y[k][i]);
          epi(o, i, t);
        }
    });
}

// x . x for one row in the storage format (a key's or a mixture's sum of squares), in kUnroll independent register
// sums, each added to the total after at most 32 products (as dot_rows: however long the row).
template <class K, class A = typename K::acc>
inline A sum_squares(const typename K::raw* x, int64_t d) {
  constexpr int64_t w = kWidth<A>, block = kUnroll * w, span = 32 * block;
  A t = 0;
  int64_t i = 0;
  while (i + w <= d) {
    Vec<A> acc[kUnroll] = {};
    const int64_t end = std::min(d, i + span);
    for (; i + block <= end; i += block)
      for (int64_t k = 0; k < kUnroll; ++k) {
        const Vec<A> v = K::vload(x + i + k * w);
        acc[k] += v * v;
      }
    for (; i + w <= end; i += w) {
      const Vec<A> v = K::vload(x + i);
      acc[0] += v * v;
    }
    for (int64_t k = 1; k < kUnroll; ++k) acc[0] += acc[k];
    t += hsum<A>(acc[0]);
  }
  for (; i < d; ++i) t += K::load(x[i]) * K::load(x[i]);
  return t;
}

// dst = factor * m (times gain, when given), converted to the storage format.
template <class K, class A = typename K::acc>
inline void store_row(typename K::raw* dst, const A* m, A factor, const A* gain, int64_t d) {
  constexpr int64_t w = kWidth<A>;
  int64_t i = 0;
  for (; i + w <= d; i += w) {
    Vec<A> v = splat(factor) * Plain<A>::vload(m + i);
    K::vstore(dst + i, gain ? v * Plain<A>::vload(gain + i) : v);
  }
  for (; i < d; ++i) dst[i] = K::store(factor * m[i] * (gain ? gain[i] : A(1)));
}

template <class K, class A = typename K::acc>
inline void load_row(A* dst, const typename K::raw* src, int64_t d) {
  constexpr int64_t w = kWidth<A>;
  int64_t i = 0;
  for (; i + w <= d; i += w) Plain<A>::vstore(dst + i, K::vload(src + i));
  for (; i < d; ++i) dst[i] = K::load(src[i]);
}

template <class A>
inline A rsqrt(A v) {
  return A(1) / std::sqrt(v);
}

// Rows of d elements, one per token: token n's row starts at data + n * stride (unit stride along d). Sources and
// gradients are read in place through it, whatever their leading strides (see as_rows).
template <class T>
struct Rows {
  T* data;
  int64_t stride;
  T* operator[](int64_t n) const { return data + n * stride; }
};

inline int64_t grain_size(int64_t n_src, int64_t d) {  // tokens per task: enough work to be worth a thread
  return std::max<int64_t>(1, (int64_t(1) << 16) / (n_src * d));
}

// x86 takes a microcode assist for every operation on a subnormal float: with 1 % of the sources' entries subnormal,
// a kernel that computes on them takes two to four times as long (benchmarks/bench_cpu.py --subnormal), and a
// softmax over depth makes its own (the exp of a score 88 below the largest). So each thread's share of a kernel
// runs with subnormal inputs read as zero and subnormal results flushed to zero (MXCSR DAZ | FTZ), and puts the
// caller's mode back after: a change of less than FLT_MIN (1.2e-38) in any value, the kernels' speed independent of
// their data.
class FlushSubnormals {
#if defined(__x86_64__) || defined(__i386__)
 public:
  FlushSubnormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kDaz | kFtz); }
  ~FlushSubnormals() { _mm_setcsr(saved_); }
  FlushSubnormals(const FlushSubnormals&) = delete;
  FlushSubnormals& operator=(const FlushSubnormals&) = delete;

 private:
  static constexpr unsigned kDaz = 0x0040, kFtz = 0x8000;
  unsigned saved_;
#endif
};

// at::parallel_for over tokens [0, n), every chunk under FlushSubnormals on the thread that runs it.
template <class F>
void parallel_tokens(int64_t n, int64_t grain, const F& f) {
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    FlushSubnormals flush;
    f(begin, end);
  });
}

// Bytes of source rows that one token keeps hot between its passes: half of a typical 512 KiB - 2 MiB L2.
constexpr int64_t kHotBytes = 256 * 1024;

// Tokens that the forward takes together (a tile), when their rows fit in kHotBytes: the per-source scalar steps
// (key rstd, score, softmax) then run as vectors across the tile's tokens. One token at a time they are chains of
// divisions, square roots and exp calls: the tiled forward takes 0.7x the time at d = 96 (docs/benchmarks.md).
constexpr int64_t kTile = 16;

// sqrt of each lane, correctly rounded as std::sqrt is (so a lane's result is the scalar one bit for bit).
template <class A>
inline Vec<A> sqrt_lanes(Vec<A> v) {
#if defined(__AVX512F__)
  if constexpr (sizeof(A) == 4) return Vec<A>(_mm512_sqrt_ps(__m512(v)));
  else return Vec<A>(_mm512_sqrt_pd(__m512d(v)));
#elif defined(__AVX__)
  if constexpr (sizeof(A) == 4) return Vec<A>(_mm256_sqrt_ps(__m256(v)));
  else return Vec<A>(_mm256_sqrt_pd(__m256d(v)));
#else
  for (int64_t k = 0; k < kWidth<A>; ++k) v[k] = std::sqrt(v[k]);
  return v;
#endif
}

// e^x for each lane. fp32: the usual reduction x = n ln2 + r (|r| <= ln2 / 2) and Cephes' degree-7 polynomial for
// e^r, within about one unit in the last place of std::exp; 2^n is applied in two halves, so results down to the
// subnormals round once and e^x below them is 0; inf above the largest float, NaN for NaN. fp64 takes std::exp per
// lane. Never inlined, so that every caller rounds alike.
template <class A>
__attribute__((noinline)) Vec<A> exp_lanes(Vec<A> x) {
  if constexpr (sizeof(A) == 8) {
    for (int64_t k = 0; k < kWidth<A>; ++k) x[k] = std::exp(x[k]);
    return x;
  } else {
    using I = typename VecOf<int32_t, kWidth<float>>::type;
    const Vec<float> lo = splat(-104.0f), hi = splat(88.72283935546875f), shifter = splat(12582912.0f);  // 1.5 * 2^23
    const Vec<float> xc = x < lo ? lo : x > hi ? hi : x;  // NaN compares false both ways and stays NaN
    const Vec<float> t = xc * splat(1.44269504088896341f) + shifter;  // n = round(x / ln2) in t's low bits
    const Vec<float> n = t - shifter;
    const Vec<float> r = (xc - n * splat(0.693359375f)) - n * splat(-2.12194440e-4f);  // Cody-Waite: ln2 = hi + lo
    Vec<float> p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    const Vec<float> e = p * (r * r) + r + splat(1.0f);
    const I ni = reinterpret_cast<I>(t) - reinterpret_cast<I>(shifter), n1 = ni >> 1, n2 = ni - n1;
    const Vec<float> y =
        e * reinterpret_cast<Vec<float>>((n1 + 127) << 23) * reinterpret_cast<Vec<float>>((n2 + 127) << 23);
    return x > hi ? splat(std::numeric_limits<float>::infinity()) : y;
  }
}

// v[i] = e^v[i] for n values, a register at a time (exp_lanes), the last partial register through a copy: the
// phase-1 kernels' weights, S x R of them per token, which one std::exp call each took a sixth of the forward.
template <class A>
inline void exp_in_place(A* v, int64_t n) {
  constexpr int64_t w = kWidth<A>;
  int64_t i = 0;
  for (; i + w <= n; i += w) Plain<A>::vstore(v + i, exp_lanes<A>(Plain<A>::vload(v + i)));
  if (i < n) {
    A t[w] = {};
    std::copy(v + i, v + n, t);
    Plain<A>::vstore(t, exp_lanes<A>(Plain<A>::vload(t)));
    std::copy(t, t + (n - i), v + i);
  }
}

// Per-thread scratch of forward_tile for tiles of up to `tile` tokens of n_src rows of d elements: the per-source
// values of a tile are kept source-major, [n_src][lanes], so that each source's values for the tile fill registers.
template <class A>
struct ForwardScratch {
  static constexpr int64_t lanes = (kTile + kWidth<A> - 1) / kWidth<A> * kWidth<A>;
  std::vector<A> acc, xc, sq, score, rstd, p, mx, z, scale, out_sq, factor, token;
  std::vector<Vec<A>> dots;
  ForwardScratch(int64_t n_src, int64_t d, int64_t tile)
      : acc(tile * d), xc(n_src * lanes), sq(n_src * lanes), score(n_src * lanes), rstd(n_src * lanes),
        p(n_src * lanes), mx(lanes), z(lanes), scale(lanes), out_sq(lanes), factor(lanes), token(2 * n_src),
        dots(4 * n_src) {}
};

// Tokens per tile for rows of n_src x d elements of `bytes` each: as many as keep their rows within kHotBytes, at
// most kTile, at least 1.
inline int64_t tile_tokens(int64_t n_src, int64_t d, int64_t bytes) {
  return std::clamp<int64_t>(kHotBytes / (n_src * d * bytes), 1, kTile);
}

// out = inv_z * acc, through the output norm (o * RMSNorm) when its gain out_w is given, in the storage format: one
// token (bank_merge); forward_tile takes the same factor as vectors across its tile.
template <class K, class A = typename K::acc>
inline void store_mixture(typename K::raw* out, const A* acc, A inv_z, const A* out_w, double out_eps, int64_t d) {
  A factor = inv_z;
  if (out_w != nullptr) factor *= rsqrt(sum_squares<Plain<A>>(acc, d) * inv_z * inv_z / A(d) + A(out_eps));
  store_row<K>(out, acc, factor, out_w, d);
}

// The forward for a tile of n tokens, token t with its n_src rows x[t * n_src + j]: writes each (normed) mixture to
// out + t * d and leaves, at [j * lanes + t], each row's key rstd in s.rstd and its weight's numerator p_j =
// exp(score_j - largest) in s.p, and 1 / sum_j p_j in s.z[t]. Rows that do not fit in kHotBytes together (one token
// per tile, then) are taken in groups merged by an online softmax: running max, rescaled partial sums. Never
// inlined: the one-shot op and the fused bank ops run this very code and agree bit for bit.
template <class K>
__attribute__((noinline)) void forward_tile(
    const typename K::raw* const* x, int64_t n, int64_t n_src, const typename K::acc* c,
    const typename K::acc* out_w, double eps, double out_eps, int64_t d, ForwardScratch<typename K::acc>& s,
    typename K::raw* out) {
  using A = typename K::acc;
  using P = Plain<A>;
  constexpr int64_t w = kWidth<A>, L = ForwardScratch<A>::lanes;
  const int64_t group = std::clamp<int64_t>(kHotBytes / (d * int64_t(sizeof(typename K::raw))), 1, n_src);
  const A dn = A(d), ep = A(eps), inf = std::numeric_limits<A>::infinity();
  for (int64_t g0 = 0; g0 < n_src; g0 += group) {
    const int64_t g1 = std::min(n_src, g0 + group);
    for (int64_t t = 0; t < n; ++t) {
      dot_rows<K>(x + t * n_src + g0, g1 - g0, &c, 1, d, s.dots.data(), s.token.data(), s.token.data() + n_src);
      for (int64_t j = g0; j < g1; ++j) s.xc[j * L + t] = s.token[j - g0], s.sq[j * L + t] = s.token[n_src + j - g0];
    }
    for (int64_t t = 0; t < n; t += w) {
      Vec<A> mx = g0 == 0 ? splat(-inf) : P::vload(s.mx.data() + t), top = mx;
      for (int64_t j = g0; j < g1; ++j) {
        const Vec<A> r = splat(A(1)) / sqrt_lanes<A>(P::vload(s.sq.data() + j * L + t) / splat(dn) + splat(ep));
        const Vec<A> score = P::vload(s.xc.data() + j * L + t) * r;
        P::vstore(s.rstd.data() + j * L + t, r);
        P::vstore(s.score.data() + j * L + t, score);
        top = top < score ? score : top;
      }
      // rescales what earlier groups accumulated
      const Vec<A> scale = g0 == 0 ? Vec<A>{} : exp_lanes<A>(mx - top);
      Vec<A> z = g0 == 0 ? Vec<A>{} : P::vload(s.z.data() + t) * scale;
      for (int64_t j = g0; j < g1; ++j) {
        const Vec<A> p = exp_lanes<A>(P::vload(s.score.data() + j * L + t) - top);
        P::vstore(s.p.data() + j * L + t, p);
        z += p;
      }
      P::vstore(s.mx.data() + t, top), P::vstore(s.z.data() + t, z), P::vstore(s.scale.data() + t, scale);
    }
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t j = g0; j < g1; ++j) s.token[j - g0] = s.p[j * L + t];
      mix_rows<K>(x + t * n_src + g0, s.token.data(), g1 - g0, g0 > 0, s.scale[t], d, s.acc.data() + t * d);
    }
  }
  const int64_t last_group = (n_src - 1) / group * group;
  for (int64_t t = 0; t < n; t += w) {
    const Vec<A> top = P::vload(s.mx.data() + t);
    for (int64_t j = 0; j < last_group; ++j)  // earlier groups: the final shift
      P::vstore(s.p.data() + j * L + t, exp_lanes<A>(P::vload(s.score.data() + j * L + t) - top));
    P::vstore(s.z.data() + t, splat(A(1)) / P::vload(s.z.data() + t));
  }
  // each token's factor 1 / z, times the output norm's rstd when there is one: store_mixture's factor, with its
  // square root and divisions as vectors across the tile
  if (out_w != nullptr)
    for (int64_t t = 0; t < n; ++t) s.out_sq[t] = sum_squares<Plain<A>>(s.acc.data() + t * d, d);
  for (int64_t t = 0; t < n; t += w) {
    Vec<A> f = P::vload(s.z.data() + t);
    if (out_w != nullptr)
      f = f * (splat(A(1)) / sqrt_lanes<A>(P::vload(s.out_sq.data() + t) * f * f / splat(dn) + splat(A(out_eps))));
    P::vstore(s.factor.data() + t, f);
  }
  for (int64_t t = 0; t < n; ++t) store_row<K>(out + t * d, s.acc.data() + t * d, s.factor[t], out_w, d);
}

template <class K>
void forward_kernel(const std::vector<Rows<const typename K::raw>>& src, const typename K::acc* c,
                    const typename K::acc* out_w, double eps, double out_eps, int64_t n_tok, int64_t d,
                    typename K::raw* out, typename K::acc* weights, typename K::acc* rstd) {
  using A = typename K::acc;
  using R = typename K::raw;
  constexpr int64_t L = ForwardScratch<A>::lanes;
  const int64_t n_src = int64_t(src.size()), tile = tile_tokens(n_src, d, sizeof(R));
  parallel_tokens(n_tok, std::max(grain_size(n_src, d), tile), [&](int64_t begin, int64_t end) {
    ForwardScratch<A> s(n_src, d, std::min(tile, end - begin));  // a decode step's one token: one token's scratch
    std::vector<const R*> x(tile * n_src);
    for (int64_t n0 = begin; n0 < end; n0 += tile) {
      const int64_t n = std::min(tile, end - n0);
      for (int64_t t = 0; t < n; ++t)
        for (int64_t j = 0; j < n_src; ++j) x[t * n_src + j] = src[j][n0 + t];
      forward_tile<K>(x.data(), n, n_src, c, out_w, eps, out_eps, d, s, out + n0 * d);
      for (int64_t j = 0; j < n_src; ++j)
        for (int64_t t = 0; t < n; ++t) {
          rstd[j * n_tok + n0 + t] = s.rstd[j * L + t];
          weights[j * n_tok + n0 + t] = s.p[j * L + t] * s.z[t];
        }
    }
  });
}

// Tokens that the backward takes together, when at least kTile tokens' rows fit in kHotBytes (d = 96 in fp32: up to
// 42 sources): the per-token scalar steps (the softmax backward) then run as vectors across the tile, where one token
// at a time they cost as much as a short row's few registers of arithmetic. The dot pass reads each token's rows side
// by side, as the forward does, and asks for the lines of its gradient sums together (more loads in flight: with cold
// caches the Full chain's backward took 0.90-0.92x the time at the minima, 0.95-0.98x at the medians, of reading one
// source's rows of the tile after another); the gradient pass walks one source's rows of the tile (one contiguous
// stream) at a time. Otherwise tokens are taken one at a time, their rows read side by side (backward_token), as
// before tiles. Against that code, tiles measured faster at d = 96 and 192 in fp32, level to faster at 256 and level
// at 512 (docs/benchmarks.md). 1: no tiles.
constexpr int64_t kBackwardTile = 64;

inline int64_t backward_tile_tokens(int64_t n_src, int64_t d, int64_t bytes) {
  const int64_t tile = std::clamp<int64_t>(kHotBytes / (n_src * d * bytes), 1, kBackwardTile);
  return tile >= kTile ? tile : 1;
}

// Backward of the output norm (o * RMSNorm of the mixture m) for one token: turns dm, the gradient reaching the
// output, into the one reaching m, and adds the gain's gradient into dw_acc.
template <class A>
inline void out_norm_backward(A* dm, const A* mix, const A* out_w, double out_eps, int64_t d, A* dw_acc) {
  using P = Plain<A>;
  constexpr int64_t w = kWidth<A>;
  const A r = rsqrt(sum_squares<Plain<A>>(mix, d) / A(d) + A(out_eps));
  Vec<A> amv = {};
  int64_t i = 0;
  for (; i + w <= d; i += w) {
    const Vec<A> dmv = P::vload(dm + i), mv = P::vload(mix + i);
    P::vstore(dw_acc + i, P::vload(dw_acc + i) + dmv * mv * splat(r));
    amv += dmv * P::vload(out_w + i) * mv;
  }
  A am = hsum<A>(amv);
  for (; i < d; ++i) {
    dw_acc[i] += dm[i] * mix[i] * r;
    am += dm[i] * out_w[i] * mix[i];
  }
  const A k = r * r * r * am / A(d);
  for (i = 0; i + w <= d; i += w) {
    const Vec<A> scaled = splat(r) * P::vload(dm + i) * P::vload(out_w + i);
    P::vstore(dm + i, scaled - splat(k) * P::vload(mix + i));
  }
  for (; i < d; ++i) dm[i] = r * dm[i] * out_w[i] - k * mix[i];
}

// The softmax backward of one token (V = A) or of a register of tokens (V = Vec<A>), given delta = sum_k alpha_k g_k:
// coef reaches c . x_j, shrink reaches x_j through its rstd r. Both paths of the backward share it, so they agree.
template <class V>
inline void softmax_backward(V alpha, V g, V delta, V r, V xc, V d, V& coef, V& shrink) {
  coef = alpha * (g - delta) * r;
  shrink = coef * (xc * r) * r / d;
}

// One element (V = A) or register (V = Vec<A>) of a source's gradient: alpha dm + coef c - shrink x.
template <class V>
inline V source_grad(V alpha, V dm, V coef, V c, V shrink, V x) {
  return alpha * dm + coef * c - shrink * x;
}

// The arguments every backward pass shares. n_acc: the first n_acc sources' gradients are added onto what `grads`
// holds (a chain of points, attnres/ops/chain.py), the others written; the lines added onto are asked for (a prefetch
// to write) as the dot pass reads the sources, so that their loads overlap the passes before the last.
template <class K>
struct BackwardArgs {
  using A = typename K::acc;
  Rows<const typename K::raw> grad_out;
  const A* grad_weights;
  const std::vector<Rows<const typename K::raw>>& src;
  const A *c, *out_w, *weights, *rstd;
  double out_eps;
  int64_t n_tok, d;
  const std::vector<typename K::raw*>& grads;
  int64_t n_acc;
};

// Per-thread scratch of backward_tile: the tile's output-gradient rows (dm), at [j * lanes + t] each row's weight, key
// rstd, two dot products and two coefficients, one token's rows and weights (the output norm's mix), and dot_rows'
// partial sums for one row against two (c and dm).
template <class K, class A = typename K::acc>
struct BackwardScratch {
  static constexpr int64_t lanes = kBackwardTile;
  static_assert(lanes % kWidth<A> == 0, "a tile's values of one source must fill whole registers");
  std::vector<A> dm, mix, alpha, rstd, xc, g, coef, shrink, token;
  std::vector<Vec<A>> dots;
  std::vector<const typename K::raw*> x;
  BackwardScratch(int64_t n_src, int64_t d, int64_t tile, bool out_norm)
      : dm(tile * d), mix(out_norm ? d : 0), alpha(n_src * lanes), rstd(n_src * lanes), xc(n_src * lanes),
        g(n_src * lanes), coef(n_src * lanes), shrink(n_src * lanes), token(n_src), dots(2 * (2 + 1)), x(n_src) {}
};

// The backward for a tile of n tokens from n0, source by source (see backward_tile_tokens).
template <class K>
void backward_tile(const BackwardArgs<K>& a, int64_t n0, int64_t n, BackwardScratch<K>& s,
                   typename K::acc* dc_acc, typename K::acc* dw_acc) {
  using A = typename K::acc;
  using R = typename K::raw;
  using P = Plain<A>;
  constexpr int64_t w = kWidth<A>, L = BackwardScratch<K>::lanes, line = 64 / sizeof(R);
  const int64_t n_src = int64_t(a.src.size()), d = a.d;
  for (int64_t j = 0; j < n_src; ++j)
    for (int64_t t = 0; t < n; ++t) {  // lanes past n are never read back: each lane is its own token's
      s.alpha[j * L + t] = a.weights[j * a.n_tok + n0 + t];
      s.rstd[j * L + t] = a.rstd[j * a.n_tok + n0 + t];
    }
  for (int64_t t = 0; t < n; ++t) {
    A* dm = s.dm.data() + t * d;
    load_row<K>(dm, a.grad_out[n0 + t], d);
    if (a.out_w != nullptr) {  // dm becomes the gradient reaching the mixture, mixed again here
      for (int64_t j = 0; j < n_src; ++j) s.x[j] = a.src[j][n0 + t], s.token[j] = s.alpha[j * L + t];
      mix_rows<K>(s.x.data(), s.token.data(), n_src, false, A(0), d, s.mix.data());
      out_norm_backward(dm, s.mix.data(), a.out_w, a.out_eps, d, dw_acc);
    }
  }
  // c . x_j and dm . x_j for every row, each token's rows side by side
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < n_src; ++j) {
      const R* row = a.src[j][n0 + t];
      const A* y[2] = {a.c, s.dm.data() + t * d};
      A out[2];
      if (j < a.n_acc)
        for (int64_t i = 0; i < d; i += line) __builtin_prefetch(a.grads[j] + (n0 + t) * d + i, 1, 3);
      dot_rows<K>(&row, 1, y, 2, d, s.dots.data(), out, nullptr);
      s.xc[j * L + t] = out[0], s.g[j * L + t] = out[1];
    }
  // softmax backward, as vectors across the tile: ds_j = alpha_j (g_j - sum_k alpha_k g_k), g_j = dm . x_j (+ the
  // weights' own gradient); coef_j reaches c . x_j, shrink_j reaches x_j through its rstd
  for (int64_t t0 = 0; t0 < n; t0 += w) {
    Vec<A> delta = {};
    for (int64_t j = 0; j < n_src; ++j) {
      A* g = s.g.data() + j * L + t0;
      if (a.grad_weights != nullptr)
        for (int64_t t = t0; t < std::min(n, t0 + w); ++t) g[t - t0] += a.grad_weights[j * a.n_tok + n0 + t];
      delta += P::vload(s.alpha.data() + j * L + t0) * P::vload(g);
    }
    for (int64_t j = 0; j < n_src; ++j) {
      const int64_t at = j * L + t0;
      Vec<A> coef, shrink;
      softmax_backward(P::vload(s.alpha.data() + at), P::vload(s.g.data() + at), delta, P::vload(s.rstd.data() + at),
                       P::vload(s.xc.data() + at), splat(A(d)), coef, shrink);
      P::vstore(s.coef.data() + at, coef), P::vstore(s.shrink.data() + at, shrink);
    }
  }
  // dx_j = alpha_j dm + coef_j c - shrink_j x_j and dc += coef_j x_j, source by source, row by row
  auto source_grads = [&]<bool Accumulate>(int64_t j) {
    for (int64_t t = 0; t < n; ++t) {
      const R* x = a.src[j][n0 + t];
      R* dx = a.grads[j] + (n0 + t) * d;
      const A* dm = s.dm.data() + t * d;
      const A al = s.alpha[j * L + t], cj = s.coef[j * L + t], sj = s.shrink[j * L + t];
      int64_t i = 0;
      for (; i + w <= d; i += w) {
        const Vec<A> xv = K::vload(x + i);
        const Vec<A> g = source_grad(splat(al), P::vload(dm + i), splat(cj), P::vload(a.c + i), splat(sj), xv);
        K::vstore(dx + i, Accumulate ? K::vload(dx + i) + g : g);
        P::vstore(dc_acc + i, P::vload(dc_acc + i) + splat(cj) * xv);
      }
      for (; i < d; ++i) {
        const A xv = K::load(x[i]);
        const A g = source_grad(al, dm[i], cj, a.c[i], sj, xv);
        dx[i] = K::store(Accumulate ? K::load(dx[i]) + g : g);
        dc_acc[i] += cj * xv;
      }
    }
  };
  for (int64_t j = 0; j < n_src; ++j)
    j < a.n_acc ? source_grads.template operator()<true>(j) : source_grads.template operator()<false>(j);
}

// The backward for the tokens begin .. end one at a time (rows too long for tiles), each token's rows read side by
// side.
template <class K>
void backward_token(const BackwardArgs<K>& a, int64_t begin, int64_t end, typename K::acc* dc_acc,
                    typename K::acc* dw_acc) {
  using A = typename K::acc;
  using R = typename K::raw;
  using P = Plain<A>;
  constexpr int64_t w = kWidth<A>, block = kUnroll * w;
  const int64_t n_src = int64_t(a.src.size()), d = a.d;
  const A* c = a.c;
  // dots[2j] = c . x_j, dots[2j + 1] = dm . x_j
  std::vector<A> dm(d), mix(a.out_w ? d : 0), alpha(n_src), dots(2 * n_src), coef(n_src), shrink(n_src);
  std::vector<Vec<A>> scratch(6 * n_src);
  std::vector<const R*> x(n_src);
  std::vector<R*> dx(n_src);
  const A* const y[2] = {c, dm.data()};
  for (int64_t n = begin; n < end; ++n) {
    for (int64_t j = 0; j < n_src; ++j) {
      x[j] = a.src[j][n], dx[j] = a.grads[j] + n * d;
      alpha[j] = a.weights[j * a.n_tok + n];
    }
    constexpr int64_t line = 64 / sizeof(R);
    for (int64_t j = 0; j < a.n_acc; ++j)
      for (int64_t i = 0; i < d; i += line) __builtin_prefetch(dx[j] + i, 1, 3);
    load_row<K>(dm.data(), a.grad_out[n], d);
    if (a.out_w != nullptr) {  // dm becomes the gradient reaching the mixture, mixed again here
      mix_rows<K>(x.data(), alpha.data(), n_src, false, A(0), d, mix.data());
      out_norm_backward(dm.data(), mix.data(), a.out_w, a.out_eps, d, dw_acc);
    }
    // softmax backward: ds_j = alpha_j (g_j - sum_k alpha_k g_k), g_j = dm . x_j (+ the weights' own gradient)
    dot_rows<K>(x.data(), n_src, y, 2, d, scratch.data(), dots.data(), nullptr);
    A delta = 0;
    for (int64_t j = 0; j < n_src; ++j) {
      coef[j] = dots[2 * j + 1] + (a.grad_weights ? a.grad_weights[j * a.n_tok + n] : A(0));  // g_j for now
      delta += alpha[j] * coef[j];
    }
    for (int64_t j = 0; j < n_src; ++j)
      softmax_backward(alpha[j], coef[j], delta, a.rstd[j * a.n_tok + n], dots[2 * j], A(d), coef[j], shrink[j]);
    // dx_j = alpha_j dm + coef_j c - shrink_j x_j and dc += coef_j x_j, one block of d at a time: the blocks of
    // dm, c and dc stay in registers across the R rows (blocks of kUnroll registers, then single ones)
    auto dx_block = [&]<int64_t U>(int64_t i) {
      Vec<A> dmv[U], cv[U], dcv[U] = {};
      for (int64_t k = 0; k < U; ++k) dmv[k] = P::vload(dm.data() + i + k * w), cv[k] = P::vload(c + i + k * w);
      auto rows = [&]<bool Accumulate>(int64_t from, int64_t to) {
        for (int64_t j = from; j < to; ++j) {
          const Vec<A> al = splat(alpha[j]), cj = splat(coef[j]), sj = splat(shrink[j]);
          for (int64_t k = 0; k < U; ++k) {
            const Vec<A> xv = K::vload(x[j] + i + k * w), g = source_grad(al, dmv[k], cj, cv[k], sj, xv);
            K::vstore(dx[j] + i + k * w, Accumulate ? K::vload(dx[j] + i + k * w) + g : g);
            dcv[k] += cj * xv;
          }
        }
      };
      rows.template operator()<true>(0, a.n_acc);
      rows.template operator()<false>(a.n_acc, n_src);
      for (int64_t k = 0; k < U; ++k) P::vstore(dc_acc + i + k * w, P::vload(dc_acc + i + k * w) + dcv[k]);
    };
    int64_t i = 0;
    for (; i + block <= d; i += block) dx_block.template operator()<kUnroll>(i);
    for (; i + w <= d; i += w) dx_block.template operator()<1>(i);
    for (; i < d; ++i) {
      for (int64_t j = 0; j < n_src; ++j) {
        const A xv = K::load(x[j][i]);
        const A g = source_grad(alpha[j], dm[i], coef[j], c[i], shrink[j], xv);
        dx[j][i] = K::store(j < a.n_acc ? K::load(dx[j][i]) + g : g);
        dc_acc[i] += coef[j] * xv;
      }
    }
  }
}

template <class K>
void backward_kernel(const BackwardArgs<K>& a, typename K::acc* dc, typename K::acc* d_out_w) {
  using A = typename K::acc;
  const int64_t n_src = int64_t(a.src.size()), d = a.d;
  const int64_t tile = backward_tile_tokens(n_src, d, sizeof(typename K::raw));
  // per-thread partial sums of dc and d_out_w, added up in thread order after the loop (deterministic)
  const int64_t n_threads = at::get_num_threads();
  std::vector<A> dc_part(n_threads * d, A(0)), dw_part(a.out_w ? n_threads * d : 0, A(0));
  parallel_tokens(a.n_tok, std::max(grain_size(n_src, d), tile), [&](int64_t begin, int64_t end) {
    A* dc_acc = dc_part.data() + at::get_thread_num() * d;
    A* dw_acc = a.out_w ? dw_part.data() + at::get_thread_num() * d : nullptr;
    if (tile == 1) return backward_token<K>(a, begin, end, dc_acc, dw_acc);
    BackwardScratch<K> s(n_src, d, std::min(tile, end - begin), a.out_w != nullptr);
    for (int64_t n0 = begin; n0 < end; n0 += tile)
      backward_tile<K>(a, n0, std::min(tile, end - n0), s, dc_acc, dw_acc);
  });
  for (int64_t t = 0; t < n_threads; ++t) {
    for (int64_t i = 0; i < d; ++i) dc[i] += dc_part[t * d + i];
    if (a.out_w != nullptr)
      for (int64_t i = 0; i < d; ++i) d_out_w[i] += dw_part[t * d + i];
  }
}

// Phase 1, forward: for S queries c_q against R sources, per token, s_qj = (c_q . x_j) r_j and
//   m_q = max_j s_qj,  z_q = sum_j exp(s_qj - m_q),  u_q = sum_j exp(s_qj - m_q) x_j,
// with u_q written straight into its row of u [S, N, d]. As in the forward, rows that do not fit in L2 together are
// taken in groups merged by an online softmax per query.
// The scores and the u_q are small matrix products per token, taken in register tiles (dot_tiles, mix_tiles).
template <class K>
void stats_forward_kernel(const std::vector<Rows<const typename K::raw>>& src, const typename K::acc* cs,
                          int64_t n_q, double eps, int64_t n_tok, int64_t d, typename K::acc* m, typename K::acc* z,
                          typename K::acc* u, typename K::acc* rstd) {
  using A = typename K::acc;
  using R = typename K::raw;
  const int64_t n_src = int64_t(src.size());
  const int64_t group = std::clamp<int64_t>(kHotBytes / (d * int64_t(sizeof(R))), 1, n_src);
  std::vector<const A*> c(n_q);
  for (int64_t q = 0; q < n_q; ++q) c[q] = cs + q * d;
  parallel_tokens(n_tok, grain_size(n_src + n_q, d), [&](int64_t begin, int64_t end) {
    // per group: s[j * n_q + q] (dot products, then scores), p[q * group + j]; per query: running max, sum, rescale
    std::vector<A> s(group * n_q), p(n_q * group), mx(n_q), zq(n_q), scale(n_q);
    std::vector<const R*> x(n_src);
    std::vector<A*> uq(n_q);
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t j = 0; j < n_src; ++j) x[j] = src[j][n];
      for (int64_t q = 0; q < n_q; ++q) uq[q] = u + (q * n_tok + n) * d;
      for (int64_t g0 = 0; g0 < n_src; g0 += group) {
        const int64_t count = std::min(n_src, g0 + group) - g0;
        dot_tiles<K>(x.data() + g0, count, c.data(), n_q, d, s.data(), n_q);
        for (int64_t j = 0; j < count; ++j) {
          const A r = rsqrt(sum_squares<K>(x[g0 + j], d) / A(d) + A(eps));
          rstd[(g0 + j) * n_tok + n] = r;
          for (int64_t q = 0; q < n_q; ++q) s[j * n_q + q] *= r;
        }
        for (int64_t q = 0; q < n_q; ++q) {
          A top = g0 == 0 ? -std::numeric_limits<A>::infinity() : mx[q];
          for (int64_t j = 0; j < count; ++j) top = std::max(top, s[j * n_q + q]);
          for (int64_t j = 0; j < count; ++j) p[q * count + j] = s[j * n_q + q] - top;
          scale[q] = g0 == 0 ? A(0) : mx[q] - top;  // rescales what earlier groups accumulated
          mx[q] = top;
        }
        exp_in_place(p.data(), n_q * count);
        if (g0 > 0) exp_in_place(scale.data(), n_q);
        for (int64_t q = 0; q < n_q; ++q) {
          A sum = g0 == 0 ? A(0) : zq[q] * scale[q];
          for (int64_t j = 0; j < count; ++j) sum += p[q * count + j];
          zq[q] = sum;
        }
        mix_tiles<K>(x.data() + g0, count, p.data(), count, n_q, d, [&](int64_t q, int64_t i, auto v) {
          if constexpr (std::is_same_v<decltype(v), A>) {
            uq[q][i] = g0 == 0 ? v : scale[q] * uq[q][i] + v;
          } else {
            Plain<A>::vstore(uq[q] + i, g0 == 0 ? v : splat(scale[q]) * Plain<A>::vload(uq[q] + i) + v);
          }
        });
      }
      for (int64_t q = 0; q < n_q; ++q) m[q * n_tok + n] = mx[q], z[q * n_tok + n] = zq[q];
    }
  });
}

// Phase 1, backward, with the shift m held fixed (p_qj = exp(s_qj - m_q)), per token:
//   coef_qj = p_qj (gz_q + gu_q . x_j) r_j
//   dx_j    = sum_q p_qj gu_q + sum_q coef_qj c_q - (sum_q coef_qj s_qj) r_j / d * x_j
//   dc_q   += sum_j coef_qj x_j
// Per token these are three small matrix products, each in register tiles (dot_tiles, mix_tiles): the dots of the
// R source rows with the 2S rows gu_q and c_q, the dx_j as weighted sums of those 2S rows, and dc as weighted sums
// of the source rows.
template <class K>
void stats_backward_kernel(const typename K::acc* grad_z, const std::vector<Rows<const typename K::acc>>& grad_u,
                           const std::vector<Rows<const typename K::raw>>& src, const typename K::acc* cs,
                           int64_t n_q, const typename K::acc* m, const typename K::acc* rstd, int64_t n_tok,
                           int64_t d, const std::vector<typename K::raw*>& grads, bool accumulate,
                           typename K::acc* dcs) {
  using A = typename K::acc;
  using R = typename K::raw;
  const int64_t n_src = int64_t(src.size()), n_y = 2 * n_q;
  // per-thread partial sums of dcs, added up in thread order after the loop (deterministic)
  const int64_t n_threads = at::get_num_threads();
  std::vector<A> dcs_part(n_threads * n_q * d, A(0));
  parallel_tokens(n_tok, grain_size(n_src + n_q, d), [&](int64_t begin, int64_t end) {
    A* dcs_acc = dcs_part.data() + at::get_thread_num() * n_q * d;
    // y = [gu_0 .. gu_{S-1}, c_0 .. c_{S-1}]; dots[j * 2S + k] = x_j . y_k, then the weights of y_k in dx_j;
    // coef_t[q * R + j] = coef_qj (the weights of the x_j in dc_q); p[j * S + q] = p_qj
    std::vector<A> dots(n_src * n_y), coef_t(n_q * n_src), x_scale(n_src), p(n_src * n_q);
    std::vector<const A*> y(n_y);
    std::vector<const R*> x(n_src);
    for (int64_t q = 0; q < n_q; ++q) y[n_q + q] = cs + q * d;
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t j = 0; j < n_src; ++j) x[j] = src[j][n];
      for (int64_t q = 0; q < n_q; ++q) y[q] = grad_u[q][n];
      dot_tiles<K>(x.data(), n_src, y.data(), n_y, d, dots.data(), n_y);
      for (int64_t j = 0; j < n_src; ++j) {  // the scores s_qj in place of the dots with c, then the p_qj
        A* sj = dots.data() + j * n_y + n_q;
        for (int64_t q = 0; q < n_q; ++q) p[j * n_q + q] = (sj[q] *= rstd[j * n_tok + n]) - m[q * n_tok + n];
      }
      exp_in_place(p.data(), n_src * n_q);
      for (int64_t j = 0; j < n_src; ++j) {
        const A r = rstd[j * n_tok + n];
        A* wj = dots.data() + j * n_y;
        A sum = 0;
        for (int64_t q = 0; q < n_q; ++q) {
          const A s = wj[n_q + q], pq = p[j * n_q + q];
          const A coef = pq * (grad_z[q * n_tok + n] + wj[q]) * r;
          sum += coef * s;
          wj[q] = pq, wj[n_q + q] = coef_t[q * n_src + j] = coef;
        }
        x_scale[j] = sum * r / A(d);
      }
      mix_tiles<Plain<A>>(y.data(), n_y, dots.data(), n_y, n_src, d, [&](int64_t j, int64_t i, auto v) {
        R* dst = grads[j] + n * d + i;  // accumulate: the sum so far plus this gradient, rounded once
        if constexpr (std::is_same_v<decltype(v), A>) {
          const A dx = v - x_scale[j] * K::load(x[j][i]);
          *dst = K::store(accumulate ? K::load(*dst) + dx : dx);
        } else {
          const auto dx = v - splat(x_scale[j]) * K::vload(x[j] + i);
          K::vstore(dst, accumulate ? K::vload(dst) + dx : dx);
        }
      });
      mix_tiles<K>(x.data(), n_src, coef_t.data(), n_src, n_q, d, [&](int64_t q, int64_t i, auto v) {
        A* dst = dcs_acc + q * d + i;
        if constexpr (std::is_same_v<decltype(v), A>) {
          *dst += v;
        } else {
          Plain<A>::vstore(dst, Plain<A>::vload(dst) + v);
        }
      });
    }
  });
  for (int64_t t = 0; t < n_threads; ++t)
    for (int64_t i = 0; i < n_q * d; ++i) dcs[i] += dcs_part[t * n_q * d + i];
}

// The fused inference ops of attnres/ops/bank.py, per token: the pending residual add (prefix += output, rounded to
// the storage format as torch's add_ rounds it), at a write point the copy of the prefix into bank row nvb, then the
// mixing. bank_aggregate mixes bank rows 0..nvb-1 and the prefix through forward_tile, in tiles as the one-shot
// forward takes them, so its result is the one-shot op's over the same rows bit for bit; bank_merge merges the
// prefix's score into phase-1 statistics (m, z, u) of the bank rows.
template <class K>
inline void add_row(typename K::raw* dst, const typename K::raw* src, int64_t d) {
  constexpr int64_t w = kWidth<typename K::acc>;
  int64_t i = 0;
  for (; i + w <= d; i += w) K::vstore(dst + i, K::vload(dst + i) + K::vload(src + i));
  for (; i < d; ++i) dst[i] = K::store(K::load(dst[i]) + K::load(src[i]));
}

template <class K>
void bank_aggregate_kernel(Rows<typename K::raw> bank, int64_t row_stride, int64_t nvb,
                           Rows<typename K::raw> prefix, Rows<const typename K::raw> output,
                           const typename K::acc* c, const typename K::acc* out_w, double eps, double out_eps,
                           bool write, int64_t n_tok, int64_t d, typename K::raw* out) {
  using R = typename K::raw;
  const int64_t n_src = nvb + 1;  // the bank rows and the prefix (which is bank row nvb at a write point)
  const int64_t tile = tile_tokens(n_src, d, sizeof(R));
  parallel_tokens(n_tok, std::max(grain_size(n_src, d), tile), [&](int64_t begin, int64_t end) {
    ForwardScratch<typename K::acc> s(n_src, d, std::min(tile, end - begin));
    std::vector<const R*> x(tile * n_src);
    for (int64_t n0 = begin; n0 < end; n0 += tile) {
      const int64_t n = std::min(tile, end - n0);
      for (int64_t t = 0; t < n; ++t) {
        R* const pre = prefix[n0 + t];
        if (output.data != nullptr) add_row<K>(pre, output[n0 + t], d);
        if (write) std::memcpy(bank[n0 + t] + nvb * row_stride, pre, d * sizeof(R));
        for (int64_t j = 0; j < nvb; ++j) x[t * n_src + j] = bank[n0 + t] + j * row_stride;
        x[t * n_src + nvb] = pre;
      }
      forward_tile<K>(x.data(), n, n_src, c, out_w, eps, out_eps, d, s, out + n0 * d);
    }
  });
}

// Per token: s = (c . x) rstd(x) for the prefix x, then with top = max(m, s), a = exp(m - top), b = exp(s - top):
// mixture = (a u + b x) / (a z + b).
template <class K>
void bank_merge_kernel(const typename K::acc* m, const typename K::acc* z, Rows<const typename K::acc> u,
                       Rows<typename K::raw> prefix, Rows<const typename K::raw> output, const typename K::acc* c,
                       const typename K::acc* out_w, double eps, double out_eps, int64_t n_tok, int64_t d,
                       typename K::raw* out) {
  using A = typename K::acc;
  parallel_tokens(n_tok, grain_size(2, d), [&](int64_t begin, int64_t end) {
    std::vector<A> x(d), acc(d);
    Vec<A> scratch[4];
    for (int64_t n = begin; n < end; ++n) {
      if (output.data != nullptr) add_row<K>(prefix[n], output[n], d);
      load_row<K>(x.data(), prefix[n], d);
      const A* rows[2] = {u[n], x.data()};
      A xc, sq;
      dot_rows<Plain<A>>(rows + 1, 1, &c, 1, d, scratch, &xc, &sq);
      const A s = xc * rsqrt(sq / A(d) + A(eps)), top = std::max(m[n], s);
      const A p[2] = {std::exp(m[n] - top), std::exp(s - top)};
      mix_rows<Plain<A>>(rows, p, 2, false, A(0), d, acc.data());
      store_mixture<K>(out + n * d, acc.data(), A(1) / (p[0] * z[n] + p[1]), out_w, out_eps, d);
    }
  });
}

// Phase 2 of a group of Full points (attnres/ops/merge.py, merge_sources), per token: the point's phase-1 statistics
// (m, z, u) merged with the K sources written since. merge_token leaves acc = e_a u + sum_k e_k x_k and returns
// Z = e_a z + sum_k e_k, with each source's e_k, score s_k and key rstd r_k (the forward's and the backward's code).
template <class K>
struct SourcesMerge {
  using A = typename K::acc;
  const A *m, *z;
  Rows<const A> u;
  const std::vector<Rows<const typename K::raw>>& src;
  const A *c, *out_w;
  double eps, out_eps;
  int64_t n_tok, d;
};

template <class K, class A = typename K::acc>
A merge_token(const SourcesMerge<K>& a, int64_t n, const typename K::raw** x, A* e, A* s, A* r, A& ea, A* acc) {
  const int64_t count = int64_t(a.src.size()), d = a.d;
  for (int64_t k = 0; k < count; ++k) x[k] = a.src[k][n];
  dot_tiles<K>(x, count, &a.c, 1, d, s, 1);
  A top = a.m[n];
  for (int64_t k = 0; k < count; ++k) {
    r[k] = rsqrt(sum_squares<K>(x[k], d) / A(d) + A(a.eps));
    s[k] *= r[k];
    top = std::max(top, s[k]);
  }
  ea = std::exp(a.m[n] - top);
  A z = ea * a.z[n];
  for (int64_t k = 0; k < count; ++k) z += e[k] = std::exp(s[k] - top);
  std::memcpy(acc, a.u[n], d * sizeof(A));
  mix_rows<K>(x, e, count, true, ea, d, acc);
  return z;
}

template <class K>
void merge_sources_kernel(const SourcesMerge<K>& a, typename K::raw* out) {
  using A = typename K::acc;
  const int64_t count = int64_t(a.src.size()), d = a.d;
  parallel_tokens(a.n_tok, grain_size(count + 2, d), [&](int64_t begin, int64_t end) {
    std::vector<A> e(count), s(count), r(count), acc(d);
    std::vector<const typename K::raw*> x(count);
    for (int64_t n = begin; n < end; ++n) {
      A ea;
      const A z = merge_token<K>(a, n, x.data(), e.data(), s.data(), r.data(), ea, acc.data());
      store_mixture<K>(out + n * d, acc.data(), A(1) / z, a.out_w, a.out_eps, d);
    }
  });
}

// Its backward, per token: h again, the gradient g reaching it (through the output norm), then with p_k = e_k / Z
//   coef_k = p_k (g . x_k - g . h) r_k,  dx_k = p_k g + coef_k c - coef_k s_k r_k / d x_k,  dc += coef_k x_k,
//   du = e_a g / Z,  dz = -e_a (g . h) / Z.
template <class K>
void merge_sources_backward_kernel(const SourcesMerge<K>& a, Rows<const typename K::raw> grad_out,
                                   const std::vector<typename K::raw*>& grads, typename K::acc* du,
                                   typename K::acc* dz, typename K::acc* dc, typename K::acc* d_out_w) {
  using A = typename K::acc;
  using R = typename K::raw;
  using P = Plain<A>;
  constexpr int64_t w = kWidth<A>;
  const int64_t count = int64_t(a.src.size()), d = a.d;
  const int64_t n_threads = at::get_num_threads();
  std::vector<A> dc_part(n_threads * d, A(0)), dw_part(a.out_w ? n_threads * d : 0, A(0));
  parallel_tokens(a.n_tok, grain_size(2 * count + 3, d), [&](int64_t begin, int64_t end) {
    A* dc_acc = dc_part.data() + at::get_thread_num() * d;
    A* dw_acc = a.out_w ? dw_part.data() + at::get_thread_num() * d : nullptr;
    std::vector<A> e(count), s(count), r(count), gx(count), h(d), g(d);
    std::vector<const R*> x(count);
    for (int64_t n = begin; n < end; ++n) {
      A ea;
      const A inv_z = A(1) / merge_token<K>(a, n, x.data(), e.data(), s.data(), r.data(), ea, h.data());
      for (int64_t i = 0; i < d; ++i) h[i] *= inv_z;
      load_row<K>(g.data(), grad_out[n], d);
      if (a.out_w != nullptr) out_norm_backward(g.data(), h.data(), a.out_w, a.out_eps, d, dw_acc);
      const A* gp = g.data();
      const A* hp = h.data();
      A gh;
      dot_tiles<Plain<A>>(&hp, 1, &gp, 1, d, &gh, 1);
      dot_tiles<K>(x.data(), count, &gp, 1, d, gx.data(), 1);
      for (int64_t k = 0; k < count; ++k) {
        const A p = e[k] * inv_z, coef = p * (gx[k] - gh) * r[k], shrink = coef * s[k] * r[k] / A(d);
        R* dx = grads[k] + n * d;
        int64_t i = 0;
        for (; i + w <= d; i += w) {
          const Vec<A> xv = K::vload(x[k] + i);
          K::vstore(dx + i, source_grad(splat(p), P::vload(gp + i), splat(coef), P::vload(a.c + i), splat(shrink), xv));
          P::vstore(dc_acc + i, P::vload(dc_acc + i) + splat(coef) * xv);
        }
        for (; i < d; ++i) {
          const A xv = K::load(x[k][i]);
          dx[i] = K::store(source_grad(p, gp[i], coef, a.c[i], shrink, xv));
          dc_acc[i] += coef * xv;
        }
      }
      const A wa = ea * inv_z;
      store_row<Plain<A>>(du + n * d, gp, wa, static_cast<const A*>(nullptr), d);
      dz[n] = -wa * gh;
    }
  });
  for (int64_t t = 0; t < n_threads; ++t) {
    if (count > 0)
      for (int64_t i = 0; i < d; ++i) dc[i] += dc_part[t * d + i];
    if (a.out_w != nullptr)
      for (int64_t i = 0; i < d; ++i) d_out_w[i] += dw_part[t * d + i];
  }
}

// Calls f(K{}) with the storage format of `dtype`.
template <class F>
void dispatch(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(F32{});
    case at::kDouble: return f(F64{});
    case at::kBFloat16: return f(BF16{});
    case at::kHalf: return f(F16{});
    default: TORCH_CHECK(false, "attnres_cpu: unsupported source dtype ", dtype);
  }
}

// `t` (n tokens of d elements) as [n, d] rows with unit stride along d: a view where its strides allow one (leading
// dims that flatten into one token stride, as for a bank row bank[:, j] or an expanded gradient), a copy otherwise.
at::Tensor as_rows(const at::Tensor& t, int64_t n, int64_t d) {
  auto rows = t.reshape({n, d});
  return rows.stride(1) == 1 || d == 1 ? rows : rows.contiguous();
}

template <class T>
Rows<T> rows_of(const at::Tensor& rows) {  // rows from as_rows
  return {static_cast<T*>(rows.data_ptr()), rows.stride(0)};
}

// The stride between the [N, d] rows of t [..., d] read in place, or -1 where they cannot be (the last dim not unit
// stride, or leading dims that do not flatten to one stride): as_rows without making a view, which costs more than a
// decode step's whole point for each of Full's many sources.
int64_t row_stride(const at::Tensor& t, int64_t d) {
  if (d != 1 && t.stride(-1) != 1) return -1;
  int64_t stride = d, span = -1;  // span: the extent the next non-unit leading dim must step by
  for (int64_t i = t.dim() - 2; i >= 0; --i) {
    if (t.size(i) == 1) continue;
    if (span != -1 && t.stride(i) != span) return -1;
    if (span == -1) stride = t.stride(i);
    span = t.stride(i) * t.size(i);
  }
  return stride;
}

// Host side: inputs are brought to the layout the kernels read (sources and gradients as [N, d] rows, see as_rows;
// vectors and [R, N] rows contiguous in the accumulator dtype; copies only where the caller's tensors differ). The
// Python layer has validated shapes.
// Sources read as [N, d] rows: each one's first row and row stride, in place where its strides allow (row_stride), else
// through a contiguous copy kept here.
struct SourceRows {
  std::vector<const void*> first_rows;
  std::vector<int64_t> row_strides;
  std::vector<at::Tensor> copies;

  void add(const at::Tensor& x, int64_t n_tok, int64_t d) {
    if (const int64_t stride = row_stride(x, d); stride >= 0) {
      first_rows.push_back(x.data_ptr());
      row_strides.push_back(stride);
    } else {
      copies.push_back(as_rows(x, n_tok, d));
      first_rows.push_back(copies.back().data_ptr());
      row_strides.push_back(copies.back().stride(0));
    }
  }
  template <class T>
  std::vector<Rows<const T>> source_rows() const {
    std::vector<Rows<const T>> out;
    for (size_t j = 0; j < first_rows.size(); ++j)
      out.push_back({static_cast<const T*>(first_rows[j]), row_strides[j]});
    return out;
  }
};

struct Problem : SourceRows {
  at::ScalarType dtype, acc;
  int64_t n_src, n_tok, d;
  std::vector<int64_t> shape;      // [..., d]: the shape of a source
  std::vector<int64_t> row_shape;  // [R, ...]: the shape of weights and rstd

  explicit Problem(at::TensorList xs) : n_src(int64_t(xs.size())) {
    TORCH_CHECK(n_src > 0 && xs[0].dim() > 0 && xs[0].size(-1) > 0, "attnres_cpu: expected sources [..., d], d >= 1");
    dtype = xs[0].scalar_type();
    acc = dtype == at::kDouble ? at::kDouble : at::kFloat;
    d = xs[0].size(-1);
    n_tok = xs[0].numel() / d;
    shape = xs[0].sizes().vec();
    row_shape = {n_src};
    for (int64_t i = 0; i + 1 < xs[0].dim(); ++i) row_shape.push_back(xs[0].size(i));
    for (const auto& x : xs) {
      TORCH_CHECK(x.device().is_cpu() && x.sizes() == xs[0].sizes() && x.scalar_type() == dtype,
                  "attnres_cpu: sources must be CPU tensors of one shape and dtype");
      add(x, n_tok, d);
    }
  }

  at::Tensor vector(const at::Tensor& t) const {  // [d] in the accumulator dtype
    TORCH_CHECK(t.device().is_cpu() && t.numel() == d, "attnres_cpu: expected a CPU vector of ", d, " elements");
    return t.reshape({d}).to(acc).contiguous();
  }
  at::Tensor queries(const at::Tensor& t) const {  // [S, d] in the accumulator dtype
    TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.size(1) == d && t.size(0) > 0,
                "attnres_cpu: expected CPU queries [S, ", d, "], S >= 1");
    return t.to(acc).contiguous();
  }
  at::Tensor rows(const at::Tensor& t, int64_t count) const {  // [count, N] in the accumulator dtype
    TORCH_CHECK(t.device().is_cpu() && t.numel() == count * n_tok, "attnres_cpu: expected CPU rows of ", count,
                " * N = ", count * n_tok, " elements");
    return t.to(acc).contiguous();
  }
  std::vector<at::Tensor> new_sources() const;  // R new outputs of a source's shape and dtype (gradients)
};

// A new contiguous output. Large ones are backed by transparent huge pages where the kernel allows it (Linux, THP
// "madvise" or "always"): the kernels write outputs of hundreds of MiB into freshly mapped memory, and faulting that
// in 4 KiB pages costs more than the writes themselves. torch does the same for all its allocations under
// THP_MEM_ALLOC_ENABLE=1.
at::Tensor new_output(at::IntArrayRef sizes, at::ScalarType dtype) {
  auto t = at::empty(sizes, at::TensorOptions().dtype(dtype));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t huge = uintptr_t(2) << 20;
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t first = (begin + huge - 1) & ~(huge - 1), last = (begin + t.nbytes()) & ~(huge - 1);
  if (last >= first + 2 * huge) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#endif
  return t;
}

std::vector<at::Tensor> Problem::new_sources() const {
  std::vector<at::Tensor> out;
  for (int64_t j = 0; j < n_src; ++j) out.push_back(new_output(shape, dtype));
  return out;
}

template <class T>
std::vector<T*> pointers(const std::vector<at::Tensor>& ts) {
  std::vector<T*> out;
  for (const auto& t : ts) out.push_back(static_cast<T*>(t.data_ptr()));
  return out;
}

template <class A>
const A* data_or_null(const std::optional<at::Tensor>& t) {
  return t ? t->data_ptr<A>() : nullptr;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const Problem& p, const at::Tensor& cv,
                                                       const std::optional<at::Tensor>& out_norm_weight, double eps,
                                                       double out_eps) {  // cv: c from p.vector
  auto out_w = out_norm_weight ? std::optional(p.vector(*out_norm_weight)) : std::nullopt;
  auto out = new_output(p.shape, p.dtype);
  auto weights = at::empty(p.row_shape, cv.options());
  auto rstd = at::empty(p.row_shape, cv.options());
  dispatch(p.dtype, [&](auto k) {
    using K = decltype(k);
    using A = typename K::acc;
    forward_kernel<K>(p.source_rows<typename K::raw>(), cv.data_ptr<A>(), data_or_null<A>(out_w), eps, out_eps,
                      p.n_tok, p.d, static_cast<typename K::raw*>(out.data_ptr()), weights.data_ptr<A>(),
                      rstd.data_ptr<A>());
  });
  return {out, weights, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> depth_attention_fwd(
    at::TensorList sources, const at::Tensor& c, const std::optional<at::Tensor>& out_norm_weight, double eps,
    double out_eps) {
  Problem p(sources);
  return forward(p, p.vector(c), out_norm_weight, eps, out_eps);
}

// The backward with the source gradients in `grads`, R [N, d] contiguous rows: added onto the first `accumulate`,
// written into the others.
std::tuple<at::Tensor, at::Tensor> backward_into(const at::Tensor& grad_out,
                                                 const std::optional<at::Tensor>& grad_weights, const Problem& p,
                                                 const at::Tensor& c, const std::optional<at::Tensor>& out_norm_weight,
                                                 const at::Tensor& weights, const at::Tensor& rstd, double out_eps,
                                                 const std::vector<at::Tensor>& grads, int64_t accumulate) {
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef(p.shape), "attnres_cpu: grad_out must have the sources' shape");
  auto g = as_rows(grad_out.to(p.dtype), p.n_tok, p.d);
  auto gw = grad_weights ? std::optional(p.rows(*grad_weights, p.n_src)) : std::nullopt;
  auto cv = p.vector(c);
  auto out_w = out_norm_weight ? std::optional(p.vector(*out_norm_weight)) : std::nullopt;
  auto w = p.rows(weights, p.n_src), r = p.rows(rstd, p.n_src);
  auto dc = at::zeros_like(cv);
  auto d_out_w = at::zeros_like(cv);
  dispatch(p.dtype, [&](auto k) {
    using K = decltype(k);
    using A = typename K::acc;
    using R = typename K::raw;
    const auto src = p.source_rows<R>();
    const auto into = pointers<R>(grads);
    const BackwardArgs<K> args{rows_of<const R>(g), data_or_null<A>(gw), src, cv.data_ptr<A>(),
                               data_or_null<A>(out_w), w.data_ptr<A>(), r.data_ptr<A>(), out_eps, p.n_tok, p.d, into,
                               accumulate};
    backward_kernel<K>(args, dc.data_ptr<A>(), d_out_w.data_ptr<A>());
  });
  return {dc, d_out_w};
}

// backward_into with the gradients in `into`: one contiguous CPU tensor per source, of its elements and dtype; the
// first `accumulate` (0 .. R) are added onto.
std::tuple<at::Tensor, at::Tensor> backward_into(const at::Tensor& grad_out,
                                                 const std::optional<at::Tensor>& grad_weights, const Problem& p,
                                                 const at::Tensor& c, const std::optional<at::Tensor>& out_norm_weight,
                                                 const at::Tensor& weights, const at::Tensor& rstd, double out_eps,
                                                 at::TensorList into, int64_t accumulate) {
  TORCH_CHECK(int64_t(into.size()) == p.n_src && 0 <= accumulate && accumulate <= p.n_src,
              "attnres_cpu: expected one `into` tensor per source and 0 <= accumulate <= R");
  for (const auto& t : into)
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == p.dtype &&
                    t.numel() == p.n_tok * p.d,
                "attnres_cpu: each `into` tensor must be a contiguous CPU tensor of a source's elements in its dtype");
  return backward_into(grad_out, grad_weights, p, c, out_norm_weight, weights, rstd, out_eps, into.vec(), accumulate);
}

// backward_into with the gradients written into new rows: (grads, dc, d_out_w).
std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor> backward_new(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_weights, const Problem& p, const at::Tensor& c,
    const std::optional<at::Tensor>& out_norm_weight, const at::Tensor& weights, const at::Tensor& rstd,
    double out_eps) {
  auto grads = p.new_sources();
  auto [dc, d_out_w] =
      backward_into(grad_out, grad_weights, p, c, out_norm_weight, weights, rstd, out_eps, grads, 0);
  return {grads, dc, d_out_w};
}

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor> depth_attention_bwd(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_weights, at::TensorList sources,
    const at::Tensor& c, const std::optional<at::Tensor>& out_norm_weight, const at::Tensor& weights,
    const at::Tensor& rstd, double out_eps) {
  return backward_new(grad_out, grad_weights, Problem(sources), c, out_norm_weight, weights, rstd, out_eps);
}

std::tuple<at::Tensor, at::Tensor> depth_attention_bwd_into(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_weights, at::TensorList sources,
    const at::Tensor& c, const std::optional<at::Tensor>& out_norm_weight, const at::Tensor& weights,
    const at::Tensor& rstd, double out_eps, at::TensorList into, int64_t accumulate) {
  return backward_into(grad_out, grad_weights, Problem(sources), c, out_norm_weight, weights, rstd, out_eps, into,
                       accumulate);
}

// An aggregation point's kernels in one call each, from its parameters: the query folded (c = g * w, in the
// accumulator dtype) before the forward, and after the backward the gradients of w, g and the output-norm gain in
// their own dtypes and shapes (w's `[1, d]` or `[d]`; none for an absent gain), as autograd forms them through the
// fold. Between two kernels a model runs a sublayer, and each separate op on these `[d]` vectors would then cost the
// Python and dispatcher work of a cold cache, far more than the products themselves.
at::Tensor fold_query(const Problem& p, const at::Tensor& query, const std::optional<at::Tensor>& gain) {
  auto w = p.vector(query);
  return gain ? at::mul(w, p.vector(*gain)) : w.clone();  // an output of its own, never a view of the query
}

using ParameterGrads = std::tuple<at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>>;

ParameterGrads parameter_grads(const Problem& p, const at::Tensor& dc, const at::Tensor& query,
                               const std::optional<at::Tensor>& gain,
                               const std::optional<at::Tensor>& out_norm_weight, const at::Tensor& d_out_w) {
  auto d_query = (gain ? at::mul(dc, p.vector(*gain)) : dc).to(query.scalar_type()).view(query.sizes());
  std::optional<at::Tensor> d_gain, d_norm;
  if (gain) d_gain = at::mul(dc, p.vector(query)).to(gain->scalar_type());
  if (out_norm_weight) d_norm = d_out_w.to(out_norm_weight->scalar_type());
  return {d_query, d_gain, d_norm};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> point_fwd(
    at::TensorList sources, const at::Tensor& query, const std::optional<at::Tensor>& gain,
    const std::optional<at::Tensor>& out_norm_weight, double eps, double out_eps) {
  Problem p(sources);
  auto c = fold_query(p, query, gain);
  auto [out, weights, rstd] = forward(p, c, out_norm_weight, eps, out_eps);
  return {out, weights, rstd, c};
}

std::tuple<std::vector<at::Tensor>, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>> point_bwd(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_weights, at::TensorList sources,
    const at::Tensor& c, const at::Tensor& query, const std::optional<at::Tensor>& gain,
    const std::optional<at::Tensor>& out_norm_weight, const at::Tensor& weights, const at::Tensor& rstd,
    double out_eps) {
  Problem p(sources);
  auto [grads, dc, d_out_w] = backward_new(grad_out, grad_weights, p, c, out_norm_weight, weights, rstd, out_eps);
  auto [d_query, d_gain, d_norm] = parameter_grads(p, dc, query, gain, out_norm_weight, d_out_w);
  return {grads, d_query, d_gain, d_norm};
}

ParameterGrads point_bwd_into(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_weights, at::TensorList sources,
    const at::Tensor& c, const at::Tensor& query, const std::optional<at::Tensor>& gain,
    const std::optional<at::Tensor>& out_norm_weight, const at::Tensor& weights, const at::Tensor& rstd,
    double out_eps, at::TensorList into, int64_t accumulate) {
  Problem p(sources);
  auto [dc, d_out_w] = backward_into(grad_out, grad_weights, p, c, out_norm_weight, weights, rstd, out_eps, into,
                                     accumulate);
  return parameter_grads(p, dc, query, gain, out_norm_weight, d_out_w);
}

// An aggregation point as one op with its own autograd node (the ops `point` and `chained_point`, the CPU twins of
// `_Point` and `_ChainedPoint` in attnres/ops/depth_attention.py and chain.py, which they equal bit for bit):
// between two points a model runs a sublayer, and a Python autograd Function then pays a cold cache's interpreter work
// to enter its forward, to unpack what it saved and to build its gradients, at every point, forward and backward.
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::optional<at::Tensor> present(const at::Tensor& t) { return t.defined() ? std::optional(t) : std::nullopt; }

at::Tensor grad_or_zeros(const at::Tensor& grad, const at::Tensor& like) {  // the kernels' contiguous grad_out
  return grad.defined() ? grad.contiguous() : at::zeros_like(like);
}

// A point's backward (`gradients`, run without building a graph) is not itself differentiable, its kernels are not: as
// with Python's @once_differentiable, under create_graph the gradients it returns raise when differentiated again,
// never a silently partial graph.
template <class F>
variable_list once_differentiable(const variable_list& grad_outputs, F&& gradients) {
  variable_list grads;
  {
    at::AutoGradMode no_graph(false);
    grads = gradients();
  }
  const bool tracked = std::any_of(grad_outputs.begin(), grad_outputs.end(),
                                   [](const at::Tensor& g) { return g.defined() && g.requires_grad(); });
  if (!at::GradMode::is_enabled() || !tracked) return grads;
  for (auto& g : grads)
    if (g.defined()) g = g.detach().requires_grad_(true);
  return torch::autograd::DelayedError("attnres_cpu: a depth-attention point's backward is not differentiable: "
                                       "it cannot be differentiated twice (create_graph)",
                                       int64_t(grads.size()))
      .apply(std::move(grads));
}

// [R, ...]: the shape of R rows shaped like x (a chain's carrier and its gradient sums).
std::vector<int64_t> rows_shape(int64_t n_rows, const at::Tensor& x) {
  std::vector<int64_t> sizes{n_rows};
  sizes.insert(sizes.end(), x.sizes().begin(), x.sizes().end());
  return sizes;
}

// What a point's backward needs: c, the parameters (saved undefined where absent), weights, rstd, the sources, and
// the output norm's epsilon.
struct SavedPoint {
  at::Tensor c, query;
  std::optional<at::Tensor> gain, out_norm_weight;
  at::Tensor weights, rstd;
  std::vector<at::Tensor> sources;
  double out_eps;

  static void save(AutogradContext* ctx, at::TensorList sources, const at::Tensor& query,
                   const std::optional<at::Tensor>& gain, const std::optional<at::Tensor>& out_norm_weight,
                   const at::Tensor& c, const at::Tensor& weights, const at::Tensor& rstd, double out_eps) {
    variable_list saved{c, query, gain.value_or(at::Tensor()), out_norm_weight.value_or(at::Tensor()), weights, rstd};
    saved.insert(saved.end(), sources.begin(), sources.end());
    ctx->save_for_backward(std::move(saved));
    ctx->saved_data["out_eps"] = out_eps;
  }
  explicit SavedPoint(AutogradContext* ctx) {
    auto saved = ctx->get_saved_variables();
    c = saved[0], query = saved[1], gain = present(saved[2]), out_norm_weight = present(saved[3]);
    weights = saved[4], rstd = saved[5];
    sources.assign(saved.begin() + 6, saved.end());
    out_eps = ctx->saved_data["out_eps"].toDouble();
  }
};

// (out, weights, rstd): depth_attention's eager point. The weights carry a gradient; rstd does not.
struct Point : torch::autograd::Function<Point> {
  static variable_list forward(AutogradContext* ctx, at::TensorList sources, const at::Tensor& query,
                               const std::optional<at::Tensor>& gain,
                               const std::optional<at::Tensor>& out_norm_weight, double eps, double out_eps) {
    auto [out, weights, rstd, c] = point_fwd(sources, query, gain, out_norm_weight, eps, out_eps);
    SavedPoint::save(ctx, sources, query, gain, out_norm_weight, c, weights, rstd, out_eps);
    ctx->mark_non_differentiable({rstd});
    ctx->set_materialize_grads(false);
    return {out, weights, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return once_differentiable(grads, [&] { return gradients(ctx, grads); });
  }

  static variable_list gradients(AutogradContext* ctx, const variable_list& grads) {
    SavedPoint s(ctx);
    auto [dx, d_query, d_gain, d_norm] =
        point_bwd(grad_or_zeros(grads[0], s.sources[0]), present(grads[1]), s.sources, s.c, s.query, s.gain,
                  s.out_norm_weight, s.weights, s.rstd, s.out_eps);
    variable_list out(dx.begin(), dx.end());  // one per argument of forward: sources, parameters, the epsilons
    out.insert(out.end(), {d_query, d_gain.value_or(at::Tensor()), d_norm.value_or(at::Tensor()), {}, {}});
    return out;
  }
};

// (out, carrier): a point of a chain (attnres/ops/chain.py). Only `tracked` are autograd inputs; `older`, a
// std::vector that autograd does not look into, get their gradients through the carrier. The carrier handed on covers
// every source, or all but the newest (`carry_newest` false: no later point reads it).
struct ChainedPoint : torch::autograd::Function<ChainedPoint> {
  static variable_list forward(AutogradContext* ctx, at::TensorList tracked, const std::vector<at::Tensor>& older,
                               const std::optional<at::Tensor>& carrier, const at::Tensor& query,
                               const std::optional<at::Tensor>& gain,
                               const std::optional<at::Tensor>& out_norm_weight, double eps, double out_eps,
                               bool carry_newest) {
    std::vector<at::Tensor> sources(older);
    sources.insert(sources.end(), tracked.begin(), tracked.end());
    auto [out, weights, rstd, c] = point_fwd(sources, query, gain, out_norm_weight, eps, out_eps);
    SavedPoint::save(ctx, sources, query, gain, out_norm_weight, c, weights, rstd, out_eps);
    const int64_t carry = int64_t(sources.size()) - !carry_newest;
    ctx->saved_data["older"] = int64_t(older.size());
    ctx->saved_data["carry"] = carry;
    ctx->set_materialize_grads(false);  // an unused carrier ends the chain: no zero buffer for it
    // the carrier's value is nothing: one element, zero strides
    const auto sizes = rows_shape(carry, sources[0]);
    return {out, at::empty_strided(sizes, std::vector<int64_t>(sizes.size(), 0), sources[0].options())};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return once_differentiable(grads, [&] { return gradients(ctx, grads); });
  }

  static variable_list gradients(AutogradContext* ctx, const variable_list& grads) {
    SavedPoint s(ctx);
    const auto& x = s.sources[0];
    const int64_t n_src = int64_t(s.sources.size()), older = ctx->saved_data["older"].toInt(),
                  carry = ctx->saved_data["carry"].toInt();
    // the carried sources' gradients: the later points' sums, added onto in place (anything but our own buffer is
    // copied first), or new rows, on huge pages where the system has them (every earlier point of the chain reads and
    // writes them, all of them at each Block point); a source past them (not carried on) gets a new gradient
    const bool accumulate = grads[1].defined();
    const at::Tensor carried = accumulate ? grads[1].contiguous() : new_output(rows_shape(carry, x), x.scalar_type());
    std::vector<at::Tensor> into = carried.unbind(0);
    for (int64_t j = carry; j < n_src; ++j) into.push_back(at::empty_like(x, at::MemoryFormat::Contiguous));
    // no grad_out where only the carrier is used further on: nothing of this point's own to add (zeros)
    auto [d_query, d_gain, d_norm] =
        point_bwd_into(grad_or_zeros(grads[0], x), std::nullopt, s.sources, s.c, s.query, s.gain, s.out_norm_weight,
                       s.weights, s.rstd, s.out_eps, into, accumulate ? carry : 0);
    // the tracked sources' gradients are complete; the older ones go on summing in the previous point
    variable_list out(into.begin() + older, into.end());
    at::Tensor back = older > 0 ? carried.narrow(0, 0, older) : at::Tensor();
    out.insert(out.end(), {at::Tensor(), back, d_query, d_gain.value_or(at::Tensor()),
                           d_norm.value_or(at::Tensor()), {}, {}, {}});
    return out;
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> point(at::TensorList sources, const at::Tensor& query,
                                                     const std::optional<at::Tensor>& gain,
                                                     const std::optional<at::Tensor>& out_norm_weight, double eps,
                                                     double out_eps) {
  auto r = Point::apply(sources, query, gain, out_norm_weight, eps, out_eps);
  return {r[0], r[1], r[2]};
}

std::tuple<at::Tensor, at::Tensor> chained_point(at::TensorList tracked, at::TensorList older,
                                                 const std::optional<at::Tensor>& carrier, const at::Tensor& query,
                                                 const std::optional<at::Tensor>& gain,
                                                 const std::optional<at::Tensor>& out_norm_weight, double eps,
                                                 double out_eps, bool carry_newest) {
  auto r = ChainedPoint::apply(tracked, older.vec(), carrier, query, gain, out_norm_weight, eps, out_eps,
                               carry_newest);
  return {r[0], r[1]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> depth_stats_fwd(at::TensorList sources,
                                                                          const at::Tensor& cs, double eps) {
  Problem p(sources);
  auto c = p.queries(cs);
  const int64_t n_q = c.size(0);
  auto m = at::empty({n_q, p.n_tok}, c.options());
  auto z = at::empty({n_q, p.n_tok}, c.options());
  auto u = new_output({n_q, p.n_tok, p.d}, p.acc);
  auto rstd = at::empty({p.n_src, p.n_tok}, c.options());
  dispatch(p.dtype, [&](auto k) {
    using K = decltype(k);
    using A = typename K::acc;
    stats_forward_kernel<K>(p.source_rows<typename K::raw>(), c.data_ptr<A>(), n_q, eps, p.n_tok, p.d,
                            m.data_ptr<A>(), z.data_ptr<A>(), u.data_ptr<A>(), rstd.data_ptr<A>());
  });
  return {m, z, u, rstd};
}

// Phase 1's backward with grad_u as S rows `[N, d]` (each query's, read in place; an absent one is zeros), or as
// the `[S, N, d]` tensor of depth_stats_bwd: a group of Full points hands each query's gradient on as its own tensor
// (attnres/ops/two_phase.py, depth_stats_per_query), which a stack would copy. The source gradients go to `grads`
// (R [N, d] rows, written or, with `accumulate`, added into); returns dcs.
at::Tensor stats_backward(const Problem& p, const at::Tensor& grad_z,
                          const std::vector<std::optional<at::Tensor>>& grad_u, const at::Tensor& cs,
                          const at::Tensor& m, const at::Tensor& rstd, const std::vector<at::Tensor>& grads,
                          bool accumulate) {
  auto c = p.queries(cs);
  const int64_t n_q = c.size(0);
  TORCH_CHECK(int64_t(grad_u.size()) == n_q, "attnres_cpu: expected grad_u for each of the ", n_q, " queries");
  auto gz = p.rows(grad_z, n_q), mv = p.rows(m, n_q), r = p.rows(rstd, p.n_src);
  std::vector<at::Tensor> gu(n_q);
  for (int64_t q = 0; q < n_q; ++q) {
    if (!grad_u[q]) continue;
    TORCH_CHECK(grad_u[q]->numel() == p.n_tok * p.d, "attnres_cpu: expected grad_u rows [N, d]");
    gu[q] = as_rows(grad_u[q]->to(p.acc), p.n_tok, p.d);
  }
  auto dcs = at::zeros_like(c);
  dispatch(p.dtype, [&](auto k) {
    using K = decltype(k);
    using A = typename K::acc;
    using R = typename K::raw;
    const std::vector<A> zeros(p.d, A(0));
    std::vector<Rows<const A>> rows(n_q, Rows<const A>{zeros.data(), 0});  // stride 0: the zero row for every token
    for (int64_t q = 0; q < n_q; ++q)
      if (gu[q].defined()) rows[q] = rows_of<const A>(gu[q]);
    stats_backward_kernel<K>(gz.data_ptr<A>(), rows, p.source_rows<R>(), c.data_ptr<A>(), n_q, mv.data_ptr<A>(),
                             r.data_ptr<A>(), p.n_tok, p.d, pointers<R>(grads), accumulate, dcs.data_ptr<A>());
  });
  return dcs;
}

std::tuple<std::vector<at::Tensor>, at::Tensor> depth_stats_bwd(const at::Tensor& grad_z, const at::Tensor& grad_u,
                                                                at::TensorList sources, const at::Tensor& cs,
                                                                const at::Tensor& m, const at::Tensor& rstd) {
  TORCH_CHECK(grad_u.dim() > 0 && grad_u.size(0) == cs.size(0), "attnres_cpu: expected grad_u [S, N, d]");
  const auto parts = grad_u.unbind(0);
  const std::vector<std::optional<at::Tensor>> rows(parts.begin(), parts.end());
  Problem p(sources);
  auto grads = p.new_sources();
  auto dcs = stats_backward(p, grad_z, rows, cs, m, rstd, grads, false);
  return {grads, dcs};
}

// Phase 1's backward with grad_u as S rows (None: zeros) and the source gradients written (accumulate: added) into
// `into`: [R, N, d] (any leading dims between), contiguous, the sources' dtype. Returns dcs.
at::Tensor depth_stats_bwd_into(const at::Tensor& grad_z, const c10::List<std::optional<at::Tensor>>& grad_u,
                                at::TensorList sources, const at::Tensor& cs, const at::Tensor& m,
                                const at::Tensor& rstd, const at::Tensor& into, bool accumulate) {
  Problem p(sources);
  TORCH_CHECK(into.device().is_cpu() && into.is_contiguous() && into.scalar_type() == p.dtype &&
                  into.numel() == p.n_src * p.n_tok * p.d,
              "attnres_cpu: `into` must be a contiguous CPU tensor of R sources' elements in their dtype");
  const auto grads = into.view({p.n_src, p.n_tok, p.d}).unbind(0);
  const std::vector<std::optional<at::Tensor>> rows(grad_u.begin(), grad_u.end());
  return stats_backward(p, grad_z, rows, cs, m, rstd, grads, accumulate);
}

// Host side of the bank ops: the Python layer (attnres/ops/bank.py) has validated every argument, so this only takes
// pointers, converting only what is not already in the kernels' layout (the query's fold and the gain in the
// accumulator dtype, element by element); nothing is allocated but the result at decode sizes.
template <class T>
Rows<T> rows_in_place(const at::Tensor& t, int64_t n, int64_t d) {  // a [n, d] tensor, unit stride along d
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.size(0) == n && t.size(1) == d && (t.stride(1) == 1 || d == 1),
              "attnres_cpu: expected CPU rows [", n, ", ", d, "] with unit stride along d");
  return {static_cast<T*>(t.data_ptr()), t.stride(0)};
}

at::Tensor acc_vector(const at::Tensor& t, int64_t d, at::ScalarType acc) {  // [d] contiguous in the accumulator dtype
  TORCH_CHECK(t.device().is_cpu() && t.numel() == d, "attnres_cpu: expected a CPU vector of ", d, " elements");
  return t.scalar_type() == acc && t.dim() == 1 && t.is_contiguous() ? t : t.reshape({d}).to(acc).contiguous();
}

// `t`'s d elements (a point's `[d]` or `[1, d]` parameter, any floating dtype) converted into `out`, element by
// element: at decode an ATen conversion per vector would cost more than the point's kernel.
template <class A>
void load_vector(const at::Tensor& t, int64_t d, A* out) {
  TORCH_CHECK(t.device().is_cpu() && t.numel() == d, "attnres_cpu: expected a CPU vector of ", d, " elements");
  const at::Tensor v = t.is_contiguous() ? t : t.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, v.scalar_type(), "attnres_cpu", [&] {
    const scalar_t* p = v.const_data_ptr<scalar_t>();
    for (int64_t i = 0; i < d; ++i) out[i] = static_cast<A>(p[i]);
  });
}

template <class A>
struct PointVectors {  // a bank op's vectors in the accumulator dtype: c = g * w, folded here, and the output-norm gain
  std::vector<A> c, out_w;

  PointVectors(const at::Tensor& query, const at::Tensor& gain, const std::optional<at::Tensor>& out_norm_weight,
               int64_t d)
      : c(d) {
    std::vector<A> g(d);
    load_vector(query, d, c.data());
    load_vector(gain, d, g.data());
    for (int64_t i = 0; i < d; ++i) c[i] *= g[i];  // one rounding, as the product of the two vectors in A
    if (out_norm_weight) {
      out_w.resize(d);
      load_vector(*out_norm_weight, d, out_w.data());
    }
  }
  const A* gain() const { return out_w.empty() ? nullptr : out_w.data(); }
};

struct BankPoint {  // what both bank ops share: the prefix [..., d] as its N token rows [N, d], and the pending output
  at::ScalarType dtype, acc;
  int64_t d, n_tok;
  at::Tensor prefix, output;  // both viewed [N, d]

  BankPoint(const at::Tensor& prefix_, const std::optional<at::Tensor>& output_)
      : dtype(prefix_.scalar_type()), acc(dtype == at::kDouble ? at::kDouble : at::kFloat),
        d(prefix_.dim() ? prefix_.size(-1) : 0), n_tok(d > 0 ? prefix_.numel() / d : 0) {
    TORCH_CHECK(d > 0, "attnres_cpu: expected a prefix [..., d], d >= 1");
    prefix = prefix_.view({n_tok, d});  // written in place: a view, never a copy
    if (output_) {
      TORCH_CHECK(output_->scalar_type() == dtype && output_->numel() == prefix.numel(),
                  "attnres_cpu: output must have the prefix's dtype and shape");
      output = output_->reshape({n_tok, d});
      if (output.stride(-1) != 1) output = output.contiguous();
    }
  }
  template <class T>
  Rows<const T> output_rows() const {
    return output.defined() ? rows_in_place<const T>(output, n_tok, d) : Rows<const T>{nullptr, 0};
  }
};

at::Tensor bank_aggregate(const at::Tensor& bank, int64_t nvb, const at::Tensor& prefix,
                          const std::optional<at::Tensor>& output, const at::Tensor& query, const at::Tensor& gain,
                          const std::optional<at::Tensor>& out_norm_weight, double eps, double out_eps, bool write) {
  BankPoint p(prefix, output);
  TORCH_CHECK(bank.device().is_cpu() && bank.dim() == 3 && bank.size(0) == p.n_tok && bank.size(2) == p.d &&
                  (bank.stride(2) == 1 || p.d == 1) && bank.scalar_type() == p.dtype,
              "attnres_cpu: expected a bank [N, NB, d] of the prefix's dtype, unit stride along d");
  TORCH_CHECK(0 <= nvb && nvb < bank.size(1) + (write ? 0 : 1), "attnres_cpu: nvb out of the bank's rows");
  auto out = new_output(prefix.sizes(), p.dtype);
  dispatch(p.dtype, [&](auto k) {
    using K = decltype(k);
    using A = typename K::acc;
    using R = typename K::raw;
    const PointVectors<A> v(query, gain, out_norm_weight, p.d);
    const Rows<R> token_rows{static_cast<R*>(bank.data_ptr()), bank.stride(0)};
    bank_aggregate_kernel<K>(token_rows, bank.stride(1), nvb, rows_in_place<R>(p.prefix, p.n_tok, p.d),
                             p.output_rows<R>(), v.c.data(), v.gain(), eps, out_eps, write, p.n_tok, p.d,
                             static_cast<R*>(out.data_ptr()));
  });
  return out;
}

at::Tensor bank_merge(const at::Tensor& m, const at::Tensor& z, const at::Tensor& u, const at::Tensor& prefix,
                      const std::optional<at::Tensor>& output, const at::Tensor& query, const at::Tensor& gain,
                      const std::optional<at::Tensor>& out_norm_weight, double eps, double out_eps) {
  BankPoint p(prefix, output);
  TORCH_CHECK(m.numel() == p.n_tok && z.numel() == p.n_tok && u.dim() == 2, "attnres_cpu: expected m, z [N], u [N, d]");
  auto mv = acc_vector(m, p.n_tok, p.acc), zv = acc_vector(z, p.n_tok, p.acc);
  auto uv = u.scalar_type() == p.acc && u.stride(-1) == 1 ? u : u.to(p.acc).contiguous();
  auto out = new_output(prefix.sizes(), p.dtype);
  dispatch(p.dtype, [&](auto k) {
    using K = decltype(k);
    using A = typename K::acc;
    using R = typename K::raw;
    const PointVectors<A> v(query, gain, out_norm_weight, p.d);
    bank_merge_kernel<K>(mv.data_ptr<A>(), zv.data_ptr<A>(), rows_in_place<const A>(uv, p.n_tok, p.d),
                         rows_in_place<R>(p.prefix, p.n_tok, p.d), p.output_rows<R>(), v.c.data(), v.gain(), eps,
                         out_eps, p.n_tok, p.d, static_cast<R*>(out.data_ptr()));
  });
  return out;
}

// Host side of merge_sources: m, z [N], u [N, d] in the accumulator dtype; K >= 0 sources of `dtype` read in place.
struct SourcesProblem : SourceRows {
  at::ScalarType dtype, acc;
  int64_t n_tok, d;
  at::Tensor m, z, u, c, out_w;

  SourcesProblem(const at::Tensor& m_, const at::Tensor& z_, const at::Tensor& u_, at::TensorList sources,
                 const std::optional<at::Tensor>& c_, const std::optional<at::Tensor>& out_norm_weight,
                 at::ScalarType dtype_)
      : dtype(dtype_), acc(u_.scalar_type()), n_tok(u_.size(0)), d(u_.size(-1)) {
    TORCH_CHECK(u_.device().is_cpu() && u_.dim() == 2 && d > 0 && m_.numel() == n_tok && z_.numel() == n_tok,
                "attnres_cpu: expected m, z [N], u [N, d] on the CPU");
    TORCH_CHECK(acc == (dtype == at::kDouble ? at::kDouble : at::kFloat),
                "attnres_cpu: expected u in the accumulator dtype of ", dtype);
    m = acc_vector(m_, n_tok, acc), z = acc_vector(z_, n_tok, acc);
    u = u_.stride(-1) == 1 ? u_ : u_.contiguous();
    for (const auto& x : sources) {
      TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == dtype && x.numel() == n_tok * d,
                  "attnres_cpu: expected sources [N, d] of dtype ", dtype);
      add(x, n_tok, d);
    }
    TORCH_CHECK(sources.empty() || c_, "attnres_cpu: merging sources needs c");
    if (c_) c = acc_vector(*c_, d, acc);
    if (out_norm_weight) out_w = acc_vector(*out_norm_weight, d, acc);
  }
  template <class K>
  SourcesMerge<K> args(const std::vector<Rows<const typename K::raw>>& src, double eps, double out_eps) const {
    using A = typename K::acc;
    return {m.data_ptr<A>(), z.data_ptr<A>(), rows_in_place<const A>(u, n_tok, d), src,
            c.defined() ? c.data_ptr<A>() : nullptr, out_w.defined() ? out_w.data_ptr<A>() : nullptr, eps, out_eps,
            n_tok, d};
  }
};

at::Tensor merge_sources_fwd(const at::Tensor& m, const at::Tensor& z, const at::Tensor& u, at::TensorList sources,
                             const std::optional<at::Tensor>& c, const std::optional<at::Tensor>& out_norm_weight,
                             double eps, double out_eps, at::ScalarType dtype) {
  SourcesProblem p(m, z, u, sources, c, out_norm_weight, dtype);
  auto out = new_output({p.n_tok, p.d}, dtype);
  dispatch(dtype, [&](auto k) {
    using K = decltype(k);
    const auto src = p.source_rows<typename K::raw>();
    merge_sources_kernel<K>(p.args<K>(src, eps, out_eps), static_cast<typename K::raw*>(out.data_ptr()));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>, at::Tensor, at::Tensor> merge_sources_bwd(
    const at::Tensor& grad_out, const at::Tensor& m, const at::Tensor& z, const at::Tensor& u, at::TensorList sources,
    const std::optional<at::Tensor>& c, const std::optional<at::Tensor>& out_norm_weight, double eps,
    double out_eps) {
  const auto dtype = grad_out.scalar_type();
  SourcesProblem p(m, z, u, sources, c, out_norm_weight, dtype);
  auto g = as_rows(grad_out, p.n_tok, p.d);
  auto du = new_output({p.n_tok, p.d}, p.acc);
  auto dz = at::empty({p.n_tok}, du.options());
  std::vector<at::Tensor> grads;
  for (size_t k = 0; k < sources.size(); ++k) grads.push_back(new_output({p.n_tok, p.d}, dtype));
  auto dc = sources.empty() ? at::empty({0}, du.options()) : at::zeros({p.d}, du.options());
  auto d_out_w = out_norm_weight ? at::zeros({p.d}, du.options()) : at::empty({0}, du.options());
  dispatch(dtype, [&](auto k) {
    using K = decltype(k);
    using A = typename K::acc;
    using R = typename K::raw;
    const auto src = p.source_rows<typename K::raw>();
    merge_sources_backward_kernel<K>(p.args<K>(src, eps, out_eps), rows_of<const R>(g), pointers<R>(grads),
                                     du.data_ptr<A>(), dz.data_ptr<A>(), dc.data_ptr<A>(), d_out_w.data_ptr<A>());
  });
  for (size_t k = 0; k < sources.size(); ++k) grads[k] = grads[k].view(sources[k].sizes());
  return {du, dz, grads, dc, d_out_w};
}

// A point of a Full group's phase 2 as one op with its own autograd node (the op `merge_sources`, the CPU twin of
// `_MergeSources` in attnres/ops/merge.py, which it equals bit for bit), its query folded and its parameters'
// gradients formed here as `point`'s are: a Python autograd Function adds about 0.1 ms of interpreter work at every
// point of a group, forward and backward.
struct MergeSources : torch::autograd::Function<MergeSources> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& m, const at::Tensor& z, const at::Tensor& u,
                               at::TensorList sources, const at::Tensor& query, const std::optional<at::Tensor>& gain,
                               const std::optional<at::Tensor>& out_norm_weight, double eps, double out_eps,
                               at::ScalarType dtype) {
    std::optional<at::Tensor> c;
    if (!sources.empty()) c = fold_query(Problem(sources), query, gain);
    auto out = merge_sources_fwd(m, z, u, sources, c, out_norm_weight, eps, out_eps, dtype);
    variable_list saved{m, z, u, c.value_or(at::Tensor()), query, gain.value_or(at::Tensor()),
                        out_norm_weight.value_or(at::Tensor())};
    saved.insert(saved.end(), sources.begin(), sources.end());
    ctx->save_for_backward(std::move(saved));
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["out_eps"] = out_eps;
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return once_differentiable(grads, [&] { return gradients(ctx, grads); });
  }

  static variable_list gradients(AutogradContext* ctx, const variable_list& grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &m = saved[0], &z = saved[1], &u = saved[2], &query = saved[4];
    const auto c = present(saved[3]), gain = present(saved[5]), out_norm_weight = present(saved[6]);
    const std::vector<at::Tensor> sources(saved.begin() + 7, saved.end());
    auto [du, dz, dxs, dc, d_out_w] =
        merge_sources_bwd(grads[0].contiguous(), m, z, u, sources, c, out_norm_weight,
                          ctx->saved_data["eps"].toDouble(), ctx->saved_data["out_eps"].toDouble());
    at::Tensor d_query;
    std::optional<at::Tensor> d_gain, d_norm;
    if (!sources.empty()) {
      std::tie(d_query, d_gain, d_norm) = parameter_grads(Problem(sources), dc, query, gain, out_norm_weight, d_out_w);
    } else if (out_norm_weight) {
      d_norm = d_out_w.to(out_norm_weight->scalar_type());
    }
    // one per argument of forward: m (a stop-gradient shift), z, u, the sources, the parameters, eps, out_eps, dtype
    variable_list out{at::Tensor(), dz, du};
    out.insert(out.end(), dxs.begin(), dxs.end());
    out.insert(out.end(), {d_query, d_gain.value_or(at::Tensor()), d_norm.value_or(at::Tensor()), {}, {}, {}});
    return out;
  }
};

at::Tensor merge_sources(const at::Tensor& m, const at::Tensor& z, const at::Tensor& u, at::TensorList sources,
                         const at::Tensor& query, const std::optional<at::Tensor>& gain,
                         const std::optional<at::Tensor>& out_norm_weight, double eps, double out_eps,
                         at::ScalarType dtype) {
  return MergeSources::apply(m, z, u, sources, query, gain, out_norm_weight, eps, out_eps, dtype)[0];
}

}  // namespace

TORCH_LIBRARY(attnres_cpu, m) {
  m.def("depth_attention_fwd(Tensor[] sources, Tensor c, Tensor? out_norm_weight, float eps, float out_eps)"
        " -> (Tensor, Tensor, Tensor)");
  m.def("depth_attention_bwd(Tensor grad_out, Tensor? grad_weights, Tensor[] sources, Tensor c,"
        " Tensor? out_norm_weight, Tensor weights, Tensor rstd, float out_eps) -> (Tensor[], Tensor, Tensor)");
  m.def("depth_attention_bwd_into(Tensor grad_out, Tensor? grad_weights, Tensor[] sources, Tensor c,"
        " Tensor? out_norm_weight, Tensor weights, Tensor rstd, float out_eps, Tensor(a!)[] into, int accumulate)"
        " -> (Tensor, Tensor)");
  m.def("point_fwd(Tensor[] sources, Tensor query, Tensor? gain, Tensor? out_norm_weight, float eps, float out_eps)"
        " -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("point_bwd(Tensor grad_out, Tensor? grad_weights, Tensor[] sources, Tensor c, Tensor query, Tensor? gain,"
        " Tensor? out_norm_weight, Tensor weights, Tensor rstd, float out_eps)"
        " -> (Tensor[], Tensor, Tensor?, Tensor?)");
  m.def("point_bwd_into(Tensor grad_out, Tensor? grad_weights, Tensor[] sources, Tensor c, Tensor query, Tensor? gain,"
        " Tensor? out_norm_weight, Tensor weights, Tensor rstd, float out_eps, Tensor(a!)[] into, int accumulate)"
        " -> (Tensor, Tensor?, Tensor?)");
  m.def("point(Tensor[] sources, Tensor query, Tensor? gain, Tensor? out_norm_weight, float eps, float out_eps)"
        " -> (Tensor, Tensor, Tensor)");
  m.def("chained_point(Tensor[] tracked, Tensor[] older, Tensor? carrier, Tensor query, Tensor? gain,"
        " Tensor? out_norm_weight, float eps, float out_eps, bool carry_newest) -> (Tensor, Tensor)");
  m.def("depth_stats_fwd(Tensor[] sources, Tensor cs, float eps) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("depth_stats_bwd(Tensor grad_z, Tensor grad_u, Tensor[] sources, Tensor cs, Tensor m, Tensor rstd)"
        " -> (Tensor[], Tensor)");
  m.def("depth_stats_bwd_into(Tensor grad_z, Tensor?[] grad_u, Tensor[] sources, Tensor cs, Tensor m, Tensor rstd,"
        " Tensor(a!) into, bool accumulate) -> Tensor");
  m.def("bank_aggregate(Tensor(a!) bank, int nvb, Tensor(b!) prefix, Tensor? output, Tensor query, Tensor gain,"
        " Tensor? out_norm_weight, float eps, float out_eps, bool write) -> Tensor");
  m.def("bank_merge(Tensor m, Tensor z, Tensor u, Tensor(a!) prefix, Tensor? output, Tensor query, Tensor gain,"
        " Tensor? out_norm_weight, float eps, float out_eps) -> Tensor");
  m.def("merge_sources(Tensor m, Tensor z, Tensor u, Tensor[] sources, Tensor query, Tensor? gain,"
        " Tensor? out_norm_weight, float eps, float out_eps, ScalarType dtype) -> Tensor");
  m.def("merge_sources_fwd(Tensor m, Tensor z, Tensor u, Tensor[] sources, Tensor? c, Tensor? out_norm_weight,"
        " float eps, float out_eps, ScalarType dtype) -> Tensor");
  m.def("merge_sources_bwd(Tensor grad_out, Tensor m, Tensor z, Tensor u, Tensor[] sources, Tensor? c,"
        " Tensor? out_norm_weight, float eps, float out_eps) -> (Tensor, Tensor, Tensor[], Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnres_cpu, CPU, m) {
  m.impl("depth_attention_fwd", &depth_attention_fwd);
  m.impl("depth_attention_bwd", &depth_attention_bwd);
  m.impl("depth_attention_bwd_into", &depth_attention_bwd_into);
  m.impl("point_fwd", &point_fwd);
  m.impl("point_bwd", &point_bwd);
  m.impl("point_bwd_into", &point_bwd_into);
  m.impl("point", &point);
  m.impl("chained_point", &chained_point);
  m.impl("depth_stats_fwd", &depth_stats_fwd);
  m.impl("depth_stats_bwd", &depth_stats_bwd);
  m.impl("depth_stats_bwd_into", &depth_stats_bwd_into);
  m.impl("bank_aggregate", &bank_aggregate);
  m.impl("bank_merge", &bank_merge);
  m.impl("merge_sources", &merge_sources);
  m.impl("merge_sources_fwd", &merge_sources_fwd);
  m.impl("merge_sources_bwd", &merge_sources_bwd);
}

// The points are their own autograd: the same kernel serves the Autograd key and, for inference tensors (which skip
// it), the CPU key.
TORCH_LIBRARY_IMPL(attnres_cpu, Autograd, m) {
  m.impl("point", &point);
  m.impl("chained_point", &chained_point);
  m.impl("merge_sources", &merge_sources);
}
