// Rows of a GGUF block tensor dequantized (llama.cpp's get_rows): the token embedding of a
// model that keeps the file's blocks. Each value is s u + o from the blocks' decoding
// (gguf_quants.h), the product exact in fp32 and one rounding at the sum, which is the value
// gguf's own dequantization gives (its products are exact too), so the rows equal the
// dequantized embedding's.
#include "gguf_quants.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

namespace {

using namespace tandem_cpu::gguf;

// A group's 32 values: s u + o, with s and o per half of 16.
inline void put(const U32& u, const float* s, const float* o, float* dst) {
  uint8_t v[32];
#ifdef TANDEM_GGUF_VNNI
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(v), u);
#else
  std::memcpy(v, u.v, 32);
#endif
  for (int j = 0; j < 32; ++j) dst[j] = s[j / 16] * static_cast<float>(v[j]) + o[j / 16];
}

template <int64_t Type>
void dequantize_row(const Segment& seg, const uint8_t* row, int64_t cols, float* dst) {
  if constexpr (is_k_quant(Type)) {
    KBlock kb;
    for (int64_t blk = 0; blk < cols / 256; ++blk) {
      expand_k<Type>(row + blk * seg.info.bytes, &kb);
      for (int g = 0; g < 8; ++g) {
        const int h = Type == kQ6_K ? 2 * g : g;  // off per 16 (Q6_K) or per 32
        const float sc[2] = {kb.d * kb.sc[g][0], kb.d * kb.sc[g][1]};
        const float off[2] = {kb.off[h], kb.off[Type == kQ6_K ? h + 1 : h]};
        put(kb.u[g], sc, off, dst + 256 * blk + 32 * g);
      }
    }
  } else {
    for (int64_t blk = 0; blk < cols / 32; ++blk) {
      float s, o;
      const U32 u = expand32<Type>(row + blk * seg.info.bytes, &s, &o);
      const float ss[2] = {s, s}, oo[2] = {o, o};
      put(u, ss, oo, dst + 32 * blk);
    }
  }
}

void dequantize(const Segment& seg, const uint8_t* row, int64_t cols, float* dst) {
  switch (seg.type) {
    case kQ4_0: return dequantize_row<kQ4_0>(seg, row, cols, dst);
    case kQ4_1: return dequantize_row<kQ4_1>(seg, row, cols, dst);
    case kQ5_0: return dequantize_row<kQ5_0>(seg, row, cols, dst);
    case kQ5_1: return dequantize_row<kQ5_1>(seg, row, cols, dst);
    case kQ8_0: return dequantize_row<kQ8_0>(seg, row, cols, dst);
    case kQ4_K: return dequantize_row<kQ4_K>(seg, row, cols, dst);
    case kQ5_K: return dequantize_row<kQ5_K>(seg, row, cols, dst);
    default: return dequantize_row<kQ6_K>(seg, row, cols, dst);
  }
}

}  // namespace

namespace tandem_cpu {

at::Tensor gguf_get_rows(const at::Tensor& blocks, const at::Tensor& segments, const at::Tensor& ids, int64_t cols,
                         at::ScalarType dtype) {
  TORCH_CHECK(ids.dim() == 1 && !at::isFloatingType(ids.scalar_type()), "gguf_get_rows: ids must be 1-d integers, got ",
              ids.sizes(), " ", ids.scalar_type());
  TORCH_CHECK(cols > 0 && cols % 32 == 0, "gguf_get_rows: cols ", cols, " not a positive multiple of 32");
  const std::vector<Segment> segs = parse_segments(blocks, segments, cols, "gguf_get_rows");
  int64_t rows = 0;
  for (const Segment& s : segs) rows += s.rows;
  const at::Tensor idx = ids.to(at::kLong).contiguous();
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < idx.numel(); ++t)
    TORCH_CHECK(ip[t] >= 0 && ip[t] < rows, "gguf_get_rows: id ", ip[t], " outside the ", rows, " rows");
  at::Tensor out = at::empty({idx.numel(), cols}, blocks.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  at::parallel_for(0, idx.numel(), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (const Segment& s : segs) {
        if (ip[t] < s.first_row + s.rows) {
          dequantize(s, s.data + (ip[t] - s.first_row) * s.row_bytes, cols, op + t * cols);
          break;
        }
      }
    }
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}

}  // namespace tandem_cpu
