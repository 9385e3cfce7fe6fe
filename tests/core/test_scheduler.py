from __future__ import annotations

from tandem.core.block_manager import KVCacheManager
from tandem.core.scheduler import Scheduler
from tandem.request import Request, RequestStatus
from tandem.sampling_params import SamplingParams


def _sched(num_blocks=64, block_size=4, budget=16, max_seqs=8, chunked=True):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(kv, max_seqs, budget, 1024, chunked)


def _req(n, max_tokens=8):
    return Request("r", list(range(100, 100 + n)), SamplingParams(), 0.0, max_tokens=max_tokens)


def test_chunked_prefill_respects_budget_and_samples_at_end():
    s = _sched(budget=16)
    r = _req(40)
    s.add_request(r)
    chunks = []
    for _ in range(3):
        out = s.schedule()
        (seq,) = out.scheduled
        chunks.append((seq.num_computed_tokens, seq.num_new_tokens, seq.sample))
    assert chunks == [(0, 16, False), (16, 16, False), (32, 8, True)]
    assert r.num_output_placeholders == 1


def test_one_step_ahead_decode_uses_previous_sample():
    s = _sched()
    r = _req(5)
    s.add_request(r)
    s.schedule()
    out = s.schedule()  # step 1's token not processed yet
    (seq,) = out.scheduled
    assert seq.uses_prev_sample and seq.token_ids == [] and seq.num_computed_tokens == 5
    assert r.num_output_placeholders == 2
    r.num_output_placeholders -= 1  # step 1's token reaches the host
    r.output_token_ids.append(7)
    out = s.schedule()
    (seq,) = out.scheduled
    assert seq.uses_prev_sample and seq.num_computed_tokens == 6


def test_never_scheduled_past_max_tokens():
    s = _sched()
    r = _req(3, max_tokens=2)
    s.add_request(r)
    assert s.schedule().scheduled
    assert s.schedule().scheduled  # second token
    assert not s.schedule().scheduled  # both tokens are placeholders: nothing more
    assert r.num_output_placeholders == 2


def test_fcfs_and_max_num_seqs():
    s = _sched(max_seqs=2, budget=100)
    reqs = [_req(4) for _ in range(3)]
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    assert [x.seq_id for x in out.scheduled] == [reqs[0].seq_id, reqs[1].seq_id]


def test_preemption_frees_blocks_and_requeues_latest():
    s = _sched(num_blocks=5, block_size=2, budget=100)  # 4 usable blocks = 8 tokens
    a, b = _req(3, max_tokens=10), _req(3, max_tokens=10)
    s.add_request(a)
    s.add_request(b)
    s.schedule()
    for r in (a, b):
        r.num_output_placeholders -= 1  # the token reaches the host
        r.output_token_ids.append(1)
    s.schedule()  # each now needs its 3rd block? 4 tokens -> 2 blocks each: fits
    for r in (a, b):
        r.num_output_placeholders -= 1  # the token reaches the host
        r.output_token_ids.append(1)
    out = s.schedule()  # 5 tokens -> 3 blocks each: one must go
    assert out.preempted_seq_ids == [b.seq_id]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.waiting[0] is b


def test_finish_is_idempotent_and_frees():
    s = _sched()
    r = _req(4)
    s.add_request(r)
    s.schedule()
    assert s.finish_request(r.seq_id, RequestStatus.FINISHED_ABORTED) is r
    assert s.finish_request(r.seq_id, RequestStatus.FINISHED_ABORTED) is None
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks - 1
    assert s.schedule().finished_seq_ids == [r.seq_id]


def _result(reqs, toks, logprobs=None):
    from tandem.outputs import ModelRunnerOutput

    return ModelRunnerOutput([r.seq_id for r in reqs], toks, logprobs)


def test_update_from_output_token_id_stops_and_frees():
    """The core's token-id checks: EOS (not before min_tokens), a stop token id (its id is
    the stop_reason), max_tokens; finished sequences are freed, late tokens dropped."""
    s = _sched()
    eos = SamplingParams(min_tokens=2)
    eos.all_stop_token_ids = {2}
    a = Request("a", [5, 6, 7], eos, 0.0, max_tokens=8)
    b = Request("b", [5, 6], SamplingParams(stop_token_ids=[9]), 0.0, max_tokens=8)
    c = Request("c", [5], SamplingParams(logprobs=1), 0.0, max_tokens=2)
    for r in (a, b, c):
        s.add_request(r)
    s.schedule()
    outs = s.update_from_output(_result([a, b, c], [2, 4, 3], [([2], [-0.5], 1), ([4], [-0.1], 1), ([3, 1], [-0.2, -1.0], 1)]))
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [("a", [2], None), ("b", [4], None),
                                                                             ("c", [3], None)]
    assert outs[0].new_logprobs is None and outs[2].new_logprobs == [([3, 1], [-0.2, -1.0], 1)]
    assert all(r.num_output_placeholders == 0 for r in (a, b, c))
    s.schedule()
    outs = s.update_from_output(_result([a, b, c], [2, 9, 3], [([2], [0.0], 1)] * 3))
    assert [(o.request_id, o.finish_reason, o.stop_reason) for o in outs] == [("a", "stop", None), ("b", "stop", 9),
                                                                           ("c", "length", None)]
    assert not s.requests and not s.kv.req_blocks
    assert s.update_from_output(_result([a], [1])) == []  # a token computed one step late is dropped


class _Grammar:
    """Stands in for StructuredOutputRequest: ready when told."""

    def __init__(self) -> None:
        self.ready = False

    def is_ready(self) -> bool:
        return self.ready


def test_request_waits_for_its_grammar_without_blocking_others():
    """A constrained request whose grammar still compiles stays waiting (in its place);
    requests behind it and running ones are scheduled; once compiled it runs, and its
    sampling sequence is listed in structured_output_seq_ids."""
    s = _sched(budget=64)
    constrained, free = _req(5), _req(6)
    constrained.structured_output = _Grammar()
    s.add_request(constrained)
    s.add_request(free)
    out = s.schedule()
    assert [q.seq_id for q in out.scheduled] == [free.seq_id]
    assert out.structured_output_seq_ids == []
    assert list(s.waiting) == [constrained]
    constrained.structured_output.ready = True
    out = s.schedule()
    assert {q.seq_id for q in out.scheduled} == {free.seq_id, constrained.seq_id}
    assert out.structured_output_seq_ids == [constrained.seq_id]


def test_compiling_requests_keep_fcfs_order():
    s = _sched(budget=64)
    a, b, c = _req(4), _req(4), _req(4)
    a.structured_output, b.structured_output = _Grammar(), _Grammar()
    for r in (a, b, c):
        s.add_request(r)
    s.schedule()
    assert list(s.waiting) == [a, b]


class _Matcher:
    """Stands in for StructuredOutputRequest: accepts ``allowed`` in order, then is
    finished; a refused token finishes it too."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed, self.accepted, self.finished = allowed, [], False
        self.forced_stop = None  # as StructuredOutputRequest: no stop token forced over min_tokens
        self.refused = False
        self.failure = None  # as StructuredOutputRequest: its matcher has not failed

    def is_ready(self) -> bool:
        return True


class _Manager:
    """Stands in for StructuredOutputManager: records each batched accept."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[str, int]]] = []

    def accept_tokens(self, reqs, toks) -> None:
        self.calls.append([(r.request_id, t) for r, t in zip(reqs, toks)])
        for r, t in zip(reqs, toks):
            g = r.structured_output
            if len(g.accepted) < len(g.allowed) and g.allowed[len(g.accepted)] == t:
                g.accepted.append(t)
                g.finished = g.accepted == g.allowed
            else:  # refused: the token is left out of the output and the grammar ends it
                g.finished = g.refused = True


def test_update_from_output_advances_grammars_and_stops_when_complete():
    """The core's output update advances the constrained sequences' grammars by their
    tokens, all of a step in one batched call (free sequences left out); a complete
    grammar (or a token it refuses) finishes the sequence as "stop" and frees it, even
    with ignore_eos and max_tokens left."""
    manager = _Manager()
    s = Scheduler(KVCacheManager(64, 4), 8, 16, 1024, True, manager)
    a = Request("a", [5, 6], SamplingParams(ignore_eos=True), 0.0, max_tokens=8)
    b = Request("b", [5, 7], SamplingParams(), 0.0, max_tokens=8)
    free = Request("free", [5, 8], SamplingParams(), 0.0, max_tokens=8)
    a.structured_output, b.structured_output = _Matcher([3, 4]), _Matcher([3, 4])
    for r in (a, free, b):
        s.add_request(r)
    assert s.schedule().structured_output_seq_ids == [a.seq_id, b.seq_id]
    outs = s.update_from_output(_result([a, free, b], [3, 1, 9]))
    assert manager.calls == [[("a", 3), ("b", 9)]]
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [
        ("a", [3], None), ("free", [1], None), ("b", [], "stop")]
    assert a.structured_output.accepted == [3]
    s.schedule()
    outs = s.update_from_output(_result([a, free], [4, 1]))
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [("a", [4], "stop"), ("free", [1], None)]
    assert list(s.requests) == [free.seq_id]


def test_grammars_advanced_first_are_not_advanced_again():
    """The engine core advances a step's grammars before filling the next bitmask, then
    takes in the rest of the step: each token reaches its grammar once."""
    manager = _Manager()
    s = Scheduler(KVCacheManager(64, 4), 8, 16, 1024, True, manager)
    a = Request("a", [5, 6], SamplingParams(), 0.0, max_tokens=8)
    a.structured_output = _Matcher([3, 4])
    s.add_request(a)
    s.schedule()
    result = _result([a], [3])
    s.advance_grammars(result)
    outs = s.update_from_output(result, grammars_advanced=True)
    assert manager.calls == [[("a", 3)]] and a.structured_output.accepted == [3]
    assert [(o.new_token_ids, o.finish_reason) for o in outs] == [([3], None)]


# ------------------------------------------------------------------ virtual engines (pipeline parallelism)
def _ve_sched(max_seqs=8, engines=2):
    return Scheduler(KVCacheManager(64, 4), max_seqs, 64, 1024, True, max_concurrent_batches=engines)


def _take(s, so, tok=7):
    from tandem.outputs import ModelRunnerOutput

    ids = [seq.seq_id for seq in so.scheduled if seq.sample]
    return s.update_from_output(ModelRunnerOutput(ids, [tok] * len(ids)))


def test_virtual_engines_batch_disjoint_halves_of_the_sequences_in_turn():
    """Two batches in flight hold different sequences, half each; an engine's next batch
    continues its own sequences from host-known tokens (never a placeholder)."""
    s = _ve_sched()
    reqs = [_req(5) for _ in range(4)]
    for r in reqs:
        s.add_request(r)
    a, b = s.schedule(0), s.schedule(1)
    ids_a, ids_b = {q.seq_id for q in a.scheduled}, {q.seq_id for q in b.scheduled}
    assert len(ids_a) == len(ids_b) == 2 and ids_a | ids_b == {r.seq_id for r in reqs}
    assert [r.virtual_engine for r in reqs] == [0, 0, 1, 1]
    _take(s, a)
    again = s.schedule(0)
    assert {q.seq_id for q in again.scheduled} == ids_a
    assert all(not q.uses_prev_sample and q.token_ids == [7] for q in again.scheduled)


def test_virtual_engines_share_max_num_seqs_and_admit_late_requests_where_there_is_room():
    s = _ve_sched(max_seqs=4)
    reqs = [_req(3) for _ in range(10)]
    for r in reqs:
        s.add_request(r)
    assert [len(s.schedule(e).scheduled) for e in (0, 1)] == [2, 2]
    assert len(s.waiting) == 6
    one = _ve_sched()
    first = _req(3)
    one.add_request(first)
    _take(one, one.schedule(0))
    late = _req(3)
    one.add_request(late)
    # Engine 0 holds its share (1 of 2): it runs its sequence; engine 1 admits the late one.
    assert [q.seq_id for q in one.schedule(0).scheduled] == [first.seq_id]
    assert [q.seq_id for q in one.schedule(1).scheduled] == [late.seq_id] and late.virtual_engine == 1
