"""The scheduler's output is plain data: no live ``Request``, copies that later scheduler
updates do not reach."""

from __future__ import annotations

import msgspec

from tandem.core.block_manager import KVCacheManager
from tandem.core.sched_output import NewRequestData, SchedulerOutput
from tandem.core.scheduler import Scheduler
from tandem.request import Request
from tandem.sampling_params import SamplingParams


def _objects(x):
    """Every object reachable through struct fields, lists and tuples."""
    yield x
    if isinstance(x, msgspec.Struct):
        for f in msgspec.structs.fields(x):
            yield from _objects(getattr(x, f.name))
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _objects(v)


def test_scheduler_output_holds_copies_not_requests():
    s = Scheduler(KVCacheManager(64, 4), 8, 16, 1024, True)
    reqs = [Request(f"r{i}", list(range(100, 106 + i)), SamplingParams(prompt_logprobs=1), 0.0, index=i, max_tokens=8)
            for i in range(2)]
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    assert not any(isinstance(o, Request) for o in _objects(out))
    new = [seq.new_request for seq in out.scheduled]
    assert all(isinstance(d, NewRequestData) for d in new)
    assert [d.compute_prompt_logprobs for d in new] == [True, False]  # only the first of n
    # The scheduler keeps changing its requests; the handed-over step does not change.
    reqs[0].output_token_ids.append(7)
    reqs[0].prompt_token_ids.append(8)
    assert new[0].output_token_ids == [] and new[0].prompt_token_ids == list(range(100, 106))
    # What TP followers receive (tandem.engine.rank_core.TPStepChannel): the same step.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=SchedulerOutput) == out


def test_rescheduled_after_preemption_carries_its_outputs():
    r = Request("r", [1, 2, 3], SamplingParams(), 0.0, max_tokens=8)
    r.output_token_ids = [5, 6]
    d = NewRequestData.from_request(r)
    assert (d.output_token_ids, d.num_output_tokens) == ([5, 6], 2)
    r.output_token_ids.append(9)
    assert d.num_output_tokens == 2
