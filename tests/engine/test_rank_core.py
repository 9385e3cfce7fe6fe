"""tandem.engine.rank_core: the TP follower's loop keeps the driver's order; the step
channel's messages round-trip."""

from __future__ import annotations

import pytest
import torch

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


class _Channel:
    """What the driver sends, in order: ``_Step``s and None (the stop) for ``recv_step``,
    bitmask names (str) and None (an abandoned step) for ``recv_bitmask``."""

    def __init__(self, sent: list) -> None:
        self.sent = iter(sent)

    def recv_step(self):
        msg = next(self.sent)
        assert msg is None or isinstance(msg, _Step), f"a step expected, {msg!r} received"
        return msg

    def recv_bitmask(self):
        msg = next(self.sent)
        assert msg is None or isinstance(msg, str), f"a bitmask expected, {msg!r} received"
        return msg


def _follow(broadcasts: list, async_output_proc: bool, constrained=(), max_concurrent_batches: int = 1) -> list:
    """Run the follower on ``broadcasts``; its call log."""
    log = []
    core = type("Core", (), {"runner": _Runner(log, set(constrained)), "async_output_proc": async_output_proc,
                             "max_concurrent_batches": max_concurrent_batches})()
    rank_core.run_tp_follower(core, _Channel(broadcasts))
    return log


@pytest.mark.parametrize("async_output_proc", [True, False])
def test_follower_order_matches_the_driver(async_output_proc):
    log = _follow([_Step("1"), _Step("2"), _Step("3", empty=True), _Step("4"), None], async_output_proc)
    if async_output_proc:
        # Step N's result after step N+1's launch; an empty step waits at once (as EngineCore.step).
        assert log == ["launch 1", "launch 2", "result 1", "launch 3", "result 2", "result 3",
                       "launch 4", "result 4"]
    else:
        assert log == ["launch 1", "result 1", "launch 2", "result 2", "launch 3", "result 3",
                       "launch 4", "result 4"]


def test_constrained_step_takes_its_bitmask_before_waiting_for_earlier_steps():
    """The bitmask follows its step on the channel: taken at once, so that a driver with
    several batches in flight never waits for a follower that waits for the driver."""
    log = _follow([_Step("1"), _Step("2"), "mask2", None], True, constrained={"2"})
    assert log == ["launch 1", "launch 2", "sample mask2", "result 1", "result mask2"]


def test_with_a_batch_per_stage_in_flight_a_stage_waits_only_for_the_oldest():
    """Pipeline parallelism, 3 batches in flight: the driver sends batch N+2 before it takes
    in batch N, so a stage waits for N only after receiving N+2; empty steps are not special."""
    log = _follow([_Step("1"), _Step("2"), _Step("3"), _Step("4", empty=True), _Step("5"), None], True,
                  max_concurrent_batches=3)
    assert log == ["launch 1", "launch 2", "launch 3", "result 1", "launch 4", "result 2", "launch 5", "result 3",
                   "result 4", "result 5"]


def test_abandoned_constrained_step_is_skipped(monkeypatch):
    """The driver's step failed before its bitmask (None in its place): the follower does
    not sample it and goes on with the next step."""
    log = _follow([_Step("1"), _Step("2"), None, _Step("3"), None], True, constrained={"2"})
    assert log == ["launch 1", "launch 2", "launch 3", "result 1", "result 3"]


@pytest.fixture
def channel(monkeypatch):
    monkeypatch.setattr(rank_core.ps, "get_tp_cpu_group", lambda: None)
    monkeypatch.setattr(rank_core.ps, "get_tp_src_rank", lambda: 0)
    return rank_core.TPStepChannel()


def test_step_messages_round_trip(channel):
    from tandem.core.sched_output import NewRequestData, ScheduledSequence, SchedulerOutput
    from tandem.sampling_params import SamplingParams
    from tandem.structured_output.bitmask import GrammarBitmask

    new = NewRequestData(7, [1, 2, 3], [4], SamplingParams(temperature=0.7, top_k=5, seed=3, stop=["x"]), True)
    so = SchedulerOutput(11, [ScheduledSequence(7, 0, 3, [1, 2, 3], False, True, [5, 6], new),
                              ScheduledSequence(8, 40, 1, [], True, True, [])], 4,
                         preempted_seq_ids=[2], finished_seq_ids=[3], structured_output_seq_ids=[8])
    assert channel._steps.decode(channel._enc.encode(so)) == so
    assert channel._steps.decode(channel._enc.encode(None)) is None
    mask = GrammarBitmask([8, 9], torch.tensor([[-1, 0, 5], [1, 2, -2**31]], dtype=torch.int32))
    got = channel._bitmasks.decode(channel._enc.encode(mask))
    assert got.seq_ids == [8, 9] and got.bitmask.dtype == torch.int32 and torch.equal(got.bitmask, mask.bitmask)
    got.bitmask[0, 0] = 3  # the runner may write to it (pinning, in place)
    empty = channel._bitmasks.decode(channel._enc.encode(GrammarBitmask([], torch.zeros(0, 3, dtype=torch.int32))))
    assert empty.bitmask.shape == (0, 3) and empty.bitmask.dtype == torch.int32
    assert channel._bitmasks.decode(channel._enc.encode(None)) is None


def test_only_int32_tensors_cross(channel):
    from tandem.structured_output.bitmask import GrammarBitmask

    with pytest.raises(TypeError, match="only int32 tensors"):
        channel._enc.encode(GrammarBitmask([1], torch.zeros(1, 2, dtype=torch.float32)))
