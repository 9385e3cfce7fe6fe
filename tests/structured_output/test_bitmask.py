"""apply_token_bitmask against a per-token reference, with xgrammar's bit layout: rows in
batch order or scattered, every logits dtype, a bitmask narrower than the logits."""

from __future__ import annotations

import pytest
import torch

from tandem.structured_output import bitmask as bitmask_mod
from tandem.structured_output.bitmask import apply_token_bitmask


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """``allowed [K, W * 32]`` bool as xgrammar's ``int32 [K, W]`` words."""
    k, bits = allowed.shape
    words = (allowed.view(k, bits // 32, 32).long() << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement


@pytest.mark.parametrize("vocab", [64, 100, 49152])
@pytest.mark.parametrize("rows", [[4, 0, 2], None], ids=["scattered", "in_order"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["cpu", "xgrammar"])
def test_matches_reference(vocab, rows, dtype, kernel, monkeypatch):
    if kernel == "xgrammar":
        # The CUDA path's code (scatter into batch order, xgrammar's kernel), on its CPU backend.
        monkeypatch.setattr(bitmask_mod, "_apply_on_cpu", bitmask_mod._apply_with_xgrammar)
    g = torch.Generator().manual_seed(vocab)
    n, words = 5, -(-vocab // 32)
    k = n if rows is None else len(rows)
    logits = torch.randn(n, vocab, generator=g).to(dtype)
    allowed = torch.rand(k, words * 32, generator=g) < 0.3
    allowed[:, -32:] = True  # bits past the vocabulary are ignored
    out = logits.clone()
    apply_token_bitmask(out, None if rows is None else torch.tensor(rows), _bitmask(allowed))
    expect = logits.clone()
    for i, r in enumerate(range(n) if rows is None else rows):
        expect[r, ~allowed[i, :vocab]] = float("-inf")
    assert torch.equal(out, expect)


def test_tokens_past_the_bitmask_are_not_allowed():
    """Logits wider than the bitmask (a padded vocabulary): the extra tokens are masked in
    the bitmask's rows only."""
    logits = torch.zeros(3, 80)
    allowed = torch.ones(2, 64, dtype=torch.bool)
    apply_token_bitmask(logits, torch.tensor([2, 0]), _bitmask(allowed))
    assert torch.isinf(logits[[0, 2], 64:]).all() and torch.isfinite(logits[:, :64]).all()
    assert torch.isfinite(logits[1]).all()


def test_same_layout_as_xgrammar():
    xgr = pytest.importorskip("xgrammar")
    vocab = 70
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    bitmask.zero_()
    allowed = [0, 5, 31, 32, 63, 69]
    for t in allowed:
        bitmask[0, t // 32] |= (1 << (t % 32)) if t % 32 != 31 else -(1 << 31)
    ours = torch.zeros(1, vocab)
    apply_token_bitmask(ours, torch.tensor([0]), bitmask)
    theirs = torch.zeros(1, vocab)
    xgr.apply_token_bitmask_inplace(theirs, bitmask)
    assert torch.equal(ours, theirs)
    assert torch.isfinite(ours[0]).nonzero().flatten().tolist() == allowed
