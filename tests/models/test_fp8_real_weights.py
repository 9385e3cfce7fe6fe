"""FP8 vs bf16 on real weights: the embedded SmolLM2-135M (GGUF, dequantized) and, opt-in
(``TANDEM_QWEN_GGUF``), Qwen2.5-Coder-0.5B-Instruct quantized online to FP8 (W8A8,
per-channel / per-token) give logits close to the bf16 model's, with and without an FP8 KV
cache, and mostly the same greedy tokens (CUDA sm89+: the FP8 GEMMs run on cuBLASLt)."""

from __future__ import annotations

import pytest
import torch

from tandem import envs

from tests.conftest import PROMPTS
from tests.models.paged_parity import step_metadata

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="FP8 GEMMs need CUDA sm89+")
# Measured on the CPU (fp32 vs FP8, torch backend, 81 prompt positions): mean cosine
# similarity of the logit rows 0.990, worst 0.88, argmax agreement 0.926 (FP8 KV cache:
# 0.990 / 0.89 / 0.914). Stated bounds:
MIN_MEAN_COS, MIN_ARGMAX_AGREE = 0.98, 0.85
# Every row: each model's top token among the other's top 5 (vLLM's check_logprobs_close
# criterion), which near-ties pass and a broken row does not.
TOP_K = 5
# The worst single row of the embedded SmolLM2 (Q4_1, 135M) is chaotic under FP8 + bf16:
# one-ulp changes in a few activations move it by 0.07 and it ranges 0.52-0.93 across
# devices and accumulation modes (benchmarks/RESULTS.md, session 13), so only the larger
# Qwen is held to a worst-row bound (measured 0.967-0.980).
MIN_WORST_COS_QWEN = 0.8
# Greedy continuations diverge once one near-tie flips; a quarter of the tokens before the
# first difference is far above what a broken FP8 path gives (a wrong first token).
MIN_GREEDY_AGREE = 0.25


def logits_fp8_vs_reference(device: str, dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                            path: str | None = None):
    """Prefill logits of PROMPTS: (FP8 model, reference model in ``dtype``), both [T, vocab]
    fp32, of the model at ``path`` (default: the embedded SmolLM2)."""
    from tandem.attention.selector import get_attention_backend
    from tandem.config import embedded_default_model
    from tandem.layers.quantization.config import Fp8Config
    from tandem.model_loader.loader import build_model, load_hf_config, load_tokenizer

    path = path or embedded_default_model()
    cfg, tok = load_hf_config(path), load_tokenizer(path)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    out = []
    for quant in (Fp8Config(), None):
        dev = torch.device(device)
        model = build_model(cfg, path, "auto", get_attention_backend(dev), dtype, dev, 512, quant_config=quant)
        heads, dim = model.kv_cache_shape_per_block
        bs, tables, nxt = 16, [], 1
        for p in prompts:
            n = -(-len(p) // bs)
            tables.append(list(range(nxt, nxt + n)))
            nxt += n
        kv = [torch.zeros(2, nxt, bs, heads, dim, dtype=kv_dtype if quant else dtype, device=dev)
              for _ in model.layers]
        meta = step_metadata([len(p) for p in prompts], [0] * len(prompts), tables, bs, dev)
        ids = torch.tensor([t for p in prompts for t in p], device=dev)
        pos = torch.cat([torch.arange(len(p), device=dev) for p in prompts])
        with torch.no_grad():
            out.append(model.compute_logits(model(ids, pos, kv, meta)).float().cpu())
        del model, kv
    return out[0], out[1]


def closeness(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float, float, float]:
    """(mean and worst cosine similarity of the logit rows, share of rows with the same
    argmax, share of rows whose argmax each lies in the other's top ``TOP_K``)."""
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    a, b = got.argmax(-1, keepdim=True), want.argmax(-1, keepdim=True)
    in_top = ((want.topk(TOP_K, -1).indices == a).any(-1) & (got.topk(TOP_K, -1).indices == b).any(-1))
    return (cos.mean().item(), cos.min().item(), (a == b).float().mean().item(), in_top.float().mean().item())


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_smollm2_fp8_logits_close_to_bf16(kv):
    got, want = logits_fp8_vs_reference("cuda", torch.bfloat16,
                                        torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16)
    mean_cos, worst_cos, agree, in_top = closeness(got, want)
    print(f"kv={kv}: mean cos {mean_cos:.4f}, worst {worst_cos:.4f}, argmax agreement {agree:.3f}, "
          f"top-{TOP_K} containment {in_top:.3f}")
    assert mean_cos >= MIN_MEAN_COS and agree >= MIN_ARGMAX_AGREE and in_top == 1.0


def test_smollm2_fp8_engine_cuda_graphs_equal_eager():
    """The engine with online FP8 and an FP8 KV cache: decode through CUDA graphs gives the
    eager run's greedy tokens."""
    from tandem import LLM, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runs = []
    for eager in (True, False):
        llm = LLM(quantization="fp8", kv_cache_dtype="fp8", enforce_eager=eager, max_model_len=512,
                  gpu_memory_utilization=0.3)
        runs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)])
        llm.engine.shutdown()
        del llm
        torch.cuda.empty_cache()
    assert runs[0] == runs[1]


def greedy_agreement(model: str, num_tokens: int = 64) -> float:
    """Share of greedy tokens (PROMPTS, ``num_tokens`` each) that the FP8 engine produces
    identical to the bf16 engine's at the same position, counted up to each request's first
    difference (after one, the two continue from different text)."""
    from tandem import LLM, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    runs = []
    for quant in (None, "fp8"):
        llm = LLM(model=model, quantization=quant, max_model_len=512, gpu_memory_utilization=0.3)
        runs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)])
        llm.engine.shutdown()
        del llm
        torch.cuda.empty_cache()
    same = 0
    for a, b in zip(*runs):
        same += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return same / (num_tokens * len(PROMPTS))


QWEN = envs.TANDEM_QWEN_GGUF


@pytest.mark.slow
@pytest.mark.skipif(not QWEN, reason="set TANDEM_QWEN_GGUF to run")
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_qwen_fp8_logits_close_to_bf16(kv):
    got, want = logits_fp8_vs_reference("cuda", torch.bfloat16,
                                        torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16, path=QWEN)
    mean_cos, worst_cos, agree, in_top = closeness(got, want)
    print(f"qwen kv={kv}: mean cos {mean_cos:.4f}, worst {worst_cos:.4f}, argmax agreement {agree:.3f}, "
          f"top-{TOP_K} containment {in_top:.3f}")
    assert mean_cos >= MIN_MEAN_COS and worst_cos >= MIN_WORST_COS_QWEN and agree >= MIN_ARGMAX_AGREE
    assert in_top == 1.0


@pytest.mark.slow
@pytest.mark.skipif(not QWEN, reason="set TANDEM_QWEN_GGUF to run")
def test_qwen_fp8_greedy_agreement():
    agree = greedy_agreement(QWEN)
    print(f"qwen FP8 vs bf16 greedy agreement (to the first difference): {agree:.3f}")
    assert agree >= MIN_GREEDY_AGREE
