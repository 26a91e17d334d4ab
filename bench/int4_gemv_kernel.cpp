// int4 x int8 GEMV/GEMM for a few rows (a prototype for issue #15; bench/int4_gemv.py builds and measures it).
//
// y[M, N] = x[M, K] @ W[N, K]^T with W in groups of 32 along K: w = a * q + m, q in 0..15 (GGUF Q4_1's form).
// llama.cpp's approach: x is quantized to int8 (x ~ d * qx), then each group's dot product is an integer one,
// u8 (q) x s8 (qx) on VNNI (vpdpbusd), scaled in float once per group:
//   sum_j (a q_j + m) x_j  ~  a sum_j d_j q_j qx_j  +  m sum_j d_j qx_j
// Unlike llama.cpp's Q8_1 (one d per 32 values), d here is per 4 values: each int32 lane of vpdpbusd sums 4
// products, so a lane can carry its own d at no cost in the loop (a vector of 16 d's per 64 values either way),
// and an outlier in x coarsens only its own 4 neighbours (per 32: 1.3% relative error on the model's gate/up
// inputs against torch's 0.3%). The second term uses the quantized x too, not its exact sum: with q's mean near
// 7.5 the two terms nearly cancel, and only the same x in both keeps x's rounding out of their large common part
// (the exact sum doubled the error on random int4 weights). It costs one fma per group per 16 output rows.
//
// Packed weights (made once in Python, bench/int4_gemv.py `pack`):
//   nibbles [N, K/2] u8: per 128-value chunk 64 bytes, byte i holding value i (low nibble) and 64 + i (high);
//                        a trailing 64-value chunk: 32 bytes, byte i holding values i and 32 + i.
//                        So one 64-byte load gives two registers of 64 values each, in K order.
//   scales  [N, K/32] fp16 (a)
//   mins    [N/16, K/32, 16] fp16 (m), 16 output rows side by side for the vectorized second term.
// Needs K % 64 == 0 and N % 16 == 0. Output rows are split over torch's OpenMP threads (at::parallel_for),
// so torch.set_num_threads applies.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlockN = 16;  // output rows per task and per vectorized epilogue
constexpr int kMaxRows = 8;      // x rows per pass over the weights (accumulators in registers)
// Weight rows are read 4 KB ahead into L1: a decode step streams ~66 MB of int4 weights through 120 matrices, and
// the hardware prefetcher alone left a step's 120 calls at 6.8 ms against 5.6 ms with this (1 thread, rows 1).
constexpr int64_t kPrefetchBytes = 4096;

// Row n's accumulator goes to slot kSlot[n] so that reduce16 leaves the 16 sums in row order (an involution).
constexpr int kSlot[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

struct QuantizedX {
  int64_t rows, k, groups;
  std::vector<int8_t> q;     // [rows, k]
  std::vector<float> scale;  // [rows, k / 4]: d of each 4 values, the span of one vpdpbusd lane
  std::vector<float> sum;    // [rows, groups]: sum of d * qx over each group
};

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

template <typename T>
QuantizedX quantize(const T* x, int64_t rows, int64_t k) {
  QuantizedX out{rows, k, k / kGroup, {}, {}, {}};
  out.q.resize(rows * k);
  out.scale.resize(rows * k / 4);
  out.sum.resize(rows * out.groups);
  const __m512i first_of_four = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < out.groups; ++g) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t offset = r * k + g * kGroup + half * 16;
        __m512 v = load16(x + offset), amax = _mm512_abs_ps(v);
        amax = _mm512_max_ps(amax, _mm512_permute_ps(amax, 0xB1));  // max within each 4 lanes
        amax = _mm512_max_ps(amax, _mm512_permute_ps(amax, 0x4E));
        __m512 factor = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ), _mm512_set1_ps(127.f), amax);
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, factor));
        __m512 scale = _mm512_mul_ps(amax, _mm512_set1_ps(1.f / 127.f));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q.data() + offset), _mm512_cvtsepi32_epi8(q));
        _mm_storeu_ps(out.scale.data() + offset / 4, _mm512_castps512_ps128(_mm512_permutexvar_ps(first_of_four, scale)));
        sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), scale, sum);
      }
      out.sum[r * out.groups + g] = _mm512_reduce_add_ps(sum);
    }
  }
  return out;
}

// 16 vectors -> one vector of their 16 horizontal sums (in kSlot order, see above).
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

struct PackedW {
  const uint8_t* nibbles;
  const c10::Half* scales;
  const c10::Half* mins;
  int64_t n, k, groups;
};

// One output row's dot products with MR x rows, left as 16-lane partial sums in acc_out[r].
template <int MR>
inline void row_dots(const PackedW& w, int64_t n, const QuantizedX& x, int64_t r0, __m512* acc) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i pair01 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i pair23 = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
  const uint8_t* qrow = w.nibbles + n * (w.k / 2);
  const c10::Half* arow = w.scales + n * w.groups;
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();

  auto accumulate = [&](__m512i values, __m512 a, int64_t offset, int64_t pair) {
    for (int r = 0; r < MR; ++r) {
      const int8_t* xq = x.q.data() + (r0 + r) * x.k + offset;
      const float* dx = x.scale.data() + (r0 + r) * (x.k / 4) + pair * 16;
      __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), values, _mm512_loadu_si512(xq));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(a, _mm512_loadu_ps(dx)), acc[r]);
    }
  };

  const int64_t chunks = w.k / 128;
  for (int64_t line = 0; line < w.k / 2; line += 64)  // prefetches never fault, past the end included
    _mm_prefetch(reinterpret_cast<const char*>(qrow + kPrefetchBytes + line), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(arow + kPrefetchBytes / 8), _MM_HINT_T0);  // scales: 1/8 the bytes
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i v = _mm512_loadu_si512(qrow + c * 64);
    __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    __m512 a4 = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(arow + c * 4))));
    accumulate(lo, _mm512_permutexvar_ps(pair01, a4), c * 128, 2 * c);
    accumulate(hi, _mm512_permutexvar_ps(pair23, a4), c * 128 + 64, 2 * c + 1);
  }
  if (w.k % 128) {  // one trailing 64-value chunk
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qrow + chunks * 64));
    __m256i low4_256 = _mm256_set1_epi8(0x0F);
    __m256i lo = _mm256_and_si256(v, low4_256), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4_256);
    __m512i values = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    int32_t two;
    std::memcpy(&two, arow + chunks * 4, sizeof(two));
    __m512 a2 = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(two)));
    accumulate(values, _mm512_permutexvar_ps(pair01, a2), chunks * 128, 2 * chunks);
  }
}

// Output rows [16 * block, 16 * block + 16) for x rows [r0, r0 + MR).
template <int MR, typename T>
void block_rows(const PackedW& w, int64_t block, const QuantizedX& x, int64_t r0, T* out) {
  alignas(64) float slots[MR][16][16];
  __m512 acc[MR];
  for (int i = 0; i < kBlockN; ++i) {
    row_dots<MR>(w, block * kBlockN + i, x, r0, acc);
    for (int r = 0; r < MR; ++r) _mm512_store_ps(slots[r][kSlot[i]], acc[r]);
  }
  const c10::Half* mins = w.mins + block * w.groups * kBlockN;
  for (int r = 0; r < MR; ++r) {
    __m512 y = reduce16(&slots[r][0][0]);
    const float* sums = x.sum.data() + (r0 + r) * x.groups;
    for (int64_t g = 0; g < w.groups; ++g) {
      __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + g * kBlockN)));
      y = _mm512_fmadd_ps(m, _mm512_set1_ps(sums[g]), y);
    }
    store16(out + (r0 + r) * w.n + block * kBlockN, y);
  }
}

template <typename T>
void gemm(const PackedW& w, const QuantizedX& x, T* out, int64_t block_begin, int64_t block_end) {
  for (int64_t r0 = 0; r0 < x.rows; r0 += kMaxRows) {
    const int64_t rows = std::min<int64_t>(kMaxRows, x.rows - r0);
    for (int64_t b = block_begin; b < block_end; ++b) {
      switch (rows) {
        case 1: block_rows<1>(w, b, x, r0, out); break;
        case 2: block_rows<2>(w, b, x, r0, out); break;
        case 3: block_rows<3>(w, b, x, r0, out); break;
        case 4: block_rows<4>(w, b, x, r0, out); break;
        case 5: block_rows<5>(w, b, x, r0, out); break;
        case 6: block_rows<6>(w, b, x, r0, out); break;
        case 7: block_rows<7>(w, b, x, r0, out); break;
        default: block_rows<8>(w, b, x, r0, out); break;
      }
    }
  }
}

at::Tensor int4_q8_mm(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales, const at::Tensor& mins) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] matrix");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(nibbles.scalar_type() == at::kByte && scales.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf);
  TORCH_CHECK(nibbles.is_contiguous() && scales.is_contiguous() && mins.is_contiguous());
  const int64_t m = x.size(0), k = x.size(1), n = nibbles.size(0);
  TORCH_CHECK(k % 64 == 0 && n % kBlockN == 0 && nibbles.size(1) == k / 2, "needs K % 64 == 0, N % 16 == 0");
  TORCH_CHECK(scales.numel() == n * (k / kGroup) && mins.numel() == n * (k / kGroup));
  PackedW w{nibbles.data_ptr<uint8_t>(), scales.data_ptr<c10::Half>(), mins.data_ptr<c10::Half>(), n, k, k / kGroup};
  at::Tensor out = at::empty({m, n}, x.options());
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  QuantizedX qx = bf16 ? quantize(x.data_ptr<c10::BFloat16>(), m, k) : quantize(x.data_ptr<float>(), m, k);
  at::parallel_for(0, n / kBlockN, 1, [&](int64_t begin, int64_t end) {
    if (bf16)
      gemm(w, qx, out.data_ptr<c10::BFloat16>(), begin, end);
    else
      gemm(w, qx, out.data_ptr<float>(), begin, end);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(lmq_int4, library) {
  library.def("int4_q8_mm(Tensor x, Tensor nibbles, Tensor scales, Tensor mins) -> Tensor", &int4_q8_mm);
}
