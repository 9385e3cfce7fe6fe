"""The TP follower's loop keeps the driver's order (tandem.engine.rank_core.run_tp_follower)."""

from __future__ import annotations

import pytest

from tandem.engine import rank_core


class _Step:
    def __init__(self, name: str, empty: bool = False) -> None:
        self.name, self.is_empty = name, empty


class _Handle:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def result(self):
        self.log.append(f"result {self.name}")


class _Runner:
    def __init__(self, log: list, constrained: set) -> None:
        self.log, self.constrained = log, constrained

    def execute_model(self, so):
        self.log.append(f"launch {so.name}")
        return None if so.name in self.constrained else _Handle(self.log, so.name)

    def sample_tokens(self, bitmask):
        self.log.append(f"sample {bitmask}")
        return _Handle(self.log, bitmask)


def _follow(monkeypatch, broadcasts: list, async_output_proc: bool, constrained=()) -> list:
    """Run the follower on ``broadcasts`` (what the driver sends, in order); its call log."""
    log, sent = [], iter(broadcasts)

    def recv(box, src, group):
        box[0] = next(sent)

    monkeypatch.setattr(rank_core.dist, "broadcast_object_list", recv)
    monkeypatch.setattr(rank_core.ps, "get_tp_cpu_group", lambda: None)
    monkeypatch.setattr(rank_core.ps, "get_tp_src_rank", lambda: 0)
    core = type("Core", (), {"runner": _Runner(log, set(constrained)), "async_output_proc": async_output_proc})()
    rank_core.run_tp_follower(core)
    return log


@pytest.mark.parametrize("async_output_proc", [True, False])
def test_follower_order_matches_the_driver(monkeypatch, async_output_proc):
    log = _follow(monkeypatch, [_Step("1"), _Step("2"), _Step("3", empty=True), _Step("4"), None], async_output_proc)
    if async_output_proc:
        # Step N's result after step N+1's launch; an empty step waits at once (as EngineCore.step).
        assert log == ["launch 1", "launch 2", "result 1", "launch 3", "result 2", "result 3",
                       "launch 4", "result 4"]
    else:
        assert log == ["launch 1", "result 1", "launch 2", "result 2", "launch 3", "result 3",
                       "launch 4", "result 4"]


def test_constrained_step_samples_after_the_previous_result(monkeypatch):
    """The driver advances grammars with step N's tokens before it sends N+1's bitmask."""
    log = _follow(monkeypatch, [_Step("1"), _Step("2"), "mask2", None], True, constrained={"2"})
    assert log == ["launch 1", "launch 2", "result 1", "sample mask2", "result mask2"]
