"""``EngineCore`` start-up on a tiny random-weight model: it wires the worker's model, KV
cache and runner to a block manager and scheduler of the block count the TP ranks agreed on."""

from __future__ import annotations

import json

import pytest

from tandem.engine.arg_utils import EngineArgs
from tandem.engine.core import EngineCore
from tandem.engine.messages import EngineCoreRequest
from tandem.sampling_params import SamplingParams
from tests.conftest import assert_all_blocks_free

LLAMA = dict(model_type="llama", vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256, rms_norm_eps=1e-6)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("llama")
    (d / "config.json").write_text(json.dumps(LLAMA))
    return str(d)


def _core(model: str, tokenizer: str, **kw) -> EngineCore:
    args = dict(model=model, tokenizer=tokenizer, load_format="dummy", block_size=8, max_model_len=128,
                dtype="float32", device="cpu")
    return EngineCore(EngineArgs(**{**args, **kw}).create_engine_config())


def test_core_runs_on_the_block_count_the_replica_ranks_agreed_on(tiny_llama, embedded_model_path, monkeypatch):
    """The worker sizes its cache (30 blocks); the replica's agreement (the smallest over its
    stages and TP ranks, here 12) sizes the tensors, the block manager and the scheduler's context (11 blocks of
    8 = 88 tokens < 128), and greedy requests run to the end with every block freed."""
    from tandem.distributed import parallel_state as ps

    asked = []
    monkeypatch.setattr(ps, "replica_min", lambda n: asked.append(n) or 12)
    core = _core(tiny_llama, embedded_model_path, num_kv_blocks=30)
    try:
        assert asked == [30]
        assert core.model is core.worker.model and core.runner is core.worker.model_runner
        assert core.num_kv_blocks == core.kv_manager.pool.num_blocks == 12
        assert all(c.shape[1] == 12 for c in core.runner.kv_caches)
        assert core.config.model_config.max_model_len == core.scheduler.max_model_len == 88
        assert core.vocab_size == core.hf_config.vocab_size == 512
        assert core.ready_message().resolved.num_kv_blocks == core.resolved.num_kv_blocks == 12
        assert core.resolved.max_model_len == 88  # lowered to the cache's capacity before it is sent
        p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True).with_defaults()
        for i, n in enumerate([5, 30, 11]):
            core.add_request(EngineCoreRequest(f"r{i}", list(range(7, 7 + n)), p, max_tokens=6, arrival_time=0.0))
        tokens: dict[str, list[int]] = {}
        while core.has_unfinished_requests():
            for o in core.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert sorted(tokens) == ["r0", "r1", "r2"] and all(len(t) == 6 for t in tokens.values())
        assert_all_blocks_free(core)
    finally:
        core.shutdown()


def test_max_model_len_beyond_the_model_is_refused_before_loading(tiny_llama, embedded_model_path, monkeypatch):
    from tandem.worker.worker import Worker

    monkeypatch.setattr(Worker, "load_model", lambda self: pytest.fail("the model was loaded"))
    with pytest.raises(ValueError, match=r"max_model_len \(512\) exceeds the model's context length \(256\)"):
        _core(tiny_llama, embedded_model_path, max_model_len=512)
