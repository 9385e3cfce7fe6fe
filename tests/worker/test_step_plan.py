"""The step plan: DBO thresholds, measured splits, graph vs eager, padding and the
cross-rank agreement, decided in one place."""

from __future__ import annotations

import pytest

from tandem.worker import step_plan
from tandem.worker.step_plan import DBOPolicy, StepMode, StepPlanner, UBatchSlice, ubatch_slices


def test_thresholds_pick_the_split():
    p = StepPlanner(DBOPolicy(decode_token_threshold=4, prefill_token_threshold=16))
    assert p.plan(3, decode_only=True).ubatches is None
    plan = p.plan(5, decode_only=True)
    assert plan.mode is StepMode.EAGER and plan.padded_tokens == 5
    assert plan.ubatches == (UBatchSlice(0, 2), UBatchSlice(2, 5))
    assert not p.plan(15, decode_only=False).split and p.plan(16, decode_only=False).split
    assert p.plan(0, decode_only=False).mode is StepMode.IDLE
    assert not StepPlanner(None).plan(600, decode_only=False).split  # DBO off


def test_measured_prefill_split_turns_prefill_splits_off(monkeypatch):
    monkeypatch.setattr(step_plan.ps, "forward_min", lambda v: v)
    dbo = DBOPolicy(decode_token_threshold=4, prefill_token_threshold=16)
    p = StepPlanner(dbo)
    assert dbo.set_prefill_split(plain_ms=1.0, split_ms=2.0) is False
    assert not p.plan(64, decode_only=False).split
    assert p.plan(64, decode_only=True).split  # eager decode steps follow the thresholds
    assert dbo.prefill_split_timings == (1.0, 2.0)


def test_graph_sizes_pad_and_carry_the_capture_time_split(monkeypatch):
    dbo = DBOPolicy(decode_token_threshold=8)
    sizes = [1, 2, 4, 8, 16]
    assert dbo.graph_split_candidates(sizes) == {8, 16}
    monkeypatch.setattr(step_plan.ps, "forward_min", lambda v: 0)  # some rank found it slower
    assert not dbo.keep_split(8, plain_ms=2.0, split_ms=1.0)
    p = StepPlanner(dbo, sizes, {16})
    plan = p.plan(5, decode_only=True)
    assert (plan.mode, plan.padded_tokens, plan.ubatches) == (StepMode.GRAPH, 8, None)
    plan = p.plan(9, decode_only=True)
    assert (plan.mode, plan.padded_tokens, plan.ubatches) == (StepMode.GRAPH, 16, ubatch_slices(16))
    assert p.plan(17, decode_only=True).mode is StepMode.EAGER  # above the largest capture size
    assert p.plan(4, decode_only=False).mode is StepMode.EAGER  # prefill tokens


@pytest.mark.parametrize("mine,other,want", [
    # (tokens, decode only) on this rank and the other -> (mode, padded, split) here.
    ((5, True), (12, True), (StepMode.GRAPH, 16, True)),  # the largest batch's size, its split form
    ((0, False), (5, True), (StepMode.GRAPH, 8, False)),  # idle rank replays padding
    ((5, True), (40, False), (StepMode.EAGER, 40, False)),  # one eager rank: every rank eager, padded
    ((40, False), (40, False), (StepMode.EAGER, 40, True)),  # both want a split
    ((0, False), (40, False), (StepMode.EAGER, 40, True)),  # an idle rank does not veto it
    ((0, False), (0, False), (StepMode.IDLE, 0, False)),
])
def test_data_parallel_ranks_agree(monkeypatch, mine, other, want):
    """The all-reduce of the two ranks' views, faked: MAX over [no split, tokens, no graph]."""
    dbo = DBOPolicy(decode_token_threshold=8, prefill_token_threshold=16)
    other_planner = StepPlanner(dbo, [1, 2, 4, 8, 16], {16})
    other_graph_ok = other[0] == 0 or (other[1] and other[0] <= 16)
    other_view = (other[0], other_planner._wants_split(other[0], other[1], other_graph_ok), other_graph_ok)

    def agree(group, n, wants_split, graph_ok):
        return max(n, other_view[0]), wants_split and other_view[1], graph_ok and other_view[2]

    monkeypatch.setattr(step_plan, "agree_across_dp", agree)
    plan = StepPlanner(dbo, [1, 2, 4, 8, 16], {16}, dp_group=object()).plan(*mine)
    assert (plan.mode, plan.padded_tokens, plan.split) == want


def test_cpu_forwards_with_prompt_tokens_are_padded_to_the_minimum():
    """A prompt's last token alone after a prefix-cache hit runs 16 rows, as it ran inside
    the whole prompt (MKL's fp32 GEMM rounds 1-11 rows otherwise); decodes are not padded."""
    p = StepPlanner(min_prompt_tokens=step_plan.CPU_MIN_PROMPT_TOKENS)
    assert p.plan(1, decode_only=True, with_prompt=True).padded_tokens == 16
    assert p.plan(3, decode_only=False, with_prompt=True).padded_tokens == 16
    plan = p.plan(1, decode_only=True)
    assert plan.padded_tokens == 1 and plan.num_tokens == 1
    assert p.plan(40, decode_only=False, with_prompt=True).padded_tokens == 40
    assert StepPlanner().plan(1, decode_only=True, with_prompt=True).padded_tokens == 1
