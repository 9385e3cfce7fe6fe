"""Tandem vs transformers continuous batching on a Llama-3.1-8B-shaped bf16 model with random
weights, in one go on one GPU (issues 3 and 4).

Runs, each in its own process so that every engine gets the whole GPU:
  1. ``tandem bench throughput`` with ``--async-output-proc`` (CUDA graphs on);
  2. the same with ``--no-async-output-proc``;
  3. transformers ``generate_batch`` (continuous batching, ``attn_implementation="paged|sdpa"``,
     CUDA graphs on) on ``--hf-num-prompts`` prompts, scaled to requests/s.
Workload: ``--num-prompts`` random prompts, input 128, output 256, greedy, EOS ignored.
Also prints two floors of a decode step at the largest batch: HBM (matmul weights + KV
read once at peak bandwidth) and matmul-at-peak + KV (2 flops per matmul weight per token
at the bf16 tensor-core peak, plus the KV read).

    python benchmarks/gpu_llama8b.py --out DIR [--num-prompts 1000] [--hf-num-prompts 200]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

from model_shapes import LLAMA_31_8B, seed_workload_command, write_config_dir

HBM_BYTES_PER_S = 4.8e12  # H200 peak HBM3e bandwidth
BF16_FLOPS_PER_S = 989e12  # H200 dense bf16 tensor-core peak (SXM datasheet)


def run_tandem(cfg_dir: str, out: str, async_on: bool, args) -> dict:
    path = os.path.join(out, f"tandem_{'on' if async_on else 'off'}.json")
    cmd = seed_workload_command(cfg_dir, path, "--async-output-proc" if async_on else "--no-async-output-proc",
                                num_prompts=args.num_prompts, max_num_seqs=args.max_num_seqs)
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    with open(path) as f:
        return json.load(f)


def run_transformers(cfg_dir: str, args) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    cfg = AutoConfig.from_pretrained(cfg_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="paged|sdpa", dtype=torch.bfloat16)
    model.eval()
    gen = GenerationConfig(max_new_tokens=256, do_sample=False, eos_token_id=None, pad_token_id=0)
    kwargs = {}
    try:
        from transformers import ContinuousBatchingConfig  # transformers >= 5.2x

        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(use_cuda_graph=True, max_memory_percent=0.5)
        graphs = "ContinuousBatchingConfig(use_cuda_graph=True, max_memory_percent=0.5)"
    except ImportError:
        gen.use_cuda_graph = True
        graphs = "GenerationConfig.use_cuda_graph=True"
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1000, cfg.vocab_size, (args.hf_num_prompts, 128), generator=g).tolist()
    # no_grad, not inference_mode: generate_batch's worker thread updates its own tensors in place.
    with torch.no_grad():
        model.generate_batch(inputs=prompts[:8], generation_config=gen, **kwargs)  # warm-up + graph capture
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = model.generate_batch(inputs=prompts, generation_config=gen, **kwargs)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    n_out = sum(len(o.generated_tokens) for o in outs.values())
    failed = sum(1 for o in outs.values() if getattr(o, "error", None))
    if failed or n_out == 0:
        raise RuntimeError(f"transformers generate_batch: {failed} failed requests, {n_out} tokens")
    return dict(num_prompts=args.hf_num_prompts, elapsed_s=elapsed, requests_per_s=args.hf_num_prompts / elapsed,
                output_tokens_per_s=n_out / elapsed, output_tokens=n_out, cuda_graphs=graphs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--hf-num-prompts", type=int, default=200)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--skip", default="", help="comma list of on,off,hf to skip")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cfg_dir = write_config_dir(LLAMA_31_8B, os.path.join(args.out, "llama31_8b"))
    skip = set(args.skip.split(","))
    res = {}
    if "on" not in skip:
        res["on"] = run_tandem(cfg_dir, args.out, True, args)
    if "off" not in skip:
        res["off"] = run_tandem(cfg_dir, args.out, False, args)
    if "hf" not in skip:
        try:
            res["hf"] = run_transformers(cfg_dir, args)
        except Exception as e:  # reported, not hidden: the table says why it is missing
            res["hf"] = {"error": f"{type(e).__name__}: {e}"}
    with open(os.path.join(args.out, "gpu_llama8b.json"), "w") as f:
        json.dump(res, f, indent=2)

    c = LLAMA_31_8B
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    # Weights of every matmul (the layers and the LM head), bf16. The input embedding is a
    # lookup: a decode step reads only its batch's rows of it, so neither floor counts it.
    matmul_weights = c["vocab_size"] * c["hidden_size"] + c["num_hidden_layers"] * (
        c["hidden_size"] * (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * head_dim
        + c["num_attention_heads"] * head_dim * c["hidden_size"] + 3 * c["hidden_size"] * c["intermediate_size"])
    weight_bytes = 2 * matmul_weights
    kv_bytes_per_token = 2 * 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim
    flops_per_token = 2 * matmul_weights  # one multiply-add per weight per decoded token
    print("\n| run | requests/s | output tok/s | GPU idle between steps | decode step (batch) | HBM floor "
          "| matmul-at-peak + KV floor |")
    print("|---|---|---|---|---|---|---|")
    for name in ("on", "off"):
        r = res.get(name)
        if not r:
            continue
        kv_bytes = kv_bytes_per_token * (r.get("max_batch_context_tokens") or 0)
        floor = (weight_bytes + kv_bytes) / HBM_BYTES_PER_S * 1e3
        compute_floor = (flops_per_token * (r.get("max_decode_batch") or 0) / BF16_FLOPS_PER_S
                         + kv_bytes / HBM_BYTES_PER_S) * 1e3
        idle = r.get("gpu_idle_fraction")
        print(f"| tandem async_output_proc={name} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.0f} | "
              f"{100 * idle:.2f}% | {r.get('decode_step_ms_at_max_batch') or 0:.2f} ms ({r.get('max_decode_batch')}) | "
              f"{floor:.2f} ms | {compute_floor:.2f} ms |" if idle is not None
              else f"| tandem {name} | {r['requests_per_s']:.2f} | | | | | |")
    if "hf" in res:
        h = res["hf"]
        if "error" in h:
            print(f"| transformers generate_batch | failed: {h['error'][:200]} |")
        else:
            print(f"| transformers generate_batch ({h['num_prompts']} prompts) | {h['requests_per_s']:.2f} | "
                  f"{h['output_tokens_per_s']:.0f} | | | |")
    if "on" in res and "off" in res:
        print(f"\nasync on / off: {res['on']['requests_per_s'] / res['off']['requests_per_s']:.3f}x")
    if "on" in res and "hf" in res and "error" not in res["hf"]:
        print(f"tandem (on) / transformers: {res['on']['requests_per_s'] / res['hf']['requests_per_s']:.2f}x")


if __name__ == "__main__":
    main()
