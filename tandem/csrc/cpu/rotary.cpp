// Rotary position embedding, NeoX style (rotate-half), in one pass: the CPU path's torch ops
// (x * cos2 + roll(x, D/2) * sin2, a cast) dispatch five ops per layer and step, each waking
// torch's thread pool at decode sizes.
//
// Same arithmetic as tandem.layers.rotary's torch path, bit for bit: each product rounded to
// fp32, their sum rounded, then the cast to x's dtype (the build turns FMA contraction off).
#include "ops.h"

#include <ATen/Parallel.h>

namespace {

constexpr int64_t kRowsPerTask = 16;

template <typename T>
void rotate_row(const T* x, const float* c, const float* s, int64_t half, T* out) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
    const float a = x1 * c[i], b = x2 * s[i];
    const float d = x2 * c[i], e = x1 * s[i];
    out[i] = static_cast<T>(a - b);
    out[i + half] = static_cast<T>(d + e);
  }
}

}  // namespace

namespace tandem_cpu {

at::Tensor rotary_embedding_neox(const at::Tensor& positions_in, const at::Tensor& x_in, const at::Tensor& cos_in,
                                 const at::Tensor& sin_in) {
  TORCH_CHECK(x_in.device().is_cpu() && positions_in.device().is_cpu() && cos_in.device().is_cpu(),
              "rotary_embedding_neox: CPU tensors only");
  TORCH_CHECK(x_in.dim() == 3, "rotary_embedding_neox: x must be [T, H, D], got ", x_in.sizes());
  const int64_t t = x_in.size(0), h = x_in.size(1), d = x_in.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0, "rotary_embedding_neox: head_dim ", d, " must be even");
  TORCH_CHECK(positions_in.dim() == 1 && positions_in.size(0) == t && positions_in.scalar_type() == at::kLong,
              "rotary_embedding_neox: positions must be [", t, "] int64, got ", positions_in.sizes(), " ",
              positions_in.scalar_type());
  TORCH_CHECK(cos_in.dim() == 2 && cos_in.size(1) == half && cos_in.scalar_type() == at::kFloat &&
                  sin_in.sizes() == cos_in.sizes() && sin_in.scalar_type() == at::kFloat,
              "rotary_embedding_neox: cos and sin must be float32 [max_positions, ", half, "], got ", cos_in.sizes(),
              " ", cos_in.scalar_type(), " and ", sin_in.sizes(), " ", sin_in.scalar_type());
  const at::Tensor x = x_in.stride(2) == 1 ? x_in : x_in.contiguous();
  const at::Tensor positions = positions_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const int64_t max_pos = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < max_pos, "rotary_embedding_neox: position ", pos[i], " outside [0, ",
                max_pos, ")");
  at::Tensor out = at::empty({t, h, d}, x.options());
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_embedding_neox", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    at::parallel_for(0, t, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        for (int64_t j = 0; j < h; ++j)
          rotate_row(xp + i * s0 + j * s1, cp + pos[i] * half, sp + pos[i] * half, half, op + (i * h + j) * d);
    });
  });
  return out;
}

}  // namespace tandem_cpu
