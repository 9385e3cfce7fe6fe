"""DP=4 + EP=4 over gloo (4 processes; issue 19's CPU part): greedy tokens equal one
process for

* a DeepSeek-V2-style model (MLA, routed + shared experts, a dense first layer) over
  ``all_to_all``, DBO off and on (the same tokens both ways), and
* a Qwen3-MoE model with 10 experts, placed 3, 3, 2, 2 over the ranks, over
  ``allgather_reducescatter`` with DBO on,

each through workloads that leave one, two or three replicas idle for some steps (fewer
live requests than replicas), while the busy ones prefill or decode batches large enough to
split into two ubatches. With 4 or 8 GPUs the same workloads run over NCCL with decode CUDA
graphs and DBO against one GPU.
"""

from __future__ import annotations

import json

import pytest
import torch

from tandem.sampling_params import SamplingParams
from tests.distributed.conftest import CONFIGS, ENGINE, GREEDY, PROMPTS, generate_ids, make_llm

DP4 = dict(data_parallel_size=4, enable_expert_parallel=True, block_size=8, num_kv_blocks=256)
DBO = dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=8)
# Least-outstanding routing, ties to the lowest replica: request i of a batch on an idle
# deployment goes to replica i % 4.
SHORT_2_3 = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (10, 10, 2, 2, 10, 10)]
WORKLOADS = {
    "mixed": (PROMPTS, GREEDY),  # 2, 2, 1, 1 requests per replica
    # Replicas 2 and 3 finish after 2 tokens and idle while 0 and 1 decode two sequences each.
    "two_idle": (PROMPTS, SHORT_2_3),
    # Replica 3 idle from the start, the others prefill 23, 11 and 37 tokens.
    "one_idle": ([PROMPTS[1], PROMPTS[2], PROMPTS[4]], GREEDY),
    "three_idle": (PROMPTS[4:5], GREEDY),
}


def _run(llm) -> dict[str, list[list[int]]]:
    return {name: generate_ids(llm, prompts, params) for name, (prompts, params) in WORKLOADS.items()}


def _single_process(model: str, tokenizer: str) -> dict[str, list[list[int]]]:
    llm = make_llm(model, tokenizer=tokenizer, block_size=8, num_kv_blocks=256)
    try:
        return _run(llm)
    finally:
        llm.engine.shutdown()


def _dp4(model: str, tokenizer: str, **kwargs) -> tuple[dict[str, list[list[int]]], dict]:
    llm = make_llm(model, tokenizer=tokenizer, **DP4, **kwargs)  # LLM runs DP itself when dp * tp > 1
    try:
        info = llm.engine.rank0_info["parallel"]
        assert (info.dp_size, info.ep_size, info.world_size) == (4, 4, 4)
        got = _run(llm)
    finally:
        llm.engine.shutdown()
    return got, llm.engine.final_stats


def test_dp4_ep4_deepseek_v2_all_to_all_dbo_off_and_on(model_dir, word_tokenizer):
    model = model_dir("deepseek_v2")
    want = _single_process(model, word_tokenizer)
    off, off_stats = _dp4(model, word_tokenizer, all2all_backend="all_to_all")
    on, on_stats = _dp4(model, word_tokenizer, all2all_backend="all_to_all", **DBO)
    assert off == want
    assert on == want
    assert off_stats["num_dbo_steps"] == 0
    # Every step above that splits has an idle replica: it must follow the busy ones.
    assert on_stats["num_dbo_steps"] > 0


def test_dp4_ep4_qwen3_moe_uneven_experts_allgather_dbo(tmp_path, word_tokenizer):
    (tmp_path / "config.json").write_text(json.dumps({**CONFIGS["qwen3_moe"], "num_experts": 10}))
    model = str(tmp_path)
    want = _single_process(model, word_tokenizer)
    got, stats = _dp4(model, word_tokenizer, all2all_backend="allgather_reducescatter", **DBO)
    assert got == want
    assert stats["num_dbo_steps"] > 0


@pytest.mark.parametrize("dp", [4, 8])
def test_dp_ep_decode_cuda_graphs_with_dbo_on_gpus(model_dir, dp):
    """DP=EP=4 or 8 over NCCL, decode CUDA graphs (all-to-alls captured), every step of 2+
    decode or 8+ prefill tokens split: the workloads above give one GPU's greedy tokens."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < dp:
        pytest.skip(f"needs {dp} GPUs")
    from tandem.entrypoints.llm import LLM
    from tests.distributed.test_data_parallel import _gpu_tokenizer

    model = model_dir("deepseek_v2")
    gpu = dict(ENGINE, device="cuda", tokenizer=_gpu_tokenizer(), enforce_eager=False, max_num_seqs=16, block_size=8,
               num_kv_blocks=256)
    ref = LLM(model=model, **gpu)
    try:
        want = _run(ref)
    finally:
        ref.engine.shutdown()
    llm = LLM(model=model, data_parallel_size=dp, enable_expert_parallel=True, all2all_backend="all_to_all",
              dbo_measure_split=False, **DBO, **gpu)
    try:
        assert _run(llm) == want
    finally:
        llm.engine.shutdown()
    assert llm.engine.final_stats["num_dbo_steps"] > 0
