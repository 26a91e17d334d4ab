// The native step's linears with int8 activations (included by decoder_step.cpp after quant_linear.h): the
// same packed matrices, blocks and dispatch as quant_linear.h, the input rows quantized to int8 instead of
// int16, their products on vpdpbusd (u8 weights x s8 x, 64 products an instruction) instead of vpdpwssd
// (32). Where a step is bound by those instructions (many rows) it costs about half: the step's Model::
// int8_from_rows says when (decoder_step.cpp: batched decodes and a long prompt's earlier rows, never a
// step that samples a prompt's last row).
//
// Quality: int8 per 32 values (llama.cpp's Q8_1) added more error to the default model than its int4
// weights; per 16 it is ~2.7x int16's KL divergence to float32 (docs/dev/measurements.md), still under
// llama.cpp's own figure on the same file. So x is int8 with one scale d per 16 values.
//
// The weights are not re-packed: a group's quads come from quant_linear.h's layouts. vpdpbusd sums 4
// consecutive bytes of a lane; a lane is an output row, so a weight vector must hold 4 k values of each of
// 16 rows. Unpacked with byte (not word) masks, a 64-byte vector j of nibbles gives two such vectors, of k
// = 8j + {0, 4, 1, 5} and 8j + {2, 6, 3, 7} (a word holds pair 4j + c's value e in nibble c, and pair p's
// values are k = 2p and 2p + 1), so x is stored in that order: each 8 values as 0, 4, 1, 5, 2, 6, 3, 7. A
// group's 8 quad vectors: quads 0-3 meet x's first 16 values (scale d0), quads 4-7 the next 16 (d1).
// Signed weights are stored biased as u8 (Q6_K's q + 32, Q8_0's q + 128, a table format's values less its
// least), and every offset folds into one term: a (q - c) x summed = a (sum q qx d - c sum qx d), with c = 8
// or 16 for Q4_0 / Q5_0 (their derived mins), the bias for the biased ones; stored mins (Q4_1, Q4_K, ...)
// add m * sum x as quant_linear.h does.

namespace {

constexpr int64_t kHalf = 16;  // x values per int8 scale

struct Int8Rows {
  int8_t* q;        // [rows, stride], each 8 values in the order 0, 4, 1, 5, 2, 6, 3, 7
  float* scale;     // [rows, stride / 16]: d, one per 16 values
  float* half_sum;  // [rows, stride / 16]: d * the 16 values' sum of qx
  int64_t stride;   // the widest K of the step
};

template <>
constexpr int kRegisterRows<Int8Rows> = kWideRows;  // 8 quad vectors beside 16 rows of accumulators

// One row of k floats -> int8 with one scale per 16 values, in the quads' order.
void quantize_row8(const float* x, int64_t k, const Int8Rows& out, int64_t r) {
  const __m128i order = _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  int8_t* q = out.q + r * out.stride;
  float* scale = out.scale + r * (out.stride / kHalf);
  float* sums = out.half_sum + r * (out.stride / kHalf);
  for (int64_t h = 0; h < k / kHalf; ++h) {
    const __m512 v = _mm512_loadu_ps(x + h * kHalf);
    const float amax = _mm512_reduce_max_ps(_mm512_abs_ps(v));
    const __m512i qv = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + h * kHalf), _mm_shuffle_epi8(_mm512_cvtsepi32_epi8(qv), order));
    scale[h] = amax / 127.f;
    sums[h] = scale[h] * static_cast<float>(_mm512_reduce_add_epi32(qv));
  }
}

// ---- a block's group as 8 vectors of u8 quads (16 rows x 4 k values) ----

template <int S>  // bits move left by S (right by -S), in 32-bit lanes
inline __m512i shift(__m512i v) {
  if constexpr (S >= 0)
    return _mm512_slli_epi32(v, S);
  else
    return _mm512_srli_epi32(v, -S);
}

// quad | (shift<A>(high) & mask_a) | (shift<B>(high) & mask_b): the high bits of the quad's four bytes,
// bytes 0 and 2 (k of pair p's values) from bits A places lower, bytes 1 and 3 (pair p + 2's) from B.
template <int A, int B>
inline __m512i with_high(__m512i quad, __m512i high, int32_t mask_a, int32_t mask_b) {
  quad = _mm512_ternarylogic_epi32(quad, shift<A>(high), _mm512_set1_epi32(mask_a), 0xF8);
  return _mm512_ternarylogic_epi32(quad, shift<B>(high), _mm512_set1_epi32(mask_b), 0xF8);
}

template <int Bits>
inline void unpack_quads(const uint8_t* packed, __m512i* quads);

template <>
inline void unpack_quads<4>(const uint8_t* packed, __m512i* quads) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512(packed + 64 * j);
    quads[2 * j] = _mm512_and_si512(v, low4);
    quads[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  }
}

// Bit 4 of pair p's value e is bit p of word e of the high plane: quad j's bytes want pairs 4j and 4j + 2
// (the low quad) or 4j + 1 and 4j + 3 (the high one) at bits 4 and 12 of each word.
template <int J>
inline void high_bits5(__m512i high, __m512i* quads) {
  quads[2 * J] = with_high<4 - 4 * J, 10 - 4 * J>(quads[2 * J], high, 0x00100010, 0x10001000);
  quads[2 * J + 1] = with_high<3 - 4 * J, 9 - 4 * J>(quads[2 * J + 1], high, 0x00100010, 0x10001000);
}

template <>
inline void unpack_quads<5>(const uint8_t* packed, __m512i* quads) {
  unpack_quads<4>(packed, quads);
  const __m512i high = _mm512_loadu_si512(packed + kInt4GroupBytes);
  high_bits5<0>(high, quads);
  high_bits5<1>(high, quads);
  high_bits5<2>(high, quads);
  high_bits5<3>(high, quads);
}

// Bits 4, 5 of pair 8h + c's value e are bits 2c, 2c + 1 of word e of high plane h; the quads keep q + 32.
template <int J>
inline void high_bits6(const uint8_t* packed, __m512i* quads) {
  constexpr int c = 4 * (J % 2);
  const __m512i high = _mm512_loadu_si512(packed + kInt4GroupBytes + 64 * (J / 2));
  quads[2 * J] = with_high<4 - 2 * c, 8 - 2 * c>(quads[2 * J], high, 0x00300030, 0x30003000);
  quads[2 * J + 1] = with_high<2 - 2 * c, 6 - 2 * c>(quads[2 * J + 1], high, 0x00300030, 0x30003000);
}

template <>
inline void unpack_quads<6>(const uint8_t* packed, __m512i* quads) {
  unpack_quads<4>(packed, quads);
  high_bits6<0>(packed, quads);
  high_bits6<1>(packed, quads);
  high_bits6<2>(packed, quads);
  high_bits6<3>(packed, quads);
}

// Pairs 4j, 4j + 1 (a) and 4j + 2, 4j + 3 (b), 32 bytes each ([16 rows, 2]): interleaving their bytes puts
// a row's pair 4j and 4j + 2 values (or 4j + 1 and 4j + 3) in one lane; the 128-bit lanes of the two
// interleaves then hold rows 0-3, 8-11 and 4-7, 12-15, put in order by one permute. The quads keep q + 128.
template <>
inline void unpack_quads<8>(const uint8_t* packed, __m512i* quads) {
  const __m512i low_index = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), high_index = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int j = 0; j < 4; ++j) {
    const __m512i a = _mm512_loadu_si512(packed + 128 * j), b = _mm512_loadu_si512(packed + 128 * j + 64);
    const __m512i low = _mm512_unpacklo_epi8(a, b), high = _mm512_unpackhi_epi8(a, b);
    quads[2 * j] = _mm512_xor_si512(_mm512_permutex2var_epi64(low, low_index, high), bias);
    quads[2 * j + 1] = _mm512_xor_si512(_mm512_permutex2var_epi64(low, high_index, high), bias);
  }
}

// A table format's least value: its quads hold each value less it, as u8 (Q3_K's + 4, IQ4's + 127).
inline int table_floor(const QuantMatrix& w) { return w.values ? *std::min_element(w.values, w.values + 16) : 0; }

// A table format's values plus `offset` (quad_offset's: less their floor) as bytes, in every 128-bit lane, for vpshufb.
inline __m512i byte_table(const QuantMatrix& w, float offset) {
  if (!w.values) return _mm512_setzero_si512();
  const __m128i values = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.values));
  return _mm512_broadcast_i32x4(_mm_add_epi8(values, _mm_set1_epi8(static_cast<char>(offset))));
}

// unpack_quads<Bits>, a table format's nibbles then replaced by their values less the floor (one vpshufb a quad).
template <int Bits>
inline void unpack_quad_values(const uint8_t* packed, __m512i* quads, __m512i table) {
  unpack_quads<Bits == kTable ? 4 : Bits>(packed, quads);
  if constexpr (Bits == kTable)
    for (int i = 0; i < 8; ++i) quads[i] = _mm512_shuffle_epi8(table, quads[i]);
}

// What the quads hold beyond the weight: c in a (q - c) (0 where the matrix keeps its mins or m = 0).
template <int Bits, bool Derived>
inline float quad_offset(const QuantMatrix& w) {
  if constexpr (Bits == 6) return 32.f;
  if constexpr (Bits == 8) return 128.f;
  if constexpr (Bits == kTable) return -static_cast<float>(table_floor(w));
  return Derived ? -static_cast<float>(w.m_factor) : 0.f;
}

// Quads [Q, Q + 4) against x's 16 values [4Q, 4Q + 16), exact in int32 (|q qx| <= 255 * 127, 16 of them).
template <int Q>
inline __m512i half_dot(const __m512i* quads, const int8_t* x) {
  __m512i dot = _mm512_setzero_si512();
  for (int i = 0; i < 4; ++i) dot = dpbusd_broadcast(dot, quads[Q + i], x + 4 * (Q + i));
  return dot;
}

// ---- the linears on int8 x ----

// Row `row`'s group g against a block's quads with x's scales applied, an offset c of a (q - c) taken out:
// d0 s0 + d1 s1 - c d sum(qx) over the group's 32 values (s0, s1: the halves' exact int32 dots). Offset:
// whether the quads hold one (c = 0 costs a broadcast and its scalars a group and row all the same).
template <bool Offset = true>
inline __m512 group_product(const __m512i* quads, const Int8Rows& x, int64_t row, int64_t g, float offset) {
  const int64_t at = row * (x.stride / kHalf) + 2 * g;
  const int8_t* q = x.q + row * x.stride + g * kGroup;
  const __m512 s0 = _mm512_cvtepi32_ps(half_dot<0>(quads, q)), s1 = _mm512_cvtepi32_ps(half_dot<4>(quads, q));
  const __m512 d0s0 = Offset ? _mm512_fmadd_ps(s0, _mm512_set1_ps(x.scale[at]), _mm512_set1_ps(-offset * (x.half_sum[at] + x.half_sum[at + 1])))
                             : _mm512_mul_ps(s0, _mm512_set1_ps(x.scale[at]));
  return _mm512_fmadd_ps(s1, _mm512_set1_ps(x.scale[at + 1]), d0s0);
}

// Output columns [16 * block, +16) for x rows [r0, r0 + rows): quant_linear.h's quant_block on int8 x.
template <int Bits, typename Scale, int Group, bool Derived, int MR>
void quant_block(const QuantMatrix& w, int64_t block, const Int8Rows& x, int64_t r0, int64_t rows, float* out, int64_t out_stride, bool accumulate) {
  constexpr bool kMins = Bits < 6 && !Derived, kOffset = !kMins;
  constexpr int kSub = kGroup / Group, kBytes = kGroupBytes<Bits>;
  const int64_t groups = w.k / kGroup, halves = x.stride / kHalf;
  const uint8_t* packed = w.weights + block * groups * kBytes;
  const BlockScales<Bits, Scale, Group, Derived> weights_of(w, block);
  const float offset = quad_offset<Bits, Derived>(w);
  const __m512i table = byte_table(w, offset);
  __m512 acc[MR == kWide ? kWideRows : MR];
  each_row<MR>(rows, acc, [](int64_t, __m512& a) { a = _mm512_setzero_ps(); });
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = packed + g * kBytes;
    prefetch_group(group, kBytes);
    __m512i quads[8];
    unpack_quad_values<Bits>(group, quads, table);
    const __m512 a0 = weights_of.scale(kSub * g, g), a1 = kSub == 1 ? a0 : weights_of.scale(2 * g + 1, g);
    const __m512 m = kMins ? weights_of.min(g) : _mm512_setzero_ps();
    each_row<MR>(rows, acc, [&](int64_t r, __m512& sum) {
      const int64_t at = (r0 + r) * halves + 2 * g;
      const float* xs = x.half_sum + at;
      if constexpr (kSub == 1) {
        sum = _mm512_fmadd_ps(group_product<kOffset>(quads, x, r0 + r, g, offset), a0, sum);
        if constexpr (kMins) sum = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[0] + xs[1]), sum);
      } else {  // a scale per half: the halves' products apart
        const int8_t* row = x.q + (r0 + r) * x.stride + g * kGroup;
        const __m512 s0 = _mm512_cvtepi32_ps(half_dot<0>(quads, row)), s1 = _mm512_cvtepi32_ps(half_dot<4>(quads, row));
        const float* d = x.scale + at;
        sum = _mm512_fmadd_ps(_mm512_fmadd_ps(s0, _mm512_set1_ps(d[0]), _mm512_set1_ps(-offset * xs[0])), a0, sum);
        sum = _mm512_fmadd_ps(_mm512_fmadd_ps(s1, _mm512_set1_ps(d[1]), _mm512_set1_ps(-offset * xs[1])), a1, sum);
      }
    });
  }
  each_row<MR>(rows, acc, [&](int64_t r, __m512& sum) {
    float* o = out + (r0 + r) * out_stride + block * kBlockN;
    _mm512_storeu_ps(o, accumulate ? _mm512_add_ps(_mm512_loadu_ps(o), sum) : sum);
  });
}

// The int8 head ([N/16, K/2, 16, 2], a scale per output row) on int8 x: quant_linear.h's int8_block.
template <int MR>
void int8_block(const int8_t* head, const float* head_scale, int64_t hidden, int64_t vocab, int64_t block, const Int8Rows& x, int64_t r0, int64_t rows, float* out) {
  const int64_t groups = hidden / kGroup;
  const uint8_t* packed = reinterpret_cast<const uint8_t*>(head + block * kBlockN * hidden);
  __m512 acc[MR == kWide ? kWideRows : MR];
  each_row<MR>(rows, acc, [](int64_t, __m512& a) { a = _mm512_setzero_ps(); });
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* bytes = packed + g * kGroup * kBlockN;
    prefetch_group(bytes, kGroup * kBlockN);
    __m512i quads[8];
    unpack_quads<8>(bytes, quads);
    each_row<MR>(rows, acc, [&](int64_t r, __m512& sum) { sum = _mm512_add_ps(sum, group_product(quads, x, r0 + r, g, 128.f)); });
  }
  const __m512 scale = _mm512_loadu_ps(head_scale + block * kBlockN);
  each_row<MR>(rows, acc, [&](int64_t r, __m512& sum) { _mm512_storeu_ps(out + (r0 + r) * vocab + block * kBlockN, _mm512_mul_ps(sum, scale)); });
}

}  // namespace

extern "C" {
// lmq_linear with x quantized as an int8 step quantizes it (tests/worker/model/test_native_int8.py).
int lmq_linear_int8(const QuantMatrix* w, const float* x, int64_t rows, float* out, int threads);
}

int lmq_linear_int8(const QuantMatrix* w, const float* x, int64_t rows, float* out, int threads) {
  return one_linear<int8_t, Int8Rows>(w, x, rows, out, threads, kHalf, quantize_row8);
}
