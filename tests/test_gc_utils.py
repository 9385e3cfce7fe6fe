"""The startup heap leaves the garbage collector's generations: what is alive when an engine
is ready is frozen (skipped by every later collection), while garbage made before is
collected, not frozen."""

from __future__ import annotations

import gc
import json
import weakref

from tandem.gc_utils import freeze_gc_heap


class _Node:
    def __init__(self) -> None:
        self.self_ref = self  # a reference cycle: only the collector frees it


def test_freeze_collects_garbage_first_and_freezes_the_live_heap():
    gc.unfreeze()
    garbage, live = _Node(), _Node()
    dead = weakref.ref(garbage)
    del garbage
    assert dead() is not None  # a cycle outlives its last outside reference
    count = freeze_gc_heap()
    assert dead() is None, "garbage made before the freeze must be collected, not frozen forever"
    assert count == gc.get_freeze_count() > 0
    assert not any(o is live for o in gc.get_objects()), "the live heap is frozen: no collection scans it"
    gc.unfreeze()


def test_engine_core_freezes_its_startup_heap(tmp_path, embedded_model_path):
    from tandem.entrypoints.llm import LLM

    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
        max_position_embeddings=256)))
    gc.unfreeze()
    llm = LLM(model=str(tmp_path), tokenizer=embedded_model_path, load_format="dummy", num_kv_blocks=32, device="cpu")
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        core = llm.engine.client.core
        assert not any(o is core.scheduler for o in gc.get_objects()), "the engine's state is in the frozen heap"
    finally:
        llm.engine.shutdown()
        gc.unfreeze()
