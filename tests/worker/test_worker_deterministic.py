"""Deterministic mode is each engine's own (issue 48): the worker hands
``ModelConfig.deterministic`` to the attention backend it builds, and the model built over
that backend keeps the mode in its layers, so two engines of one process, one deterministic
and one not, each compute as their own config says (before: one process-wide switch, which
the last engine started set for both)."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.attention.torch_backend import TorchAttentionBackend
from tandem.engine.arg_utils import EngineArgs
from tandem.layers import batch_invariant
from tandem.model_loader.loader import load_hf_config
from tandem.worker.worker import Worker
from tests.distributed.conftest import COMMON, CONFIGS
from tests.models.paged_parity import step_metadata

BLOCK = 8


def _worker(model: str, deterministic: bool, **kw) -> Worker:
    args = EngineArgs(model=model, load_format="dummy", block_size=BLOCK, max_model_len=128, dtype="float32",
                      device="cpu", deterministic=deterministic, **kw)
    config = args.create_engine_config()
    hf_config = load_hf_config(model)
    config.resolve_limits(hf_config.max_position_embeddings)
    return Worker(config, hf_config)


def _step(model: torch.nn.Module, kv: list[torch.Tensor], q_lens: list[int], computed: list[int]) -> None:
    """One forward and the logits of requests ``r`` on blocks ``4r+1 ..``: ``q_lens[r]`` new
    tokens after ``computed[r]`` (decodes first)."""
    tables = [list(range(4 * r + 1, 4 * r + 5)) for r in range(len(q_lens))]
    meta = step_metadata(q_lens, computed, tables, BLOCK)
    ids = torch.randint(2, COMMON["vocab_size"], (sum(q_lens),))
    pos = torch.cat([torch.arange(c, c + q) for c, q in zip(computed, q_lens)])
    with torch.no_grad():
        model.compute_logits(model(ids, pos, kv, meta))


@pytest.mark.parametrize("family", list(CONFIGS))
def test_two_engines_of_one_process_keep_their_own_mode(tmp_path, family, monkeypatch):
    """A deterministic worker's model (loaded first) and a default one's: every layer and
    attention backend holds its own worker's mode, and steps of the two, interleaved, take
    that mode's routes: the row-blocked GEMMs (linear layers, LM head, MoE router and
    experts, MLA's per-head products) and the torch backend's split decode attention in the
    deterministic model only."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS[family]))
    workers = {True: _worker(str(tmp_path), True), False: _worker(str(tmp_path), False)}
    models = {mode: w.load_model() for mode, w in workers.items()}
    for mode, model in models.items():
        modes = {m.deterministic for m in model.modules() if hasattr(m, "deterministic")}
        backends = {m.backend.deterministic for m in model.modules() if hasattr(m, "backend")}
        assert modes == {mode} and backends <= {mode}, (mode, modes, backends)
        assert backends or family == "deepseek_v2"  # MLA runs its own attention
    caches = {mode: w.initialize_kv_cache(17).kv_caches for mode, w in workers.items()}

    blocked, split_decodes = [], []
    row_blocked, decode_split = batch_invariant.row_blocked, TorchAttentionBackend._decode_split
    monkeypatch.setattr(batch_invariant, "row_blocked",
                        lambda fn, x, n: blocked.append(n) or row_blocked(fn, x, n))
    monkeypatch.setattr(TorchAttentionBackend, "_decode_split",
                        lambda self, *a: split_decodes.append(self.deterministic) or decode_split(self, *a))
    seen = {}
    for q_lens, computed in (([5, 9], [0, 0]), ([1, 1], [5, 9])):  # a prefill step, then a decode step
        for mode in (True, False):
            blocked.clear()
            _step(models[mode], caches[mode], q_lens, computed)
            seen.setdefault(mode, set()).update(blocked)
    assert not seen[False]
    assert COMMON["vocab_size"] in seen[True] and COMMON["hidden_size"] in seen[True]  # the LM head, o_proj
    assert set(split_decodes) == (set() if family == "deepseek_v2" else {True})


@pytest.mark.parametrize("deterministic", [True, False])
def test_an_eagle_head_takes_its_engine_mode(tmp_path, deterministic):
    """The EAGLE head (built by tandem.spec_decode, not build_model) holds its worker's mode."""
    for name, layers in (("target", COMMON["num_hidden_layers"]), ("head", 1)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**CONFIGS["llama"], "num_hidden_layers": layers}))
    spec = {"method": "eagle", "model": str(tmp_path / "head"), "num_speculative_tokens": 2}
    worker = _worker(str(tmp_path / "target"), deterministic, speculative_config=spec)
    worker.load_model()
    head = worker.draft_model
    assert {m.deterministic for m in head.modules() if hasattr(m, "deterministic")} == {deterministic}
    assert {m.backend.deterministic for m in head.modules() if hasattr(m, "backend")} == {deterministic}
