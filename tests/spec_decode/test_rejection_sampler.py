"""Rejection sampler: greedy equals the argmax reference; random sampling emits tokens that
follow the target distribution (chi-square, and the same check rejects wrong samplers);
layout, padding, seeding and argument errors."""

from __future__ import annotations

import pytest
import torch

from tandem.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, rejection_sample

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))]

V = 8
N = 200_000  # requests per distribution test
P_MIN = 1e-3  # a correct sampler's chi-square p-value stays above this
# Target at the two draft positions and the bonus position, and the two draft
# distributions: each differs from its target, token 7 is drafted but has no target
# mass (always rejected), token 0 has target mass but is never drafted (only the
# residual can emit it).
P_TARGET = torch.tensor([
    [0.20, 0.05, 0.30, 0.10, 0.15, 0.05, 0.15, 0.00],
    [0.05, 0.25, 0.05, 0.25, 0.10, 0.10, 0.10, 0.10],
    [0.10, 0.10, 0.10, 0.30, 0.05, 0.05, 0.20, 0.10],
])
Q_DRAFT = torch.tensor([
    [0.00, 0.20, 0.10, 0.20, 0.15, 0.15, 0.05, 0.15],
    [0.10, 0.05, 0.30, 0.05, 0.20, 0.10, 0.10, 0.10],
])


def chi_square_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness-of-fit p-value of ``samples`` (token ids) against
    ``probs [V]``; 0 when a token without probability appears."""
    counts = torch.bincount(samples, minlength=probs.shape[0]).double()
    probs = probs.double()
    if counts[probs == 0].any():
        return 0.0
    expected = probs * counts.sum()
    keep = probs > 0
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def two_draft_batch(gen: torch.Generator, one_hot: bool):
    """N requests with 2 drafts each, drawn from Q_DRAFT. ``one_hot``: no draft
    probabilities, each draft is then a deterministic proposal of its own request (drafts
    spread non-uniformly over the requests: with uniform drafts, sampling the recovered
    token from p instead of p without the draft happens to give p too)."""
    drafts = torch.stack([torch.multinomial(Q_DRAFT[i], N, replacement=True, generator=gen) for i in range(2)], dim=1)
    target = P_TARGET.repeat(N, 1)
    draft_probs = None if one_hot else Q_DRAFT.repeat(N, 1)
    return drafts.reshape(-1), [2] * N, target, draft_probs


def check_emitted_follow_target(out) -> None:
    """First token ~ target at position 1; second, given the first draft accepted, ~ target
    at position 2; third (bonus), given both accepted, ~ target at the bonus position."""
    tok, acc = out.token_ids, out.num_accepted
    assert chi_square_pvalue(tok[:, 0], P_TARGET[0]) > P_MIN
    assert chi_square_pvalue(tok[acc >= 1, 1], P_TARGET[1]) > P_MIN
    assert chi_square_pvalue(tok[acc == 2, 2], P_TARGET[2]) > P_MIN


def test_random_draft_distribution_preserves_target():
    gen = torch.Generator().manual_seed(1)
    drafts, counts, target, draft_probs = two_draft_batch(gen, one_hot=False)
    out = rejection_sample(drafts, counts, target, draft_probs, greedy=False, generator=gen)
    check_emitted_follow_target(out)
    # The first draft is accepted with probability sum(min(p, q)) (Leviathan et al. 2023, Def. 3.1).
    beta = torch.minimum(P_TARGET[0], Q_DRAFT[0]).sum().item()
    rate = (out.num_accepted >= 1).double().mean().item()
    assert abs(rate - beta) < 5 * (beta * (1 - beta) / N) ** 0.5


def test_one_hot_draft_distribution_preserves_target():
    gen = torch.Generator().manual_seed(2)
    drafts, counts, target, _ = two_draft_batch(gen, one_hot=True)
    out = rejection_sample(drafts, counts, target, None, greedy=False, generator=gen)
    check_emitted_follow_target(out)
    # A one-hot draft is accepted with the target's probability of the drafted token.
    expected = P_TARGET[0][drafts.view(N, 2)[:, 0]].double().mean().item()
    rate = (out.num_accepted >= 1).double().mean().item()
    assert abs(rate - expected) < 5 * (expected * (1 - expected) / N) ** 0.5


def wrong_first_token(kind: str, gen: torch.Generator) -> torch.Tensor:
    """The first emitted token of classic wrong samplers on the single-draft problem."""
    p, q = P_TARGET[0], Q_DRAFT[0]
    drafts = torch.multinomial(q, N, replacement=True, generator=gen)
    if kind == "always_accept":
        return drafts
    # One-hot: the draft is accepted with probability p(x), as it should be.
    q_x = 1.0 if kind == "one_hot_recovered_from_target" else q[drafts]
    accept = torch.rand(N, generator=gen) * q_x < p[drafts]
    from_target = torch.multinomial(p, N, replacement=True, generator=gen)  # instead of the residual
    return torch.where(accept, drafts, from_target)


@pytest.mark.parametrize("kind", ["always_accept", "recovered_from_target", "one_hot_recovered_from_target"])
def test_chi_square_check_rejects_wrong_sampler(kind):
    assert chi_square_pvalue(wrong_first_token(kind, torch.Generator().manual_seed(3)), P_TARGET[0]) < P_MIN


def reference_greedy(drafts: list[int], counts: list[int], target: torch.Tensor):
    """Per request: drafts accepted while equal to the row's argmax (lowest id on ties),
    then that row's argmax."""
    tokens, accepted, d, row = [], [], 0, 0
    for n in counts:
        out = []
        for j in range(n):
            best = int(target[row + j].argmax())
            if drafts[d + j] != best:
                out.append(best)
                break
            out.append(drafts[d + j])
        else:
            out.append(int(target[row + n].argmax()))
        tokens.append(out)
        accepted.append(len(out) - 1)
        d, row = d + n, row + n + 1
    return tokens, accepted


def tied_greedy_batch(gen: torch.Generator, counts: list[int], vocab: int = 16):
    """Probabilities from small integer scores (exact ties everywhere); each draft is the
    row's argmax with probability 1/2, else one of the row's other tokens, tied or not."""
    rows = sum(counts) + len(counts)
    scores = torch.randint(0, 4, (rows, vocab), generator=gen).float()
    target = scores / scores.sum(dim=-1, keepdim=True)
    draft_rows = [r + j for r, n in zip(_row_starts(counts), counts) for j in range(n)]
    best = target[draft_rows].argmax(dim=-1)
    other = (best + torch.randint(1, vocab, best.shape, generator=gen)) % vocab
    drafts = torch.where(torch.rand(best.shape, generator=gen) < 0.5, best, other)
    return drafts, target


def _row_starts(counts: list[int]) -> list[int]:
    starts, row = [], 0
    for n in counts:
        starts.append(row)
        row += n + 1
    return starts


def check_layout(out, drafts: torch.Tensor, counts: list[int]) -> None:
    """Accepted drafts, one emitted token, then placeholders, per request."""
    width = max(counts, default=0) + 1
    assert out.token_ids.shape == (len(counts), width) and out.token_ids.dtype == torch.int64
    assert out.num_accepted.dtype == torch.int64
    d = 0
    for r, n in enumerate(counts):
        a = int(out.num_accepted[r])
        row = out.token_ids[r].tolist()
        assert 0 <= a <= n
        assert row[:a] == drafts[d:d + a].tolist()
        assert row[a] != PLACEHOLDER_TOKEN_ID
        assert row[a + 1:] == [PLACEHOLDER_TOKEN_ID] * (width - a - 1)
        d += n


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_equals_argmax_reference(device):
    gen = torch.Generator().manual_seed(4)
    counts = [3, 0, 1, 5, 2, 0, 4, 4] * 25
    drafts, target = tied_greedy_batch(gen, counts)
    out = rejection_sample(drafts.to(device), counts, target.to(device), None, greedy=True)
    tokens, accepted = reference_greedy(drafts.tolist(), counts, target)
    width = max(counts) + 1
    assert out.token_ids.cpu().tolist() == [t + [PLACEHOLDER_TOKEN_ID] * (width - len(t)) for t in tokens]
    assert out.num_accepted.cpu().tolist() == accepted
    # The batch covers every outcome: a rejection at the first and at a later draft, and
    # all drafts accepted (bonus token).
    acc = out.num_accepted.cpu()
    n = torch.tensor(counts)
    assert ((acc == 0) & (n > 0)).any() and ((acc > 0) & (acc < n)).any() and ((acc == n) & (n > 0)).any()


def test_greedy_ties_take_lowest_id_and_bonus():
    target = torch.tensor([
        [0.1, 0.4, 0.1, 0.4],  # tie of 1 and 3: 1 is the greedy token
        [0.1, 0.4, 0.1, 0.4],
        [0.3, 0.1, 0.3, 0.3],  # bonus row: 0 wins the three-way tie
        [0.0, 0.5, 0.0, 0.5],  # request 1: draft 3 loses the tie to 1
        [0.2, 0.2, 0.2, 0.4],
    ])
    out = rejection_sample(torch.tensor([1, 1, 3]), [2, 1], target, None, greedy=True)
    assert out.token_ids.tolist() == [[1, 1, 0], [1, PLACEHOLDER_TOKEN_ID, PLACEHOLDER_TOKEN_ID]]
    assert out.num_accepted.tolist() == [2, 0]


def test_target_greedy_ids_override_probs_argmax():
    target = torch.full((3, 4), 0.25)
    ids = torch.tensor([2, 3, 1])
    out = rejection_sample(torch.tensor([2]), [1, 0], target, None, greedy=True, target_greedy_ids=ids)
    assert out.token_ids.tolist() == [[2, 3], [1, PLACEHOLDER_TOKEN_ID]]


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_greedy_rows_match_reference_and_layout(device):
    gen = torch.Generator().manual_seed(5)
    counts = [2, 0, 3, 1, 4, 0, 2, 3] * 10
    drafts, target = tied_greedy_batch(gen, counts)
    draft_probs = torch.rand(drafts.shape[0], target.shape[1], generator=gen)
    draft_probs /= draft_probs.sum(dim=-1, keepdim=True)
    greedy = torch.tensor([r % 3 == 0 for r in range(len(counts))])
    dev_gen = torch.Generator(device).manual_seed(6)
    out = rejection_sample(drafts.to(device), counts, target.to(device), draft_probs.to(device), greedy.to(device), generator=dev_gen)
    out.token_ids, out.num_accepted = out.token_ids.cpu(), out.num_accepted.cpu()
    check_layout(out, drafts, counts)
    tokens, accepted = reference_greedy(drafts.tolist(), counts, target)
    for r in torch.nonzero(greedy).flatten().tolist():
        assert out.token_ids[r, :len(tokens[r])].tolist() == tokens[r]
        assert int(out.num_accepted[r]) == accepted[r]


def test_random_layout_with_zero_drafts_and_placeholders():
    gen = torch.Generator().manual_seed(7)
    counts = [0, 3, 1, 0, 2, 5]
    vocab = 50
    rows = sum(counts) + len(counts)
    target = torch.softmax(torch.randn(rows, vocab, generator=gen), dim=-1)
    drafts = torch.randint(0, vocab, (sum(counts),), generator=gen)
    for draft_probs in (torch.softmax(torch.randn(sum(counts), vocab, generator=gen), dim=-1), None):
        out = rejection_sample(drafts, counts, target, draft_probs, greedy=False, generator=gen)
        check_layout(out, drafts, counts)
        assert out.token_ids[[0, 3], 1:].eq(PLACEHOLDER_TOKEN_ID).all()


def test_empty_batch_and_no_drafts():
    out = rejection_sample(torch.empty(0, dtype=torch.int64), [], torch.empty(0, V), None, greedy=False)
    assert out.token_ids.shape == (0, 1) and out.num_accepted.shape == (0,)
    target = torch.eye(V)[[5, 2]]
    out = rejection_sample(torch.empty(0, dtype=torch.int64), [0, 0], target, None, greedy=False)
    assert out.token_ids.tolist() == [[5], [2]] and out.num_accepted.tolist() == [0, 0]


def test_all_zero_residual_falls_back_to_target():
    # Draft probabilities at or above the target's everywhere (rounding taken to the
    # extreme): draft 2 is rejected half the time, and max(0, p - q) has no mass left.
    # Without the fallback the exponential race over all-zero weights returns token 0,
    # which has no target probability.
    target = torch.tensor([[0.0, 0.5, 0.5], [0.0, 0.5, 0.5]])
    draft_probs = torch.tensor([[0.0, 0.5, 1.0]])
    outs = [rejection_sample(torch.tensor([2]), [1], target, draft_probs, greedy=False, generator=torch.Generator().manual_seed(s))
            for s in range(40)]
    rejected = [o.token_ids[0, 0].item() for o in outs if o.num_accepted.item() == 0]
    assert rejected and 0 not in rejected


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_reproducible(device):
    gen = torch.Generator().manual_seed(8)
    vocab = 1000
    counts = [4, 2, 0, 3]
    rows = sum(counts) + len(counts)
    target = torch.softmax(torch.randn(rows, vocab, generator=gen) * 3, dim=-1).to(device)
    draft_probs = torch.softmax(torch.randn(sum(counts), vocab, generator=gen) * 3, dim=-1).to(device)
    drafts = torch.multinomial(draft_probs, 1, generator=torch.Generator(device).manual_seed(9)).flatten()

    def run(seed: int):
        out = rejection_sample(drafts, counts, target, draft_probs, greedy=False, generator=torch.Generator(device).manual_seed(seed))
        return out.token_ids.tolist(), out.num_accepted.tolist()

    assert run(10) == run(10)
    assert len({str(run(s)) for s in range(10, 15)}) > 1


@pytest.mark.parametrize("device", DEVICES)
def test_per_request_generator_independent_of_batch(device):
    gen = torch.Generator().manual_seed(11)
    vocab = 1000
    target = torch.softmax(torch.randn(4, vocab, generator=gen) * 3, dim=-1).to(device)  # 3 draft rows + bonus
    draft_probs = torch.softmax(torch.randn(3, vocab, generator=gen) * 3, dim=-1).to(device)
    drafts = torch.multinomial(draft_probs, 1, generator=torch.Generator(device).manual_seed(12)).flatten()
    other_target = torch.softmax(torch.randn(3, vocab, generator=gen), dim=-1).to(device)  # 2 draft rows + bonus
    other_q = torch.softmax(torch.randn(2, vocab, generator=gen), dim=-1).to(device)
    other_drafts = torch.randint(0, vocab, (2,), generator=gen).to(device)

    def seeded(seed: int) -> torch.Generator:
        return torch.Generator(device).manual_seed(seed)

    alone = rejection_sample(drafts, [3], target, draft_probs, greedy=False, generators={0: seeded(13)})
    batched = rejection_sample(
        torch.cat([other_drafts, drafts]), [2, 3], torch.cat([other_target, target]), torch.cat([other_q, draft_probs]),
        greedy=False, generator=seeded(99), generators={1: seeded(13)})
    assert batched.token_ids[1].tolist() == alone.token_ids[0].tolist()
    assert batched.num_accepted[1].item() == alone.num_accepted[0].item()
    runs = {str(rejection_sample(drafts, [3], target, draft_probs, greedy=False, generators={0: seeded(s)}).token_ids.tolist())
            for s in range(13, 18)}
    assert len(runs) > 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_no_host_sync():
    gen = torch.Generator().manual_seed(14)
    counts = [3, 0, 2]
    drafts, target = tied_greedy_batch(gen, counts)
    draft_probs = torch.softmax(torch.randn(drafts.shape[0], target.shape[1], generator=gen), dim=-1)
    drafts, target, draft_probs = drafts.cuda(), target.cuda(), draft_probs.cuda()
    greedy = torch.tensor([True, False, False], device="cuda")
    rejection_sample(drafts, counts, target, draft_probs, greedy)  # warm-up: allocator, pinned pool
    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rejection_sample(drafts, counts, target, draft_probs, greedy)
    finally:
        torch.cuda.set_sync_debug_mode(before)


@pytest.mark.parametrize("kwargs, field", [
    ({"draft_token_ids": torch.zeros(2, dtype=torch.int64)}, "draft_token_ids"),
    ({"num_draft_tokens": [2, -1, 2]}, "num_draft_tokens"),
    ({"target_probs": torch.full((5, V), 1 / V)}, "target_probs"),
    ({"draft_probs": torch.full((3, V + 1), 1 / V)}, "draft_probs"),
    ({"greedy": torch.tensor([True, False])}, "greedy"),
    ({"greedy": torch.tensor([1])}, "greedy"),
    ({"target_greedy_ids": torch.zeros(3, dtype=torch.int64)}, "target_greedy_ids"),
    ({"generators": {1: torch.Generator()}}, "generators"),
])
def test_inconsistent_shapes_raise(kwargs, field):
    args = {
        "draft_token_ids": torch.zeros(3, dtype=torch.int64), "num_draft_tokens": [3], "target_probs": torch.full((4, V), 1 / V),
        "draft_probs": torch.full((3, V), 1 / V), "greedy": False,
    }
    with pytest.raises(ValueError, match=field):
        rejection_sample(**{**args, **kwargs})
