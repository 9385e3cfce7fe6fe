"""EngineConfig rejects inconsistent simulated-EP settings with errors naming the field."""

from __future__ import annotations

import pytest

from tandem.config import EngineConfig


def test_simulated_ep_fields_are_checked():
    with pytest.raises(ValueError, match="simulated_ep_rank_experts"):
        EngineConfig(model="m", simulated_ep_rank_experts=True)
    with pytest.raises(ValueError, match="simulated_ep_size"):
        EngineConfig(model="m", all2all_backend="simulated", simulated_ep_size=0)
    cfg = EngineConfig(model="m", all2all_backend="simulated", simulated_ep_rank_experts=True)
    assert cfg.dbo_measure_split  # split decode graphs only where measured faster, by default


def test_cli_flags_reach_the_config():
    import argparse

    from tandem.entrypoints.cli import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(p.parse_args(["--model", "m", "--all2all-backend", "simulated",
                                                "--simulated-ep-rank-experts", "--no-dbo-measure-split"]))
    assert cfg.simulated_ep_rank_experts and not cfg.dbo_measure_split
