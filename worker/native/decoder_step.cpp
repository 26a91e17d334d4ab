// One engine step of a dense decoder in a single call (worker/runtime/native_step.py owns it): decodes and
// prompt chunks alike, each new token a row that attends to its own sequence's keys up to itself.
//
// One step for every dense family: what sets a family apart is a parameter of the model or of a layer,
// never a copy of the step. Llama is the case with every option off; Qwen2 adds q/k/v biases, Qwen3 and
// Gemma 3 a per-head RMSNorm of q and k, Mistral and Gemma's local layers a sliding window (per layer,
// each with its own rotary table), Gemma norms on the attention's and the MLP's outputs, a scaled
// embedding, GELU-tanh, a query scale of its own and soft-capped scores, Phi-4-mini a partial rotary;
// Mixtral and Qwen3-MoE a sparse MLP (a router and experts: expert_mlp.h) in place of the dense one.
//
// Why native: on 2 cores a torch decode step of the default model is ~40 small operators per layer,
// each costing 2-4x its own arithmetic in dispatch and cache misses, plus torch's int4 kernel, which
// dequantizes weights to bfloat16 before multiplying. Here a step is one loop over the layers, the
// activations stay in float32 in L1/L2, and the linears are int4 x int16 dot products on VNNI.
//
// Linears: quant_linear.h (int4, int5 and int8 weights with a scale and min per group, the GGUF block
// types as their files hold them). The input row is quantized to int16 with one scale per group of 32.
// The output head is int8 per row, or, where the file keeps it in fewer bits (the Q6_K head llama-quantize
// writes), its file's own blocks on the same kernels: fewer bytes a token, and no second rounding.
// Why int16 and not int8 (llama.cpp's Q8_1): int8 activations, even with a scale per 16 values, tripled
// the KL divergence to float32 that the int4 weights alone cause (bench/quality.py: 0.0028 against
// 0.00104 for int16, the torch path's 0.00106) and flipped near-ties such as the first word of the
// answer to "What is the capital of France?". vpdpwssd does half vpdpbusd's products per instruction,
// so int16 costs ~2x int8 where the step is bound by them (16 rows: 17.7 against 10.9 ms).
// On a CPU with AMX, steps of Model::amx_from_rows rows or more run the linears (and, with as many logit
// rows, the head) on bfloat16 tiles instead: amx_linear.h. Below them steps of Model::int8_from_rows rows or
// more take x in int8 per 16 values on vpdpbusd (int8_linear.h): twice vpdpwssd's products an instruction
// where many rows make the step bound by them, at ~2.7x int16's (small) KL divergence. Never a step that
// samples a prompt's last row (Step::sampled_prompt_rows): it gives the answer's first token, which a short
// question's near-tie would flip (docs/dev/measurements.md). Batched decodes and a long prompt's earlier
// rows take it (worker/runtime/long_prompts.py); a decode of one sequence stays int16 whatever its load.
//
// Attention reads K/V in place from the paged pool (bfloat16 [pages, page_size, kv_heads, head_dim] per
// layer), one (sequence, KV head) at a time with its query heads together: scores, softmax, values; a
// prompt chunk's rows a tile at a time (prompt_attention.h), with the same arithmetic.
//
// Threads: one OpenMP team for the whole step; each phase splits its work statically over the team
// and ends at a barrier. A step of a few rows has five barriers a layer, not ten: every thread
// normalises and quantizes all the rows for itself (into its own copy: a few microseconds, where a
// barrier costs that much on idle cores and a scheduler slice when another process has the core),
// and in a decode each (sequence, KV head) task rotates and writes its own K/V before attending. A row's arithmetic depends on nothing else in the step (rows never share a
// reduction) but the kernel its step's size picks (int16 or int8 x on VNNI, or tiles); with both off (cpu_steps
// "invariant") a sequence's tokens do not depend on what it is batched with.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "quant_linear.h"
#include "int8_linear.h"
#include "gguf_rows.h"

extern "C" {

struct LayerWeights {
  QuantMatrix qkv, o, gate_up, down;
  const float* input_norm;
  const float* post_norm;           // before the MLP (Llama's post_attention_layernorm, Gemma's pre_feedforward_layernorm)
  const float* qkv_bias;            // null, or [(heads + 2 kv_heads) * head_dim] (Qwen2)
  const float* q_norm;              // null, or [head_dim]: RMSNorm of each query head before the rotary (Qwen3, Gemma 3)
  const float* k_norm;              // with q_norm
  const float* attention_out_norm;  // null, or [hidden]: the attention's output normalised before the residual (Gemma)
  const float* mlp_out_norm;        // null, or [hidden]: the MLP's output likewise (Gemma)
  int64_t window;                   // 0: every key; else each row sees its `window` most recent keys, itself included
  int64_t rotary;                   // which of Model::rotaries' tables rotates this layer's q and k
  int64_t experts;                  // 0: the dense gated MLP (gate_up, down); else a sparse one of this many experts (expert_mlp.h)
  int64_t top_k;                    // experts a row takes
  int64_t normalize_top_k;          // their weights renormalised to sum to 1 (Mixtral, Qwen3-MoE)
  int64_t expert_intermediate;      // each expert's MLP width
  const float* router;              // float32 [experts, hidden]
  const QuantMatrix* expert_gate_up;  // [experts]: each [2 * expert_intermediate, hidden], gate rows first
  const QuantMatrix* expert_down;     // [experts]: each [hidden, expert_intermediate]
};

struct Model {
  int64_t layers, hidden, heads, kv_heads, head_dim, intermediate, vocab;  // vocab: the head's rows (a multiple of 16)
  float eps;
  int64_t rotary_dim;        // the leading dims of a head that rotate (head_dim, or fewer: partial rotary)
  int64_t rotaries;          // rotary tables (Gemma 3: global and local bases)
  const float* inv_freq;     // [rotaries, rotary_dim / 2]
  const float* rope_factor;  // [rotaries]: cos and sin scaled by it (YaRN's and long-rope's attention factor)
  float embed_scale;         // embeddings multiplied by it (Gemma: sqrt(hidden)); 1: none
  float attention_scale;     // the factor on q.k (1 / sqrt(head_dim), Gemma: query_pre_attn_scalar^-0.5)
  float attention_softcap;   // scores become cap * tanh(score / cap) before the softmax (Gemma 2); 0: none
  int64_t activation;        // the MLP's: 0 SiLU, 1 GELU (tanh approximation)
  const uint16_t* embed;     // bf16 [vocab, hidden], or null with embed_blocks or embed_from_head
  const LayerWeights* layer;
  const float* final_norm;   // [hidden]
  const int8_t* head;        // [vocab / 16, hidden / 2, 16, 2] int8, or null with head_blocks
  const float* head_scale;   // [vocab]
  int64_t amx_from_rows;     // steps of at least this many rows run their linears on AMX tiles (amx_linear.h); 0: none
  const QuantMatrix* head_blocks;  // null, or the head in its file's own blocks (head and head_scale unused then)
  int64_t int8_from_rows;    // steps of at least this many rows (not on tiles, no prompt's last row sampled) take x in int8 (int8_linear.h); 0: none
  const uint8_t* embed_blocks;  // null, or the embedding in its GGUF file's blocks (gguf_rows.h), rows embed_row_bytes apart
  int64_t embed_type;           // their GGML type
  int64_t embed_row_bytes;
  int64_t embed_from_head;      // 1: the embedding is the tied head's own blocks (head_blocks), read a row at a time
  int64_t bf16_attention;       // 1: a prompt's tiles of rows in steps on int8 x attend in bfloat16 products (prompt_attention_bf16.h)
};

struct Step {
  int64_t rows;
  const int64_t* ids;
  const int64_t* positions;
  const int64_t* slots;     // where each row's new K/V goes: page * page_size + offset
  const int64_t* contexts;     // keys each row attends to, its new one included (its position + 1)
  const int64_t* page_tables;  // [rows, stride]: each row's sequence's pages
  int64_t page_table_stride;
  uint16_t* k_pool;  // bf16 [layers, pages, page_size, kv_heads, head_dim]
  uint16_t* v_pool;
  int64_t layer_stride;  // elements
  int64_t page_size;
  const int64_t* logit_rows;  // the rows whose next-token logits are wanted (each sequence's last)
  int64_t logit_count;
  float* logits;  // [logit_count, vocab]
  double* phase_seconds;  // null, or [kPhases]: where the step's wall time went
  int64_t one_row_per_sequence;  // a decode step: no row attends to a key another row of the step writes
  int64_t sampled_prompt_rows;   // logit rows that are a prompt's last token (the answer's first): int8 x never serves them
};

int lmq_step(const Model* model, const Step* step, int threads);
// Rows `rows[0..n)` of a [?, k] GGUF tensor of `type` as float32 (tests/worker/model/test_gguf_rows.py); 1: no such type here.
int lmq_gguf_rows(int64_t type, const uint8_t* data, int64_t row_bytes, int64_t k, const int64_t* rows, int64_t n, float* out);
int lmq_step_phases();
int lmq_amx_enable();
}

namespace {

constexpr int kPhases = 10;  // embed, norm, qkv, rope + K/V write, attention, o, gate_up, SiLU, down, head (experts: routing in norm)
constexpr int64_t kOwnEncodeRows = 4;  // steps of at most this many rows: every thread encodes x itself (Buffers::own)
constexpr int kSlot[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

// ---- small vector helpers ----

inline __m512 load_bf16(const uint16_t* p) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

inline __m512i bf16_bits(__m512 v) {  // v rounded to bfloat16 (nearest even), in the high halves of its lanes
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
}

inline void store_bf16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(v), 16)));
}

inline __m512 exp512(__m512 x) {  // e^x, relative error ~1e-7; x clamped to [-87, 88]
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-87.f));
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718f));  // e^f, |f| <= ln2 / 2
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// The largest of row[0, count), count >= 1.
inline float row_max(const float* row, int64_t count) {
  __m512 top = _mm512_set1_ps(row[0]);
  int64_t t = 0;
  for (; t + 16 <= count; t += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(row + t));
  if (t < count) top = _mm512_mask_max_ps(top, static_cast<__mmask16>((1u << (count - t)) - 1), top, _mm512_loadu_ps(row + t));
  return _mm512_reduce_max_ps(top);
}

// 16 vectors -> one vector of their 16 horizontal sums (in kSlot order).
inline __m512 reduce16(const float* slots /* [16][16] */) {
  __m512 c[8], e[4], f[2];
  for (int i = 0; i < 8; ++i) {
    __m512 a = _mm512_loadu_ps(slots + i * 16), b = _mm512_loadu_ps(slots + (i + 8) * 16);
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int i = 0; i < 4; ++i)
    e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[i], c[i + 4], 0x88), _mm512_shuffle_f32x4(c[i], c[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    f[i] = _mm512_add_ps(_mm512_shuffle_ps(e[i], e[i + 2], 0x44), _mm512_shuffle_ps(e[i], e[i + 2], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(f[0], f[1], 0x88), _mm512_shuffle_ps(f[0], f[1], 0xDD));
}

#include "amx_linear.h"

// ---- per-row pieces ----

void rms_norm(const float* x, const float* weight, int64_t k, float eps, float* out) {
  __m512 sq = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    __m512 v = _mm512_loadu_ps(x + i);
    sq = _mm512_fmadd_ps(v, v, sq);
  }
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(sq) / k + eps));
  for (int64_t i = 0; i < k; i += 16)
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), inv), _mm512_loadu_ps(weight + i)));
}

inline __m512 tanh512(__m512 x) {  // 1 - 2 / (e^2x + 1): exp512's clamp keeps it finite, -1 and 1 at the ends
  const __m512 one = _mm512_set1_ps(1.f);
  return _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(exp512(_mm512_add_ps(x, x)), one)));
}

// The gated MLP's act(gate) * up, act being SiLU (activation 0) or GELU's tanh approximation (1).
void gated_activation(const float* gate_up, int64_t width, int64_t activation, float* out) {
  const __m512 one = _mm512_set1_ps(1.f), half = _mm512_set1_ps(0.5f);
  for (int64_t i = 0; i < width; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate_up + i), u = _mm512_loadu_ps(gate_up + width + i);
    __m512 act;
    if (activation == 1) {
      const __m512 inner = _mm512_mul_ps(_mm512_set1_ps(0.7978845608f), _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g), _mm512_mul_ps(g, g), g));
      act = _mm512_mul_ps(_mm512_mul_ps(half, g), _mm512_add_ps(one, tanh512(inner)));
    } else {
      act = _mm512_mul_ps(g, _mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
    }
    _mm512_storeu_ps(out + i, _mm512_mul_ps(act, u));
  }
}

// Rotate-half RoPE of the first rotary_dim dims of `count` heads of x in place (the rest pass through).
void rope(float* x, int64_t count, int64_t head_dim, int64_t rotary_dim, const float* cos, const float* sin) {
  const int64_t half = rotary_dim / 2;
  for (int64_t h = 0; h < count; ++h) {
    float* v = x + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cos[i] - b * sin[i];
      v[i + half] = b * cos[i] + a * sin[i];
    }
  }
}

// How a layer's scores are formed: scaled, then soft-capped where softcap > 0.
struct Scoring {
  float scale, softcap;
};

// Key t of a sequence sits at page pages[t / ps], offset t % ps: walked page by page, never divided per key.
struct KeyWalk {
  const int64_t* pages;
  int64_t ps, stride, page, offset;
  KeyWalk(const int64_t* pages, int64_t ps, int64_t stride, int64_t t) : pages(pages), ps(ps), stride(stride), page(t / ps), offset(t % ps) {}
  int64_t next() {  // the element offset of this key, then on to the next
    const int64_t at = (pages[page] * ps + offset) * stride;
    if (++offset == ps) offset = 0, ++page;
    return at;
  }
};

// A head's key (or value) is a few cache lines at a stride of every KV head's: a 4 KB page holds one to
// four of a head's keys, and the hardware's stride prefetcher stops at page boundaries. So each pass asks
// for the key kKeysAhead places on while it works on this one, into L2 (T1): prefetches into L1 (T0) held
// its few miss buffers, and a decode's attention ran at about half the machine's read bandwidth (AMD EPYC
// Zen 4, Qwen3-0.6B shape, 16 rows at context 400: 40-45 -> 28-31 ms a step, context 120: 12.7-14.1 ->
// 9.4-11.0 ms; bit-identical; a long prompt's attention, which re-reads keys from the caches, unchanged).
constexpr int64_t kKeysAhead = 16;

template <int64_t Bytes>
inline void prefetch_key(const uint16_t* key) {
  for (int64_t line = 0; line < Bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(key) + line, _MM_HINT_T1);
}

// Scores row[0, count) become e^(score - their max) in place, and zeros up to the next multiple of 16;
// returns 1 / their sum.
inline float exp_row(float* row, int64_t count) {
  const float top = row_max(row, count);
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < count; t += 16) {
    const __mmask16 live = count - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (count - t)) - 1);
    __m512 p = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(_mm512_loadu_ps(row + t), _mm512_set1_ps(top))));
    _mm512_storeu_ps(row + t, p);
    total = _mm512_add_ps(total, p);
  }
  return 1.f / _mm512_reduce_add_ps(total);
}

// G query heads (of one KV head, in one sequence) against keys [first, context) in one layer's pool.
// C = head_dim / 16 and G are compile-time, so the accumulators stay in registers.
template <int C, int G>
void attend_heads(const uint16_t* k_pool, const uint16_t* v_pool, const int64_t* pages, int64_t ps, int64_t token_stride,
                  int64_t first, int64_t context, Scoring scoring, const float* q, float* out, std::vector<float>& scores) {
  constexpr int64_t hd = C * 16;
  const int64_t count = context - first, padded = (count + 15) / 16 * 16;
  scores.resize(G * padded);
  __m512 query[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) query[g][c] = _mm512_loadu_ps(q + g * hd + c * 16);

  // Scores 16 keys at a time: each key's 16-lane partial dot products go to a slot, and one reduce16
  // sums all 16 at once.
  alignas(64) float slots[G][16][16];
  const __m512 scale = _mm512_set1_ps(scoring.scale), cap = _mm512_set1_ps(scoring.softcap);
  const __m512 inv_cap = _mm512_set1_ps(scoring.softcap > 0.f ? 1.f / scoring.softcap : 0.f);
  KeyWalk keys_at(pages, ps, token_stride, first), ahead(pages, ps, token_stride, first + kKeysAhead);
  for (int64_t t0 = 0; t0 < count; t0 += 16) {
    const int64_t keys = std::min<int64_t>(16, count - t0);
    for (int64_t j = 0; j < 16; ++j) {
      if (j >= keys) {
        for (int g = 0; g < G; ++g) _mm512_store_ps(slots[g][kSlot[j]], _mm512_setzero_ps());
        continue;
      }
      if (t0 + j + kKeysAhead < count) prefetch_key<hd * 2>(k_pool + ahead.next());
      const uint16_t* key = k_pool + keys_at.next();
      __m512 k[C];
      for (int c = 0; c < C; ++c) k[c] = load_bf16(key + c * 16);
      for (int g = 0; g < G; ++g) {
        __m512 acc = _mm512_mul_ps(k[0], query[g][0]);
        for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(k[c], query[g][c], acc);
        _mm512_store_ps(slots[g][kSlot[j]], acc);
      }
    }
    for (int g = 0; g < G; ++g) {
      __m512 score = _mm512_mul_ps(reduce16(&slots[g][0][0]), scale);
      if (scoring.softcap > 0.f) score = _mm512_mul_ps(cap, tanh512(_mm512_mul_ps(score, inv_cap)));
      _mm512_storeu_ps(scores.data() + g * padded + t0, score);
    }
  }
  float inv_sum[G];
  for (int g = 0; g < G; ++g) inv_sum[g] = exp_row(scores.data() + g * padded, count);
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  KeyWalk values_at(pages, ps, token_stride, first), values_ahead(pages, ps, token_stride, first);
  for (int64_t t = 0; t < std::min(kKeysAhead, count); ++t) prefetch_key<hd * 2>(v_pool + values_ahead.next());
  for (int64_t t = 0; t < count; ++t) {
    if (t + kKeysAhead < count) prefetch_key<hd * 2>(v_pool + values_ahead.next());
    const uint16_t* value = v_pool + values_at.next();
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = load_bf16(value + c * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * padded + t]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + g * hd + c * 16, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv_sum[g])));
}

// As many query heads per pass over the keys as registers hold accumulators for (4 of head_dim 64).
template <int C>
void attend_group(const uint16_t* k_pool, const uint16_t* v_pool, const int64_t* pages, int64_t ps, int64_t token_stride,
                  int64_t first, int64_t context, Scoring scoring, const float* q, float* out, int64_t group,
                  std::vector<float>& scores) {
  constexpr int64_t most = C == 4 ? 4 : C == 8 ? 2 : 1;
  for (int64_t g0 = 0; g0 < group; g0 += most) {
    const float* qg = q + g0 * C * 16;
    float* og = out + g0 * C * 16;
    switch (std::min(most, group - g0)) {
      case 1: attend_heads<C, 1>(k_pool, v_pool, pages, ps, token_stride, first, context, scoring, qg, og, scores); break;
      case 2: attend_heads<C, (most >= 2 ? 2 : 1)>(k_pool, v_pool, pages, ps, token_stride, first, context, scoring, qg, og, scores); break;
      case 3: attend_heads<C, (most >= 3 ? 3 : 1)>(k_pool, v_pool, pages, ps, token_stride, first, context, scoring, qg, og, scores); break;
      default: attend_heads<C, most>(k_pool, v_pool, pages, ps, token_stride, first, context, scoring, qg, og, scores); break;
    }
  }
}

// One sequence's query heads of KV head h against its keys in the pool (its window's, where the layer has one).
void attend(const Model& m, const Step& s, int64_t layer, const float* q, float* out, int64_t r, int64_t h, std::vector<float>& scores) {
  const int64_t kvh = m.kv_heads, group = m.heads / kvh, token_stride = kvh * m.head_dim;
  const int64_t* pages = s.page_tables + r * s.page_table_stride;
  const uint16_t* k_pool = s.k_pool + layer * s.layer_stride + h * m.head_dim;
  const uint16_t* v_pool = s.v_pool + layer * s.layer_stride + h * m.head_dim;
  const int64_t context = s.contexts[r], window = m.layer[layer].window;
  const int64_t first = window > 0 ? std::max<int64_t>(0, context - window) : 0;
  const Scoring scoring{m.attention_scale, m.attention_softcap};
  switch (m.head_dim) {
    case 64: attend_group<4>(k_pool, v_pool, pages, s.page_size, token_stride, first, context, scoring, q, out, group, scores); break;
    case 128: attend_group<8>(k_pool, v_pool, pages, s.page_size, token_stride, first, context, scoring, q, out, group, scores); break;
    default: attend_group<16>(k_pool, v_pool, pages, s.page_size, token_stride, first, context, scoring, q, out, group, scores); break;
  }
}

#include "prompt_attention.h"
#include "expert_mlp.h"

struct Buffers {
  std::vector<float> hidden, normed, qkv, attention, gate_up, out, cos, sin;
  std::vector<int16_t> q;
  std::vector<float> scale, sum;
  QuantizedRows quantized;  // x for VNNI, and always for the head
  bool amx;                 // this step's linears on AMX tiles
  bool int8;                // this step's linears and head on int8 x (int8_rows)
  bool head_int8;           // its head on int8 x: an int8 step's, and a tiles step's whose head stays on VNNI
  std::vector<int8_t> q8;
  std::vector<float> scale8, half_sum8;
  Int8Rows int8_rows;
  bool own;                 // each thread encodes every row of x itself, into own[thread] (no barrier before a linear)
  std::vector<int16_t> own_q;
  std::vector<float> own_scale, own_sum, own_scratch;
  std::vector<QuantizedRows> own_rows;  // [threads]
  int64_t scratch_stride;               // own_scratch's floats per thread: rows * widest
  std::vector<uint16_t> bf16;
  std::vector<float> bf16_sum;
  Bf16Rows bf16_rows;  // x for AMX
  std::vector<int64_t> tiles;  // a prompt step's rows in tiles (prompt_attention.h): tile i is rows [tiles[i], tiles[i + 1])
  std::vector<int64_t> chosen;      // a sparse layer's experts for each row [rows, top_k] (expert_mlp.h)
  std::vector<float> route_weight;  // and their weights
  std::vector<ExpertPlan> plans;     // [threads]

  Buffers(const Model& m, const Step& s, int threads) {
    const int64_t rows = s.rows;
    int64_t top_k = 0, expert_width = 0, dense_width = 0;  // a sparse layer's x rows are its (row, expert) pairs
    for (int64_t i = 0; i < m.layers; ++i) {
      const LayerWeights& w = m.layer[i];
      if (w.experts)
        top_k = std::max(top_k, w.top_k), expert_width = std::max(expert_width, w.expert_intermediate);
      else
        dense_width = m.intermediate;  // Qwen3-MoE's config states one that its all-sparse layers never use
    }
    const int64_t x_rows = std::max(rows, rows * top_k);
    const int64_t widest = std::max({m.hidden, dense_width, m.heads * m.head_dim, expert_width}), qkv_n = (m.heads + 2 * m.kv_heads) * m.head_dim;
    hidden.resize(rows * m.hidden);
    normed.resize(x_rows * widest);
    qkv.resize(rows * qkv_n);
    attention.resize(rows * m.heads * m.head_dim);
    gate_up.resize(std::max(rows * dense_width, rows * top_k * expert_width) * 2);
    out.resize(x_rows * m.hidden);
    chosen.resize(rows * top_k);
    route_weight.resize(rows * top_k);
    if (top_k) plans.resize(std::max(threads, 1));
    cos.resize(rows * m.rotaries * m.rotary_dim / 2);  // [rows, rotaries, rotary_dim / 2]
    sin.resize(rows * m.rotaries * m.rotary_dim / 2);
    q.resize(x_rows * widest);
    scale.resize(x_rows * widest / kGroup);
    sum.resize(x_rows * widest / kGroup);
    quantized = QuantizedRows{q.data(), scale.data(), sum.data(), widest};
    amx = m.amx_from_rows > 0 && rows >= m.amx_from_rows;
    int8 = !amx && m.int8_from_rows > 0 && rows >= m.int8_from_rows && s.sampled_prompt_rows == 0;
    own = !amx && !int8 && threads > 1 && rows <= kOwnEncodeRows;
    // A head in its file's blocks (a Q6_K head) runs on VNNI even in a tiles step: int8 x there too, by the
    // int8 tier's rule (no prompt's last row sampled), as the same decode below the tiles takes it.
    head_int8 = int8 || (amx && m.head_blocks && m.int8_from_rows > 0 && s.sampled_prompt_rows == 0);
    if (head_int8) {
      q8.resize(x_rows * widest);
      scale8.resize(x_rows * widest / kHalf);
      half_sum8.resize(x_rows * widest / kHalf);
      int8_rows = Int8Rows{q8.data(), scale8.data(), half_sum8.data(), widest};
    }
    if (own) {
      scratch_stride = x_rows * widest;
      own_q.resize(threads * x_rows * widest);
      own_scale.resize(threads * x_rows * widest / kGroup);
      own_sum.resize(threads * x_rows * widest / kGroup);
      own_scratch.resize(threads * scratch_stride);
      for (int t = 0; t < threads; ++t)
        own_rows.push_back(QuantizedRows{own_q.data() + t * x_rows * widest, own_scale.data() + t * x_rows * widest / kGroup,
                                         own_sum.data() + t * x_rows * widest / kGroup, widest});
    }
    if (!s.one_row_per_sequence) tiles = row_tiles(s, std::max<int64_t>(1, kTileQueries / (m.heads / m.kv_heads)));
    if (amx) {
      const int64_t padded = (rows + kTileRows - 1) / kTileRows * kTileRows;
      bf16.resize(padded * widest);
      bf16_sum.resize(padded * widest / kGroup);
      bf16_rows = Bf16Rows{bf16.data(), bf16_sum.data(), widest};
    }
  }
};

// x as this thread's linears read it: its own copy, or the team's.
const QuantizedRows& linear_input(const Buffers& b) { return b.own ? b.own_rows[omp_get_thread_num()] : b.quantized; }

// Scratch for a row of k floats: this thread's own (b.own), or the team's b.normed.
float* row_scratch(Buffers& b, int64_t r, int64_t k) {
  return b.own ? b.own_scratch.data() + omp_get_thread_num() * b.scratch_stride + r * k : b.normed.data() + r * k;
}

// Row r of x as the linears' kernel takes it.
void encode_row(const float* x, int64_t k, Buffers& b, int64_t r) {
  if (b.amx)
    bf16_row(x, k, b.bf16_rows, r);
  else if (b.int8)
    quantize_row8(x, k, b.int8_rows, r);
  else
    quantize_row(x, k, linear_input(b), r);
}

// f(x) with x as this step's VNNI linears read it: int8 rows, or int16 (this thread's own copy, or the team's).
template <typename F>
void with_vnni_input(const Buffers& b, F&& f) {
  if (b.int8)
    f(b.int8_rows);
  else
    f(linear_input(b));
}

void linear(const QuantMatrix& w, const Buffers& b, int64_t rows, float* out, bool accumulate) {
  if (b.amx)
    amx_int4_linear(w, b.bf16_rows, rows, out, accumulate);
  else
    with_vnni_input(b, [&](const auto& x) { quant_linear(w, x, rows, out, accumulate); });
}

// The rows this thread encodes: all of them (b.own), else its share; with the team's barrier after.
template <typename F>
void each_encoded_row(int64_t rows, const Buffers& b, F&& f) {
  int64_t begin = 0, end = rows;
  if (!b.own) share(rows, begin, end);
  for (int64_t r = begin; r < end; ++r) f(r);
  if (!b.own) {
#pragma omp barrier
  }
}

// Normalise (when norm is given) and encode rows of x [rows, k].
void encode_rows(const float* x, int64_t rows, int64_t k, const float* norm, float eps, Buffers& b) {
  each_encoded_row(rows, b, [&](int64_t r) {
    const float* row = x + r * k;
    if (norm) {
      float* normed = row_scratch(b, r, k);
      rms_norm(row, norm, k, eps, normed);
      row = normed;
    }
    encode_row(row, k, b, r);
  });
}

// Thread 0 adds each phase's wall time (phases end at barriers, so it is the team's) to step.phase_seconds.
struct PhaseClock {
  double* seconds;
  double last;
  explicit PhaseClock(double* out) : seconds(omp_get_thread_num() == 0 ? out : nullptr), last(omp_get_wtime()) {}
  void mark(int phase) {
    if (!seconds) return;
    const double now = omp_get_wtime();
    seconds[phase] += now - last;
    last = now;
  }
};

// A linear's output added to the residual: in place, or (Gemma) normalised first through `out`.
void residual_linear(const Model& m, const QuantMatrix& w, const float* out_norm, Buffers& b, int64_t rows) {
  if (!out_norm) {
    linear(w, b, rows, b.hidden.data(), true);
#pragma omp barrier
    return;
  }
  linear(w, b, rows, b.out.data(), false);
#pragma omp barrier
  int64_t begin, end;
  share(rows, begin, end);
  for (int64_t r = begin; r < end; ++r) {
    float* o = b.out.data() + r * m.hidden;
    float* h = b.hidden.data() + r * m.hidden;
    rms_norm(o, out_norm, m.hidden, m.eps, o);
    for (int64_t i = 0; i < m.hidden; i += 16) _mm512_storeu_ps(h + i, _mm512_add_ps(_mm512_loadu_ps(h + i), _mm512_loadu_ps(o + i)));
  }
#pragma omp barrier
}

inline void add_bias(float* x, const float* bias, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(x + i, _mm512_add_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(bias + i)));
}

// Row r's q heads of KV head h, and h's k and v, after the projection: bias, per-head q/k norms, rotary;
// the K/V written to the pool. Each value's arithmetic is the same whichever heads a call takes.
void place_heads(const Model& m, const Step& s, int64_t index, Buffers& b, int64_t r, int64_t h) {
  const LayerWeights& w = m.layer[index];
  const int64_t hd = m.head_dim, kvh = m.kv_heads, group = m.heads / kvh, q_size = m.heads * hd, qkv_n = q_size + 2 * kvh * hd;
  float* row = b.qkv.data() + r * qkv_n;
  float* q = row + h * group * hd;
  float* k = row + q_size + h * hd;
  float* v = row + q_size + kvh * hd + h * hd;
  if (w.qkv_bias) {
    add_bias(q, w.qkv_bias + h * group * hd, group * hd);
    add_bias(k, w.qkv_bias + q_size + h * hd, hd);
    add_bias(v, w.qkv_bias + q_size + kvh * hd + h * hd, hd);
  }
  if (w.q_norm) {
    for (int64_t g = 0; g < group; ++g) rms_norm(q + g * hd, w.q_norm, hd, m.eps, q + g * hd);
    rms_norm(k, w.k_norm, hd, m.eps, k);
  }
  const int64_t half = m.rotary_dim / 2, table = (r * m.rotaries + w.rotary) * half;
  rope(q, group, hd, m.rotary_dim, b.cos.data() + table, b.sin.data() + table);
  rope(k, 1, hd, m.rotary_dim, b.cos.data() + table, b.sin.data() + table);
  const int64_t slot = s.slots[r];
  uint16_t* k_dst = s.k_pool + index * s.layer_stride + slot * kvh * hd + h * hd;
  uint16_t* v_dst = s.v_pool + index * s.layer_stride + slot * kvh * hd + h * hd;
  for (int64_t i = 0; i < hd; i += 16) {
    store_bf16(k_dst + i, _mm512_loadu_ps(k + i));
    store_bf16(v_dst + i, _mm512_loadu_ps(v + i));
  }
}

// A sparse layer's MLP (expert_mlp.h): route each row, sort the (row, expert) pairs by expert, run each chosen
// expert's gated MLP on its pairs, add each row's outputs by weight to the residual.
void expert_mlp(const Model& m, const LayerWeights& w, Buffers& b, int64_t rows, PhaseClock& clock) {
  const int64_t k = w.top_k, width = w.expert_intermediate, pairs = rows * k;
  int64_t begin, end;
  share(rows, begin, end);
  float* normed = b.out.data();  // each row normalised once, read by its router and its pairs (b.out is free until down)
  for (int64_t r = begin; r < end; ++r) {
    rms_norm(b.hidden.data() + r * m.hidden, w.post_norm, m.hidden, m.eps, normed + r * m.hidden);
    route_row(w, m.hidden, normed + r * m.hidden, b.chosen.data() + r * k, b.route_weight.data() + r * k);
  }
#pragma omp barrier
  ExpertPlan& plan = b.plans[omp_get_thread_num()];  // each thread its own copy of the same plan
  plan.build(b.chosen.data(), b.route_weight.data(), rows, k, w.experts);
  auto each_expert = [&](const QuantMatrix* matrices, float* out, int64_t out_width) {  // no tiles: lmq_step refuses them
    with_vnni_input(b, [&](const auto& x) { experts_linear(matrices, plan, w.experts, x, out, out_width); });
  };
  each_encoded_row(pairs, b, [&](int64_t pair) { encode_row(normed + plan.pair_row[pair] * m.hidden, m.hidden, b, pair); });
  clock.mark(1);
  each_expert(w.expert_gate_up, b.gate_up.data(), 2 * width);
#pragma omp barrier
  clock.mark(6);
  each_encoded_row(pairs, b, [&](int64_t pair) {
    float* act = row_scratch(b, pair, width);
    gated_activation(b.gate_up.data() + pair * 2 * width, width, m.activation, act);
    encode_row(act, width, b, pair);
  });
  clock.mark(7);
  each_expert(w.expert_down, b.out.data(), m.hidden);
#pragma omp barrier
  for (int64_t r = begin; r < end; ++r) {  // summed in expert order, then added: moe.py's index_add_, then the residual
    float* h = b.hidden.data() + r * m.hidden;
    for (int64_t i = 0; i < m.hidden; i += 16) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < k; ++j) {
        const int64_t pair = plan.row_pair[r * k + j];
        sum = _mm512_fmadd_ps(_mm512_set1_ps(plan.pair_weight[pair]), _mm512_loadu_ps(b.out.data() + pair * m.hidden + i), sum);
      }
      _mm512_storeu_ps(h + i, _mm512_add_ps(_mm512_loadu_ps(h + i), sum));
    }
  }
#pragma omp barrier
}

void layer_step(const Model& m, const Step& s, int64_t index, Buffers& b, std::vector<float>& scores, TileScratch& tile_scratch,
                PhaseClock& clock) {
  const LayerWeights& w = m.layer[index];
  const int64_t rows = s.rows, kvh = m.kv_heads, q_size = m.heads * m.head_dim;
  int64_t begin, end;

  encode_rows(b.hidden.data(), rows, m.hidden, w.input_norm, m.eps, b);
  clock.mark(1);
  linear(w.qkv, b, rows, b.qkv.data(), false);
#pragma omp barrier
  clock.mark(2);
  // A prompt chunk's rows attend to each other's keys: every row's K/V in the pool first. A decode's
  // (row, KV head) task places its own heads, then attends (no barrier between).
  const bool placed_by_task = s.one_row_per_sequence != 0;
  if (!placed_by_task) {
    share(rows * kvh, begin, end);
    for (int64_t task = begin; task < end; ++task) place_heads(m, s, index, b, task / kvh, task % kvh);
#pragma omp barrier
  }
  clock.mark(3);
  // A decode's (row, KV head) tasks and a prompt's (tile of rows, KV head) tasks, claimed as threads come
  // free; a prompt's last tiles first (its later rows attend to more keys: the longest tasks start first,
  // and the short ones even out the end).
  if (placed_by_task) {
    const int64_t task_macs = 2 * (m.heads / kvh) * m.head_dim * (s.positions[0] + 1);  // about: rows' contexts differ
    each_claimed(rows * kvh, 1, task_macs, [&](int64_t task) {
      const int64_t r = task / kvh, h = task % kvh;
      place_heads(m, s, index, b, r, h);
      attend_rows(m, s, index, b.qkv.data(), b.attention.data(), r, 1, h, scores, tile_scratch, false);
    });
  } else {
    const int64_t tasks = (static_cast<int64_t>(b.tiles.size()) - 1) * kvh;
    const bool bf16_tiles = b.int8 && m.bf16_attention;  // rows no one samples from
    each_claimed(tasks, rows, kChunkMacs, [&](int64_t claimed) {  // a tile of rows over all its keys: one a chunk
      const int64_t task = tasks - 1 - claimed;
      const int64_t* tile = b.tiles.data() + task / kvh;
      attend_rows(m, s, index, b.qkv.data(), b.attention.data(), tile[0], tile[1] - tile[0], task % kvh, scores, tile_scratch,
                  bf16_tiles);
    });
  }
#pragma omp barrier
  clock.mark(4);
  encode_rows(b.attention.data(), rows, q_size, nullptr, 0.f, b);
  residual_linear(m, w.o, w.attention_out_norm, b, rows);
  clock.mark(5);
  if (w.experts) {
    expert_mlp(m, w, b, rows, clock);
    clock.mark(8);
    return;
  }
  encode_rows(b.hidden.data(), rows, m.hidden, w.post_norm, m.eps, b);
  clock.mark(1);
  linear(w.gate_up, b, rows, b.gate_up.data(), false);
#pragma omp barrier
  clock.mark(6);
  each_encoded_row(rows, b, [&](int64_t r) {
    float* act = row_scratch(b, r, m.intermediate);
    gated_activation(b.gate_up.data() + r * 2 * m.intermediate, m.intermediate, m.activation, act);
    encode_row(act, m.intermediate, b, r);
  });
  clock.mark(7);
  residual_linear(m, w.down, w.mlp_out_norm, b, rows);
  clock.mark(8);
}

// Token `id`'s embedding times embed_scale: from the bfloat16 table, or from the file's values (the tied head's
// packed blocks, or a copy of the embedding's own) rounded to bfloat16 as the loader's table would hold them.
void embed_row(const Model& m, int64_t id, float* hidden) {
  const __m512 embed_scale = _mm512_set1_ps(m.embed_scale);
  if (!m.embed_from_head && !m.embed_blocks) {
    const uint16_t* embedding = m.embed + id * m.hidden;
    for (int64_t i = 0; i < m.hidden; i += 16) _mm512_storeu_ps(hidden + i, _mm512_mul_ps(load_bf16(embedding + i), embed_scale));
    return;
  }
  if (m.embed_from_head)
    matrix_row(*m.head_blocks, id, hidden);
  else
    gguf_row(m.embed_type, m.embed_blocks, m.embed_row_bytes, m.hidden, id, hidden);
  for (int64_t i = 0; i < m.hidden; i += 16) {
    const __m512 value = _mm512_castsi512_ps(bf16_bits(_mm512_loadu_ps(hidden + i)));
    _mm512_storeu_ps(hidden + i, _mm512_mul_ps(value, embed_scale));
  }
}

void prepare_rows(const Model& m, const Step& s, Buffers& b) {
  const int64_t half = m.rotary_dim / 2;
  for (int64_t r = 0; r < s.rows; ++r) {
    embed_row(m, s.ids[r], b.hidden.data() + r * m.hidden);
    const float position = static_cast<float>(s.positions[r]);
    for (int64_t t = 0; t < m.rotaries; ++t) {
      const float* inv_freq = m.inv_freq + t * half;
      float* cos = b.cos.data() + (r * m.rotaries + t) * half;
      float* sin = b.sin.data() + (r * m.rotaries + t) * half;
      for (int64_t i = 0; i < half; ++i) {
        const float angle = position * inv_freq[i];
        cos[i] = std::cos(angle) * m.rope_factor[t];
        sin[i] = std::sin(angle) * m.rope_factor[t];
      }
    }
  }
}

void run_step(const Model& m, const Step& s, Buffers& b) {
  if (b.amx) configure_tiles(s.rows);
  std::vector<float> scores;
  TileScratch tile_scratch;
  PhaseClock clock(s.phase_seconds);
  for (int64_t index = 0; index < m.layers; ++index) layer_step(m, s, index, b, scores, tile_scratch, clock);
  int64_t begin, end;
  share(s.logit_count, begin, end);
  // A prompt chunk's one row: VNNI; a head in its file's blocks: VNNI always (tiles read int8 heads only).
  const bool head_on_tiles = b.amx && s.logit_count >= m.amx_from_rows && !m.head_blocks;
  for (int64_t i = begin; i < end; ++i) {
    float* normed = b.normed.data() + i * m.hidden;
    rms_norm(b.hidden.data() + s.logit_rows[i] * m.hidden, m.final_norm, m.hidden, m.eps, normed);
    if (head_on_tiles)
      bf16_row(normed, m.hidden, b.bf16_rows, i);
    else if (b.head_int8)  // every logit row a generated token's
      quantize_row8(normed, m.hidden, b.int8_rows, i);
    else
      quantize_row(normed, m.hidden, b.quantized, i);
  }
#pragma omp barrier
  auto head = [&](const auto& x) {
    if (m.head_blocks)
      quant_linear(*m.head_blocks, x, s.logit_count, s.logits, false);
    else
      int8_head(m.head, m.head_scale, m.hidden, m.vocab, x, s.logit_count, s.logits);
  };
  if (head_on_tiles)
    amx_head(m, b.bf16_rows, s.logit_count, s.logits);
  else if (b.head_int8)
    head(b.int8_rows);
  else
    head(b.quantized);
#pragma omp barrier
  clock.mark(9);
  if (b.amx) _tile_release();
}

}  // namespace

int lmq_step(const Model* model, const Step* step, int threads) {
  const Model& m = *model;
  const Step& s = *step;
  if ((m.head_dim != 64 && m.head_dim != 128 && m.head_dim != 256) || m.heads % m.kv_heads || m.heads / m.kv_heads > 16) return 1;
  if (m.hidden % 64 || m.intermediate % 64 || (m.heads * m.head_dim) % 64 || m.vocab % kBlockN) return 1;
  if (m.rotary_dim % 2 || m.rotary_dim > m.head_dim || m.rotaries < 1 || m.activation < 0 || m.activation > 1) return 1;
  if (m.embed_from_head ? !m.head_blocks || m.head_blocks->next || m.head_blocks->k != m.hidden || !known_format(*m.head_blocks)
      : m.embed_blocks ? m.embed_row_bytes < gguf_row_bytes(m.embed_type, m.hidden) || !gguf_row_bytes(m.embed_type, m.hidden)
                       : !m.embed)
    return 1;
  for (int64_t i = 0; i < m.layers; ++i)
    if (m.layer[i].rotary < 0 || m.layer[i].rotary >= m.rotaries || m.layer[i].window < 0 || !m.layer[i].q_norm != !m.layer[i].k_norm) return 1;
  for (int64_t i = 0; i < m.layers; ++i) {
    const LayerWeights& w = m.layer[i];
    std::vector<const QuantMatrix*> matrices = {&w.qkv, &w.o};
    if (w.experts) {
      if (w.top_k < 1 || w.top_k > w.experts || w.expert_intermediate % 64 || !w.router || w.mlp_out_norm) return 1;
      if (m.amx_from_rows) return 3;  // the pairs' x is not laid out in tiles
      for (int64_t e = 0; e < w.experts; ++e) {
        if (w.expert_gate_up[e].k != m.hidden || total_rows(w.expert_gate_up[e]) != 2 * w.expert_intermediate) return 1;
        if (w.expert_down[e].k != w.expert_intermediate || total_rows(w.expert_down[e]) != m.hidden) return 1;
        matrices.push_back(&w.expert_gate_up[e]);
        matrices.push_back(&w.expert_down[e]);
      }
    } else {
      matrices.push_back(&w.gate_up);
      matrices.push_back(&w.down);
    }
    for (const QuantMatrix* matrix : matrices) {
      if (!known_format(*matrix)) return 2;
      if (m.amx_from_rows && !amx_format(*matrix)) return 3;  // tiles run int4 with fp16 scales only
    }
  }
  if (m.head_blocks && (!known_format(*m.head_blocks) || m.head_blocks->k != m.hidden || total_rows(*m.head_blocks) != m.vocab)) return 2;
  const double started = omp_get_wtime();
  Buffers buffers(m, s, threads);
  prepare_rows(m, s, buffers);
  if (s.phase_seconds) s.phase_seconds[0] += omp_get_wtime() - started;
  if (threads <= 1) {
    run_step(m, s, buffers);
    return 0;
  }
#pragma omp parallel num_threads(threads)
  run_step(m, s, buffers);
  return 0;
}

int lmq_step_phases() { return kPhases; }

int lmq_gguf_rows(int64_t type, const uint8_t* data, int64_t row_bytes, int64_t k, const int64_t* rows, int64_t n, float* out) {
  const int64_t bytes = gguf_row_bytes(type, k);
  if (bytes == 0 || row_bytes < bytes) return 1;
  for (int64_t i = 0; i < n; ++i) gguf_row(type, data, row_bytes, k, rows[i], out + i * k);
  return 0;
}

int lmq_amx_enable() { return request_amx() ? 1 : 0; }
