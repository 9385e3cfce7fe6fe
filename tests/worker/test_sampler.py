"""The sampler's tie rule: every deterministic selection picks the same token on exact ties."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tandem.worker.sampler import SamplingBatch, sample

V = 64
TIED = (7, 40, 41)  # token ids sharing the maximal logit; 7 must win


def make_batch(rows: list[dict]) -> SamplingBatch:
    """A SamplingBatch for rows of SamplingParams-like dicts (temperature, top_k, top_p, min_p)."""
    temp = [r.get("temperature", 1.0) for r in rows]
    greedy = [t < 1e-5 for t in temp]
    top_k = [r.get("top_k", 0) or V for r in rows]
    top_p = [r.get("top_p", 1.0) for r in rows]
    min_p = [r.get("min_p", 0.0) for r in rows]
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
    return SamplingBatch(
        temperature=f32(temp), top_k=torch.tensor(top_k), top_p=f32(top_p), min_p=f32(min_p),
        all_greedy=all(greedy), all_random=not any(greedy),
        greedy_mask=None if all(greedy) or not any(greedy) else torch.tensor(greedy),
        need_top_k=any(k < V for k in top_k), need_top_p=any(p < 1 for p in top_p), need_min_p=any(p > 0 for p in min_p),
        penalty_rows=None, penalty_slots=None, presence=None, frequency=None, repetition=None, bias=None,
        seeded=[], max_num_logprobs=-1)


def tied_logits(dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """One row ``[V]`` of logits in ``dtype`` (as the model emits them, then fp32) whose
    maximum is shared exactly by the tokens ``TIED``; the runner-up is one step of the
    bf16 grid below (a near miss, not a tie)."""
    x = (torch.randn(V, generator=gen) * 2).to(dtype)
    top = torch.tensor(12.0, dtype=dtype)
    x = x.clamp(max=8.0)
    x[list(TIED)] = top
    x[3] = 12.0 - 0.0625
    return x.float()


DETERMINISTIC = [
    dict(temperature=0.0),
    dict(temperature=1e-7),  # below the greedy epsilon
    dict(temperature=1e-4),  # every other probability underflows: the tied tokens alone are left
    dict(temperature=1.0, top_k=1),
    dict(temperature=0.7, top_k=1),
    dict(temperature=1.0, top_p=1e-9),
    dict(temperature=1.5, top_p=1e-6, top_k=5),
    dict(temperature=1.0, min_p=1.0),
    dict(temperature=2.0, min_p=1.0, top_k=50),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", DETERMINISTIC, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_deterministic_modes_break_ties_to_the_lowest_id(dtype, mode):
    gen = torch.Generator().manual_seed(0)
    for trial in range(4):
        torch.manual_seed(trial)
        logits = tied_logits(dtype, gen)
        alone = sample(logits[None].clone(), make_batch([mode]), None, None).sampled
        assert alone.tolist() == [TIED[0]]
        # Batched with every other deterministic mode and with random rows.
        others = [dict(temperature=1.0), dict(temperature=0.8, top_k=3), *DETERMINISTIC]
        rows = [mode, *others]
        noise = torch.randn(len(others), V, generator=gen)
        batch = torch.cat([logits[None], noise]).contiguous()
        got = sample(batch, make_batch(rows), None, None).sampled
        assert got[0].item() == TIED[0]
        assert got[3:].tolist() == greedy_of(noise[2:])


def greedy_of(logits: torch.Tensor) -> list[int]:
    return sample(logits.clone(), make_batch([dict(temperature=0.0)] * len(logits)), None, None).sampled.tolist()


@pytest.mark.parametrize("mode", [dict(temperature=1.0), dict(temperature=1.0, top_k=2), dict(temperature=1.0, top_k=3),
                                  dict(temperature=1.0, min_p=0.9)])
def test_random_modes_still_sample_among_ties(mode):
    """Only deterministic selections are tie-broken: top_k=2 over two tied tokens is a coin flip."""
    logits = torch.full((1, V), -30.0)
    logits[0, [5, 9]] = 4.0
    logits[0, 2] = 3.0 if mode.get("top_k") == 3 else -30.0
    seen = {sample(logits.clone(), make_batch([mode]), None, None).sampled.item() for _ in range(64)}
    assert {5, 9} <= seen


def test_masked_tokens_are_never_sampled_when_the_noise_is_zero(monkeypatch):
    """An Exp(1) draw of exactly 0 must not turn a dropped token's 0/0 into a NaN that argmax picks."""
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, *a, **k: self.zero_())
    logits = torch.zeros(1, V)
    logits[0, 11] = 5.0
    got = sample(logits, make_batch([dict(temperature=1.0, top_k=1, top_p=0.5)]), None, None).sampled
    assert got.item() == 11


def test_a_row_samples_the_same_bits_whatever_the_batch():
    """Issue 36: a seeded row (top-p, top-k, min-p) and a greedy row give the same token,
    logprobs and rank alone and among random rows of other parameters at any position."""
    from tandem.worker.sampler import token_seed

    vocab = 4096
    gen = torch.Generator().manual_seed(1)
    target_logits = torch.randn(vocab, generator=gen) * 3
    targets = [dict(temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, seed=11), dict(temperature=0.0)]

    def run(rows: list[dict], logits: torch.Tensor, pos: int) -> tuple:
        b = make_batch([{"top_k": vocab, **r} for r in rows])  # top_k = vocab: off
        b.seeded = [(i, token_seed(r["seed"], 3)) for i, r in enumerate(rows) if "seed" in r]
        b.max_num_logprobs = 5
        out = sample(logits, b, None, None)
        return (int(out.sampled[pos]), out.logprobs[pos].tolist(), out.logprob_token_ids[pos].tolist(),
                int(out.sampled_ranks[pos]))

    for target in targets:
        alone = run([target], target_logits[None], 0)
        for n in (2, 9, 64):
            others = [dict(temperature=float(t), top_p=0.95, seed=int(s)) if s % 2 else dict(temperature=0.0)
                      for t, s in zip(torch.rand(n - 1, generator=gen) + 0.1, torch.randint(0, 99, (n - 1,), generator=gen))]
            pos = int(torch.randint(0, n, (1,), generator=gen))
            rows = others[:pos] + [target] + others[pos:]
            logits = torch.randn(n, vocab, generator=gen) * 3
            logits[pos] = target_logits
            assert run(rows, logits, pos) == alone, (target, n, pos)


# ----------------------------------------------------------------- speculative decoding
@pytest.mark.parametrize("mode", DETERMINISTIC, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_target_distribution_of_a_deterministic_row_is_one_hot_on_the_lowest_tied_id(mode):
    """Draft verification then accepts and emits exactly the token plain sampling picks."""
    from tandem.worker.sampler import target_distribution

    logits = tied_logits(torch.float32, torch.Generator().manual_seed(1))[None, :]
    probs, greedy = target_distribution(logits, make_batch([mode]))
    assert greedy.tolist() == [TIED[0]]
    if not make_batch([mode]).all_greedy:
        assert probs[0, TIED[0]] == 1.0 and probs[0].sum() == 1.0


def test_target_distribution_is_what_sample_draws_from():
    """Random rows: the sampler's temperature / top-k / top-p / min-p distribution."""
    from tandem.worker.sampler import target_distribution

    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2)) * 3
    rows = [dict(temperature=0.7, top_k=10), dict(temperature=1.3, top_p=0.8), dict(temperature=1.0, min_p=0.1)]
    probs, _ = target_distribution(logits, make_batch(rows))
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    draws = torch.stack([sample(logits, make_batch(rows), None, None).sampled for _ in range(300)])
    support = probs > 0
    assert support.gather(1, draws.T).all()  # every plain sample lies in the target's support
    assert (probs[0] > 0).sum() == 10


def test_repeat_rows_repeats_per_position_and_refuses_per_token_state():
    from dataclasses import replace

    from tandem.worker.sampler import repeat_rows

    b = make_batch([dict(temperature=0.0), dict(temperature=0.5, top_k=3)])
    r = repeat_rows(b, [2, 3])
    assert r.temperature.tolist() == [0.0, 0.0, 0.5, 0.5, 0.5] and r.top_k.tolist() == [V, V, 3, 3, 3]
    assert r.greedy_mask.tolist() == [True, True, False, False, False]
    with pytest.raises(ValueError, match="repeat_rows"):
        repeat_rows(replace(b, seeded=[(0, 7)]), [1, 1])


def test_repeat_rows_carries_bias_and_allowed_tokens_to_every_position():
    """A sequence's logit bias and allowed token ids hold at each position it verifies:
    the repeated batch gives every position the distribution its sequence's row has."""
    from tandem.worker.sampler import repeat_rows, target_distribution

    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    b = make_batch([dict(temperature=0.8), dict(temperature=0.9, top_k=20), dict(temperature=1.1)])
    allowed = torch.zeros(2, V, dtype=torch.bool)
    allowed[0, [1, 5, 9]] = True
    allowed[1, 3:40] = True
    b = replace(b, bias=(torch.tensor([0, 2, 2]), torch.tensor([4, 7, 8]), torch.tensor([2.0, -1.5, 3.0])),
                allowed=(torch.tensor([1, 2]), allowed), max_num_logprobs=2)
    counts = [2, 1, 3]
    r = repeat_rows(b, counts)
    assert r.max_num_logprobs == 2
    expanded = logits.repeat_interleave(torch.tensor(counts), dim=0)
    probs, greedy = target_distribution(expanded, r)
    want, want_greedy = target_distribution(logits, b)
    index = torch.tensor([0, 0, 1, 2, 2, 2])
    assert torch.equal(probs, want[index]) and torch.equal(greedy, want_greedy[index])
    assert (probs[2][~allowed[0]] == 0).all()  # row 1's allowed tokens, at its one position
    assert (probs[3:][:, ~allowed[1]] == 0).all()


def test_repeat_rows_counts_the_drafts_before_each_position_into_the_penalties():
    """Position ``j`` of a verifying row is penalised as if its drafts before ``j`` had been
    sampled: the same distribution as the plain batch whose tables hold them."""
    from tandem.worker.sampler import repeat_rows, target_distribution

    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(2, V, generator=gen) * 2
    counts = torch.zeros(4, V, dtype=torch.int32)  # state rows 0..3; the batch uses rows 2 and 3
    counts[2, 5] = 2
    counts[3, 7] = 1
    prompt_mask = torch.zeros(4, V, dtype=torch.bool)
    prompt_mask[3, 11] = True
    b = replace(make_batch([dict(temperature=0.9), dict(temperature=0.0)]), penalty_rows=torch.tensor([0, 1]),
                penalty_slots=torch.tensor([2, 3]), presence=torch.tensor([0.5, 0.3]),
                frequency=torch.tensor([0.2, 0.4]), repetition=torch.tensor([1.1, 1.3]))
    drafts = [[5, 9], [7, 7, 12]]
    r = repeat_rows(b, [3, 4], drafts)
    expanded = logits.repeat_interleave(torch.tensor([3, 4]), dim=0)
    probs, greedy = target_distribution(expanded, r, counts, prompt_mask)
    position = 0
    for row, d in enumerate(drafts):
        for j in range(len(d) + 1):
            tables = counts.clone()
            for t in d[:j]:
                tables[2 + row, t] += 1
            one = replace(b, penalty_rows=torch.tensor([0]), penalty_slots=torch.tensor([2 + row]),
                          presence=b.presence[row:row + 1], frequency=b.frequency[row:row + 1],
                          repetition=b.repetition[row:row + 1],
                          temperature=b.temperature[row:row + 1], top_k=b.top_k[row:row + 1],
                          top_p=b.top_p[row:row + 1], min_p=b.min_p[row:row + 1], all_greedy=row == 1,
                          all_random=row == 0, greedy_mask=None)
            want, want_greedy = target_distribution(logits[row:row + 1], one, tables, prompt_mask)
            assert greedy[position] == want_greedy[0]
            if row == 0:  # the random row's probabilities (the greedy row's are a one-hot on it)
                assert torch.allclose(probs[position], want[0])
            position += 1
    with pytest.raises(ValueError, match="penalties need the drafts"):
        repeat_rows(b, [1, 1])
