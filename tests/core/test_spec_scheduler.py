"""The scheduler's side of speculative decoding (synchronous, stage 1 of issue 46): drafts
for decoding sequences, their KV slots, the variable number of tokens a step returns,
the take-back of rejected drafts, and the prefix cache only ever holding confirmed
tokens."""

from __future__ import annotations

from tandem.core.block_manager import KVCacheManager, hash_block_tokens
from tandem.core.scheduler import Scheduler
from tandem.outputs import ModelRunnerOutput
from tandem.request import Request, RequestStatus
from tandem.sampling_params import SamplingParams
from tandem.spec_decode.ngram_proposer import NgramProposer

# Repeats itself: the bigram (1, 2) is followed by 3, 4, 5, 6 earlier in the prompt.
PROMPT = [1, 2, 3, 4, 5, 6, 7, 1, 2]


def _sched(num_blocks=64, block_size=4, budget=64, k=4, max_model_len=1024):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(kv, 8, budget, max_model_len, proposer=NgramProposer(k, 1, 2))


def _req(prompt=PROMPT, max_tokens=32, params=None):
    return Request("r", list(prompt), params or SamplingParams(temperature=0), 0.0, max_tokens=max_tokens)


def _prefill(s, r):
    s.add_request(r)
    (seq,) = s.schedule().scheduled
    assert seq.sample and not seq.spec_token_ids
    s.update_from_output(ModelRunnerOutput([r.seq_id], [3]))  # the model agrees with the pattern


def _verify(s, r, tokens):
    """One decode step of ``r``; the runner emitted ``tokens``. Returns the scheduled sequence."""
    (seq,) = s.schedule().scheduled
    out = ModelRunnerOutput([r.seq_id], [tokens[0]])
    if seq.num_drafts:
        out.accepted_token_ids, out.num_draft_tokens = {0: tokens}, {0: seq.num_drafts}
    return seq, s.update_from_output(out)


def test_decode_gets_drafts_and_kv_slots_for_them():
    s = _sched()
    r = _req()
    _prefill(s, r)
    (seq,) = s.schedule().scheduled
    assert seq.spec_token_ids == [4, 5, 6, 7]  # after the earlier (2, 3)
    assert seq.token_ids == [3] and seq.num_new_tokens == 5 and seq.sample
    assert r.num_computed_tokens == 10 + 4
    assert len(s.kv.req_blocks[r.seq_id]) * 4 >= 14


def test_accepted_tokens_advance_and_rejected_drafts_are_taken_back():
    s = _sched()
    r = _req()
    _prefill(s, r)
    _, outs = _verify(s, r, [4, 5, 9])  # two drafts accepted, then a correction
    assert outs[0].new_token_ids == [4, 5, 9]
    assert r.output_token_ids == [3, 4, 5, 9]
    assert r.num_computed_tokens == 9 + 1 + 2  # (before) + the step's input token + the accepted drafts
    assert r.spec_token_ids == [] and r.num_output_placeholders == 0
    assert (s.num_draft_tokens, s.num_accepted_tokens) == (4, 2)
    (seq,) = s.schedule().scheduled
    assert seq.num_computed_tokens == 12 and seq.token_ids == [9]  # the rejected slots are written again


def test_drafts_are_capped_by_max_tokens_context_and_budget():
    s = _sched()
    r = _req(max_tokens=3)  # 1 sampled, 2 left: 1 sample + 1 draft
    _prefill(s, r)
    (seq,) = s.schedule().scheduled
    assert seq.spec_token_ids == [4]
    s = _sched(max_model_len=12)  # 10 tokens known: room for 2 more
    r = _req()
    _prefill(s, r)
    (seq,) = s.schedule().scheduled
    assert seq.spec_token_ids == [4]
    s = _sched(budget=3)
    r = _req(prompt=PROMPT[:3] + [1, 2])  # prefilled over two steps with budget 3
    s.add_request(r)
    s.schedule()
    s.schedule()
    s.update_from_output(ModelRunnerOutput([r.seq_id], [3]))
    (seq,) = s.schedule().scheduled
    assert seq.num_new_tokens == 3 and seq.spec_token_ids == [1, 2]


def test_stop_token_inside_the_accepted_run_ends_there_and_frees():
    p = SamplingParams(temperature=0, stop_token_ids=[5])
    s = _sched()
    r = _req(params=p)
    _prefill(s, r)
    _, outs = _verify(s, r, [4, 5, 6, 7, 8])
    assert outs[0].new_token_ids == [4, 5] and outs[0].finish_reason == "stop" and outs[0].stop_reason == 5
    assert r.output_token_ids == [3, 4, 5] and r.status == RequestStatus.FINISHED_STOPPED
    assert not s.kv.req_blocks and s.kv.pool.num_free_blocks == s.kv.pool.num_blocks - 1


def test_max_tokens_inside_the_run_ends_there():
    s = _sched()
    r = _req(max_tokens=3)
    _prefill(s, r)
    _, outs = _verify(s, r, [4, 5])
    assert r.output_token_ids == [3, 4, 5] and outs[0].finish_reason == "length"


def test_no_drafts_below_min_tokens():
    s = _sched()
    r = _req(params=SamplingParams(temperature=0, min_tokens=3))
    _prefill(s, r)
    (seq,) = s.schedule().scheduled
    assert not seq.spec_token_ids  # 1 output token < min_tokens


def test_drafts_never_preempt_another_sequence():
    s = _sched(num_blocks=7, block_size=4)  # 6 usable blocks
    a, b = _req(), _req(prompt=[8] * 9)
    s.add_request(a)
    s.add_request(b)
    s.schedule()  # 3 blocks each
    s.update_from_output(ModelRunnerOutput([a.seq_id, b.seq_id], [3, 8]))
    out = s.schedule()  # a's drafts would need a 4th block: none free
    assert not out.preempted_seq_ids
    assert [q.spec_token_ids for q in out.scheduled] == [[], []]


def test_preemption_drops_drafts_and_frees_every_block():
    s = _sched()
    r = _req()
    _prefill(s, r)
    s.schedule()
    s._preempt(s.running.pop())
    assert r.spec_token_ids == [] and r.num_computed_tokens == 0
    s.finish_request(r.seq_id, RequestStatus.FINISHED_ABORTED)
    assert not s.kv.req_blocks and s.kv.pool.num_free_blocks == s.kv.pool.num_blocks - 1


def test_only_confirmed_tokens_enter_the_prefix_cache():
    """Drafts filled block 2 (positions 8..11) and were all rejected: the block is cached
    only once confirmed tokens fill it, under the hash of those tokens."""
    s = _sched()
    r = _req()
    _prefill(s, r)
    _verify(s, r, [0])  # every draft rejected; positions 10..13 hold rejected K/V
    cached = {b.block_hash for b in s.kv.req_blocks[r.seq_id] if b.block_hash is not None}
    tokens = r.all_token_ids
    assert len(tokens) == 11

    def chain(n):
        h, out = None, []
        for i in range(n):
            h = hash_block_tokens(h, tuple(tokens[4 * i: 4 * i + 4]))
            out.append(h)
        return out

    assert cached == set(chain(2))
    s.schedule()  # hashes what the next step makes known, nothing more
    cached = {b.block_hash for b in s.kv.req_blocks[r.seq_id] if b.block_hash is not None}
    assert cached == set(chain(len(tokens) // 4))


# ----------------------------------------------------------------- drafts of a draft model
def test_draft_model_drafts_come_from_the_output_with_lookahead_slots():
    """With a draft model the runner returns each sampling sequence's next drafts; the
    scheduler verifies them next step and reserves K slots past every sampling step for the
    draft model's K/V (never past the context)."""
    kv = KVCacheManager(64, 4)
    s = Scheduler(kv, 8, 64, 1024, num_lookahead_tokens=3)
    r = _req()
    s.add_request(r)
    (seq,) = s.schedule().scheduled
    assert seq.sample and len(kv.req_blocks[r.seq_id]) == 3  # 9 prompt tokens + 3 lookahead in blocks of 4
    s.update_from_output(ModelRunnerOutput([r.seq_id], [3], draft_token_ids=[[4, 5, 6]]))
    assert r.draft_token_ids == [4, 5, 6]
    (seq,) = s.schedule().scheduled
    assert seq.spec_token_ids == [4, 5, 6] and seq.num_new_tokens == 4
    assert len(kv.req_blocks[r.seq_id]) * 4 >= 10 + 3 + 3
    s.update_from_output(ModelRunnerOutput([r.seq_id], [4], accepted_token_ids={0: [4, 8]}, num_draft_tokens={0: 3},
                                           draft_token_ids=[[9, 9, 9]]))
    assert r.output_token_ids == [3, 4, 8] and r.num_computed_tokens == 11 and r.draft_token_ids == [9, 9, 9]


def test_lookahead_never_passes_the_context_nor_costs_a_block_nobody_has():
    kv = KVCacheManager(4, 4)  # 3 usable blocks of 4 tokens
    s = Scheduler(kv, 8, 64, 12, num_lookahead_tokens=3)
    a = _req(prompt=[1, 2, 3, 4], max_tokens=2)
    s.add_request(a)
    s.schedule()
    assert len(kv.req_blocks[a.seq_id]) == 2  # 4 tokens + 3 lookahead
    s.update_from_output(ModelRunnerOutput([a.seq_id], [3], draft_token_ids=[[4, 5, 6]]))
    b = Request("b", [5, 6, 7, 8], SamplingParams(temperature=0), 0.0, max_tokens=2)
    s.add_request(b)
    out = s.schedule()
    # a (no room for a draft before max_tokens) keeps its lookahead in its 2 blocks; b gets
    # the last block, without lookahead.
    assert [(q.seq_id, q.spec_token_ids) for q in out.scheduled] == [(a.seq_id, []), (b.seq_id, [])]
    assert len(kv.req_blocks[a.seq_id]) == 2
    assert len(kv.req_blocks[b.seq_id]) == 1 and kv.pool.num_free_blocks == 0
    c = _req(prompt=list(range(1, 10)), max_tokens=8)
    s2 = Scheduler(KVCacheManager(64, 4), 8, 64, 12, num_lookahead_tokens=3)
    s2.add_request(c)
    s2.schedule()
    assert len(s2.kv.req_blocks[c.seq_id]) == 3  # 9 + 3 = the context: no more


# ----------------------------------------------------------------- drafts kept on the device
def _draft_sched(k=3, **kw):
    return Scheduler(KVCacheManager(64, 4), 8, 64, kw.pop("max_model_len", 1024), num_lookahead_tokens=k, **kw)


def _running_ahead(k=3, prompt=PROMPT, max_tokens=32, params=None):
    """A sequence whose prompt step (proposing drafts) is in flight, and the step scheduled
    behind it (one step ahead, as the engine core runs it)."""
    s = _draft_sched(k)
    r = _req(prompt=prompt, max_tokens=max_tokens, params=params)
    s.add_request(r)
    s.schedule()
    (seq,) = s.schedule().scheduled
    return s, r, seq


def test_the_step_behind_one_in_flight_verifies_the_runners_drafts_as_if_all_were_accepted():
    s, r, seq = _running_ahead()
    # Its input is the prompt step's sample, then the 3 drafts proposed after it: none on the host.
    assert seq.uses_prev_sample and seq.token_ids == [] and seq.spec_token_ids == []
    assert (seq.num_device_drafts, seq.num_new_tokens, seq.num_computed_tokens) == (3, 4, 9)
    assert r.num_output_placeholders == 1 + 1 + 3 and r.num_computed_tokens == 9 + 4
    assert len(s.kv.req_blocks[r.seq_id]) * 4 >= 13 + 3  # its 4 tokens and the drafts' lookahead
    s.update_from_output(ModelRunnerOutput([r.seq_id], [3]))  # the prompt step arrives
    assert r.output_token_ids == [3] and r.num_output_placeholders == 4
    (seq2,) = s.schedule().scheduled  # two ahead of the host: positions assume 3 accepted
    assert seq2.num_computed_tokens == 13 and seq2.num_device_drafts == 3
    # The first verification arrives: 1 of 3 drafts accepted, then a correction.
    s.update_from_output(ModelRunnerOutput([r.seq_id], [4], accepted_token_ids={0: [4, 7]},
                                           num_draft_tokens={0: 3}))
    assert r.output_token_ids == [3, 4, 7] and r.num_output_placeholders == 4
    assert r.num_computed_tokens == 13 + 4 - 2  # the 2 rejected drafts taken back
    assert (s.num_draft_tokens, s.num_accepted_tokens) == (3, 1)


def test_runner_drafts_respect_max_tokens_context_and_min_tokens_counting_tokens_in_flight():
    # max_tokens 4: 1 in flight (the prompt step's sample) leaves 3: the step's own token + 2 drafts.
    assert _running_ahead(max_tokens=4)[2].num_device_drafts == 2
    s = _draft_sched(max_model_len=12)
    r = _req()
    s.add_request(r)
    s.schedule()
    (seq,) = s.schedule().scheduled  # 9 known + 1 in flight + the step's token: room for 1 draft
    assert seq.num_device_drafts == 1
    # min_tokens 3: the token in flight makes 1, below it: no drafts (their stop tokens are masked per token).
    assert _running_ahead(params=SamplingParams(temperature=0, min_tokens=3))[2].num_device_drafts == 0
    assert _running_ahead(params=SamplingParams(temperature=0, min_tokens=1))[2].num_device_drafts == 3


def test_a_sequence_at_its_length_limit_counting_drafts_in_flight_waits_for_them():
    s, r, seq = _running_ahead(max_tokens=5)  # 1 + (1 + 3) in flight: the 5 it may produce
    assert r.num_output_placeholders == 5
    assert s.schedule().scheduled == []
    s.update_from_output(ModelRunnerOutput([r.seq_id], [3]))
    s.update_from_output(ModelRunnerOutput([r.seq_id], [4], accepted_token_ids={0: [4]}, num_draft_tokens={0: 3}))
    (seq,) = s.schedule().scheduled  # 2 produced, none in flight: it goes on from the host's tokens
    assert seq.token_ids == [4] and not seq.uses_prev_sample and seq.num_computed_tokens == 10


def test_preemption_with_drafts_in_flight_keeps_the_counts_consistent():
    s, r, seq = _running_ahead()
    s._preempt(s.running.pop())
    assert r.num_computed_tokens == 0 and r.num_device_drafts == 0
    s.update_from_output(ModelRunnerOutput([r.seq_id], [3]))
    s.update_from_output(ModelRunnerOutput([r.seq_id], [4], accepted_token_ids={0: [4]}, num_draft_tokens={0: 3}))
    assert r.num_computed_tokens == 0 and r.num_output_placeholders == 0  # nothing taken back below zero
    (again,) = s.schedule().scheduled  # recomputed from its prompt and the outputs it kept (a prefix hit first)
    assert again.new_request.output_token_ids == [3, 4]
    assert again.num_computed_tokens + again.num_new_tokens == 9 + 2 and not again.num_drafts


def test_a_running_constrained_sequence_needs_each_step_taken_in_before_drafting():
    class _Grammar:  # the scheduler only asks whether a sequence is constrained here
        pass

    s, r, _ = _running_ahead()
    assert s.wants_drafts() and not s.needs_outputs_to_draft()
    r.structured_output = _Grammar()
    assert s.needs_outputs_to_draft()
    assert Scheduler(KVCacheManager(64, 4), 8, 64, 1024, proposer=NgramProposer(3, 1, 2)).needs_outputs_to_draft()
