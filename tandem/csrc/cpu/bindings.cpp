// Registers the kernels of this folder as torch.ops.tandem_cpu.* (CPU dispatch key only).
#include "ops.h"

#include <torch/library.h>

TORCH_LIBRARY(tandem_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_embedding_neox(Tensor positions, Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("paged_attention_decode(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale) "
        "-> Tensor");
  m.def("gguf_vnni() -> bool", &tandem_cpu::gguf_vnni);  // no tensor to dispatch on
  m.def("gguf_repack(Tensor blocks, Tensor segments, int in_features) -> (Tensor, Tensor)");
  m.def("gguf_repacked_linear(Tensor x, Tensor repacked, Tensor segments, Tensor? bias) -> Tensor");
  m.def("gguf_repacked_width(Tensor repacked, Tensor segments) -> int");
  m.def("gguf_repacked_get_rows(Tensor repacked, Tensor segments, Tensor ids, int cols, ScalarType dtype) -> Tensor");
  m.def("decoder_layer_decode(Tensor hidden, Tensor? residual, Tensor positions, Tensor slot_mapping, "
        "Tensor(a!) kv_cache, Tensor block_tables, Tensor seq_lens, Tensor cos, Tensor sin, Tensor[] weights, "
        "int num_heads, int num_kv_heads, int group_size, float eps, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("rms_norm", &tandem_cpu::rms_norm);
  m.impl("fused_add_rms_norm", &tandem_cpu::fused_add_rms_norm);
  m.impl("rotary_embedding_neox", &tandem_cpu::rotary_embedding_neox);
  m.impl("silu_and_mul", &tandem_cpu::silu_and_mul);
  m.impl("paged_attention_decode", &tandem_cpu::paged_attention_decode);
  m.impl("gguf_repack", &tandem_cpu::gguf_repack);
  m.impl("gguf_repacked_linear", &tandem_cpu::gguf_repacked_linear);
  m.impl("gguf_repacked_width", &tandem_cpu::gguf_repacked_width);
  m.impl("gguf_repacked_get_rows", &tandem_cpu::gguf_repacked_get_rows);
  m.impl("decoder_layer_decode", &tandem_cpu::decoder_layer_decode);
}
