// One decoder layer of a Llama-family model for a decode step (one new token per request),
// its linear layers GGUF int4 layers (tandem.layers.quantization.gguf.GGUFInt4Linear) or dense
// ones: the layer's ~25 dispatched ops and ~12 Python module calls in one op. It runs the same kernels in
// the same order as the model's Python forward in fused-ops mode `cpu` (norm.cpp, rotary.cpp,
// paged_attention.cpp, activation.cpp, torch's int4 GEMM), so its results are the same bits.
#include "ops.h"

#include <cstring>
#include <optional>

namespace {

// Weights, in this order (tandem/models/cpu_decode.py builds the list): the input norm's and
// the post-attention norm's weights, then three tensors for each of qkv_proj, o_proj,
// gate_up_proj and down_proj: an int4 layer's (packed planes, scales and zeros, bias or an
// empty tensor), a GGUF block layer's (repacked tiles, int64 segments, bias or an empty tensor), or a
// dense layer's (weight, an empty tensor, bias or an empty tensor).
constexpr int64_t kNumWeights = 14;

// A linear layer as its Python module computes it. int4 (GGUFInt4Linear._int4): the planes'
// products summed in bf16, cast back, the bias added. Blocks (GGUFBlockLinear): gguf_repacked_linear.
// Dense (ColumnShardedLinear /
// RowParallelLinear at one rank, not deterministic): F.linear, with the bias inside for a
// column layer (`column`), added after it for a row layer.
at::Tensor linear(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias,
                  int64_t group_size, bool column) {
  if (b.numel() == 0) {
    if (column) return at::linear(x, a, bias.numel() ? std::optional<at::Tensor>(bias) : std::nullopt);
    const at::Tensor y = at::linear(x, a);
    return bias.numel() ? y + bias : y;
  }
  if (b.scalar_type() == at::kLong)
    return tandem_cpu::gguf_repacked_linear(x, a, b, bias.numel() ? std::optional<at::Tensor>(bias) : std::nullopt);
  const at::Tensor xb = (x.scalar_type() == at::kBFloat16 ? x : x.to(at::kBFloat16)).contiguous();
  at::Tensor y = at::_weight_int4pack_mm_for_cpu(xb, a[0], group_size, b[0]);
  for (int64_t p = 1; p < a.size(0); ++p) y.add_(at::_weight_int4pack_mm_for_cpu(xb, a[p], group_size, b[p]));
  if (y.scalar_type() != x.scalar_type()) y = y.to(x.scalar_type());
  return bias.numel() ? y + bias : y;
}

// The new tokens' keys and values into their cache slots (the backend's index_copy_ of both
// planes); a negative slot is padding, written nowhere.
void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  const int64_t t = k.size(0), row = k.size(1) * k.size(2), slots = kv_cache.size(1) * kv_cache.size(2);
  const at::Tensor kc = k.contiguous(), vc = v.contiguous(), sm = slot_mapping.contiguous();
  const int64_t* sp = sm.data_ptr<int64_t>();
  const int64_t elem = kv_cache.element_size();
  auto* base = static_cast<char*>(kv_cache.data_ptr());
  const auto* kp = static_cast<const char*>(kc.data_ptr());
  const auto* vp = static_cast<const char*>(vc.data_ptr());
  for (int64_t i = 0; i < t; ++i) {
    if (sp[i] < 0) continue;
    TORCH_CHECK(sp[i] < slots, "decoder_layer_decode: slot ", sp[i], " outside the cache's ", slots);
    std::memcpy(base + sp[i] * row * elem, kp + i * row * elem, row * elem);
    std::memcpy(base + (slots + sp[i]) * row * elem, vp + i * row * elem, row * elem);
  }
}

}  // namespace

namespace tandem_cpu {

std::tuple<at::Tensor, at::Tensor> decoder_layer_decode(
    const at::Tensor& hidden, const std::optional<at::Tensor>& residual, const at::Tensor& positions,
    const at::Tensor& slot_mapping, const at::Tensor& kv_cache, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, const at::Tensor& cos, const at::Tensor& sin, at::TensorList w, int64_t num_heads,
    int64_t num_kv_heads, int64_t group_size, double eps, double scale) {
  TORCH_CHECK(static_cast<int64_t>(w.size()) == kNumWeights, "decoder_layer_decode: ", kNumWeights,
              " weight tensors expected, got ", w.size());
  TORCH_CHECK(hidden.dim() == 2 && kv_cache.dim() == 5 && kv_cache.is_contiguous() &&
                  kv_cache.scalar_type() == hidden.scalar_type() && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.numel() == hidden.size(0),
              "decoder_layer_decode: hidden [T, H], a contiguous 5-d cache of its dtype and T int64 slots expected");
  const int64_t t = hidden.size(0), d = kv_cache.size(4), q_size = num_heads * d, kv_size = num_kv_heads * d;
  at::Tensor x, res;
  if (residual.has_value()) {
    std::tie(x, res) = fused_add_rms_norm(hidden, *residual, w[0], eps);
  } else {
    x = rms_norm(hidden, w[0], eps);
    res = hidden;
  }
  const at::Tensor qkv = linear(x, w[2], w[3], w[4], group_size, true);
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "decoder_layer_decode: qkv_proj gives ", qkv.size(1),
              " values, heads need ", q_size + 2 * kv_size);
  const at::Tensor qk = rotary_embedding_neox(positions, qkv.narrow(1, 0, q_size + kv_size).view({t, -1, d}), cos,
                                              sin);
  write_kv(qk.narrow(1, num_heads, num_kv_heads), qkv.narrow(1, q_size + kv_size, kv_size).view({t, num_kv_heads, d}),
           kv_cache, slot_mapping);
  const at::Tensor o = paged_attention_decode(qk.narrow(1, 0, num_heads), kv_cache, block_tables, seq_lens, scale);
  const at::Tensor h = linear(o.view({t, q_size}), w[5], w[6], w[7], group_size, false);
  auto [mlp_in, res2] = fused_add_rms_norm(h, res, w[1], eps);
  const at::Tensor act = silu_and_mul(linear(mlp_in, w[8], w[9], w[10], group_size, true));
  return {linear(act, w[11], w[12], w[13], group_size, false), res2};
}

}  // namespace tandem_cpu
