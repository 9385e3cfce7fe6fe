// SiLU-and-mul (SwiGLU's activation) in one pass: the torch path's chunk, silu and mul are
// three dispatched ops (two of them passes over the data) per layer and step.
//
// silu(g) = g / (1 + e^-g) in fp32 (e^x by the polynomial of exp.h, not libm's, so the loop
// vectorizes), rounded to the input dtype, times u in fp32, rounded again: the torch path's
// roundings (F.silu(gate) * up), with an exp within ~2e-7 of libm's.
#include "convert.h"
#include "exp.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <vector>

namespace {

constexpr int64_t kRowsPerTask = 16;

template <typename T>
void silu_and_mul_row(const T* gate, const T* up, int64_t n, T* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = static_cast<float>(gate[i]);
    const T act = tandem_cpu::round_to<T>(g / (1.0f + tandem_cpu::exp_approx(-g)));
    out[i] = tandem_cpu::round_to<T>(static_cast<float>(act) * static_cast<float>(up[i]));
  }
}

}  // namespace

namespace tandem_cpu {

at::Tensor silu_and_mul(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.device().is_cpu(), "silu_and_mul: CPU tensors only, got ", x_in.device());
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) % 2 == 0, "silu_and_mul: the last dim must be even, got ",
              x_in.sizes());
  const at::Tensor x = x_in.stride(-1) == 1 && (x_in.dim() == 1 || x_in.is_contiguous()) ? x_in : x_in.contiguous();
  const int64_t two_i = x.size(-1), inter = two_i / 2, rows = two_i ? x.numel() / two_i : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = inter;
  at::Tensor out = at::empty(shape, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_and_mul_row(xp + r * two_i, xp + r * two_i + inter, inter, op + r * inter);
    });
  });
  return out;
}

}  // namespace tandem_cpu
