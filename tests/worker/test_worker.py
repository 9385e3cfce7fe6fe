"""The worker on tiny random-weight models (``load_format="dummy"``, CPU): the MoE
all-to-all choice, the KV cache's size from the memory budget, its allocation and the model
runner over it; and the metadata of the CUDA memory-profile step."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch

from tandem.distributed.all2all import LocalAll2All, SimulatedAll2All
from tandem.engine.arg_utils import EngineArgs
from tandem.model_loader.loader import load_hf_config
from tandem.worker.worker import Worker, profile_step_metadata
from tests.distributed.conftest import COMMON, CONFIGS

# (planes, KV heads, head dim) of one layer's cache block: K and V of 2 heads of 16; one MLA
# latent of kv_lora_rank + qk_rope_head_dim.
GEOMETRY = {"llama": (2, 2, 16), "qwen3_moe": (2, 2, 16), "deepseek_v2": (1, 1, 48)}
BLOCK = 8


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    dirs = {}
    for family, cfg in CONFIGS.items():
        d = tmp_path_factory.mktemp(family)
        (d / "config.json").write_text(json.dumps(cfg))
        dirs[family] = str(d)
    return dirs


def _worker(model: str, **kw) -> Worker:
    """A worker on the test engine settings, its limits resolved as the engine core does."""
    args = dict(model=model, load_format="dummy", block_size=BLOCK, max_model_len=128, dtype="float32", device="cpu")
    config = EngineArgs(**{**args, **kw}).create_engine_config()
    hf_config = load_hf_config(model)
    config.resolve_limits(hf_config.max_position_embeddings)
    return Worker(config, hf_config)


def _moe_backends(model: torch.nn.Module) -> list:
    return [m.all2all for m in model.modules() if hasattr(m, "all2all")]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_cache_sized_from_budget_and_runner_built_over_it(model_dirs, family):
    """On the CPU the cache gets kv_cache_memory_gib // bytes per block blocks; the runner
    is built over per-layer caches of that many blocks, in the model's cache geometry."""
    planes, heads, dim = GEOMETRY[family]
    bytes_per_block = planes * COMMON["num_hidden_layers"] * BLOCK * heads * dim * 4
    worker = _worker(model_dirs[family], kv_cache_memory_gib=(40.5 * bytes_per_block) / 2**30)
    model = worker.load_model()
    assert worker.model is model and tuple(model.kv_cache_shape_per_block) == (heads, dim)
    assert worker.determine_num_kv_blocks() == 40
    runner = worker.initialize_kv_cache(40)
    assert worker.model_runner is runner and worker.num_kv_blocks == 40 and runner.model is model
    assert len(runner.kv_caches) == COMMON["num_hidden_layers"]
    assert all(c.shape == (planes, 40, BLOCK, heads, dim) and c.dtype == torch.float32 for c in runner.kv_caches)
    assert all(not c.any() for c in runner.kv_caches)  # zeroed: unwritten slots never hold NaN
    assert worker.config.model_config.max_model_len == 128  # 39 blocks hold 312 tokens


def test_set_num_kv_blocks_wins_over_the_budget(model_dirs):
    worker = _worker(model_dirs["llama"], num_kv_blocks=5, kv_cache_memory_gib=1e-9)
    worker.load_model()
    assert worker.determine_num_kv_blocks() == 5


def test_budget_below_two_blocks_is_refused(model_dirs):
    worker = _worker(model_dirs["llama"], kv_cache_memory_gib=4096 * 1.5 / 2**30)  # 1.5 blocks of 4 KiB
    worker.load_model()
    with pytest.raises(ValueError, match="not enough memory for the KV cache"):
        worker.determine_num_kv_blocks()


def test_small_cache_lowers_max_model_len(model_dirs, caplog):
    """A cache holding fewer tokens than max_model_len lowers it (with a warning) before the
    runner is built, so the runner's block table is sized for what the cache can hold."""
    worker = _worker(model_dirs["llama"])
    worker.load_model()
    with caplog.at_level(logging.INFO, logger="tandem.worker.worker"):
        runner = worker.initialize_kv_cache(6)  # blocks 1..5: 40 tokens
    assert worker.config.model_config.max_model_len == 40
    assert "KV cache holds 40 tokens: max_model_len lowered from 128" in caplog.text
    # One line sizes the cache: blocks (the null block included), tokens, GiB, dtype.
    assert re.search(rf"KV cache: 6 blocks of {BLOCK} tokens \(40 usable tokens: one null block\), \d+\.\d\d GiB, torch.float32",
                     caplog.text), caplog.text
    assert runner.input_batch.block_table.shape[1] == 40 // BLOCK


def test_cache_before_model_is_refused(model_dirs):
    worker = _worker(model_dirs["llama"])
    with pytest.raises(RuntimeError, match="load_model"):
        worker.initialize_kv_cache(8)
    with pytest.raises(RuntimeError, match="load_model"):
        worker.determine_num_kv_blocks()


@pytest.mark.parametrize("backend, want", [("auto", LocalAll2All), ("local", LocalAll2All),
                                           ("allgather_reducescatter", LocalAll2All),  # one EP rank
                                           ("simulated", SimulatedAll2All)])
def test_moe_layers_get_the_chosen_all2all(model_dirs, backend, want):
    worker = _worker(model_dirs["qwen3_moe"], all2all_backend=backend)
    backends = _moe_backends(worker.load_model())
    assert len(backends) == COMMON["num_hidden_layers"]
    assert all(type(b) is want for b in backends)
    assert worker.all2all_backend == ("local" if backend == "auto" else backend)  # what the core sends


def test_dbo_on_a_dense_model_warns(model_dirs, caplog):
    worker = _worker(model_dirs["llama"], enable_dbo=True)
    with caplog.at_level(logging.WARNING, logger="tandem.worker.worker"):
        model = worker.load_model()
    assert "--enable-dbo has no effect on the dense model llama" in caplog.text
    assert not _moe_backends(model) and worker.all2all_backend is None


@pytest.mark.parametrize("tokens, max_len, lens", [(16384, 2048, [2048] * 8), (5000, 2048, [2048, 2048, 904]),
                                                   (2048, 4096, [2048])])
def test_profile_step_is_the_whole_token_budget_in_sequences_of_max_model_len(tokens, max_len, lens):
    """The profiled step holds every token a step may schedule (not one sequence's worth),
    each sequence in its own blocks past the null block, every slot once."""
    meta, num_blocks = profile_step_metadata(tokens, max_len, 16, torch.device("cpu"))
    assert meta.seq_lens_cpu == lens and meta.seq_lens.tolist() == lens
    assert meta.query_start_loc_cpu[-1] == tokens and meta.query_start_loc.tolist() == meta.query_start_loc_cpu
    assert meta.slot_mapping.numel() == tokens and meta.slot_mapping.unique().numel() == tokens
    assert int(meta.slot_mapping.min()) >= 16 and int(meta.slot_mapping.max()) < num_blocks * 16
    for i, n in enumerate(lens):  # each sequence's slots come from its own block-table row
        s = meta.slot_mapping[meta.query_start_loc_cpu[i]:meta.query_start_loc_cpu[i + 1]]
        assert torch.equal(s // 16, meta.block_tables[i].long()[torch.arange(n) // 16])
    assert meta.num_decode_reqs == 0 and meta.max_query_len == max(lens)


@pytest.mark.parametrize("step_thread", ["on", "off"])
def test_cpu_torch_work_runs_on_the_step_thread(model_dirs, monkeypatch, step_thread):
    """On the CPU the model is built, the cache allocated and the steps run on one thread,
    the worker's step thread (one OpenMP team: tandem.worker.worker's docstring); with
    TANDEM_CPU_STEP_THREAD=off all of it on the caller's thread."""
    import threading

    from tandem.worker import worker as worker_mod

    monkeypatch.setenv("TANDEM_CPU_STEP_THREAD", step_thread)
    seen = []

    def recorded(fn):
        def run(*args, **kwargs):
            seen.append((fn.__name__, threading.current_thread()))
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(worker_mod, "build_model", recorded(worker_mod.build_model))
    monkeypatch.setattr(worker_mod, "allocate_kv_caches", recorded(worker_mod.allocate_kv_caches))
    worker = _worker(model_dirs["llama"], num_kv_blocks=8)
    worker.load_model()
    runner = worker.initialize_kv_cache(8)
    try:
        if step_thread == "off":
            assert worker.step_thread is None and runner._executor is None
            owner = threading.current_thread()
        else:
            assert runner._executor is worker.step_thread
            owner = worker.step_thread.submit(threading.current_thread).result()
            assert owner is not threading.current_thread()
        assert seen == [("build_model", owner), ("allocate_kv_caches", owner)]
    finally:
        runner.shutdown()


@pytest.mark.parametrize("parallel, dequantized", [({}, False), ({"pipeline_parallel_size": 2}, True),
                                                   ({"tensor_parallel_size": 2}, True)])
def test_a_gguf_split_over_ranks_says_it_runs_dequantized(embedded_model_path, caplog, parallel, dequantized):
    config = EngineArgs(model=embedded_model_path, device="cpu", **parallel).create_engine_config()
    worker = Worker(config, load_hf_config(embedded_model_path))
    with caplog.at_level(logging.WARNING, logger="tandem.worker.worker"):
        scheme = worker._gguf_scheme()
    assert (scheme is None) == dequantized
    # The model dtype is this machine's auto dtype (bf16 where the CPU has native bf16, else fp32).
    dtype = str(worker.dtype).removeprefix("torch.")
    assert dtype in ("float32", "bfloat16")
    assert (f"the GGUF weights run dequantized to {dtype}:" in caplog.text) == dequantized
