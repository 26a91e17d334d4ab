// One row of a GGUF tensor dequantized from its file's own blocks, as ggml-quants.c's dequantize_row_* do
// (included by decoder_step.cpp). The native step reads the token embedding this way: a row a token, so a
// model keeps its embedding in the file's bits (Q8_0 1.06 bytes a value, Q6_K 0.82, Q4_0 0.56) instead
// of a bfloat16 copy (2 bytes), which was the largest tensor a worker held beside its packed weights.
//
// Every value is exact in float32 as numpy's gguf.quants computes it: an fp16 scale times a small
// integer (and the K-quants' 6-bit scale) has at most 24 significant bits, so the only rounding is where a
// min is added, once, in both. tests/worker/model/test_gguf_rows.py compares every type with gguf.quants.

namespace {

// The GGML type ids of the formats read here (ggml.h's enum ggml_type).
enum GgmlType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23 };

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Q4_0 / Q5_0 (Min false: q - 8, q - 16) and Q4_1 / Q5_1 (d q + m): blocks of 32, the low nibbles values
// 0..15 and the high ones 16..31, Q5's fifth bits a little-endian uint32 after the scales.
template <int Bits, bool Min>
void row_32(const uint8_t* b, int64_t k, float* y) {
  constexpr int64_t scales = Min ? 4 : 2, high_bytes = Bits == 5 ? 4 : 0, bytes = scales + high_bytes + 16;
  constexpr int offset = Min ? 0 : (Bits == 5 ? 16 : 8);
  for (int64_t i = 0; i < k / 32; ++i, b += bytes, y += 32) {
    const float d = f16_at(b), m = Min ? f16_at(b + 2) : 0.f;
    uint32_t high = 0;
    if (Bits == 5) std::memcpy(&high, b + scales, 4);
    const uint8_t* qs = b + scales + high_bytes;
    for (int j = 0; j < 16; ++j) {
      const int q0 = (qs[j] & 0x0F) | (Bits == 5 ? ((high >> j) << 4) & 0x10 : 0);
      const int q1 = (qs[j] >> 4) | (Bits == 5 ? (high >> (j + 12)) & 0x10 : 0);
      y[j] = Min ? d * q0 + m : d * (q0 - offset);
      y[j + 16] = Min ? d * q1 + m : d * (q1 - offset);
    }
  }
}

void row_q8_0(const uint8_t* b, int64_t k, float* y) {
  for (int64_t i = 0; i < k / 32; ++i, b += 34, y += 32) {
    const float d = f16_at(b);
    for (int j = 0; j < 32; ++j) y[j] = d * static_cast<int8_t>(b[2 + j]);
  }
}

// Q4_K / Q5_K's 6-bit scale and min of group j (of 8) from their 12 packed bytes (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int& scale, int& min) {
  if (j < 4) {
    scale = q[j] & 63, min = q[j + 4] & 63;
  } else {
    scale = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q4_K (144 bytes) and Q5_K (176): d, dmin, 12 bytes of scales and mins, [Q5_K: 32 bytes of fifth bits,] 128 of
// nibbles; each 32 bytes of nibbles hold a pair of groups (low nibbles the first), each group d sc q - dmin mn.
template <int Bits>
void row_k(const uint8_t* b, int64_t k, float* y) {
  constexpr int64_t bytes = Bits == 5 ? 176 : 144;
  for (int64_t i = 0; i < k / 256; ++i, b += bytes) {
    const float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t *high = b + 16, *qs = b + 16 + (Bits == 5 ? 32 : 0);
    for (int pair = 0; pair < 4; ++pair, qs += 32) {
      for (int half = 0; half < 2; ++half, y += 32) {
        int scale, min;
        scale_min_k4(2 * pair + half, b + 4, scale, min);
        const float a = d * scale, m = dmin * min;
        const int bit = 2 * pair + half;
        for (int l = 0; l < 32; ++l) {
          const int q = (half ? qs[l] >> 4 : qs[l] & 0x0F) | (Bits == 5 ? ((high[l] >> bit) & 1) << 4 : 0);
          y[l] = a * q - m;
        }
      }
    }
  }
}

// Q6_K (210 bytes): 128 bytes of low nibbles, 64 of bit pairs, 16 int8 scales (one per 16 values), d.
void row_q6_k(const uint8_t* b, int64_t k, float* y) {
  for (int64_t i = 0; i < k / 256; ++i, b += 210) {
    const float d = f16_at(b + 208);
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int n = 0; n < 2; ++n, y += 128, ql += 64, qh += 32, sc += 8) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        y[l] = d * sc[is] * (((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) - 32);
        y[l + 32] = d * sc[is + 2] * (((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32);
        y[l + 64] = d * sc[is + 4] * (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
        y[l + 96] = d * sc[is + 6] * (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
      }
    }
  }
}

// Q3_K (110 bytes): 32 bytes of third bits, 64 of bit pairs, 12 of 6-bit scales, d. Value v is bit pair
// (v % 128) / 32 of byte 32 (v / 128) + v % 32, less 4 where bit v / 32 of mask byte v % 32 is clear; scale
// j (one per 16 values, less 32) has its low nibble in byte j % 8 (the high nibble for j >= 8) and its top
// two bits at 2 (j / 4) of byte 8 + j % 4.
void row_q3_k(const uint8_t* b, int64_t k, float* y) {
  for (int64_t i = 0; i < k / 256; ++i, b += 110, y += 256) {
    const uint8_t *mask = b, *pairs = b + 32, *packed = b + 96;
    const float d = f16_at(b + 108);
    for (int v = 0; v < 256; ++v) {
      const int j = v / 16;
      const int sc = (((packed[j % 8] >> (4 * (j / 8))) & 0x0F) | (((packed[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
      const int q = ((pairs[32 * (v / 128) + v % 32] >> (2 * ((v % 128) / 32))) & 3) - (((mask[v % 32] >> (v / 32)) & 1) ? 0 : 4);
      y[v] = d * static_cast<float>(sc) * static_cast<float>(q);
    }
  }
}

// IQ4_NL and IQ4_XS's values: a fixed int8 table at 4-bit indices, each 32 of them 16 bytes' low nibbles
// and then their high ones (ggml's kvalues_iq4nl).
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

inline void iq4_group(const uint8_t* qs, float a, float* y) {
  for (int j = 0; j < 16; ++j) {
    y[j] = a * static_cast<float>(kIq4Values[qs[j] & 0x0F]);
    y[j + 16] = a * static_cast<float>(kIq4Values[qs[j] >> 4]);
  }
}

// IQ4_NL (18 bytes): d, 16 bytes of indices for 32 values.
void row_iq4_nl(const uint8_t* b, int64_t k, float* y) {
  for (int64_t i = 0; i < k / 32; ++i, b += 18, y += 32) iq4_group(b + 2, f16_at(b), y);
}

// IQ4_XS (136 bytes): d, a uint16 of the 8 scales' top bit pairs, 4 bytes of their low nibbles, 128 of
// indices; group g's scale (less 32) is nibble g % 2 of byte g / 2 with bits 2g, 2g + 1 of the uint16 above.
void row_iq4_xs(const uint8_t* b, int64_t k, float* y) {
  for (int64_t i = 0; i < k / 256; ++i, b += 136) {
    const float d = f16_at(b);
    uint16_t high;
    std::memcpy(&high, b + 2, 2);
    for (int g = 0; g < 8; ++g, y += 32) {
      const int sc = (((b[4 + g / 2] >> (4 * (g % 2))) & 0x0F) | (((high >> (2 * g)) & 3) << 4)) - 32;
      iq4_group(b + 8 + 16 * g, d * static_cast<float>(sc), y);
    }
  }
}

// Each type read here: its values and bytes a block, and its row reader.
struct RowFormat {
  int64_t type, block_values, block_bytes;
  void (*row)(const uint8_t*, int64_t, float*);
};
constexpr RowFormat kRowFormats[] = {
    {kQ4_0, 32, 18, row_32<4, false>}, {kQ4_1, 32, 20, row_32<4, true>}, {kQ5_0, 32, 22, row_32<5, false>},
    {kQ5_1, 32, 24, row_32<5, true>},  {kQ8_0, 32, 34, row_q8_0},        {kQ4_K, 256, 144, row_k<4>},
    {kQ5_K, 256, 176, row_k<5>},       {kQ6_K, 256, 210, row_q6_k},       {kQ3_K, 256, 110, row_q3_k},
    {kIQ4_NL, 32, 18, row_iq4_nl},     {kIQ4_XS, 256, 136, row_iq4_xs},
};

inline const RowFormat* row_format(int64_t type) {
  for (const RowFormat& format : kRowFormats)
    if (format.type == type) return &format;
  return nullptr;
}

// The bytes of a row of k values of `type`; 0: a type not read here, or k not in its blocks.
int64_t gguf_row_bytes(int64_t type, int64_t k) {
  const RowFormat* format = row_format(type);
  return format && k % format->block_values == 0 ? k / format->block_values * format->block_bytes : 0;
}

// Row `row` of a tensor of `type` whose rows of k values are `row_bytes` apart, as k floats (gguf_row_bytes
// says which types and widths are read).
void gguf_row(int64_t type, const uint8_t* data, int64_t row_bytes, int64_t k, int64_t row, float* y) {
  row_format(type)->row(data + row * row_bytes, k, y);
}

}  // namespace
