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
// Q6_K 6.56, Q8_0 8.5). An output value depends on its row of x only (batch-invariant); the
// only error besides fp32 rounding is x's int8 rounding. A call of more than kRowTile rows
// runs the GEMM of gguf_gemm.cpp instead (its own arithmetic, not these bits).
//
// The weight is one flat uint8 tensor of segments of rows (a fused layer's parts, each of its
// own type): `segments` [S, 3] int64 holds each one's GGML type id, row count and byte offset.
// Without AVX512-VNNI the same arithmetic runs as scalar code (for tests; slow).
#include "gguf_quants.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

using namespace tandem_cpu::gguf;

// Rows of x multiplied per pass over a weight row (their accumulators stay in registers); a
// call with more rows runs the GEMM (gguf_gemm.cpp), faster from about there on.
constexpr int kRowTile = 4;

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
  const LinearCall call = parse_linear(x_in, blocks, segments, bias, "gguf_linear");
  if (x_in.size(0) > kRowTile) return gemm(x_in, call, bias);
  const std::vector<Segment>& segs = call.segs;
  const int64_t t_rows = x_in.size(0), in = x_in.size(1), out = call.out;
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
  return finish_linear(y, bias, x_in.scalar_type());
}

}  // namespace tandem_cpu
