"""apply_token_bitmask against a per-token reference, with xgrammar's bit layout."""

from __future__ import annotations

import pytest
import torch

from tandem.structured_output.bitmask import apply_token_bitmask


@pytest.mark.parametrize("vocab", [64, 100, 49152])
def test_matches_reference(vocab):
    g = torch.Generator().manual_seed(vocab)
    n, words = 5, -(-vocab // 32)
    logits = torch.randn(n, vocab, generator=g)
    allowed = torch.rand(3, words * 32, generator=g) < 0.3
    bits = (allowed.view(3, words, 32).long() << torch.arange(32)).sum(-1)
    bitmask = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)  # two's complement words
    rows = torch.tensor([4, 0, 2])
    out = logits.clone()
    apply_token_bitmask(out, rows, bitmask)
    expect = logits.clone()
    for i, r in enumerate(rows.tolist()):
        expect[r, ~allowed[i, :vocab]] = float("-inf")
    assert torch.equal(out, expect)


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
