"""Pipeline parallelism below the engine (issue 50, stage 1): the layer split, the process
groups of a DP x PP x TP world over gloo, and a split Llama / Qwen2 whose stages, passing the
residual stream on, give transformers' logits (fp32, 1e-4) for a ragged prefill, decode steps
and a chunked step over the paged KV cache."""

from __future__ import annotations

import pytest
import torch

from tandem.distributed.pipeline import pp_layer_range
from tests.distributed._harness import run_ranks

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)


@pytest.mark.parametrize("layers,stages,want", [
    (8, 2, [(0, 4), (4, 8)]),
    (5, 3, [(0, 2), (2, 4), (4, 5)]),  # the extra layers go to the stages before the last
    (7, 4, [(0, 2), (2, 4), (4, 6), (6, 7)]),
    (3, 1, [(0, 3)]),
])
def test_layers_split_evenly_with_the_remainder_before_the_last_stage(layers, stages, want, monkeypatch):
    monkeypatch.delenv("TANDEM_PP_LAYER_PARTITION", raising=False)
    assert [pp_layer_range(layers, r, stages) for r in range(stages)] == want


def test_the_partition_variable_overrides_and_is_checked(monkeypatch):
    monkeypatch.setenv("TANDEM_PP_LAYER_PARTITION", "1,4")
    assert [pp_layer_range(5, r, 2) for r in range(2)] == [(0, 1), (1, 5)]
    with pytest.raises(ValueError, match="need 3 stage counts summing to the model's 5"):
        pp_layer_range(5, 0, 3)
    monkeypatch.setenv("TANDEM_PP_LAYER_PARTITION", "2,x")
    with pytest.raises(ValueError, match="TANDEM_PP_LAYER_PARTITION='2,x'"):
        pp_layer_range(5, 0, 2)
    monkeypatch.delenv("TANDEM_PP_LAYER_PARTITION")
    with pytest.raises(ValueError, match="pipeline_parallel_size 4 exceeds the model's 3"):
        pp_layer_range(3, 0, 4)


def _layout(rank, world, port, tp, pp, dp, ep):
    from tandem.distributed import parallel_state as ps

    info = ps.init_distributed(tp, dp, ep, pp_size=pp, rank=rank, world_size=world, master_port=port)
    try:
        return (info.dp_rank, info.pp_rank, info.tp_rank, info.ep_rank, info.is_driver, ps.get_tp_src_rank(),
                ps.get_pp_ranks(), ps.get_dp_ranks())
    finally:
        ps.destroy_distributed()


def test_process_groups_of_a_dp_pp_tp_world():
    """DP=2 x PP=2 x TP=2 (8 ranks): rank = (dp * pp + pp_rank) * tp + tp_rank; a pipeline
    is the ranks of one (dp, tp_rank); the driver is TP rank 0 of stage 0; EP spans a stage."""
    out = run_ranks(_layout, 8, 2, 2, 2, True, timeout=120)
    for r, (d, p, t, e, driver, src, pp_ranks, dp_ranks) in enumerate(out):
        assert r == (d * 2 + p) * 2 + t
        assert pp_ranks == tuple((d * 2 + q) * 2 + t for q in range(2))
        assert dp_ranks == tuple((k * 2 + p) * 2 + t for k in range(2))
        assert src == (d * 2 + p) * 2 and driver == (p == 0 and t == 0)
        assert e == d * 2 + t


def _stage(rank, world, port, family, tp, pp):
    """One rank of a PP x TP split model: runs the parity steps; the last stage returns the
    largest logit difference from transformers' over every step (None elsewhere)."""
    from transformers import LlamaConfig, Qwen2Config

    from tandem.attention.torch_backend import TorchAttentionBackend
    from tandem.distributed import parallel_state as ps
    from tandem.distributed.pipeline import IntermediateTensors
    from tandem.models.llama import LlamaForCausalLM
    from tests.models.paged_parity import random_hf_reference, step_metadata

    cfg = (LlamaConfig(**COMMON, tie_word_embeddings=False) if family == "llama"
           else Qwen2Config(**COMMON, tie_word_embeddings=True))
    ref = random_hf_reference(cfg)
    info = ps.init_distributed(tp, 1, pp_size=pp, rank=rank, world_size=world, master_port=port)
    try:
        model = LlamaForCausalLM(cfg, TorchAttentionBackend()).eval()
        model.load_weights(ref.state_dict().items())
        bs = 8
        kv = [torch.zeros(2, 32, bs, cfg.num_key_value_heads // tp, model.spec.head_dim)
              for _ in range(model.num_stage_layers)]
        torch.manual_seed(1)
        prompts = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in (13, 8, 21)]
        tables = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
        seqs = [list(p) for p in prompts]
        steps = [([len(p) for p in prompts], [0, 0, 0], [t for p in prompts for t in p],
                  [i for p in prompts for i in range(len(p))])]
        nxt = torch.randint(0, cfg.vocab_size, (2, 3)).tolist()  # teacher-forced decode tokens
        worst = 0.0
        with torch.no_grad():
            for k in range(3):
                q_lens, computed, ids, pos = steps[-1]
                meta = step_metadata(q_lens, computed, tables, bs)
                inter = None if info.is_first_stage else IntermediateTensors.recv(len(ids), cfg.hidden_size,
                                                                                  torch.float32, torch.device("cpu"))
                out = model(torch.tensor(ids), torch.tensor(pos), kv, meta, inter)
                if not info.is_last_stage:
                    assert isinstance(out, IntermediateTensors)
                    out.send()
                else:
                    logits = model.compute_logits(out)
                    ends = torch.tensor(q_lens).cumsum(0) - 1
                    for i, s in enumerate(seqs):
                        want = ref(torch.tensor([s])).logits[0, -1]
                        worst = max(worst, (logits[ends[i]] - want).abs().max().item())
                if k < 2:
                    for s, t in zip(seqs, nxt[k]):
                        s.append(t)
                    computed = [len(s) - 1 for s in seqs]
                    steps.append(([1, 1, 1], computed, nxt[k], computed))
        return worst if info.is_last_stage else None
    finally:
        ps.destroy_distributed()


@pytest.mark.parametrize("family,tp,pp", [("llama", 1, 2), ("qwen2", 1, 3), ("llama", 2, 2)],
                         ids=["llama-pp2", "qwen2-tied-pp3", "llama-tp2-pp2"])
def test_split_stages_give_transformers_logits(family, tp, pp):
    results = run_ranks(_stage, tp * pp, family, tp, pp, timeout=180)
    last = [r for r in results if r is not None]
    assert len(last) == tp and max(last) < 1e-4, results


# ----------------------------------------------------------------------------- the engine
@pytest.fixture
def deep_llama(tmp_path):
    """The tests' tiny random Llama (dummy weights) with 4 layers, so that 3 stages split it."""
    import json

    from tests.distributed.conftest import CONFIGS

    (tmp_path / "config.json").write_text(json.dumps({**CONFIGS["llama"], "num_hidden_layers": 4}))
    return str(tmp_path)


def _assert_same_tokens_and_logprobs(got, want) -> None:
    """Greedy tokens equal; each position's top logprobs the same ids, within fp32 tolerance."""
    for (ids, lps), (want_ids, want_lps) in zip(got, want, strict=True):
        assert ids == want_ids
        for pos, want_pos in zip(lps, want_lps):
            assert pos.keys() == want_pos.keys()
            assert all(abs(pos[t] - want_pos[t]) < 1e-4 for t in pos), (pos, want_pos)


def _tokens_and_logprobs(outputs) -> list[tuple[list[int], list[dict[int, float]]]]:
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
            for o in outputs]


@pytest.mark.parametrize("pp,tp,overlap", [(2, 1, True), (3, 1, True), (2, 2, True), (2, 1, False)],
                         ids=["pp2", "pp3", "pp2-tp2", "pp2-sync"])
def test_an_engine_of_stages_gives_the_tokens_and_logprobs_of_one_process(deep_llama, pp, tp, overlap):
    """Greedy tokens equal, logprobs (top 2 of each position) within fp32 tolerance, for a
    batch of mixed-length prompts (chunked prefills, then decodes), and again after idling;
    with asynchronous output processing (the default) several batches were in flight at once."""
    from tandem.sampling_params import SamplingParams
    from tests.distributed.conftest import PROMPTS, generate_outputs, make_llm

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    one = make_llm(deep_llama)
    try:
        want = _tokens_and_logprobs(generate_outputs(one, PROMPTS, params))
    finally:
        one.engine.shutdown()
    llm = make_llm(deep_llama, pipeline_parallel_size=pp, tensor_parallel_size=tp, async_output_proc=overlap)
    try:
        info = llm.engine.rank0_info["parallel"]
        assert (info.pp_size, info.tp_size, info.pp_rank) == (pp, tp, 0)
        got = _tokens_and_logprobs(generate_outputs(llm, PROMPTS, params))
        again = _tokens_and_logprobs(generate_outputs(llm, PROMPTS[:1], params))
        stats = llm.engine.client.debug_stats()[0]
    finally:
        llm.engine.shutdown()
    assert (stats["num_overlapped_steps"] > 0) == overlap, stats
    assert len(stats["pp_stage_busy_s"]) == pp and all(b > 0 for b in stats["pp_stage_busy_s"]), stats
    _assert_same_tokens_and_logprobs(got + again, want + want[:1])


def test_preemption_with_a_batch_per_stage_in_flight_gives_one_process_tokens(deep_llama):
    """A cache too small for every sequence: virtual engines preempt each other's sequences
    (some with a batch in flight), and the tokens stay those of one process."""
    from tandem.sampling_params import SamplingParams
    from tests.distributed.conftest import PROMPTS, generate_ids, make_llm, single_process_ids

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    small = dict(num_kv_blocks=16)
    want = single_process_ids(deep_llama, PROMPTS, params, **small)
    llm = make_llm(deep_llama, pipeline_parallel_size=2, **small)
    try:
        got = generate_ids(llm, PROMPTS, params)
        stats = llm.engine.client.debug_stats()[0]
    finally:
        llm.engine.shutdown()
    assert stats["num_preemptions"] > 0 and stats["num_overlapped_steps"] > 0, stats
    assert got == want


def test_penalties_seeded_sampling_and_prefix_hits_as_in_one_process(deep_llama):
    """Penalties and seeded random sampling on the last stage, and prefix-cache hits (each
    stage's cache holds its layers' K/V of a shared prefix): PP=2 with batches in flight gives
    one process's tokens."""
    from tandem.sampling_params import SamplingParams
    from tests.distributed.conftest import generate_ids, make_llm

    shared = list(range(40, 72))  # 4 full blocks of 8
    prompts = [shared + [100 + i, 7, 9 + i] for i in range(6)]
    params = [SamplingParams(temperature=0.8, seed=11 + i, max_tokens=12, ignore_eos=True, frequency_penalty=0.5,
                             repetition_penalty=1.2, presence_penalty=0.3 * (i % 2)) for i in range(6)]
    runs = []
    for pp in (1, 2):  # the prefix first, then the prompts that hit it
        llm = make_llm(deep_llama, pipeline_parallel_size=pp)
        try:
            runs.append(generate_ids(llm, prompts[:1], params[:1]) + generate_ids(llm, prompts[1:], params[1:]))
            stats = llm.engine.client.debug_stats()[0]
        finally:
            llm.engine.shutdown()
    assert stats["prefix_cache_hits"] > 0 and stats["num_overlapped_steps"] > 0, stats
    assert runs[1] == runs[0]


def test_a_shutdown_with_batches_in_flight_stops_every_stage_at_once(deep_llama):
    """Shut down while both stages run batches: the driver takes in what is in flight, so the
    last stage is not left reporting to no one; every rank exits well within the timeout."""
    import time

    import psutil

    from tandem.sampling_params import SamplingParams
    from tests.distributed.conftest import PROMPTS, make_llm

    llm = make_llm(deep_llama, pipeline_parallel_size=2)
    ranks = [p for p in psutil.Process().children(recursive=True) if "resource_tracker" not in " ".join(p.cmdline())]
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        llm.engine.add_request(str(i), p, params)
    deadline = time.monotonic() + 60
    while not any(o.outputs[0].token_ids for o in llm.engine.step()) and time.monotonic() < deadline:
        pass
    t0 = time.monotonic()
    llm.engine.shutdown()
    assert time.monotonic() - t0 < 15
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive


def test_constrained_requests_sample_on_the_last_stage(model_dir, word_tokenizer):
    """The driver's bitmask reaches the last stage, which samples: PP=2 gives one process's
    tokens for constrained requests beside free ones."""
    from tests.distributed.conftest import PROMPTS, constrained_mix, generate_ids, make_llm, single_process_ids

    model = model_dir("llama")
    params = constrained_mix()
    want = single_process_ids(model, PROMPTS, params, tokenizer=word_tokenizer)
    llm = make_llm(model, pipeline_parallel_size=2, tokenizer=word_tokenizer)
    try:
        got = generate_ids(llm, PROMPTS, params)
    finally:
        llm.engine.shutdown()
    assert got == want and any(9 in ids for ids in got[1::2])


@pytest.mark.parametrize("kwargs,message", [
    (dict(enable_dbo=True), "pipeline_parallel_size > 1 does not support enable_dbo yet"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "speculative_config does not support tensor, pipeline, data or expert parallelism yet"),
    (dict(enable_expert_parallel=True, data_parallel_size=2),
     "does not support enable_expert_parallel with data_parallel_size > 1 yet"),
])
def test_what_stages_do_not_cover_yet_is_refused_with_one_line(kwargs, message):
    from tandem.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs(pipeline_parallel_size=2, **kwargs).create_engine_config()


def test_stages_keep_output_overlap_with_a_batch_per_stage_in_flight_and_turn_off_cuda_graphs():
    from tandem.engine.arg_utils import EngineArgs

    cfg = EngineArgs(pipeline_parallel_size=3).create_engine_config()
    assert (cfg.parallel_config.world_size, cfg.scheduler_config.async_output_proc, cfg.max_concurrent_batches,
            cfg.model_config.enforce_eager) == (3, True, 3, True)
    off = EngineArgs(pipeline_parallel_size=3, async_output_proc=False).create_engine_config()
    assert off.max_concurrent_batches == 1


@pytest.fixture
def deep_moe(tmp_path):
    """``deep_moe(family)``: the tests' tiny random MoE model of ``family`` with 4 layers."""
    import json

    from tests.distributed.conftest import CONFIGS

    def make(family: str) -> str:
        d = tmp_path / family
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**CONFIGS[family], "num_hidden_layers": 4}))
        return str(d)

    return make


@pytest.mark.parametrize("family,tp,ep", [("qwen3_moe", 1, False), ("deepseek_v2", 1, False),
                                          ("qwen3_moe", 2, True)], ids=["qwen3_moe", "deepseek_v2", "qwen3_moe-tp2-ep"])
def test_moe_models_split_into_stages_give_one_process_tokens_and_logprobs(deep_moe, family, tp, ep):
    """MoE decoders per stage (DeepSeek-V2's first layer dense, MLA caches): PP=2 gives one
    process's greedy tokens and logprobs; with TP=2 and expert parallelism each stage's
    experts are sharded over its two ranks."""
    from tandem.sampling_params import SamplingParams
    from tests.distributed.conftest import PROMPTS, generate_outputs, make_llm

    model = deep_moe(family)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    one = make_llm(model)
    try:
        want = _tokens_and_logprobs(generate_outputs(one, PROMPTS, params))
    finally:
        one.engine.shutdown()
    extra = dict(tensor_parallel_size=tp, enable_expert_parallel=True, all2all_backend="all_to_all") if ep else {}
    llm = make_llm(model, pipeline_parallel_size=2, **extra)
    try:
        got = _tokens_and_logprobs(generate_outputs(llm, PROMPTS, params))
    finally:
        llm.engine.shutdown()
    _assert_same_tokens_and_logprobs(got, want)
