// The int4 linears and the head on AMX tiles (Intel Sapphire Rapids and later), included by
// decoder_step.cpp, which runs a step's linears here when it has Model::amx_from_rows rows or more and the
// kernel granted the tile state (lmq_amx_enable); smaller steps, and other CPUs, stay on VNNI.
//
// Why: on VNNI a 16-row step is bound by its vpdpwssd (32 products each, one a cycle): 12 of its 18 ms.
// One tile product (TDPBF16PS) does 8,192: a group of 32 k values for 16 rows x 16 outputs. The weights
// go in exactly: a nibble q becomes the bfloat16 of 128 + q (bits 0x4300 | q), so a group's dot product
// is a * sum (128 + q) x + (m - 128 a) sum x, with x rounded to bfloat16 (torch's int4 path rounds it the
// same way) and the products summed in float32 by the tile unit. A tile product costs about the same for
// 1 row as for 16, VNNI's grow with the rows: hence the threshold (docs/benchmarks.md).
// A row's arithmetic does not depend on the other rows of its tile, so steps on tiles are invariant
// among themselves; they are not bit-identical to VNNI steps.
//
// Tiles: 0 = C (rows x 16 float32), 1 = A (rows of x, 32 bfloat16 each), 2 = B (16 pairs x 16 outputs).
// A step of more than 16 rows runs tiles of 16, the last one padded (the x buffer's rows are padded to
// a multiple of 16, and C's extra rows ignored).

#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int kTileRows = 16;

// x rows in bfloat16, and each group's sum of them (for the m term), [rows padded to 16, stride].
struct Bf16Rows {
  uint16_t* values;
  float* sum;  // [rows, stride / 32]
  int64_t stride;
};

void bf16_row(const float* x, int64_t k, const Bf16Rows& out, int64_t r) {
  uint16_t* values = out.values + r * out.stride;
  float* sums = out.sum + r * (out.stride / kGroup);
  for (int64_t g = 0; g < k / kGroup; ++g) {
    uint16_t* v = values + g * kGroup;
    store_bf16(v, _mm512_loadu_ps(x + g * kGroup));
    store_bf16(v + 16, _mm512_loadu_ps(x + g * kGroup + 16));
    sums[g] = _mm512_reduce_add_ps(_mm512_add_ps(load_bf16(v), load_bf16(v + 16)));
  }
}

// Each thread that runs tiles loads the configuration once per step (and releases it at the end). A and
// C have as many rows as the step's tiles (all of a step's linears have its rows): a product's time and
// C's store scale with them, which is what makes a decode of one row cheap.
void configure_tiles(int64_t rows) {
  // palette 1; bytes 16 + 2t: tile t's bytes per row; byte 48 + t: its rows. Tiles C, A, B: 0, 1, 2.
  alignas(64) uint8_t config[64] = {1};
  const uint8_t tile_rows = static_cast<uint8_t>(std::min<int64_t>(rows, kTileRows));
  for (int t = 0; t < 3; ++t) {
    config[16 + 2 * t] = 64;
    config[48 + t] = t == 2 ? kGroup / 2 : tile_rows;
  }
  asm volatile("" : : "r"(config) : "memory");  // GCC 12 dropped some of the stores above without it
  _tile_loadconfig(config);
}

// One group of a block into acc (x rows [r0, r0 + MR)). The tile intrinsics paste the tile *number* into
// the instruction's text: they take literals, not constants.
template <int MR>
inline void amx_group(const QuantMatrix& w, int64_t block, const Bf16Rows& x, int64_t r0, int64_t g, uint16_t (*b_tile)[32], float (*c_tile)[16], __m512* acc) {
  const __m512i low4 = _mm512_set1_epi16(0x0F), bf16_128 = _mm512_set1_epi16(0x4300);
  const int64_t groups = w.k / kGroup, per_row = x.stride / kGroup, at = block * groups + g;
  const uint8_t* packed = w.weights + at * kInt4GroupBytes;
  prefetch_group(packed, kInt4GroupBytes);
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512(packed + 64 * j);
    for (int s = 0; s < 4; ++s)
      _mm512_store_si512(b_tile[4 * j + s], _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4 * s), low4, bf16_128, 0xEA));  // (v & 15) | 0x4300
  }
  _tile_loadd(2, b_tile, 64);
  _tile_loadd(1, x.values + r0 * x.stride + g * kGroup, x.stride * sizeof(uint16_t));
  _tile_zero(0);
  _tile_dpbf16ps(0, 1, 2);
  _tile_stored(0, c_tile, 64);
  const __m512 a = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w.scales) + at * kBlockN)));
  const __m512 m = w.mins ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w.mins) + at * kBlockN)))
                          : _mm512_mul_ps(a, _mm512_set1_ps(static_cast<float>(w.m_factor)));  // Q4_0: m = -8 a
  const __m512 offset_m = _mm512_fnmadd_ps(a, _mm512_set1_ps(128.f), m);
  for (int r = 0; r < MR; ++r) {
    acc[r] = _mm512_fmadd_ps(_mm512_load_ps(c_tile[r]), a, acc[r]);
    acc[r] = _mm512_fmadd_ps(offset_m, _mm512_set1_ps(x.sum[(r0 + r) * per_row + g]), acc[r]);
  }
}

// Output columns [16 * block, +16) for x rows [r0, r0 + MR), MR <= 16; accumulate: out += y, else out = y.
// (Groups in pairs on two sets of tiles, so that one's product would overlap the other's unpacking,
// measured no faster.)
template <int MR>
void amx_int4_block(const QuantMatrix& w, int64_t block, const Bf16Rows& x, int64_t r0, float* out, int64_t out_stride, bool accumulate) {
  alignas(64) uint16_t b_tile[kGroup / 2][32];
  alignas(64) float c_tile[kTileRows][16];
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.k / kGroup; ++g) amx_group<MR>(w, block, x, r0, g, b_tile, c_tile, acc);
  for (int r = 0; r < MR; ++r) {
    float* o = out + (r0 + r) * out_stride + block * kBlockN;
    _mm512_storeu_ps(o, accumulate ? _mm512_add_ps(_mm512_loadu_ps(o), acc[r]) : acc[r]);
  }
}

// Whether tiles can run w: one part, int4 with fp16 scales and mins, stored or m_factor a (the other formats run on VNNI only).
bool amx_format(const QuantMatrix& w) { return !w.next && !w.values && w.bits == 4 && w.scale_bytes == 2 && w.group == kGroup; }

// out [rows, w.n] (= or +=) x @ w^T, the team splitting the column blocks.
void amx_int4_linear(const QuantMatrix& w, const Bf16Rows& x, int64_t rows, float* out, bool accumulate) {
  over_blocks<kTileRows>(w.n / kBlockN, rows, w.k, [&](int64_t b, int64_t r0, auto tile) { amx_int4_block<tile.value>(w, b, x, r0, out, w.n, accumulate); });
}

// The output head: its int8 weights turned into bfloat16 (exact: integers below 128) group by group, and,
// with one scale per output row, the products of all groups summed in tile C.
void amx_head(const Model& m, const Bf16Rows& x, int64_t rows, float* out) {
  alignas(64) uint16_t b_tile[kGroup / 2][32];
  alignas(64) float c_tile[kTileRows][16];
  alignas(64) uint16_t odd[32];  // word 2i + 1 of two float vectors side by side: their bfloat16s, in order
  for (int i = 0; i < 32; ++i) odd[i] = static_cast<uint16_t>(2 * i + 1);
  const __m512i high_halves = _mm512_load_si512(odd);
  int64_t begin, end;
  share(m.vocab / kBlockN, begin, end);
  for (int64_t b = begin; b < end; ++b) {
    const int8_t* weights = m.head + b * kBlockN * m.hidden;
    const __m512 scale = _mm512_loadu_ps(m.head_scale + b * kBlockN);
    for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
      _tile_zero(0);
      for (int64_t g = 0; g < m.hidden / kGroup; ++g) {
        const int8_t* bytes = weights + g * kGroup * kBlockN;
        prefetch_group(reinterpret_cast<const uint8_t*>(bytes), kGroup * kBlockN);
        for (int p = 0; p < kGroup / 2; ++p) {
          const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 32 * p))));
          const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 32 * p + 16))));
          _mm512_store_si512(b_tile[p], _mm512_permutex2var_epi16(_mm512_castps_si512(low), high_halves, _mm512_castps_si512(high)));
        }
        _tile_loadd(2, b_tile, 64);
        _tile_loadd(1, x.values + r0 * x.stride + g * kGroup, x.stride * sizeof(uint16_t));
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, c_tile, 64);
      for (int64_t r = 0; r < std::min<int64_t>(kTileRows, rows - r0); ++r)
        _mm512_storeu_ps(out + (r0 + r) * m.vocab + b * kBlockN, _mm512_mul_ps(_mm512_load_ps(c_tile[r]), scale));
    }
  }
}

// Whether this process may use AMX: the kernel must grant the tile state (Linux 5.16+), once per process.
bool request_amx() {
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

}  // namespace
