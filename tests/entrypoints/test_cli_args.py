"""``tandem serve``'s API-server count when left unset (tandem.entrypoints.openai.cli_args)."""

from __future__ import annotations

import argparse

import pytest

from tandem.engine.arg_utils import EngineArgs
from tandem.entrypoints.openai.cli_args import (MAX_API_SERVERS_PER_REPLICA, default_api_server_count,
                                                resolve_api_server_count)


@pytest.mark.parametrize("cpus, ranks, replicas, on_gpu, want", [
    (2, 1, 1, False, 1),     # the CPU: the engine uses every core
    (64, 1, 1, False, 1),
    (2, 1, 1, True, 1),      # a GPU with few CPUs: at least one server
    (16, 1, 1, True, 4),     # one H200 and its 16 cores: (16 - 1) // 3 = 5, capped at 4 for one replica
    (8, 1, 1, True, 2),
    (32, 2, 2, True, 8),     # two replicas: up to 4 each
    (128, 8, 2, True, 8),    # TP=4 x DP=2 on 8 GPUs: the cap counts replicas, not ranks
    (16, 16, 16, True, 1),   # every core taken by a rank
])
def test_default_api_server_count(cpus, ranks, replicas, on_gpu, want):
    got = default_api_server_count(cpus, ranks, replicas, on_gpu)
    assert got == want and 1 <= got <= MAX_API_SERVERS_PER_REPLICA * replicas


def test_a_given_count_wins_and_an_unset_one_is_resolved_for_the_host():
    cfg = EngineArgs(device="cpu").create_engine_config("openai_api_server")
    given = argparse.Namespace(api_server_count=3)
    assert resolve_api_server_count(given, cfg) == 3
    unset = argparse.Namespace(api_server_count=None)
    assert resolve_api_server_count(unset, cfg) == 1 and unset.api_server_count == 1
