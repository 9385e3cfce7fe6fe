// The decoder's RMSNorms on the CPU, one pass each (tandem/layers/cpu_ops.py builds and loads
// this folder; bindings.cpp registers the ops). torch's F.rms_norm dispatches several ops per call, and at decode sizes each one
// that enters an OpenMP region wakes the pool's other threads: ~30 us per norm inside a decode
// step, for 576 values. Here a task of up to kRowsPerTask rows runs on the calling thread.
//
// Same arithmetic as the torch references in tandem/layers/fused_ops.py (transformers' order):
// fp32 math; the residual sum rounded to the input dtype before it is normalized; the normalized
// value rounded to the input dtype before the weight multiplies, the product rounded again. Only
// the order of the sum of squares differs (eight fp32 partial sums), so fp32 results may differ
// from torch's in the last bits.
#include "convert.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kRowsPerTask = 16;

using tandem_cpu::round_to;

// rsqrt(mean(r^2) + eps) of one fp32 row.
inline float inv_rms(const float* r, int64_t n, float eps) {
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) part[j] += r[i + j] * r[i + j];
  float sum = 0.f;
  for (int j = 0; j < 8; ++j) sum += part[j];
  for (; i < n; ++i) sum += r[i] * r[i];
  return 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
}

// out = round(w * round(r * inv_rms(r))) for one row given in fp32.
template <typename T>
inline void norm_row(const float* r, const T* w, int64_t n, float eps, T* out) {
  const float inv = inv_rms(r, n, eps);
  for (int64_t i = 0; i < n; ++i) {
    const float y = static_cast<float>(round_to<T>(r[i] * inv));
    out[i] = round_to<T>(static_cast<float>(w[i]) * y);
  }
}

void check(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, ": CPU tensors only, got ", x.device());
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dim");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.scalar_type() == x.scalar_type(), op,
              ": weight must be [", x.size(-1), "] of x's dtype ", x.scalar_type(), ", got ", weight.sizes(), " ",
              weight.scalar_type());
}

}  // namespace

namespace tandem_cpu {

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  check("rms_norm", x_in, weight_in);
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      std::vector<float> r(n);
      for (int64_t row = begin; row < end; ++row) {
        for (int64_t i = 0; i < n; ++i) r[i] = static_cast<float>(xp[row * n + i]);
        norm_row(r.data(), wp, n, static_cast<float>(eps), op + row * n);
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x_in, const at::Tensor& residual_in,
                                                      const at::Tensor& weight_in, double eps) {
  check("fused_add_rms_norm", x_in, weight_in);
  TORCH_CHECK(residual_in.sizes() == x_in.sizes() && residual_in.scalar_type() == x_in.scalar_type() &&
                  residual_in.device().is_cpu(),
              "fused_add_rms_norm: residual ", residual_in.sizes(), " ", residual_in.scalar_type(), " for x ",
              x_in.sizes(), " ", x_in.scalar_type());
  const at::Tensor x = x_in.contiguous(), residual = residual_in.contiguous(), weight = weight_in.contiguous();
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor sum = at::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      std::vector<float> r(n);
      for (int64_t row = begin; row < end; ++row) {
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t s =
              round_to<scalar_t>(static_cast<float>(xp[row * n + i]) + static_cast<float>(rp[row * n + i]));
          sp[row * n + i] = s;
          r[i] = static_cast<float>(s);
        }
        norm_row(r.data(), wp, n, static_cast<float>(eps), op + row * n);
      }
    });
  });
  return {out, sum};
}

}  // namespace tandem_cpu
