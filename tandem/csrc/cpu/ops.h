// The CPU kernels of tandem/csrc/cpu, declared for bindings.cpp (which registers them as
// torch.ops.tandem_cpu.*); tandem/layers/cpu_ops.py documents each one.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace tandem_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps);

at::Tensor rotary_embedding_neox(const at::Tensor& positions, const at::Tensor& x, const at::Tensor& cos,
                                 const at::Tensor& sin);

at::Tensor silu_and_mul(const at::Tensor& x);

at::Tensor paged_attention_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale);

// Whether the GGUF kernels were built with AVX512-VNNI.
bool gguf_vnni();

std::tuple<at::Tensor, at::Tensor> gguf_repack(const at::Tensor& blocks, const at::Tensor& segments,
                                               int64_t in_features);

at::Tensor gguf_repacked_linear(const at::Tensor& x, const at::Tensor& repacked, const at::Tensor& segments,
                                const std::optional<at::Tensor>& bias);

int64_t gguf_repacked_width(const at::Tensor& repacked, const at::Tensor& segments);

at::Tensor gguf_repacked_get_rows(const at::Tensor& repacked, const at::Tensor& segments, const at::Tensor& ids,
                                  int64_t cols, at::ScalarType dtype);

std::tuple<at::Tensor, at::Tensor> decoder_layer_decode(
    const at::Tensor& hidden, const std::optional<at::Tensor>& residual, const at::Tensor& positions,
    const at::Tensor& slot_mapping, const at::Tensor& kv_cache, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, const at::Tensor& cos, const at::Tensor& sin, at::TensorList weights,
    int64_t num_heads, int64_t num_kv_heads, int64_t group_size, double eps, double scale);

}  // namespace tandem_cpu
