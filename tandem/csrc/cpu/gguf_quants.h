// GGUF blocks (llama.cpp's layouts, ggml-common.h) as the CPU kernels read them: the types'
// sizes, the expansion of a group of 32 weights to unsigned 8-bit values u with w = s u + o, and
// x quantized to int8 per 32 values as llama.cpp quantizes it for its dot products. Shared by
// the unpacking and repacking (gguf_unpack.cpp) and the repacked kernels (gguf_repacked.cpp).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define TANDEM_GGUF_VNNI 1
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

namespace tandem_cpu::gguf {

// GGML type ids (ggml.h).
enum GgmlType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

struct TypeInfo {
  int64_t weights;  // per block
  int64_t bytes;    // per block
};

// A type's block size, false for a type the kernels do not read.
bool type_info(int64_t type, TypeInfo* info);

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef TANDEM_GGUF_VNNI
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// x quantized to int8 per 32 values as llama.cpp's Q8_0 (its CPU dot products' input): per 32
// values one scale dx and int8 values q, with dx * sum(q) per 16 and per 32 (the offsets'
// factors).
struct QuantizedX {
  std::vector<int8_t> q;      // [T, in]
  std::vector<float> d;       // [T, in / 32]
  std::vector<int32_t> qsum;  // [T, in / 16]: the sums of q per 16 (Q6_K's offset of -32)
  std::vector<float> dsum32;  // [T, in / 32]: d times the sum of q per 32
};

// Round v / d to int8 for every value of a group, with d = max|v| / 127.
inline float quantize_group(const float* v, int n, int8_t* q) {
  float amax = 0.0f;
  for (int j = 0; j < n; ++j) amax = std::max(amax, std::fabs(v[j]));
  const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
  for (int j = 0; j < n; ++j) q[j] = static_cast<int8_t>(std::nearbyint(v[j] * id));
  return d;
}

// x [T, in] fp32 quantized per 32 values (multi-threaded over the groups).
void quantize_x32(const float* x, int64_t t_rows, int64_t in, QuantizedX* qx);

// The eight 6-bit scales and mins of a Q4_K/Q5_K super-block (12 bytes; ggml's
// get_scale_min_k4 for j < 8), unpacked four at a time in 32-bit words: scales j < 4 are the
// low 6 bits of bytes 0-3, mins j < 4 of bytes 4-7; for j >= 4 the low (scale) and high (min)
// nibbles of bytes 8-11 with the top two bits of bytes 0-3 (scales) and 4-7 (mins) above them.
inline void scales_mins_k4(const uint8_t* q, uint8_t* sc, uint8_t* m) {
  uint32_t w[3];
  std::memcpy(w, q, 12);
  constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
  const uint32_t sc_lo = w[0] & k6, m_lo = w[1] & k6;
  const uint32_t sc_hi = (w[2] & k4) | (((w[0] >> 6) & k2) << 4);
  const uint32_t m_hi = ((w[2] >> 4) & k4) | (((w[1] >> 6) & k2) << 4);
  std::memcpy(sc, &sc_lo, 4);
  std::memcpy(sc + 4, &sc_hi, 4);
  std::memcpy(m, &m_lo, 4);
  std::memcpy(m + 4, &m_hi, 4);
}

// A group of 32 weights as 32 unsigned 8-bit values u (in a vector, or an array).
#ifdef TANDEM_GGUF_VNNI
using U32 = __m256i;
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i low4(__m256i b) { return _mm256_and_si256(b, _mm256_set1_epi8(0x0F)); }
inline __m256i high4(__m256i b) { return _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(0x0F)); }
#else
struct U32 {
  uint8_t v[32];
};
#endif

// 32-weight blocks: Q4_0 (d, qs[16]), Q4_1 (d, m, qs[16]), Q5_0 (d, qh[4], qs[16]), Q5_1 (d, m,
// qh[4], qs[16]), Q8_0 (d, qs[32]): u and w_j = s u_j + o. Low nibbles are weights 0-15, high
// nibbles 16-31; the fifth bit of weight j is bit j of qh.
template <int64_t Type>
inline U32 expand32(const uint8_t* b, float* s, float* o) {
  const float d = fp16(b);
  *s = d;
  U32 u;
  if constexpr (Type == kQ8_0) {
    *o = -128.0f * d;
#ifdef TANDEM_GGUF_VNNI
    u = _mm256_xor_si256(load32(b + 2), _mm256_set1_epi8(static_cast<char>(0x80)));  // q + 128
#else
    for (int j = 0; j < 32; ++j) u.v[j] = static_cast<uint8_t>(static_cast<int8_t>(b[2 + j]) + 128);
#endif
    return u;
  }
  constexpr bool has_min = Type == kQ4_1 || Type == kQ5_1, five = Type == kQ5_0 || Type == kQ5_1;
  *o = has_min ? fp16(b + 2) : -d * (five ? 16.0f : 8.0f);
  const uint8_t* p = b + (has_min ? 4 : 2);
  uint32_t qh = 0;
  if constexpr (five) {
    std::memcpy(&qh, p, 4);
    p += 4;
  }
#ifdef TANDEM_GGUF_VNNI
  const __m128i q = load16(p);
  u = low4(_mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1));
  if constexpr (five) u = _mm256_mask_add_epi8(u, qh, u, _mm256_set1_epi8(16));
#else
  for (int j = 0; j < 16; ++j) {
    u.v[j] = (p[j] & 0xF) | (five ? ((qh >> j) & 1) << 4 : 0);
    u.v[j + 16] = (p[j] >> 4) | (five ? ((qh >> (j + 16)) & 1) << 4 : 0);
  }
#endif
  return u;
}

// A K-quant super-block of 256 weights as 8 groups of 32: u, and integer scales per 16
// (sc[g][h], h the half) with w = d sc u - dmin m[g] (Q4_K, Q5_K) or d sc (u - 32) (Q6_K).
struct KBlock {
  U32 u[8];
  alignas(32) int16_t sc[8][2];
  // The offset's factor per 32 (-dmin m, Q4_K/Q5_K) or per 16 (-32 d sc, Q6_K).
  alignas(64) float off[16];
  float d;
};

// Q4_K (d, dmin, scales[12], qs[128]) and Q5_K (d, dmin, scales[12], qh[32], qs[128]): group
// 2i the low nibbles of qs[32i..32i+32), 2i+1 their high ones; Q5_K's fifth bit of group g is
// bit g of qh[l]. Q6_K (ql[128], qh[64], scales[16] int8, d): ggml's dequantize_row_q6_K, group
// g = 4 half + k.
template <int64_t Type>
inline void expand_k(const uint8_t* b, KBlock* kb) {
  if constexpr (Type == kQ6_K) {
    kb->d = fp16(b + 208);
#ifdef TANDEM_GGUF_VNNI
    _mm512_store_ps(kb->off, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(b + 192))),
                                           _mm512_set1_ps(-32.0f * kb->d)));
#else
    for (int h = 0; h < 16; ++h) kb->off[h] = -32.0f * kb->d * static_cast<int8_t>(b[192 + h]);
#endif
    for (int g = 0; g < 8; ++g) {
      const int half = g / 4, k = g % 4;
      const uint8_t* ql = b + 64 * half + 32 * (k % 2);
      const uint8_t* qh = b + 128 + 32 * half;
      const auto* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * half + 2 * k);
      kb->sc[g][0] = sc[0];
      kb->sc[g][1] = sc[1];
#ifdef TANDEM_GGUF_VNNI
      const __m256i q = load32(ql);
      const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(load32(qh), 2 * k), _mm256_set1_epi8(3));
      kb->u[g] = _mm256_or_si256(k < 2 ? low4(q) : high4(q), _mm256_slli_epi16(hb, 4));
#else
      for (int l = 0; l < 32; ++l)
        kb->u[g].v[l] = (k < 2 ? ql[l] & 0xF : ql[l] >> 4) | (((qh[l] >> (2 * k)) & 3) << 4);
#endif
    }
    return;
  }
  constexpr bool five = Type == kQ5_K;
  kb->d = fp16(b);
  const float dmin = fp16(b + 2);
#ifdef TANDEM_GGUF_VNNI
  const __m256i qh = five ? load32(b + 16) : _mm256_setzero_si256();
#endif
  uint8_t sc[8], m[8];
  scales_mins_k4(b + 4, sc, m);
#ifdef TANDEM_GGUF_VNNI
  _mm256_store_ps(kb->off, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                             reinterpret_cast<const __m128i*>(m)))),
                                         _mm256_set1_ps(-dmin)));
#else
  for (int g = 0; g < 8; ++g) kb->off[g] = -dmin * m[g];
#endif
  for (int g = 0; g < 8; ++g) {
    const uint8_t* qs = b + (five ? 48 : 16) + 32 * (g / 2);
    kb->sc[g][0] = kb->sc[g][1] = sc[g];
#ifdef TANDEM_GGUF_VNNI
    const __m256i q = load32(qs);
    __m256i u = g % 2 ? high4(q) : low4(q);
    if constexpr (five)
      u = _mm256_mask_add_epi8(u, _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << g))), u,
                               _mm256_set1_epi8(16));
    kb->u[g] = u;
#else
    for (int l = 0; l < 32; ++l)
      kb->u[g].v[l] = (g % 2 ? qs[l] >> 4 : qs[l] & 0xF) | (five ? ((b[16 + l] >> g) & 1) << 4 : 0);
#endif
  }
}

constexpr bool is_k_quant(int64_t type) { return type == kQ4_K || type == kQ5_K || type == kQ6_K; }

struct Segment {
  int64_t type;
  TypeInfo info;
  int64_t rows;
  const uint8_t* data;
  int64_t row_bytes;
  int64_t first_row;  // in the output
};

// Checks that t (`name` in errors) is a contiguous 1-d uint8 tensor.
void check_bytes(const at::Tensor& t, const char* name, const char* op);

// A segment table [S >= 1, 3] int64 (type, rows, byte offset), checked, contiguous.
at::Tensor segment_table(const at::Tensor& segments, const char* op);

// The segment table [S, 3] (type, rows, byte offset) over `blocks` for an input of `in` values,
// checked (`op` names the caller in errors).
std::vector<Segment> parse_segments(const at::Tensor& blocks, const at::Tensor& segments, int64_t in, const char* op);

// y [T, out] fp32 with the bias added, in `dtype`.
at::Tensor finish_linear(at::Tensor y, const std::optional<at::Tensor>& bias, at::ScalarType dtype);

// Weight rows of a tile: one int32 lane of a 512-bit vector each.
constexpr int kTileRows = 16;

// Up to 16 weight rows of one segment, unpacked for the whole input width: u in runs of four
// columns interleaved over the rows (u[64 (k / 4) + 4 r + k % 4] is row r's value at column
// k), s and o per group and row ([in / G, 16], G = 16 for Q6_K, 32 otherwise).
struct Tile {
  std::vector<uint8_t> u;
  std::vector<float> s, o;
};

// The tile of rows [r0, r0 + rows) of a segment (t sized for `in` columns: u 16 in, s and o
// in values); rows past `rows` are zeros (gguf_unpack.cpp).
void unpack_tile(const Segment& seg, int64_t r0, int rows, int64_t in, Tile* t);

}  // namespace tandem_cpu::gguf
