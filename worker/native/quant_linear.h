// The native step's linears (included by decoder_step.cpp): out [rows, n] (= or +=) x [rows, k] @ w^T for
// a matrix in one of the packed formats below (worker/model/native_pack.py writes them), and the int8
// output head. The step calls `linear(matrix, x, rows, out, accumulate)`; the format is data in the
// matrix, so a model mixing GGUF types (a "Q4_K_M" file: Q4_K, Q5_0, Q6_K, Q8_0) runs each matrix on
// its own weights, never re-quantized.
//
// Every GGUF type lmq reads natively is, once its super-block scales are multiplied out, integer
// weights q with a scale a and a min m per group of 32 (Q6_K: 16) input values: value = a * q + m.
//   bits 4: q in 0..15 with m     Q4_0 (m = -8 a), Q4_1, Q4_K (a = d * sc, m = -dmin * mn)
//   bits 5: q in 0..31 with m     Q5_0 (m = -16 a), Q5_1, Q5_K
//   bits 6: signed q, m = 0       Q6_K (q - 32 in -32..31, groups of 16, a = d * sc)
//   bits 8: signed q, m = 0       Q8_0 (q in -128..127)
//   a table: signed q, m = 0      Q3_K (q - 4 in -4..3, groups of 16, a = d sc), IQ4_NL and IQ4_XS (q one of 16
//                                 fixed int8 values, a = d or d sc): each q a 4-bit index into QuantMatrix::values,
//                                 stored as bits 4's nibbles and looked up once unpacked (kTable)
// Scales and mins are fp16 where every value of the matrix is one exactly (the files' own d and m);
// the K-quants keep their own two levels, an 8-bit sc (and mn) per group and an fp16 d (and dmin) per
// 256 values, multiplied out here in float32 (exact: up to 18 significant bits, which fp16 would round);
// float32 scales for anything else.
//
// The input row is quantized to int16 with one scale d per group of 32 (why int16, not int8: the
// comment at the top of decoder_step.cpp), so per group
//   sum_j (a q_j + m) x_j  ~  a d sum_j q_j qx_j  +  m d sum_j qx_j,
// both inner sums exact in int32 (|q qx| <= 128 * 32767, 32 of them). With groups of 16 (and m = 0) a
// group of x meets two weight groups: two dot products, each with its own a.
// Layout, per block of 16 output rows and group of 32 k values (kGroupBytes), vectors of 16 rows x a
// pair of k values, one vpdpwssd operand each once unpacked to int16:
//   bits 4: nibbles [4, 16, 2] int16: vector j's words hold 4 nibbles, pairs 4j..4j+3;
//   bits 5: the same nibbles, then [16, 2] int16 high bits: bit p of word (row, e) is bit 4 of pair p's value e;
//   bits 6: nibbles of q + 32, then [2, 16, 2] int16: bits 2c, 2c + 1 of vector h's word (row, e) are bits 4, 5 of
//           pair 8h + c's value e;
//   bits 8: [16, 16, 2] int8: pair p of every row;
//   scales, mins [N/16, K/group, 16] (fp16 or float32): the group's a and m for the block's 16 rows.
// Q4_0 and Q5_0 store no mins (m_factor -8, -16: m = m_factor * a, exact in float32): their blocks are
// 4.5 and 5.5 bits a weight as in the file, not 5.0 and 6.0, and a one-row step is bound by those bytes.
// The output head is int8 per row ([N/16, K/2, 16, 2]), widened to int16 as it is read: y = s d sum qx w.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>
#include <vector>

struct QuantMatrix {
  const uint8_t* weights;
  const void* scales;  // fp16 (scale_bytes 2), float32 (4), or a K-quant's 8-bit sc (1: uint8, int8 for bits 6)
  const void* mins;    // as scales (uint8 mn for K-quants); null for bits 6 and 8
  const uint16_t* super_scales;  // K-quants (scale_bytes 1): fp16 d [N/16, K/256, 16], a = d * sc
  const uint16_t* super_mins;    // K-quants with mins: fp16 dmin, m = -(dmin * mn)
  int64_t n, k;
  int32_t bits;         // 4, 5 (unsigned, with mins), 6 or 8 (signed, no mins)
  int32_t scale_bytes;  // 1, 2 or 4
  int32_t group;        // 32, or 16 (bits 6 and 8, and tables, only)
  int32_t m_factor;     // 0, or bits 4 and 5 with fp16 scales and no mins stored: m = m_factor * a (Q4_0 -8, Q5_0 -16)
  const int8_t* values;  // bits 4 as indices (kTable): the 16 values q they stand for; else null
  const QuantMatrix* next;  // further output rows in another format (a fused q/k/v whose parts differ), or null
};

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlockN = 16;
constexpr int kMaxRows = 8;  // a tile of at most this many x rows keeps its accumulators in registers, beside 16 weight vectors
template <typename Rows>
constexpr int kRegisterRows = kMaxRows;  // per kind of x: int8_linear.h's quads are 8 vectors, not 16, and leave room for 16
constexpr int kInt4GroupBytes = kGroup * kBlockN / 2;  // a group of a block: 4 vectors
constexpr int64_t kPrefetchBytes = 4096;
constexpr int64_t kLargeChunks = 2, kSmallChunks = 32, kWeightRows = 16;  // each_claimed's: chunks a thread
constexpr int64_t kChunkMacs = 1 << 18;  // each_claimed's least chunk: ~4 us of a 1-row linear

constexpr int kTable = 7;  // the Bits of a table format: 4-bit indices (bits 4's nibbles) into QuantMatrix::values

template <int Bits>
constexpr int kGroupBytes = Bits == 4 || Bits == kTable ? kInt4GroupBytes : Bits == 5 ? kInt4GroupBytes + 64 : Bits == 6 ? kInt4GroupBytes + 128 : kGroup * kBlockN;

// The team's share of [0, total): static, contiguous.
inline void share(int64_t total, int64_t& begin, int64_t& end) {
  const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
  const int64_t each = total / team, extra = total % team;
  begin = me * each + std::min(me, extra);
  end = begin + each + (me < extra ? 1 : 0);
}

// f(i) for i in [0, total), the team claiming chunks as its threads come free (no barrier after). The
// cores are shared with the event loop, Redis and the gateway: a thread the OS preempts leaves the rest
// of the work to the others instead of holding up the team's next barrier, as a static share would.
// Three quarters go in large chunks (long runs of weights for the prefetchers), the last quarter in
// small ones, so that the thread that finishes first waits little for the other's last chunk. `rows`:
// the x rows each item covers (heavier items come in proportionally smaller chunks); `item_macs`, its
// multiply-adds: a chunk holds at least kChunkMacs, since each claim costs a cache line passed between
// cores. A loop too small for four such chunks a thread keeps the static share (the default model's
// 1-row linears: claimed in chunks they took 5% longer), as does a team of one.
template <typename F>
void each_claimed(int64_t total, int64_t rows, int64_t item_macs, F&& f) {
  const int64_t team = omp_get_num_threads(), least = std::max<int64_t>(1, kChunkMacs / std::max<int64_t>(item_macs, 1));
  if (team == 1 || total < team * 4 * least) {
    int64_t begin, end;
    share(total, begin, end);
    for (int64_t i = begin; i < end; ++i) f(i);
    return;
  }
  const int64_t weight = std::max<int64_t>(1, rows / kWeightRows), bulk = total * 3 / 4;
  const int64_t large = std::max(least, bulk / (team * kLargeChunks * weight));
  const int64_t small = std::max(least, total / (team * kSmallChunks * weight));
#pragma omp for schedule(dynamic, large) nowait
  for (int64_t i = 0; i < bulk; ++i) f(i);
#pragma omp for schedule(dynamic, small) nowait
  for (int64_t i = bulk; i < total; ++i) f(i);
}

// ---- activations quantized to int16 ----

struct QuantizedRows {
  int16_t* q;      // [rows, stride]
  float* scale;    // [rows, stride / 32]: d, one per group
  float* sum;      // [rows, stride / 32]: d * the group's sum of qx
  int64_t stride;  // the widest K of the step
};

// One row of k floats -> int16 with one scale per group of 32.
void quantize_row(const float* x, int64_t k, const QuantizedRows& out, int64_t r) {
  int16_t* q = out.q + r * out.stride;
  float* scale = out.scale + r * (out.stride / kGroup);
  float* sums = out.sum + r * (out.stride / kGroup);
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const __m512 a = _mm512_loadu_ps(x + g * kGroup), b = _mm512_loadu_ps(x + g * kGroup + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 factor = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, factor)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, factor));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * kGroup), _mm512_cvtsepi32_epi16(qa));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * kGroup + 16), _mm512_cvtsepi32_epi16(qb));
    scale[g] = amax / 32767.f;
    sums[g] = scale[g] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
  }
}

// dot + the products of w's int16 pairs with x's pair at `pair`, broadcast by the instruction itself: GCC
// keeps a separate vpbroadcastd, which competes with the products for the vector pipes (AMD EPYC Zen 4:
// a 256-row chunk's int8 linears 487 -> 446 ms, a 16-row int8 decode step 56.2 -> 52.7 ms; bit-identical).
inline __m512i dpwssd_broadcast(__m512i dot, __m512i w, const int16_t* pair) {
  asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(dot) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(pair)));
  return dot;
}

inline __m512i dpbusd_broadcast(__m512i dot, __m512i w, const int8_t* quad) {  // u8 w, s8 x: the same for int8 x
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(dot) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(quad)));
  return dot;
}

// Pairs [P0, P1) of a row's group, each pair one dword broadcast to 16 lanes, dotted with the weight
// vectors of a block (pair p of every output row) in exact int32 arithmetic. Four chains of products
// summed at the end (the same int32 total, exactly): one chain is 16 dependent vpdpwssd, and its latency,
// not the instruction's throughput, bounded the kernel (one thread, Q4_0 6144x1024: 1 row 117 -> 104 us,
// 16 rows 1,284 -> 1,105; docs/benchmarks.md, issue 27's kernel pass).
template <int P0 = 0, int P1 = kGroup / 2>
inline __m512i group_dot(const __m512i* weights, const int16_t* group) {
  constexpr int kChains = 4;
  __m512i dot[kChains];
  for (int c = 0; c < kChains; ++c) dot[c] = _mm512_setzero_si512();
  for (int p = P0; p < P1; p += kChains)
    for (int c = 0; c < kChains && p + c < P1; ++c)
      dot[c] = dpwssd_broadcast(dot[c], weights[p + c], group + 2 * (p + c));
  return _mm512_add_epi32(_mm512_add_epi32(dot[0], dot[1]), _mm512_add_epi32(dot[2], dot[3]));
}

// The weights kPrefetchBytes on, into L2 (T1): into L1 (T0) the prefetches held L1's few miss buffers and a
// one-row step read its weights well under the machine's bandwidth (AMD EPYC Zen 4, Qwen3-0.6B shape:
// 18.7-22.1 -> 16.8 ms a one-row step, 54.9-61.6 -> 51.6-58.1 ms at 16 rows; bit-identical).
inline void prefetch_group(const uint8_t* bytes, int size) {
  for (int line = 0; line < size; line += 64) _mm_prefetch(reinterpret_cast<const char*>(bytes + kPrefetchBytes + line), _MM_HINT_T1);
}

// ---- unpacking a block's group to 16 int16 weight vectors ----

template <int Bits>
inline void unpack(const uint8_t* packed, __m512i* weights);

template <>
inline void unpack<4>(const uint8_t* packed, __m512i* weights) {
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512(packed + 64 * j);
    weights[4 * j] = _mm512_and_si512(v, low4);
    weights[4 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    weights[4 * j + 2] = _mm512_and_si512(_mm512_srli_epi16(v, 8), low4);
    weights[4 * j + 3] = _mm512_srli_epi16(v, 12);
  }
}

template <>
inline void unpack<5>(const uint8_t* packed, __m512i* weights) {
  unpack<4>(packed, weights);
  const __m512i high = _mm512_loadu_si512(packed + kInt4GroupBytes), bit4 = _mm512_set1_epi16(0x10);
  for (int p = 0; p < kGroup / 2; ++p) {
    const __m512i moved = p <= 4 ? _mm512_slli_epi16(high, 4 - p) : _mm512_srli_epi16(high, p - 4);
    weights[p] = _mm512_ternarylogic_epi32(weights[p], moved, bit4, 0xF8);  // weights | (moved & bit4)
  }
}

template <>
inline void unpack<6>(const uint8_t* packed, __m512i* weights) {
  unpack<4>(packed, weights);
  const __m512i bits45 = _mm512_set1_epi16(0x30), bias = _mm512_set1_epi16(32);
  for (int h = 0; h < 2; ++h) {
    const __m512i high = _mm512_loadu_si512(packed + kInt4GroupBytes + 64 * h);
    for (int c = 0; c < 8; ++c) {
      const __m512i moved = c <= 2 ? _mm512_slli_epi16(high, 4 - 2 * c) : _mm512_srli_epi16(high, 2 * c - 4);
      weights[8 * h + c] = _mm512_sub_epi16(_mm512_ternarylogic_epi32(weights[8 * h + c], moved, bits45, 0xF8), bias);
    }
  }
}

template <>
inline void unpack<8>(const uint8_t* packed, __m512i* weights) {
  for (int p = 0; p < kGroup / 2; ++p) weights[p] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + 32 * p)));
}

// A table format's values as int16 words 0..15 of a vector, for vpermw (the indices never reach words 16..31).
inline __m512i word_table(const QuantMatrix& w) {
  if (!w.values) return _mm512_setzero_si512();
  return _mm512_cvtepi8_epi16(_mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.values))));
}

// unpack<Bits>, a table format's nibbles then replaced by their values (one vpermw a vector).
template <int Bits>
inline void unpack_values(const uint8_t* packed, __m512i* weights, __m512i table) {
  unpack<Bits == kTable ? 4 : Bits>(packed, weights);
  if constexpr (Bits == kTable)
    for (int p = 0; p < kGroup / 2; ++p) weights[p] = _mm512_permutexvar_epi16(weights[p], table);
}

inline __m512 load_scales(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load_scales(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_scales(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
inline __m512 load_scales(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }

constexpr int64_t kSuperGroups = 256 / kGroup;  // groups of x per K-quant super-block

// A block's weight scales a and mins m per group, as the packed matrix holds them: fp16 or float32, or a
// K-quant's 8-bit sc (mn) times its super-block's fp16 d (dmin, negated), as the loader multiplies them.
// Scale: the type of a and m (uint16_t: fp16); Group: the weights' group (32, or 16 with no mins).
template <int Bits, typename Scale, int Group, bool Derived>
struct BlockScales {
  static constexpr bool kMins = Bits < 6 && !Derived;
  static constexpr bool kSuper = sizeof(Scale) == 1;
  const Scale* scales;
  const Scale* mins;
  const uint16_t* super_scales;
  const uint16_t* super_mins;

  BlockScales(const QuantMatrix& w, int64_t block) {
    const int64_t groups = w.k / kGroup;
    scales = static_cast<const Scale*>(w.scales) + block * groups * (kGroup / Group) * kBlockN;
    mins = kMins ? static_cast<const Scale*>(w.mins) + block * groups * kBlockN : nullptr;
    super_scales = kSuper ? w.super_scales + block * (groups / kSuperGroups) * kBlockN : nullptr;
    super_mins = kSuper && kMins ? w.super_mins + block * (groups / kSuperGroups) * kBlockN : nullptr;
  }
  // a of the block's 16 rows for weight group `at` (of Group values), which lies in x's group g (of 32)
  __m512 scale(int64_t at, int64_t g) const {
    const __m512 v = load_scales(scales + at * kBlockN);
    return kSuper ? _mm512_mul_ps(load_scales(super_scales + g / kSuperGroups * kBlockN), v) : v;
  }
  __m512 min(int64_t g) const {
    const __m512 v = load_scales(mins + g * kBlockN);
    if (!kSuper) return v;
    const __m512 product = _mm512_mul_ps(load_scales(super_mins + g / kSuperGroups * kBlockN), v);
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(product), _mm512_set1_epi32(INT32_MIN)));  // -product
  }
};

// ---- the linears ----

// x rows [r0, r0 + rows) against one block: MR of them (rows == MR) with their accumulators in registers,
// or, MR == kWide, 9 to 16 rows with theirs in L1 (a runtime loop over the rows: 16 registers of
// accumulators beside 16 of weights would spill), so that a group is unpacked once for all 16 rows.
constexpr int kWide = 0;
constexpr int kWideRows = 16;

template <int MR, typename F>
inline void each_row(int64_t rows, __m512* acc, F&& f) {
  if constexpr (MR == kWide) {
#pragma GCC unroll 1
    for (int64_t r = 0; r < rows; ++r) f(r, acc[r]);
  } else {
    for (int r = 0; r < MR; ++r) f(r, acc[r]);
  }
}

// Output columns [16 * block, +16) for x rows [r0, r0 + rows); accumulate: out += y, else out = y.
// Scale: the type of a and m (uint16_t: fp16); Group: the weights' group (32, or 16 with no mins).
template <int Bits, typename Scale, int Group, bool Derived, int MR>
void quant_block(const QuantMatrix& w, int64_t block, const QuantizedRows& x, int64_t r0, int64_t rows, float* out, int64_t out_stride, bool accumulate) {
  constexpr bool kMins = Bits < 6;
  constexpr int kSub = kGroup / Group, kBytes = kGroupBytes<Bits>;
  static_assert(kSub == 1 || !kMins, "groups of 16 only without mins: x's sums are per 32");
  const int64_t groups = w.k / kGroup, per_row = x.stride / kGroup;
  const uint8_t* packed = w.weights + block * groups * kBytes;
  const BlockScales<Bits, Scale, Group, Derived> weights_of(w, block);
  const __m512 m_factor = _mm512_set1_ps(static_cast<float>(w.m_factor));
  const __m512i table = word_table(w);
  __m512 acc[MR == kWide ? kWideRows : MR];
  each_row<MR>(rows, acc, [](int64_t, __m512& a) { a = _mm512_setzero_ps(); });
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = packed + g * kBytes;
    prefetch_group(group, kBytes);
    __m512i weights[kGroup / 2];
    unpack_values<Bits>(group, weights, table);
    if constexpr (kSub == 1) {
      const __m512 a = weights_of.scale(g, g);
      const __m512 m = Derived ? _mm512_mul_ps(a, m_factor) : kMins ? weights_of.min(g) : _mm512_setzero_ps();
      each_row<MR>(rows, acc, [&](int64_t r, __m512& sum) {
        const int64_t at = (r0 + r) * per_row + g;
        const __m512i dot = group_dot(weights, x.q + (r0 + r) * x.stride + g * kGroup);
        sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(a, _mm512_set1_ps(x.scale[at])), sum);
        if constexpr (kMins) sum = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sum[at]), sum);
      });
    } else {
      const __m512 a0 = weights_of.scale(2 * g, g), a1 = weights_of.scale(2 * g + 1, g);
      each_row<MR>(rows, acc, [&](int64_t r, __m512& sum) {
        const int16_t* row = x.q + (r0 + r) * x.stride + g * kGroup;
        const __m512 d = _mm512_set1_ps(x.scale[(r0 + r) * per_row + g]);
        const __m512i dot0 = group_dot<0, kGroup / 4>(weights, row), dot1 = group_dot<kGroup / 4, kGroup / 2>(weights, row);
        sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot0), _mm512_mul_ps(a0, d), sum);
        sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot1), _mm512_mul_ps(a1, d), sum);
      });
    }
  }
  each_row<MR>(rows, acc, [&](int64_t r, __m512& sum) {
    float* o = out + (r0 + r) * out_stride + block * kBlockN;
    _mm512_storeu_ps(o, accumulate ? _mm512_add_ps(_mm512_loadu_ps(o), sum) : sum);
  });
}

// f(std::integral_constant<int, rows>) for 1 <= rows <= Most: a kernel's row count as a template argument.
template <int Most, typename F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (Most > 1) {
    if (rows < Most) return with_rows<Most - 1>(rows, f);
  }
  f(std::integral_constant<int, Most>{});
}

// f(block, r0, tile rows) over the `blocks` column blocks this thread claims, x's rows in tiles of at most
// Most: a block's weights come from memory once, then from cache.
template <int Most, typename F>
void over_blocks(int64_t blocks, int64_t rows, int64_t k, F&& f) {
  each_claimed(blocks, rows, rows * k * kBlockN, [&](int64_t b) {
    for (int64_t r0 = 0; r0 < rows; r0 += Most) with_rows<Most>(std::min<int64_t>(Most, rows - r0), [&](auto tile) { f(b, r0, tile); });
  });
}

// f(block, r0, tile rows, kernel) over the `blocks` column blocks this thread claims, x's rows in tiles of 16:
// each block's weights come from memory once, and each of its groups is unpacked once a tile. The
// kernel (a std::integral_constant) is the tile's rows where they fit registers, else kWide.
template <int MaxRows = kMaxRows, typename F>
void over_tiles(int64_t blocks, int64_t rows, int64_t k, F&& f) {
  each_claimed(blocks, rows, rows * k * kBlockN, [&](int64_t b) {
    for (int64_t r0 = 0; r0 < rows; r0 += kWideRows) {
      const int64_t tile = std::min<int64_t>(kWideRows, rows - r0);
      if (tile > MaxRows)
        f(b, r0, tile, std::integral_constant<int, kWide>{});
      else
        with_rows<MaxRows>(tile, [&](auto most) { f(b, r0, tile, most); });
    }
  });
}

// Rows: QuantizedRows (int16 x, below) or Int8Rows (int8_linear.h); each has its own quant_block.
template <int Bits, typename Scale, int Group, bool Derived = false, typename Rows>
void quant_part(const QuantMatrix& w, const Rows& x, int64_t rows, float* out, int64_t out_stride, bool accumulate) {
  over_tiles<kRegisterRows<Rows>>(w.n / kBlockN, rows, w.k, [&](int64_t b, int64_t r0, int64_t tile, auto most) {
    quant_block<Bits, Scale, Group, Derived, most.value>(w, b, x, r0, tile, out, out_stride, accumulate);
  });
}

// A packed format as types, for the templates that read it: Format<Bits, Scale, Group, Derived> (BlockScales' terms).
template <int B, typename S, int G, bool D>
struct Format {
  static constexpr int bits = B, group = G;
  static constexpr bool derived = D;
  using Scale = S;
};

template <int Bits, int Group, typename F>
void with_scales(const QuantMatrix& w, F&& f) {
  using Sub = std::conditional_t<(Bits >= 6), int8_t, uint8_t>;  // a K-quant's sc: Q6_K's signed, Q4_K/Q5_K's 6-bit
  if constexpr (Bits < 6) {
    if (w.m_factor) return f(Format<Bits, uint16_t, Group, true>{});
  }
  if (w.scale_bytes == 2)
    f(Format<Bits, uint16_t, Group, false>{});
  else if (w.scale_bytes == 4)
    f(Format<Bits, float, Group, false>{});
  else
    f(Format<Bits, Sub, Group, false>{});
}

// f(Format<...>{}) for one part's format (known_format's); false: a format with no kernel (refused before a step).
template <typename F>
bool with_format(const QuantMatrix& w, F&& f) {
  if (w.values) {
    if (w.bits != 4 || (w.group != 16 && w.group != 32)) return false;
    w.group == 16 ? with_scales<kTable, 16>(w, f) : with_scales<kTable, 32>(w, f);
    return true;
  }
  switch (w.bits * 100 + w.group) {
    case 432: with_scales<4, 32>(w, f); return true;
    case 532: with_scales<5, 32>(w, f); return true;
    case 832: with_scales<8, 32>(w, f); return true;
    case 816: with_scales<8, 16>(w, f); return true;
    case 616: with_scales<6, 16>(w, f); return true;
    default: return false;
  }
}

// The formats with a kernel (bits, scale bytes, group); lmq_step refuses a model with any other.
bool known_format(const QuantMatrix& w) {
  for (const QuantMatrix* part = &w; part; part = part->next) {
    const bool super = part->super_scales && (part->bits >= 6 || part->values || part->super_mins) && part->k % 256 == 0;
    const bool scales = part->scale_bytes == 2 || part->scale_bytes == 4 || (part->scale_bytes == 1 && super);
    const bool derived = part->m_factor && !part->mins && part->scale_bytes == 2;
    const bool table = part->values && part->bits == 4 && !part->mins && !part->m_factor && (part->group == 32 || part->group == 16);
    const bool ok = part->values ? table
                    : (part->bits == 4 || part->bits == 5) ? part->group == 32 && (part->mins || derived)
                                                           : (part->bits == 6 || part->bits == 8) && (part->group == 32 || part->group == 16);
    if (!scales || !ok || part->n % kBlockN || part->k != w.k) return false;
  }
  return true;
}

// Its parts' output rows side by side: the whole matrix's n.
int64_t total_rows(const QuantMatrix& w) {
  int64_t n = 0;
  for (const QuantMatrix* part = &w; part; part = part->next) n += part->n;
  return n;
}

// out [rows, total n] (= or +=) x @ w^T, each part on its format's kernel, the team splitting each part's
// column blocks (parts write disjoint columns: no barrier between them).
template <typename Rows>
void quant_linear(const QuantMatrix& w, const Rows& x, int64_t rows, float* out, bool accumulate) {
  const int64_t stride = total_rows(w);
  int64_t column = 0;
  for (const QuantMatrix* part = &w; part; column += part->n, part = part->next) {
    const QuantMatrix& p = *part;
    with_format(p, [&](auto format) {
      using F = decltype(format);
      quant_part<F::bits, typename F::Scale, F::group, F::derived>(p, x, rows, out + column, stride, accumulate);
    });
  }
}

// ---- one row of a packed matrix ----

// Row r of a single-part matrix as floats, a q + m per group: a tied head packed from the embedding's own blocks
// gives the step a token's embedding row (the file's values bit for bit, as gguf_rows.h reads them) with no
// second copy of the table. A group's 16 unpacked vectors hold pair p of the block's 16 rows, 2 values a row.
template <int Bits, typename Scale, int Group, bool Derived>
void packed_row(const QuantMatrix& w, int64_t r, float* y) {
  const int64_t block = r / kBlockN, lane = r % kBlockN, groups = w.k / kGroup;
  const uint8_t* packed = w.weights + block * groups * kGroupBytes<Bits>;
  const BlockScales<Bits, Scale, Group, Derived> weights_of(w, block);
  alignas(64) int16_t pairs[kGroup / 2][2 * kBlockN];
  alignas(64) float a[2][kBlockN], m[kBlockN];
  const __m512i table = word_table(w);
  for (int64_t g = 0; g < groups; ++g, y += kGroup) {
    __m512i weights[kGroup / 2];
    unpack_values<Bits>(packed + g * kGroupBytes<Bits>, weights, table);
    for (int p = 0; p < kGroup / 2; ++p) _mm512_store_si512(pairs[p], weights[p]);
    constexpr int kSub = kGroup / Group;
    for (int sub = 0; sub < kSub; ++sub) _mm512_store_ps(a[sub], weights_of.scale(kSub * g + sub, g));
    if constexpr (BlockScales<Bits, Scale, Group, Derived>::kMins) _mm512_store_ps(m, weights_of.min(g));
    for (int v = 0; v < kGroup; ++v) {
      const float scale = a[v / Group][lane], q = pairs[v / 2][2 * lane + v % 2];
      if constexpr (BlockScales<Bits, Scale, Group, Derived>::kMins)
        y[v] = scale * q + m[lane];
      else if constexpr (Derived)
        y[v] = scale * q + w.m_factor * scale;
      else
        y[v] = scale * q;
    }
  }
}

// packed_row for the matrix's format (known_format's); false: a fused matrix of several parts, not read here.
bool matrix_row(const QuantMatrix& w, int64_t r, float* y) {
  if (w.next) return false;
  return with_format(w, [&](auto format) {
    using F = decltype(format);
    packed_row<F::bits, typename F::Scale, F::group, F::derived>(w, r, y);
  });
}

// ---- int8 head ----

template <int MR>
void int8_block(const int8_t* head, const float* head_scale, int64_t hidden, int64_t vocab, int64_t block, const QuantizedRows& x, int64_t r0, int64_t rows, float* out) {
  const int64_t groups = hidden / kGroup, per_row = x.stride / kGroup;
  const int8_t* packed = head + block * kBlockN * hidden;
  __m512 acc[MR == kWide ? kWideRows : MR];
  each_row<MR>(rows, acc, [](int64_t, __m512& a) { a = _mm512_setzero_ps(); });
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* bytes = packed + g * kGroup * kBlockN;
    prefetch_group(reinterpret_cast<const uint8_t*>(bytes), kGroup * kBlockN);
    __m512i weights[kGroup / 2];
    unpack<8>(reinterpret_cast<const uint8_t*>(bytes), weights);
    each_row<MR>(rows, acc, [&](int64_t r, __m512& sum) {
      const __m512i dot = group_dot(weights, x.q + (r0 + r) * x.stride + g * kGroup);
      sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(x.scale[(r0 + r) * per_row + g]), sum);
    });
  }
  const __m512 scale = _mm512_loadu_ps(head_scale + block * kBlockN);
  each_row<MR>(rows, acc, [&](int64_t r, __m512& sum) { _mm512_storeu_ps(out + (r0 + r) * vocab + block * kBlockN, _mm512_mul_ps(sum, scale)); });
}

// logits [rows, vocab] = x @ head^T, head int8 per row [vocab / 16, hidden / 2, 16, 2] with scales [vocab].
template <typename Rows>
void int8_head(const int8_t* head, const float* head_scale, int64_t hidden, int64_t vocab, const Rows& x, int64_t rows, float* out) {
  over_tiles<kRegisterRows<Rows>>(vocab / kBlockN, rows, hidden, [&](int64_t b, int64_t r0, int64_t tile, auto most) {
    int8_block<most.value>(head, head_scale, hidden, vocab, b, x, r0, tile, out);
  });
}

// One linear outside a step (tests, benchmarks): out [rows, total n] = x [rows, k] @ w^T, x quantized by
// `quantize` into Rows of Q values with a scale per `per_scale` of them, as a step's kernel takes it.
template <typename Q, typename Rows, typename Quantize>
int one_linear(const QuantMatrix* w, const float* x, int64_t rows, float* out, int threads, int64_t per_scale, Quantize quantize) {
  if (!known_format(*w) || w->k % kGroup) return 1;
  std::vector<Q> q(rows * w->k);
  std::vector<float> scale(rows * w->k / per_scale), sum(rows * w->k / per_scale);
  const Rows quantized{q.data(), scale.data(), sum.data(), w->k};
  for (int64_t r = 0; r < rows; ++r) quantize(x + r * w->k, w->k, quantized, r);
#pragma omp parallel num_threads(std::max(threads, 1))
  quant_linear(*w, quantized, rows, out, false);
  return 0;
}

}  // namespace

extern "C" {
// One linear outside a step (tests, bench/engine/native_linear.py): out [rows, total n] = x [rows, k] @ w^T,
// x quantized as a step quantizes it, on `threads` threads. Returns 0, or 1 for a format with no kernel.
int lmq_linear(const QuantMatrix* w, const float* x, int64_t rows, float* out, int threads);
}

int lmq_linear(const QuantMatrix* w, const float* x, int64_t rows, float* out, int threads) {
  return one_linear<int16_t, QuantizedRows>(w, x, rows, out, threads, kGroup, quantize_row);
}
