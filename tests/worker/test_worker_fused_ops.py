"""The fused-ops mode is each engine's own (issue 48): the worker resolves
``TANDEM_FUSED_OPS`` once for its device, and every model it builds (the target, a draft
model, an EAGLE head) keeps the mode in its layers, so two engines of one process, one on
the Triton kernels and one on the torch code, each run as their environment said when they
loaded (before: one process-wide mode, read at every call)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.triton_interpreter import triton_test_setup

_, INTERPRET = triton_test_setup()

from tandem.engine.arg_utils import EngineArgs  # noqa: E402
from tandem.layers import fused_ops, mla_latent  # noqa: E402
from tandem.model_loader.loader import load_hf_config  # noqa: E402
from tandem.worker.worker import Worker  # noqa: E402
from tests.distributed.conftest import COMMON, CONFIGS  # noqa: E402
from tests.models.paged_parity import step_metadata  # noqa: E402

BLOCK = 8


def _worker(model: str, monkeypatch, env: str | None, **kw) -> Worker:
    """A CPU worker over ``model`` (dummy weights), its model loaded with ``TANDEM_FUSED_OPS``
    set to ``env`` (unset: None); the variable is unset again afterwards."""
    if env is None:
        monkeypatch.delenv("TANDEM_FUSED_OPS", raising=False)
    else:
        monkeypatch.setenv("TANDEM_FUSED_OPS", env)
    args = EngineArgs(model=model, load_format="dummy", block_size=BLOCK, max_model_len=128, dtype="float32",
                      device="cpu", **kw)
    config = args.create_engine_config()
    hf_config = load_hf_config(model)
    config.resolve_limits(hf_config.max_position_embeddings)
    worker = Worker(config, hf_config)
    worker.load_model()
    monkeypatch.delenv("TANDEM_FUSED_OPS", raising=False)  # the models keep what they were built with
    return worker


def _modes(model: torch.nn.Module) -> set[str]:
    return {m.fused_ops_mode for m in model.modules() if hasattr(m, "fused_ops_mode")}


def _config(path: Path, family: str, **overrides) -> str:
    """A config folder for ``family`` (tests/distributed/conftest.py) at ``path``."""
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({**CONFIGS[family], **overrides}))
    return str(path)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_each_model_keeps_its_engines_mode(tmp_path, family, monkeypatch):
    """Three engines of one process, loaded one after the other: every layer that calls a
    fused op holds its own worker's mode, ``auto`` resolved for the CPU (the C++ norms)."""
    model = _config(tmp_path, family)
    workers = {env: _worker(model, monkeypatch, env) for env in ("triton", "torch", None)}
    assert {env: _modes(w.model) for env, w in workers.items()} == {"triton": {"triton"}, "torch": {"torch"},
                                                                      None: {"cpu"}}


@pytest.mark.skipif(not INTERPRET, reason="the Triton mode on CPU tensors runs in the interpreter")
@pytest.mark.parametrize("family", list(CONFIGS))
def test_interleaved_steps_take_their_own_models_path(tmp_path, family, monkeypatch):
    """Steps of a Triton-mode and a torch-mode engine, interleaved: the fused ops' kernels
    (MLA's latent write among them) run in the Triton-mode model's steps only."""
    model = _config(tmp_path, family)
    workers = {env: _worker(model, monkeypatch, env) for env in ("triton", "torch")}
    caches = {env: w.initialize_kv_cache(17).kv_caches for env, w in workers.items()}
    launched: list[str] = []
    kernel, latent_kernel = fused_ops._kernel, mla_latent._kernel
    monkeypatch.setattr(fused_ops, "_kernel", lambda name: launched.append(name) or kernel(name))
    monkeypatch.setattr(mla_latent, "_kernel", lambda: launched.append("_mla_latent_kernel") or latent_kernel())
    seen: dict[str, set[str]] = {}
    for q_lens, computed in (([5, 9], [0, 0]), ([1, 1], [5, 9])):  # a prefill step, then a decode step
        for env in ("triton", "torch"):
            launched.clear()
            tables = [list(range(4 * r + 1, 4 * r + 5)) for r in range(len(q_lens))]
            ids = torch.randint(2, COMMON["vocab_size"], (sum(q_lens),))
            pos = torch.cat([torch.arange(c, c + q) for c, q in zip(computed, q_lens)])
            with torch.no_grad():
                m = workers[env].model
                m.compute_logits(m(ids, pos, caches[env], step_metadata(q_lens, computed, tables, BLOCK)))
            seen.setdefault(env, set()).update(launched)
    assert seen["torch"] == set()
    want = {"llama": {"_rms_norm_kernel", "_rope_kernel", "_silu_and_mul_kernel"},
            "qwen3_moe": {"_rms_norm_kernel", "_rope_kernel"},
            "deepseek_v2": {"_rms_norm_kernel", "_mla_latent_kernel", "_silu_and_mul_kernel"}}[family]
    assert want <= seen["triton"], seen["triton"]


@pytest.mark.parametrize("method", ["eagle", "draft_model"])
def test_a_drafter_takes_its_engines_mode(tmp_path, method, monkeypatch):
    """An EAGLE head (built by tandem.spec_decode, not build_model) and a draft model hold
    their worker's mode, as the target does."""
    target = _config(tmp_path / "target", "llama")
    drafter = _config(tmp_path / "drafter", "llama", num_hidden_layers=1)
    spec = {"method": method, "model": drafter, "num_speculative_tokens": 2}
    for env in ("triton", "torch"):
        worker = _worker(target, monkeypatch, env, speculative_config=spec)
        assert _modes(worker.model) == _modes(worker.draft_model) == {env}
