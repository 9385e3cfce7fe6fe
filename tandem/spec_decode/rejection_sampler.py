"""Rejection sampling of speculative draft tokens, batched over requests on the device.

The algorithm is speculative sampling (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding", Algorithm 1 and Appendix A.1; Chen et al. 2023,
"Accelerating Large Language Model Decoding with Speculative Sampling", Algorithm 2): a
draft token ``x`` proposed with probability ``q(x)`` is accepted with probability
``min(1, p(x) / q(x))`` under the target's ``p``; at the first rejection the emitted token
is drawn from the residual ``normalize(max(0, p - q))``; when every draft is accepted a
bonus token is drawn from the target's distribution at the position after the last
draft. Each emitted token then follows the target's distribution exactly. Greedy requests
are the special case of a one-hot ``p`` on the target's argmax.

The batch layout follows vLLM V1's ``RejectionSampler``: the drafts of all requests are
flattened, and each request owns ``n + 1`` consecutive rows of the target's
probabilities (its ``n`` draft positions, then its bonus position).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

PLACEHOLDER_TOKEN_ID = -1


@dataclass
class RejectionSampleOutput:
    """``token_ids``: ``[num_reqs, max_spec_len + 1]`` int64: per request the accepted
    draft tokens, then the recovered token (first rejection) or bonus token (all
    accepted), then :data:`PLACEHOLDER_TOKEN_ID`; ``num_accepted``: ``[num_reqs]`` int64,
    the number of accepted draft tokens (a request emits ``num_accepted + 1`` tokens)."""

    token_ids: torch.Tensor
    num_accepted: torch.Tensor


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    greedy: bool | torch.Tensor,
    generator: torch.Generator | None = None,
    generators: Mapping[int, torch.Generator] | None = None,
    target_greedy_ids: torch.Tensor | None = None,
) -> RejectionSampleOutput:
    """Verify the draft tokens of a batch of requests; the emitted tokens follow the target.

    With ``R = len(num_draft_tokens)``, ``T = sum(num_draft_tokens)``, ``V`` the vocabulary
    and ``L = max(num_draft_tokens)`` (0 for an empty batch or no drafts):

    - ``draft_token_ids``: ``[T]`` int64, the drafts of request 0, then of request 1, ...
    - ``num_draft_tokens``: ``R`` host ints >= 0 (0: the request only takes its bonus
      token). They come from the scheduler and fix the output's width, which is therefore
      known without a device-to-host sync.
    - ``target_probs``: ``[T + R, V]`` float32, the target's probabilities after the
      request's temperature / top-k / top-p processing; request ``r`` owns the rows
      ``start_r + r .. start_r + r + n_r`` (``start_r`` = drafts of the requests before
      it): one per draft position, then its bonus position.
    - ``draft_probs``: ``[T, V]`` float32, the proposer's distribution each draft was drawn
      from; None for a deterministic proposer (n-gram), whose distribution is a one-hot on
      the proposed token: the draft is then accepted with probability ``p(x)`` and the
      residual is ``p`` with ``x`` removed.
    - ``greedy``: True (every request greedy: no random draws), False (every request
      random: no argmax), or a ``[R]`` bool tensor. A greedy request accepts a draft while
      it equals the target's greedy token and emits that token at its first mismatch, and
      the bonus position's greedy token when all drafts match: the tokens speculation-free
      greedy decoding gives. Rows the plain sampler treats as greedy (deterministic rows,
      :func:`tandem.worker.sampler.deterministic_rows`) belong in this mask too.
    - ``generator``: the source of the random draws (torch's default one when None).
    - ``generators``: request index -> generator (on the tensors' device) for seeded
      requests; such a request draws from it alone, first ``n_r`` uniforms (acceptance),
      then ``V`` exponentials (its recovered or bonus token), so its tokens depend on
      nothing else in the batch.
    - ``target_greedy_ids``: ``[T + R]`` int64, the target's greedy token of each row;
      when None, ``target_probs.argmax(-1)`` (lowest token id among equal maxima). Pass
      :func:`tandem.worker.sampler.greedy_select` of the processed logits for bit-exact
      agreement with speculation-free greedy decoding: distinct logits can round to equal
      probabilities.

    Random requests accept a draft ``x`` when ``u * q(x) < p(x)`` with ``u ~ U[0, 1)``
    (``P = min(1, p(x) / q(x))``, no division, so ``q(x) = 0`` and ``p(x) = 0`` need no
    special case), all accept decisions are made at once and a cumulative product keeps
    the accepted prefix, and only the one position per request that emits a
    non-draft token is sampled, by the exponential race ``argmax(w / E)``, ``E ~ Exp(1)``,
    which draws from ``w / sum(w)`` without normalizing. A residual that rounds to all
    zeros (``p`` and ``q`` equal up to rounding, yet ``x`` rejected) falls back to ``p``.

    Returns a :class:`RejectionSampleOutput` on ``target_probs``' device. Raises
    ValueError when the shapes disagree (the drafts' count with ``num_draft_tokens``, the
    rows of ``target_probs`` with ``T + R``, ``draft_probs`` with ``[T, V]``, ``greedy``
    or ``target_greedy_ids`` with their lengths), on a negative count, or on a
    ``generators`` key outside ``range(R)``.
    """
    counts = [int(n) for n in num_draft_tokens]
    num_reqs, num_drafts = len(counts), sum(counts)
    max_spec_len = max(counts, default=0)
    _check_inputs(draft_token_ids, counts, target_probs, draft_probs, greedy, generators, target_greedy_ids)
    device = target_probs.device

    # Through pinned memory, so that the copy does not wait for the device to drain.
    n = torch.tensor(counts, dtype=torch.int64, pin_memory=device.type == "cuda").to(device, non_blocking=True)
    starts = n.cumsum(0) - n
    req_ids = torch.arange(num_reqs, device=device)
    draft_req = torch.repeat_interleave(req_ids, n, output_size=num_drafts)
    # Target row of each draft: its flat index plus the bonus rows of the requests before it.
    draft_rows = torch.arange(num_drafts, device=device) + draft_req
    draft_token_ids = draft_token_ids.to(device=device, dtype=torch.int64)

    # Padded [R, L] views of the flat drafts; padding reads a valid index and is masked.
    pos = torch.arange(max_spec_len, device=device)
    valid = pos[None, :] < n[:, None]
    flat = (starts[:, None] + pos[None, :]).clamp_(max=max(num_drafts - 1, 0))

    mixed = isinstance(greedy, torch.Tensor)
    all_greedy = not mixed and bool(greedy)
    all_random = not mixed and not bool(greedy)
    if not all_random:
        if target_greedy_ids is None:
            greedy_ids = target_probs.argmax(dim=-1)
        else:
            greedy_ids = target_greedy_ids.to(device=device, dtype=torch.int64)
        greedy_accept = draft_token_ids == greedy_ids[draft_rows]
    if not all_greedy:
        p_x = target_probs[draft_rows, draft_token_ids]
        q_x = 1.0 if draft_probs is None else draft_probs[torch.arange(num_drafts, device=device), draft_token_ids]
        u = torch.rand(num_drafts, device=device, generator=generator)
        seeded = _seeded_spans(counts, generators)
        for gen, d0, d1, _ in seeded:
            u[d0:d1] = torch.rand(d1 - d0, device=device, generator=gen)
        random_accept = u * q_x < p_x

    if all_greedy:
        accept = greedy_accept
    elif all_random:
        accept = random_accept
    else:
        accept = torch.where(greedy[draft_req], greedy_accept, random_accept)

    accepted_prefix = torch.where(valid, accept[flat], False).to(torch.int32).cumprod(dim=1)
    num_accepted = accepted_prefix.sum(dim=1, dtype=torch.int64)
    # The one row per request that emits a non-draft token: the first rejected position,
    # or the bonus position when every draft was accepted.
    emit_rows = starts + req_ids + num_accepted

    if not all_random:
        greedy_tokens = greedy_ids[emit_rows]
    if not all_greedy:
        first_rejected = (starts + num_accepted).clamp_(max=max(num_drafts - 1, 0))
        random_tokens = _sample_emitted(
            target_probs, draft_token_ids, draft_probs, emit_rows, first_rejected, num_accepted < n, generator, seeded)
    if all_greedy:
        emitted = greedy_tokens
    elif all_random:
        emitted = random_tokens
    else:
        emitted = torch.where(greedy, greedy_tokens, random_tokens)

    token_ids = torch.full((num_reqs, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    kept = pos[None, :] < num_accepted[:, None]
    token_ids[:, :max_spec_len] = torch.where(kept, draft_token_ids[flat], PLACEHOLDER_TOKEN_ID)
    token_ids.scatter_(1, num_accepted[:, None], emitted[:, None])
    return RejectionSampleOutput(token_ids=token_ids, num_accepted=num_accepted)


def _sample_emitted(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    emit_rows: torch.Tensor,
    rejected_draft: torch.Tensor,
    rejected: torch.Tensor,
    generator: torch.Generator | None,
    seeded: list[tuple[torch.Generator, int, int, int]],
) -> torch.Tensor:
    """Per request, a token from the residual at its first rejected draft
    (``rejected_draft``, where ``rejected``), else from the target at its bonus row."""
    p = target_probs[emit_rows]
    if draft_token_ids.numel():
        if draft_probs is None:
            # max(0, p - onehot(x)) is p without x, since p(x) <= 1.
            tok = draft_token_ids[rejected_draft][:, None]
            weights = p.scatter(1, tok, torch.where(rejected[:, None], 0.0, p.gather(1, tok)))
        else:
            weights = (p - draft_probs[rejected_draft] * rejected[:, None]).clamp_min_(0.0)
        weights = torch.where(weights.sum(dim=-1, keepdim=True) > 0, weights, p)
    else:
        weights = p
    q = torch.empty_like(weights).exponential_(generator=generator)
    for gen, _, _, r in seeded:
        q[r].exponential_(generator=gen)
    # q = 0 would turn a zero weight's 0 / q into NaN, which argmax picks.
    return (weights / q.clamp_min_(torch.finfo(q.dtype).tiny)).argmax(dim=-1)


def _seeded_spans(
    counts: list[int], generators: Mapping[int, torch.Generator] | None,
) -> list[tuple[torch.Generator, int, int, int]]:
    """(generator, first draft, end of drafts, request) of each seeded request, in request
    order so that each generator's draws happen in the documented order."""
    if not generators:
        return []
    starts = [0, *itertools.accumulate(counts)]
    return [(generators[r], starts[r], starts[r + 1], r) for r in sorted(generators)]


def _check_inputs(
    draft_token_ids: torch.Tensor,
    counts: list[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    greedy: bool | torch.Tensor,
    generators: Mapping[int, torch.Generator] | None,
    target_greedy_ids: torch.Tensor | None,
) -> None:
    num_reqs, num_drafts = len(counts), sum(counts)
    if any(c < 0 for c in counts):
        raise ValueError(f"num_draft_tokens must be >= 0, got {min(counts)}")
    if draft_token_ids.dim() != 1 or draft_token_ids.shape[0] != num_drafts:
        raise ValueError(
            f"draft_token_ids must have shape [{num_drafts}] (sum of num_draft_tokens), got {list(draft_token_ids.shape)}")
    if target_probs.dim() != 2 or target_probs.shape[0] != num_drafts + num_reqs:
        raise ValueError(
            f"target_probs must have shape [{num_drafts + num_reqs}, vocab] (drafts + requests), got {list(target_probs.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (num_drafts, target_probs.shape[1]):
        raise ValueError(
            f"draft_probs must have shape [{num_drafts}, {target_probs.shape[1]}], got {list(draft_probs.shape)}")
    if isinstance(greedy, torch.Tensor) and (greedy.dtype != torch.bool or tuple(greedy.shape) != (num_reqs,)):
        raise ValueError(
            f"greedy must be a bool or a bool tensor of shape [{num_reqs}], got {greedy.dtype} {list(greedy.shape)}")
    if target_greedy_ids is not None and tuple(target_greedy_ids.shape) != (num_drafts + num_reqs,):
        raise ValueError(
            f"target_greedy_ids must have shape [{num_drafts + num_reqs}], got {list(target_greedy_ids.shape)}")
    bad = [r for r in (generators or {}) if not 0 <= r < num_reqs]
    if bad:
        raise ValueError(f"generators keys must be request indices in [0, {num_reqs}), got {bad}")
