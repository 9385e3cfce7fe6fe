// y = x W^T + b with W in GGUF blocks as the file stores them (llama.cpp's layouts,
// ggml-common.h), the way llama.cpp's CPU backend runs them: each row of x is quantized to
// int8 per 32 values (its Q8_0: scale max|x| / 127, round to nearest), and each group of 32
// weights is expanded to unsigned 8-bit values u with w = s u + o (s, o per 16 weights) and
// multiplied into x's int8 values with AVX512-VNNI's u8 x s8 dot product (int32 sums, exact),
// then scaled in fp32:
//
//   sum_j w_j x_j ~= sum over halves h of 16: s_h dx (sum u_j q_j) + o_h dx (sum q_j)
//
// with x_j ~= dx q_j. The weight is read once per call at the file's bits per weight (Q5_0 5.5,
// Q6_K 6.56, Q8_0 8.5), whatever the number of rows of x. An output value depends on its row
// of x only (batch-invariant); the only error besides fp32 rounding is x's int8 rounding.
//
// The weight is one flat uint8 tensor of segments of rows (a fused layer's parts, each of its
// own type): `segments` [S, 3] int64 holds each one's GGML type id, row count and byte offset.
// Without AVX512-VNNI the same arithmetic runs as scalar code (for tests; slow).
#include "ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define TANDEM_GGUF_VNNI 1
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

// GGML type ids (ggml.h).
enum GgmlType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

struct TypeInfo {
  int64_t weights;  // per block
  int64_t bytes;    // per block
};

bool type_info(int64_t type, TypeInfo* info) {
  switch (type) {
    case kQ4_0: *info = {32, 18}; return true;
    case kQ4_1: *info = {32, 20}; return true;
    case kQ5_0: *info = {32, 22}; return true;
    case kQ5_1: *info = {32, 24}; return true;
    case kQ8_0: *info = {32, 34}; return true;
    case kQ4_K: *info = {256, 144}; return true;
    case kQ5_K: *info = {256, 176}; return true;
    case kQ6_K: *info = {256, 210}; return true;
    default: return false;
  }
}

// Rows of x multiplied per pass over a weight row (their accumulators stay in registers).
constexpr int kRowTile = 4;

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef TANDEM_GGUF_VNNI
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// x quantized as llama.cpp quantizes it for a type's dot product. For the 32-weight types
// (its Q8_0): per 32 values one scale dx and int8 values q, with dx * sum(q) per 16 and per 32
// (the offsets' factor). For the K-quants (its Q8_K): per 256 values one scale and int8
// values, with the scale times the sums of q per 16 and per 32 (the mins' factor).
struct QuantizedX {
  std::vector<int8_t> q;       // [T, in]
  std::vector<float> d;        // [T, in / 32]
  std::vector<float> dsum;     // [T, in / 16]
  std::vector<float> dsum32;   // [T, in / 32]
  std::vector<int8_t> q256;    // [T, in]
  std::vector<float> d256;     // [T, in / 256]
  std::vector<float> dbsum;    // [T, in / 16]: the 256-scale times the sums of q per 16
  std::vector<float> dbsum32;  // [T, in / 32]: per 32
};

// Round v / d to int8 for every value of a group, with d = max|v| / 127.
inline float quantize_group(const float* v, int n, int8_t* q) {
  float amax = 0.0f;
  for (int j = 0; j < n; ++j) amax = std::max(amax, std::fabs(v[j]));
  const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
  for (int j = 0; j < n; ++j) q[j] = static_cast<int8_t>(std::nearbyint(v[j] * id));
  return d;
}

void quantize_x256(const float* x, int64_t t_rows, int64_t in, QuantizedX* qx) {
  qx->q256.resize(t_rows * in);
  qx->d256.resize(t_rows * in / 256);
  qx->dbsum.resize(t_rows * in / 16);
  qx->dbsum32.resize(t_rows * in / 32);
  for (int64_t b = 0; b < t_rows * in / 256; ++b) {
    int8_t* q = qx->q256.data() + 256 * b;
    const float d = quantize_group(x + 256 * b, 256, q);
    qx->d256[b] = d;
    for (int h = 0; h < 16; h += 2) {
      int sums[2] = {0, 0};
      for (int j = 0; j < 32; ++j) sums[j / 16] += q[16 * h + j];
      qx->dbsum[16 * b + h] = d * sums[0];
      qx->dbsum[16 * b + h + 1] = d * sums[1];
      qx->dbsum32[8 * b + h / 2] = d * (sums[0] + sums[1]);
    }
  }
}

void quantize_x32(const float* x, int64_t t_rows, int64_t in, QuantizedX* qx) {
  QuantizedX& r = *qx;
  r.q.resize(t_rows * in);
  r.d.resize(t_rows * in / 32);
  r.dsum.resize(t_rows * in / 16);
  r.dsum32.resize(t_rows * in / 32);
  for (int64_t b = 0; b < t_rows * in / 32; ++b) {
    int8_t* q = r.q.data() + 32 * b;
    const float d = quantize_group(x + 32 * b, 32, q);
    int sums[2] = {0, 0};
    for (int j = 0; j < 32; ++j) sums[j / 16] += q[j];
    r.d[b] = d;
    r.dsum[2 * b] = d * sums[0];
    r.dsum[2 * b + 1] = d * sums[1];
    r.dsum32[b] = d * (sums[0] + sums[1]);
  }
}

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

struct Segment {
  int64_t type;
  TypeInfo info;
  int64_t rows;
  const uint8_t* data;
  int64_t row_bytes;
  int64_t first_row;  // in the output
};

#ifdef TANDEM_GGUF_VNNI
inline float hsum(__m256 a) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}
#endif

// Output rows [r0, r1) of a segment of a 32-weight type for rows [t0, t0 + TN) of x (quantized
// per 32), into y (fp32 [T, out]): per block and row, s dx (sum u q) + o dx (sum q).
template <int64_t Type, int TN>
void run_tile32(const Segment& s, int64_t r0, int64_t r1, const QuantizedX& qx, int64_t t0, int64_t in, float* y,
                int64_t out) {
  const int64_t blocks = in / 32;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = s.data + r * s.row_bytes;
    float corr[TN][2] = {};  // two chains, as acc: the sums' latency, not their work, would bound a row
#ifdef TANDEM_GGUF_VNNI
    __m256 acc[TN][2];
    for (int t = 0; t < TN; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
#else
    float acc[TN] = {};
#endif
    for (int64_t blk = 0; blk < blocks; ++blk) {
      float ws, wo;
      const U32 u = expand32<Type>(row + blk * s.info.bytes, &ws, &wo);
      for (int t = 0; t < TN; ++t) {
        const int64_t xb = (t0 + t) * blocks + blk;
        const int8_t* xq = qx.q.data() + 32 * xb;
        corr[t][blk & 1] += wo * qx.dsum32[xb];
#ifdef TANDEM_GGUF_VNNI
        const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, load32(xq));
        acc[t][blk & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(ws * qx.d[xb]), acc[t][blk & 1]);
#else
        int sum = 0;
        for (int j = 0; j < 32; ++j) sum += u.v[j] * xq[j];
        acc[t] += ws * qx.d[xb] * sum;
#endif
      }
    }
    for (int t = 0; t < TN; ++t) {
#ifdef TANDEM_GGUF_VNNI
      const float sum = hsum(_mm256_add_ps(acc[t][0], acc[t][1]));
#else
      const float sum = acc[t];
#endif
      y[(t0 + t) * out + s.first_row + r] = sum + (corr[t][0] + corr[t][1]);
    }
  }
}

// The same for a K-quant, x quantized per 256 (llama.cpp's Q8_K): per super-block and row,
// d dx (sum over halves of sc sum u q) + (sum over groups of off dx sum q), the first sums in
// integers (u q pairs by maddubs, times sc by VNNI's dpwssd), the offsets' in fp32 vectors.
template <int64_t Type, int TN>
void run_tile_k(const Segment& s, int64_t r0, int64_t r1, const QuantizedX& qx, int64_t t0, int64_t in, float* y,
                int64_t out) {
  const int64_t blocks = in / 256;
  KBlock kb;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = s.data + r * s.row_bytes;
#ifdef TANDEM_GGUF_VNNI
    __m256 acc[TN], corr[TN];
    for (int t = 0; t < TN; ++t) acc[t] = corr[t] = _mm256_setzero_ps();
#else
    float acc[TN] = {}, corr[TN] = {};
#endif
    for (int64_t blk = 0; blk < blocks; ++blk) {
      expand_k<Type>(row + blk * s.info.bytes, &kb);
#ifdef TANDEM_GGUF_VNNI
      // Group g's scales over its 16 int16 lanes: sc[g][0] on the first 8 (the first 16
      // weights' pairs), sc[g][1] on the last 8.
      const __m256i sc16 = load32(kb.sc);
      __m256i scv[8];
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g)
        scv[g] = _mm256_permutexvar_epi16(
            _mm256_inserti128_si256(_mm256_set1_epi16(static_cast<int16_t>(2 * g)), _mm_set1_epi16(2 * g + 1), 1),
            sc16);
#endif
      for (int t = 0; t < TN; ++t) {
        const int64_t xb = (t0 + t) * blocks + blk;
        const int8_t* xq = qx.q256.data() + 256 * xb;
        const float dx = qx.d256[xb];
#ifdef TANDEM_GGUF_VNNI
        // Four chains of dpwssd: one would wait on its own latency eight times a super-block.
        __m256i isum[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                           _mm256_setzero_si256()};
#pragma GCC unroll 8
        for (int g = 0; g < 8; ++g)
          isum[g % 4] = _mm256_dpwssd_epi32(isum[g % 4], _mm256_maddubs_epi16(kb.u[g], load32(xq + 32 * g)), scv[g]);
        const __m256i total = _mm256_add_epi32(_mm256_add_epi32(isum[0], isum[1]), _mm256_add_epi32(isum[2], isum[3]));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(kb.d * dx), acc[t]);
        if constexpr (Type == kQ6_K) {
          const float* dbs = qx.dbsum.data() + 16 * xb;
          corr[t] = _mm256_fmadd_ps(_mm256_load_ps(kb.off), _mm256_loadu_ps(dbs), corr[t]);
          corr[t] = _mm256_fmadd_ps(_mm256_load_ps(kb.off + 8), _mm256_loadu_ps(dbs + 8), corr[t]);
        } else {
          corr[t] = _mm256_fmadd_ps(_mm256_load_ps(kb.off), _mm256_loadu_ps(qx.dbsum32.data() + 8 * xb), corr[t]);
        }
#else
        int isum = 0;
        for (int g = 0; g < 8; ++g)
          for (int j = 0; j < 32; ++j) isum += kb.sc[g][j / 16] * kb.u[g].v[j] * xq[32 * g + j];
        acc[t] += kb.d * dx * static_cast<float>(isum);
        if constexpr (Type == kQ6_K) {
          for (int h = 0; h < 16; ++h) corr[t] += kb.off[h] * qx.dbsum[16 * xb + h];
        } else {
          for (int g = 0; g < 8; ++g) corr[t] += kb.off[g] * qx.dbsum32[8 * xb + g];
        }
#endif
      }
    }
    for (int t = 0; t < TN; ++t) {
#ifdef TANDEM_GGUF_VNNI
      const float sum = hsum(_mm256_add_ps(acc[t], corr[t]));
#else
      const float sum = acc[t] + corr[t];
#endif
      y[(t0 + t) * out + s.first_row + r] = sum;
    }
  }
}

constexpr bool is_k_quant(int64_t type) { return type == kQ4_K || type == kQ5_K || type == kQ6_K; }

template <int64_t Type, int TN>
void run_tile(const Segment& s, int64_t r0, int64_t r1, const QuantizedX& qx, int64_t t0, int64_t in, float* y,
              int64_t out) {
  if constexpr (is_k_quant(Type)) {
    run_tile_k<Type, TN>(s, r0, r1, qx, t0, in, y, out);
  } else {
    run_tile32<Type, TN>(s, r0, r1, qx, t0, in, y, out);
  }
}

template <int64_t Type>
void run_rows(const Segment& s, int64_t r0, int64_t r1, const QuantizedX& qx, int64_t t_rows, int64_t in, float* y,
              int64_t out) {
  int64_t t0 = 0;
  for (; t0 + kRowTile <= t_rows; t0 += kRowTile) run_tile<Type, kRowTile>(s, r0, r1, qx, t0, in, y, out);
  switch (t_rows - t0) {
    case 3: run_tile<Type, 3>(s, r0, r1, qx, t0, in, y, out); break;
    case 2: run_tile<Type, 2>(s, r0, r1, qx, t0, in, y, out); break;
    case 1: run_tile<Type, 1>(s, r0, r1, qx, t0, in, y, out); break;
    default: break;
  }
}

void run_segment(const Segment& s, int64_t r0, int64_t r1, const QuantizedX& qx, int64_t t_rows, int64_t in,
                 float* y, int64_t out) {
  switch (s.type) {
    case kQ4_0: return run_rows<kQ4_0>(s, r0, r1, qx, t_rows, in, y, out);
    case kQ4_1: return run_rows<kQ4_1>(s, r0, r1, qx, t_rows, in, y, out);
    case kQ5_0: return run_rows<kQ5_0>(s, r0, r1, qx, t_rows, in, y, out);
    case kQ5_1: return run_rows<kQ5_1>(s, r0, r1, qx, t_rows, in, y, out);
    case kQ8_0: return run_rows<kQ8_0>(s, r0, r1, qx, t_rows, in, y, out);
    case kQ4_K: return run_rows<kQ4_K>(s, r0, r1, qx, t_rows, in, y, out);
    case kQ5_K: return run_rows<kQ5_K>(s, r0, r1, qx, t_rows, in, y, out);
    default: return run_rows<kQ6_K>(s, r0, r1, qx, t_rows, in, y, out);
  }
}

}  // namespace

namespace tandem_cpu {

bool gguf_linear_vnni() {
#ifdef TANDEM_GGUF_VNNI
  return true;
#else
  return false;
#endif
}

at::Tensor gguf_linear(const at::Tensor& x_in, const at::Tensor& blocks, const at::Tensor& segments,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu(), "gguf_linear: x must be a 2-d CPU tensor, got ",
              x_in.sizes());
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 1 && blocks.is_contiguous(),
              "gguf_linear: blocks must be a contiguous 1-d uint8 tensor");
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(1) == 3 &&
                  segments.size(0) > 0,
              "gguf_linear: segments must be int64 [S, 3] (type, rows, byte offset), got ", segments.sizes());
  const int64_t t_rows = x_in.size(0), in = x_in.size(1);
  TORCH_CHECK(in % 32 == 0, "gguf_linear: in_features ", in, " not a multiple of 32");
  const at::Tensor seg = segments.contiguous();
  const int64_t* sp = seg.data_ptr<int64_t>();
  std::vector<Segment> segs;
  int64_t out = 0;
  for (int64_t i = 0; i < seg.size(0); ++i) {
    Segment s{sp[3 * i], {}, sp[3 * i + 1], nullptr, 0, out};
    TORCH_CHECK(type_info(s.type, &s.info), "gguf_linear: GGML type ", s.type, " is not supported");
    TORCH_CHECK(in % s.info.weights == 0, "gguf_linear: in_features ", in, " not a multiple of the type's block of ",
                s.info.weights);
    s.row_bytes = in / s.info.weights * s.info.bytes;
    TORCH_CHECK(s.rows >= 0 && sp[3 * i + 2] >= 0 && sp[3 * i + 2] + s.rows * s.row_bytes <= blocks.numel(),
                "gguf_linear: segment ", i, " passes the end of the blocks");
    s.data = blocks.data_ptr<uint8_t>() + sp[3 * i + 2];
    out += s.rows;
    segs.push_back(s);
  }
  if (bias.has_value())
    TORCH_CHECK(bias->numel() == out, "gguf_linear: bias of ", bias->numel(), " values for ", out, " outputs");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  QuantizedX qx;
  const bool any_k = std::any_of(segs.begin(), segs.end(), [](const Segment& g) { return is_k_quant(g.type); });
  const bool any_32 = std::any_of(segs.begin(), segs.end(), [](const Segment& g) { return !is_k_quant(g.type); });
  if (any_32) quantize_x32(x.data_ptr<float>(), t_rows, in, &qx);
  if (any_k) quantize_x256(x.data_ptr<float>(), t_rows, in, &qx);
  at::Tensor y = at::empty({t_rows, out}, x.options());
  float* yp = y.data_ptr<float>();
  // ~64K weights a task: a small layer stays on the calling thread.
  const int64_t grain = std::max<int64_t>(1, 65536 / in);
  at::parallel_for(0, out, grain, [&](int64_t begin, int64_t end) {
    for (const Segment& s : segs) {
      const int64_t r0 = std::max(begin, s.first_row) - s.first_row;
      const int64_t r1 = std::min(end, s.first_row + s.rows) - s.first_row;
      if (r0 < r1) run_segment(s, r0, r1, qx, t_rows, in, yp, out);
    }
  });
  if (bias.has_value()) y.add_(*bias);
  return y.scalar_type() == x_in.scalar_type() ? y : y.to(x_in.scalar_type());
}

}  // namespace tandem_cpu
