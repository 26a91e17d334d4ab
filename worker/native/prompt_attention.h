// A prompt chunk's attention, a tile of its rows at a time (decoder_step.cpp includes this after attend()).
//
// attend() takes one row's query heads of a KV head over all its keys: each key is widened from bfloat16
// once for those few heads, and each score is a 16-lane partial dot product summed across lanes (reduce16),
// so a long prompt's attention ran at ~51 cycles per (row, key, KV head) where its FMAs need 32 (AMD EPYC
// Zen 4, Qwen3-0.6B's shape, a 1,000-token prompt: 30% of the time to first token). The rows of one prompt
// chunk read the same keys from the same pages, so a tile of them shares the work that is not FMAs: each
// block of 16 keys is widened and transposed once (dimension-major, 16 keys a vector) for every query of
// the tile, and each query's 16 scores come out as one vector with no reduction across lanes; the values
// are widened once a block into float32 for all of the tile's queries.
//
// Bit for bit the arithmetic of attend(): each score sums the same products in the same order (the 16
// lane partials of reduce16, then its tree across lanes), the softmax is exp_row on the row's own keys,
// and each output sums p * v over the keys in order. A key outside a row's range (past its own context,
// or before its window) gets p = 0, and fma(0, v, acc) is acc. So a row's output does not depend on the
// tile it is in, and a step may serve any row by either path.

// The rows of a tile: consecutive positions of one sequence, at most as many as keep its query heads at
// kTileQueries (scores, one row of keys each, stay in L2).
constexpr int64_t kTileQueries = 32;
constexpr int64_t kValueBlock = 32;  // keys whose values are widened to float32 at a time (16 KB at head_dim 128)

// Whether row r + 1 reads row r's keys from the same pages: the next position, the same page table.
inline bool continues(const Step& s, int64_t r) {
  if (s.contexts[r + 1] != s.contexts[r] + 1) return false;
  const int64_t pages = (s.contexts[r + 1] + s.page_size - 1) / s.page_size;
  const int64_t* a = s.page_tables + r * s.page_table_stride;
  return std::equal(a, a + pages, a + s.page_table_stride);
}

// The step's rows in tiles: starts[i] to starts[i + 1], each at most `most` rows of one sequence.
std::vector<int64_t> row_tiles(const Step& s, int64_t most) {
  std::vector<int64_t> starts{0};
  for (int64_t r = 1; r < s.rows; ++r)
    if (!continues(s, r - 1) || r - starts.back() == most) starts.push_back(r);
  starts.push_back(s.rows);
  return starts;
}

// r[0..16) (16 vectors of 16 floats) transposed in place: r[i][j] becomes r[j][i].
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  auto lo = [](__m512 a, __m512 b) { return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))); };
  auto hi = [](__m512 a, __m512 b) { return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))); };
  for (int i = 0; i < 16; i += 4) {
    r[i] = lo(t[i], t[i + 2]);
    r[i + 1] = hi(t[i], t[i + 2]);
    r[i + 2] = lo(t[i + 1], t[i + 3]);
    r[i + 3] = hi(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// Up to 16 keys (zeros past `keys`) widened and transposed: kt[d * 16 + j] is dimension d of key j.
template <int C>
void transpose_keys(const uint16_t* k_pool, KeyWalk& keys_at, KeyWalk& ahead, int64_t ahead_left, int64_t keys, float* kt) {
  constexpr int64_t hd = C * 16;
  const uint16_t* key[16];
  for (int64_t j = 0; j < 16; ++j) {
    if (j < keys) {
      if (j < ahead_left) prefetch_key<hd * 2>(k_pool + ahead.next());
      key[j] = k_pool + keys_at.next();
    }
  }
  for (int c = 0; c < C; ++c) {
    __m512 r[16];
    for (int64_t j = 0; j < 16; ++j) r[j] = j < keys ? load_bf16(key[j] + c * 16) : _mm512_setzero_ps();
    transpose16(r);
    for (int l = 0; l < 16; ++l) _mm512_store_ps(kt + (c * 16 + l) * 16, r[l]);
  }
}

// Lane l's partial dot products of N queries with 16 keys: sum over c of k[c * 16 + l] * q[c * 16 + l],
// in attend_heads' order (a product, then fused multiply-adds).
template <int C, int N>
inline void lane_partials(const float* kt, const float* const* q, int l, __m512 (&p)[N]) {
  const __m512 k0 = _mm512_load_ps(kt + l * 16);
  for (int n = 0; n < N; ++n) p[n] = _mm512_mul_ps(k0, _mm512_set1_ps(q[n][l]));
  for (int c = 1; c < C; ++c) {
    const __m512 k = _mm512_load_ps(kt + (c * 16 + l) * 16);
    for (int n = 0; n < N; ++n) p[n] = _mm512_fmadd_ps(k, _mm512_set1_ps(q[n][c * 16 + l]), p[n]);
  }
}

// N queries' raw dot products with a transposed block of 16 keys, summed across lanes in reduce16's tree:
// ((y0 + y2) + (y1 + y3)), y_m = (x_m + x_m+8) + (x_m+4 + x_m+12).
template <int C, int N>
inline void block_dots(const float* kt, const float* const* q, __m512 (&out)[N]) {
  __m512 y[4][N];
  for (int m : {0, 2, 1, 3}) {
    __m512 a[N], b[N];
    lane_partials<C, N>(kt, q, m, a);
    lane_partials<C, N>(kt, q, m + 8, b);
    for (int n = 0; n < N; ++n) y[m][n] = _mm512_add_ps(a[n], b[n]);
    lane_partials<C, N>(kt, q, m + 4, a);
    lane_partials<C, N>(kt, q, m + 12, b);
    for (int n = 0; n < N; ++n) y[m][n] = _mm512_add_ps(y[m][n], _mm512_add_ps(a[n], b[n]));
  }
  for (int n = 0; n < N; ++n) out[n] = _mm512_add_ps(_mm512_add_ps(y[0][n], y[2][n]), _mm512_add_ps(y[1][n], y[3][n]));
}

// N queries' scores for one block, scaled and capped as attend_heads' are, stored at scores[n * stride].
template <int C, int N>
inline void score_block(const float* kt, const float* const* q, Scoring scoring, float* scores, int64_t stride) {
  __m512 dots[N];
  block_dots<C, N>(kt, q, dots);
  const __m512 scale = _mm512_set1_ps(scoring.scale), cap = _mm512_set1_ps(scoring.softcap);
  const __m512 inv_cap = _mm512_set1_ps(scoring.softcap > 0.f ? 1.f / scoring.softcap : 0.f);
  for (int n = 0; n < N; ++n) {
    __m512 score = _mm512_mul_ps(dots[n], scale);
    if (scoring.softcap > 0.f) score = _mm512_mul_ps(cap, tanh512(_mm512_mul_ps(score, inv_cap)));
    _mm512_storeu_ps(scores + n * stride, score);
  }
}

// N accumulators' worth of p * v: queries [0, N) x value chunks [c0, c0 + 4) over keys [0, keys) of vf;
// query n's p at p + n * p_stride, its sums at acc + n * hd.
template <int N>
inline void value_block(const float* vf, int64_t hd, const float* p, int64_t p_stride, int64_t keys, int c0, float* acc) {
  __m512 sum[N][4];
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < 4; ++c) sum[n][c] = _mm512_loadu_ps(acc + n * hd + (c0 + c) * 16);
  for (int64_t t = 0; t < keys; ++t) {
    __m512 v[4];
    for (int c = 0; c < 4; ++c) v[c] = _mm512_load_ps(vf + t * hd + (c0 + c) * 16);
    for (int n = 0; n < N; ++n) {
      const __m512 pn = _mm512_set1_ps(p[n * p_stride + t]);
      for (int c = 0; c < 4; ++c) sum[n][c] = _mm512_fmadd_ps(pn, v[c], sum[n][c]);
    }
  }
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + n * hd + (c0 + c) * 16, sum[n][c]);
}

// Per-thread scratch of the tiled attention (reused across tasks and layers), sized by the tile's keys.
struct TileScratch {
  std::vector<float> scores, acc, inv_sum;
  std::vector<const float*> queries;  // each query's q (its row's, at its head)
  std::vector<uint32_t> query_pairs, prob_pairs;  // prompt_attention_bf16.h's: q and p rounded, in pairs
  std::vector<const uint32_t*> pair_rows;         // each query's pairs
};

// count queries in groups of 4 (and one of the rest): f(integral_constant<int, N>, first) for each group.
template <typename F>
inline void in_fours(int64_t count, F&& f) {
  int64_t i = 0;
  for (; i + 4 <= count; i += 4) f(std::integral_constant<int, 4>{}, i);
  switch (count - i) {
    case 3: f(std::integral_constant<int, 3>{}, i); break;
    case 2: f(std::integral_constant<int, 2>{}, i); break;
    case 1: f(std::integral_constant<int, 1>{}, i); break;
    default: break;
  }
}

// Where a tile's keys are in one layer's pool for KV head h, and the span [first, first + count) its rows attend to:
// from its first row's window start to its last row's own key.
struct TileKeys {
  const int64_t* pages;
  const uint16_t *k_pool, *v_pool;
  int64_t token_stride, window, first, count;

  TileKeys(const Model& m, const Step& s, int64_t layer, int64_t r0, int64_t n, int64_t h)
      : pages(s.page_tables + r0 * s.page_table_stride),
        k_pool(s.k_pool + layer * s.layer_stride + h * m.head_dim),
        v_pool(s.v_pool + layer * s.layer_stride + h * m.head_dim),
        token_stride(m.kv_heads * m.head_dim),
        window(m.layer[layer].window),
        first(first_of(s, r0)),
        count(s.contexts[r0 + n - 1] - first) {}

  // Row r's first key: its window's, or the sequence's.
  int64_t first_of(const Step& s, int64_t r) const { return window > 0 ? std::max<int64_t>(0, s.contexts[r] - window) : int64_t{0}; }
};

// Each query's softmax over its own row's keys, its scores at x.scores + q * stride from the tile's first key:
// x.inv_sum[q] set, and p = 0 outside the row's keys, up to `padded`.
inline void tile_softmax(const Step& s, const TileKeys& keys, int64_t r0, int64_t n, int64_t group, int64_t padded,
                         int64_t stride, TileScratch& x) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t own_first = keys.first_of(s, r0 + i) - keys.first, own_count = s.contexts[r0 + i] - keys.first - own_first;
    for (int64_t g = 0; g < group; ++g) {
      float* row = x.scores.data() + (i * group + g) * stride;
      x.inv_sum[i * group + g] = exp_row(row + own_first, own_count);
      std::fill(row, row + own_first, 0.f);
      std::fill(row + own_first + own_count, row + padded, 0.f);
    }
  }
}

// Each query's sums of p * v (x.acc) times its 1 / sum of p, into its row's head of `out`.
template <int C>
inline void tile_output(const TileScratch& x, float* out, int64_t out_n, int64_t r0, int64_t n, int64_t h, int64_t group) {
  constexpr int64_t hd = C * 16;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < group; ++g) {
      const float* sum = x.acc.data() + (i * group + g) * hd;
      float* o = out + (r0 + i) * out_n + (h * group + g) * hd;
      const __m512 inv = _mm512_set1_ps(x.inv_sum[i * group + g]);
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + c * 16, _mm512_mul_ps(_mm512_loadu_ps(sum + c * 16), inv));
    }
}

// Rows [r0, r0 + n) (one tile) x the query heads of KV head h, against their keys in one layer's pool.
template <int C>
void attend_tile(const Model& m, const Step& s, int64_t layer, const float* qkv, int64_t qkv_n, float* out, int64_t out_n,
                 int64_t r0, int64_t n, int64_t h, TileScratch& x) {
  constexpr int64_t hd = C * 16;
  const int64_t group = m.heads / m.kv_heads, queries = n * group;
  const TileKeys keys(m, s, layer, r0, n, h);
  const int64_t count = keys.count;
  const int64_t padded = (count + 15) / 16 * 16, stride = padded + 16;  // exp_row may write up to 15 floats past a row's keys
  x.scores.resize(queries * stride);
  x.acc.assign(queries * hd, 0.f);
  x.inv_sum.resize(queries);
  x.queries.resize(queries);
  alignas(64) float kt[hd * 16];           // a block of 16 keys, transposed
  alignas(64) float vf[kValueBlock * hd];  // a block of values, widened
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < group; ++g) x.queries[i * group + g] = qkv + (r0 + i) * qkv_n + (h * group + g) * hd;

  const Scoring scoring{m.attention_scale, m.attention_softcap};
  KeyWalk keys_at(keys.pages, s.page_size, keys.token_stride, keys.first);
  KeyWalk ahead(keys.pages, s.page_size, keys.token_stride, keys.first + kKeysAhead);
  for (int64_t t0 = 0; t0 < count; t0 += 16) {
    transpose_keys<C>(keys.k_pool, keys_at, ahead, count - kKeysAhead - t0, std::min<int64_t>(16, count - t0), kt);
    in_fours(queries, [&](auto size, int64_t q0) {
      score_block<C, decltype(size)::value>(kt, x.queries.data() + q0, scoring, x.scores.data() + q0 * stride + t0, stride);
    });
  }
  tile_softmax(s, keys, r0, n, group, padded, stride, x);
  KeyWalk values_at(keys.pages, s.page_size, keys.token_stride, keys.first);
  for (int64_t t0 = 0; t0 < count; t0 += kValueBlock) {
    const int64_t block = std::min(kValueBlock, count - t0);
    for (int64_t t = 0; t < block; ++t) {
      const uint16_t* value = keys.v_pool + values_at.next();
      for (int c = 0; c < C; ++c) _mm512_store_ps(vf + t * hd + c * 16, load_bf16(value + c * 16));
    }
    for (int c0 = 0; c0 < C; c0 += 4)
      in_fours(queries, [&](auto size, int64_t q0) {
        value_block<decltype(size)::value>(vf, hd, x.scores.data() + q0 * stride + t0, stride, block, c0, x.acc.data() + q0 * hd);
      });
  }
  tile_output<C>(x, out, out_n, r0, n, h, group);
}

#include "prompt_attention_bf16.h"

// A tile of rows x KV head h: attend_tile where the tile has rows to share its keys, else attend() (a decode's row);
// bf16: the tile's rows are no one's sampled row, on a CPU with AVX512-BF16 (prompt_attention_bf16.h).
void attend_rows(const Model& m, const Step& s, int64_t layer, const float* qkv, float* out, int64_t r0, int64_t n, int64_t h,
                 std::vector<float>& scores, TileScratch& x, bool bf16) {
  const int64_t hd = m.head_dim, group = m.heads / m.kv_heads, q_size = m.heads * hd, qkv_n = q_size + 2 * m.kv_heads * hd;
  if (n == 1) {
    attend(m, s, layer, qkv + r0 * qkv_n + h * group * hd, out + r0 * q_size + h * group * hd, r0, h, scores);
    return;
  }
  if (bf16) {
    switch (hd) {
      case 64: attend_tile_bf16<4>(m, s, layer, qkv, qkv_n, out, q_size, r0, n, h, x); break;
      case 128: attend_tile_bf16<8>(m, s, layer, qkv, qkv_n, out, q_size, r0, n, h, x); break;
      default: attend_tile_bf16<16>(m, s, layer, qkv, qkv_n, out, q_size, r0, n, h, x); break;
    }
    return;
  }
  switch (hd) {
    case 64: attend_tile<4>(m, s, layer, qkv, qkv_n, out, q_size, r0, n, h, x); break;
    case 128: attend_tile<8>(m, s, layer, qkv, qkv_n, out, q_size, r0, n, h, x); break;
    default: attend_tile<16>(m, s, layer, qkv, qkv_n, out, q_size, r0, n, h, x); break;
  }
}
