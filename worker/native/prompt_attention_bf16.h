// A prompt's attention in bfloat16 products, for the rows no one samples from (decoder_step.cpp includes this
// after prompt_attention.h, whose tiles, scratch and softmax it shares).
//
// Which rows: a tile (several rows of one sequence) in a step whose x is int8 (int8_linear.h's rule: a long
// prompt's rows before the one that gives the answer's first token, worker/runtime/long_prompts.py), on a CPU
// with AVX512-BF16 (Model::bf16_attention). Every other row attends in float32 (attend(), attend_tile()), the
// sampled row among them, so batch-invariant mode (no int8 x) never runs this.
//
// Why: a long prompt's attention is a quarter of its time on Qwen3-0.6B's shape, at ~65% of the FMA peak.
// Zen 4's vdpbf16ps issues at vfmadd231ps's rate with two multiply-adds a lane (docs/benchmarks.md, "Fifteenth
// session"), and the pool's keys and values are bfloat16 already: a score is the query, rounded to bfloat16,
// against 16 keys' pairs of dimensions (the keys transposed as 32-bit pairs, never widened), and an output the
// probabilities, rounded to bfloat16 a pair of keys at a time, against the two keys' values interleaved
// dimension by dimension. Products of two bfloat16 are exact in float32 and sum there; what changes is the
// rounding of q and p (llama.cpp rounds both to f16 on this path), measured as KL to float32 in docs/models.md.

// Up to 16 keys (zeros past `keys`) as 32-bit pairs of dimensions: kp[i * 16 + j] holds key j's dims 2i, 2i + 1.
template <int C>
__attribute__((target("avx512bf16"))) void transpose_key_pairs(const uint16_t* k_pool, KeyWalk& keys_at, KeyWalk& ahead,
                                                                int64_t ahead_left, int64_t keys, uint32_t* kp) {
  constexpr int64_t hd = C * 16;
  const uint16_t* key[16];
  for (int64_t j = 0; j < keys; ++j) {
    if (j < ahead_left) prefetch_key<hd * 2>(k_pool + ahead.next());
    key[j] = k_pool + keys_at.next();
  }
  for (int c = 0; c < C / 2; ++c) {  // 32 dimensions, 16 pairs, a vector
    __m512 r[16];
    for (int64_t j = 0; j < 16; ++j)
      r[j] = j < keys ? _mm512_castsi512_ps(_mm512_loadu_si512(key[j] + c * 32)) : _mm512_setzero_ps();
    transpose16(r);  // moves bits only
    for (int l = 0; l < 16; ++l) _mm512_store_ps(reinterpret_cast<float*>(kp + (c * 16 + l) * 16), r[l]);
  }
}

// n floats (a multiple of 32) rounded to bfloat16, in order: out[i] holds values 2i, 2i + 1.
__attribute__((target("avx512bf16"))) inline void bf16_pairs(const float* in, int64_t n, uint32_t* out) {
  for (int64_t i = 0; i < n; i += 32) {
    const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(in + i + 16), _mm512_loadu_ps(in + i));
    _mm512_storeu_si512(out + i / 2, reinterpret_cast<__m512i>(both));
  }
}

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// N queries' scores with a block of 16 transposed keys, scaled and capped as attend_heads' are.
template <int C, int N>
__attribute__((target("avx512bf16"))) inline void score_block_bf16(const uint32_t* kp, const uint32_t* const* qp, Scoring scoring,
                                                                    float* scores, int64_t stride) {
  __m512 even[N], odd[N];  // two chains a query: vdpbf16ps's latency
  for (int n = 0; n < N; ++n) even[n] = odd[n] = _mm512_setzero_ps();
  for (int i = 0; i < C * 8; i += 2) {
    const __m512bh k0 = as_bh(_mm512_load_si512(kp + i * 16)), k1 = as_bh(_mm512_load_si512(kp + (i + 1) * 16));
    for (int n = 0; n < N; ++n) {
      even[n] = _mm512_dpbf16_ps(even[n], k0, as_bh(_mm512_set1_epi32(static_cast<int>(qp[n][i]))));
      odd[n] = _mm512_dpbf16_ps(odd[n], k1, as_bh(_mm512_set1_epi32(static_cast<int>(qp[n][i + 1]))));
    }
  }
  const __m512 scale = _mm512_set1_ps(scoring.scale), cap = _mm512_set1_ps(scoring.softcap);
  const __m512 inv_cap = _mm512_set1_ps(scoring.softcap > 0.f ? 1.f / scoring.softcap : 0.f);
  for (int n = 0; n < N; ++n) {
    __m512 score = _mm512_mul_ps(_mm512_add_ps(even[n], odd[n]), scale);
    if (scoring.softcap > 0.f) score = _mm512_mul_ps(cap, tanh512(_mm512_mul_ps(score, inv_cap)));
    _mm512_storeu_ps(scores + n * stride, score);
  }
}

// A block of values as pairs of keys: vp[(u * C + c) * 16 + l] holds dim c * 16 + l of keys 2u and 2u + 1.
template <int C>
__attribute__((target("avx512bf16"))) void interleave_values(const uint16_t* v_pool, KeyWalk& values_at, int64_t keys, uint32_t* vp) {
  const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                       39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int64_t t = 0; t < keys; t += 2) {
    const uint16_t* first = v_pool + values_at.next();
    const uint16_t* second = t + 1 < keys ? v_pool + values_at.next() : nullptr;
    uint32_t* out = vp + (t / 2) * C * 16;
    for (int c = 0; c < C / 2; ++c) {
      const __m512i a = _mm512_loadu_si512(first + c * 32);
      const __m512i b = second ? _mm512_loadu_si512(second + c * 32) : _mm512_setzero_si512();  // p is 0 there too
      _mm512_store_si512(out + (2 * c) * 16, _mm512_permutex2var_epi16(a, low, b));
      _mm512_store_si512(out + (2 * c + 1) * 16, _mm512_permutex2var_epi16(a, high, b));
    }
  }
}

// N queries' sums of p * v over `pairs` pairs of keys, value chunks [c0, c0 + 4); query n's probability pairs at
// pp + n * pp_stride, its sums at acc + n * hd.
template <int C, int N>
__attribute__((target("avx512bf16"))) inline void value_block_bf16(const uint32_t* vp, const uint32_t* pp, int64_t pp_stride,
                                                                    int64_t pairs, int c0, float* acc) {
  constexpr int64_t hd = C * 16;
  __m512 sum[N][4];
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < 4; ++c) sum[n][c] = _mm512_loadu_ps(acc + n * hd + (c0 + c) * 16);
  for (int64_t u = 0; u < pairs; ++u) {
    __m512bh v[4];
    for (int c = 0; c < 4; ++c) v[c] = as_bh(_mm512_load_si512(vp + (u * C + c0 + c) * 16));
    for (int n = 0; n < N; ++n) {
      const __m512bh p = as_bh(_mm512_set1_epi32(static_cast<int>(pp[n * pp_stride + u])));
      for (int c = 0; c < 4; ++c) sum[n][c] = _mm512_dpbf16_ps(sum[n][c], v[c], p);
    }
  }
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + n * hd + (c0 + c) * 16, sum[n][c]);
}

// Rows [r0, r0 + n) (one tile) x the query heads of KV head h, as attend_tile() but in bfloat16 products.
template <int C>
__attribute__((target("avx512bf16"))) void attend_tile_bf16(const Model& m, const Step& s, int64_t layer, const float* qkv,
                                                             int64_t qkv_n, float* out, int64_t out_n, int64_t r0, int64_t n,
                                                             int64_t h, TileScratch& x) {
  constexpr int64_t hd = C * 16;
  const int64_t group = m.heads / m.kv_heads, queries = n * group;
  const TileKeys keys(m, s, layer, r0, n, h);
  const int64_t count = keys.count;
  const int64_t padded = (count + 31) / 32 * 32, stride = padded + 16;  // pairs of keys in 32s; exp_row's spill
  x.scores.resize(queries * stride);
  x.acc.assign(queries * hd, 0.f);
  x.inv_sum.resize(queries);
  x.query_pairs.resize(queries * hd / 2);
  x.prob_pairs.resize(queries * padded / 2);
  x.pair_rows.resize(queries);
  alignas(64) uint32_t kp[hd / 2 * 16];           // a block of 16 keys, transposed as pairs
  alignas(64) uint32_t vp[kValueBlock / 2 * hd];  // a block of values, pairs of keys interleaved
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < group; ++g) {
      uint32_t* pairs = x.query_pairs.data() + (i * group + g) * hd / 2;
      bf16_pairs(qkv + (r0 + i) * qkv_n + (h * group + g) * hd, hd, pairs);
      x.pair_rows[i * group + g] = pairs;
    }

  const Scoring scoring{m.attention_scale, m.attention_softcap};
  KeyWalk keys_at(keys.pages, s.page_size, keys.token_stride, keys.first);
  KeyWalk ahead(keys.pages, s.page_size, keys.token_stride, keys.first + kKeysAhead);
  for (int64_t t0 = 0; t0 < count; t0 += 16) {
    transpose_key_pairs<C>(keys.k_pool, keys_at, ahead, count - kKeysAhead - t0, std::min<int64_t>(16, count - t0), kp);
    in_fours(queries, [&](auto size, int64_t q0) {
      score_block_bf16<C, decltype(size)::value>(kp, x.pair_rows.data() + q0, scoring, x.scores.data() + q0 * stride + t0, stride);
    });
  }
  tile_softmax(s, keys, r0, n, group, padded, stride, x);
  for (int64_t q = 0; q < queries; ++q) bf16_pairs(x.scores.data() + q * stride, padded, x.prob_pairs.data() + q * padded / 2);
  KeyWalk values_at(keys.pages, s.page_size, keys.token_stride, keys.first);
  for (int64_t t0 = 0; t0 < count; t0 += kValueBlock) {
    const int64_t block = std::min(kValueBlock, count - t0);
    interleave_values<C>(keys.v_pool, values_at, block, vp);
    for (int c0 = 0; c0 < C; c0 += 4)
      in_fours(queries, [&](auto size, int64_t q0) {
        value_block_bf16<C, decltype(size)::value>(vp, x.prob_pairs.data() + q0 * padded / 2 + t0 / 2, padded / 2,
                                                   (block + 1) / 2, c0, x.acc.data() + q0 * hd);
      });
  }
  tile_output<C>(x, out, out_n, r0, n, h, group);
}
