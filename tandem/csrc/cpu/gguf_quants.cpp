// The definitions of gguf_quants.h that are not inline.
#include "gguf_quants.h"

#include <ATen/Parallel.h>

namespace tandem_cpu::gguf {

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

// One group of 32 as quantize_group rounds it (the same bits: max of |v|, d = max / 127, v / d
// as v * (1 / d) rounded to nearest even), vectorized, with the sums of q per 16.
inline float quantize32(const float* v, int8_t* q, int* sums) {
#ifdef TANDEM_GGUF_VNNI
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  sums[0] = _mm512_reduce_add_epi32(qa);
  sums[1] = _mm512_reduce_add_epi32(qb);
  return d;
#else
  const float d = quantize_group(v, 32, q);
  sums[0] = sums[1] = 0;
  for (int j = 0; j < 32; ++j) sums[j / 16] += q[j];
  return d;
#endif
}

void quantize_x32(const float* x, int64_t t_rows, int64_t in, QuantizedX* qx) {
  QuantizedX& r = *qx;
  r.q.resize(t_rows * in);
  r.d.resize(t_rows * in / 32);
  r.qsum.resize(t_rows * in / 16);
  r.dsum32.resize(t_rows * in / 32);
  at::parallel_for(0, t_rows * in / 32, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      int sums[2];
      const float d = quantize32(x + 32 * b, r.q.data() + 32 * b, sums);
      r.d[b] = d;
      r.qsum[2 * b] = sums[0];
      r.qsum[2 * b + 1] = sums[1];
      r.dsum32[b] = d * (sums[0] + sums[1]);
    }
  });
}

void check_bytes(const at::Tensor& t, const char* name, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kByte && t.dim() == 1 && t.is_contiguous(), op, ": ", name,
              " must be a contiguous 1-d uint8 tensor");
}

at::Tensor segment_table(const at::Tensor& segments, const char* op) {
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(1) == 3 &&
                  segments.size(0) > 0,
              op, ": segments must be int64 [S, 3] (type, rows, byte offset), got ", segments.sizes());
  return segments.contiguous();
}

std::vector<Segment> parse_segments(const at::Tensor& blocks, const at::Tensor& segments, int64_t in, const char* op) {
  check_bytes(blocks, "blocks", op);
  const at::Tensor seg = segment_table(segments, op);
  const int64_t* sp = seg.data_ptr<int64_t>();
  std::vector<Segment> segs;
  int64_t out = 0;
  for (int64_t i = 0; i < seg.size(0); ++i) {
    Segment s{sp[3 * i], {}, sp[3 * i + 1], nullptr, 0, out};
    TORCH_CHECK(type_info(s.type, &s.info), op, ": GGML type ", s.type, " is not supported");
    TORCH_CHECK(in % s.info.weights == 0, op, ": in_features ", in, " not a multiple of the type's block of ",
                s.info.weights);
    s.row_bytes = in / s.info.weights * s.info.bytes;
    TORCH_CHECK(s.rows >= 0 && sp[3 * i + 2] >= 0 && sp[3 * i + 2] + s.rows * s.row_bytes <= blocks.numel(),
                op, ": segment ", i, " passes the end of the blocks");
    s.data = blocks.data_ptr<uint8_t>() + sp[3 * i + 2];
    out += s.rows;
    segs.push_back(s);
  }
  return segs;
}

at::Tensor finish_linear(at::Tensor y, const std::optional<at::Tensor>& bias, at::ScalarType dtype) {
  if (bias.has_value()) y.add_(*bias);
  return y.scalar_type() == dtype ? y : y.to(dtype);
}

}  // namespace tandem_cpu::gguf
