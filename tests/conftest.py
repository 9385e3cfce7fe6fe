"""Shared fixtures: the embedded model's engine is loaded once per test session."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def embedded_model_path() -> str:
    from tandem.config import embedded_default_model

    return embedded_default_model()


@pytest.fixture(scope="session")
def smol_tokenizer(embedded_model_path):
    from tandem.model_loader.loader import load_tokenizer

    return load_tokenizer(embedded_model_path)


def assert_all_blocks_free(engine) -> None:
    """Every KV block is back in the free queue (block 0 is the reserved null block)."""
    pool = engine.kv_manager.pool
    assert not engine.scheduler.requests, "requests left in the scheduler"
    assert not engine.kv_manager.req_blocks, "sequences still hold blocks"
    assert pool.num_free_blocks == pool.num_blocks - 1
