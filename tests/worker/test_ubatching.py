"""DBO ubatches: metadata of each half, the split forward equals the unsplit one, and the
two-ubatch interleave."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, AutoModelForCausalLM

from tandem.attention.torch_backend import TorchAttentionBackend
from tandem.models.llama import LlamaForCausalLM
from tandem.worker.step_plan import can_split, ubatch_slices
from tandem.worker.ubatching import StepInputs, pad_step_inputs, run_ubatches


def _inputs(q_lens, computed, block_size=16, width=10):
    q_lens, computed = np.array(q_lens), np.array(computed)
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    tables = np.array([[1 + r * width + i for i in range(width)] for r in range(len(q_lens))], dtype=np.int32)
    positions = np.concatenate([np.arange(c, c + q) for c, q in zip(computed, q_lens)])
    req = np.repeat(np.arange(len(q_lens)), q_lens)
    slots = tables[req, positions // block_size].astype(np.int64) * block_size + positions % block_size
    ids = np.arange(len(positions)) % 200 + 3
    return StepInputs(ids, positions, slots, qsl, computed, computed + q_lens, torch.from_numpy(tables), [], [])


def split_ubatches(inputs: StepInputs, padded_tokens: int) -> tuple[StepInputs, StepInputs]:
    return tuple(inputs.slice_tokens(u.token_start, min(u.token_stop, inputs.num_tokens))
                 for u in ubatch_slices(padded_tokens))


def test_cached_prefix_split_4_4():
    a, b = split_ubatches(_inputs([8], [24]), 8)
    assert a.num_computed.tolist() == [24] and b.num_computed.tolist() == [28]
    assert a.seq_lens.tolist() == [28] and b.seq_lens.tolist() == [32]
    assert a.positions.tolist() == list(range(24, 28)) and b.positions.tolist() == list(range(28, 32))


def test_prefill_160_split_80_80():
    a, b = split_ubatches(_inputs([160], [0]), 160)
    assert (a.num_tokens, b.num_tokens) == (80, 80)
    assert a.num_computed.tolist() == [0] and b.num_computed.tolist() == [80]


def test_mixed_batch_split_keeps_decodes_leading():
    inp = _inputs([1, 1, 1, 30, 7], [10, 20, 5, 0, 3])
    a, b = split_ubatches(inp, 40)
    assert a.num_tokens == 20 and b.num_tokens == 20
    assert a.num_decode_reqs() == 3 and a.num_reqs == 4  # 3 decodes + head of the prefill
    assert b.num_computed.tolist() == [17, 3] and b.seq_lens.tolist() == [30, 10]
    np.testing.assert_array_equal(np.concatenate([a.slot_mapping, b.slot_mapping]), inp.slot_mapping)


def test_padding_request_gets_its_own_blocks():
    from tandem.worker.ubatching import empty_step_inputs, pad_step_inputs

    padded = pad_step_inputs(empty_step_inputs(), 9, block_size=8)
    assert padded.num_tokens == 9 and tuple(padded.block_table.shape) == (1, 2)
    assert (padded.slot_mapping == -1).all() and (padded.block_table == 0).all()
    padded = pad_step_inputs(_inputs([3], [0], block_size=8, width=1), 20, block_size=8)
    assert tuple(padded.block_table.shape) == (2, 3) and padded.block_table[0, 0] == 1
    assert padded.seq_lens.tolist() == [3, 17]


def test_cut_at_half_the_padded_count():
    assert [(u.token_start, u.token_stop) for u in ubatch_slices(5)] == [(0, 2), (2, 5)]  # second is larger
    assert [(u.token_start, u.token_stop) for u in ubatch_slices(8)] == [(0, 4), (4, 8)]
    assert can_split(2) and can_split(3)
    assert not can_split(1) and not can_split(0)  # a half would hold no token


def test_split_forward_equals_unsplit():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)
    ref = AutoModelForCausalLM.from_config(cfg).eval()
    model = LlamaForCausalLM(cfg, TorchAttentionBackend()).eval()
    model.load_weights(ref.state_dict().items())
    inp = _inputs([1, 1, 37, 22], [0, 0, 0, 0])  # the 37-token prefill straddles the cut
    caches = [torch.zeros(2, 64, 16, 2, 16) for _ in range(2)]
    caches_split = [c.clone() for c in caches]
    with torch.no_grad():
        full = model(torch.from_numpy(inp.input_ids), torch.from_numpy(inp.positions), caches, inp.metadata(torch.device("cpu")))
        parts = []
        for half in split_ubatches(inp, inp.num_tokens):
            parts.append(model(torch.from_numpy(half.input_ids), torch.from_numpy(half.positions), caches_split,
                               half.metadata(torch.device("cpu"))))
    torch.testing.assert_close(torch.cat(parts), full, atol=1e-5, rtol=0)
    for c1, c2 in zip(caches, caches_split):
        torch.testing.assert_close(c1, c2)


def _gen(n, log, name, fail_at=None):
    for i in range(n):
        if i == fail_at:
            raise RuntimeError(f"{name} failed")
        log.append((name, i))
        yield
    return name


def test_run_ubatches_alternates_and_checks_yields():
    log = []
    assert run_ubatches(_gen(3, log, "a"), _gen(3, log, "b")) == ("a", "b")
    assert log == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    with pytest.raises(AssertionError, match="yield points"):
        run_ubatches(_gen(2, [], "a"), _gen(3, [], "b"))


def test_run_ubatches_failure_closes_the_other():
    closed = []

    def other():
        try:
            while True:
                yield
        finally:
            closed.append(True)

    with pytest.raises(RuntimeError, match="a failed"):
        run_ubatches(_gen(5, [], "a", fail_at=2), other())
    assert closed == [True]


def test_generated_mask_follows_prompt_lengths_through_slices_and_padding():
    """Tokens at or past their request's prompt length are generated ones: decodes, and the
    outputs of a sequence recomputed after a preemption (positions 5.. of request 2)."""
    inputs = _inputs([1, 1, 8], [20, 3, 0])
    inputs.prompt_lens = np.array([10, 4, 5])
    mask = inputs.generated_mask()
    assert mask.tolist() == [True, False] + [False] * 5 + [True] * 3
    assert inputs.slice_tokens(4, 10).generated_mask().tolist() == mask[4:].tolist()
    padded = pad_step_inputs(inputs, 16, 16)
    assert padded.generated_mask().tolist() == mask.tolist() + [False] * 6
    decodes = _inputs([1, 1], [20, 3])
    decodes.prompt_lens = np.array([10, 4])
    assert decodes.generated_mask().tolist() == [True, False]
    assert _inputs([1], [0]).generated_mask() is None
