"""The persistent input batch: rows survive steps, only changes cross from the host, and the
sampling inputs gathered by row equal the sequences' parameters."""

from __future__ import annotations

import numpy as np
import torch

from tandem.core.sched_output import NewRequestData
from tandem.sampling_params import SamplingParams
from tandem.worker.input_batch import SCALAR_SAMPLING_FIELDS, InputBatch
from tandem.worker.sampler import token_seed

V = 50


def _new(seq_id, params, prompt=(1, 2, 3), outputs=()):
    # The engine fills unset parameters (generation_config.json, else vLLM's defaults).
    return NewRequestData(seq_id, list(prompt), list(outputs), params.with_defaults(), False)


def _batch():
    ib = InputBatch(max_num_seqs=4, max_blocks_per_seq=6, vocab_size=V, device=torch.device("cpu"))
    p_greedy = SamplingParams(temperature=0)
    p_random = SamplingParams(temperature=0.7, top_k=5, seed=11, logprobs=2)
    p_pen = SamplingParams(temperature=0, presence_penalty=0.5, repetition_penalty=1.2, min_tokens=2,
                           stop_token_ids=[7], logit_bias={3: 1.5})
    for sid, p in ((10, p_greedy), (11, p_random), (12, p_pen)):
        ib.add_request(_new(sid, p, outputs=(4, 4) if sid == 12 else ()))
    ib.append_blocks(10, [5, 6])
    ib.append_blocks(11, [7])
    ib.append_blocks(12, [8, 9, 10])
    ib.flush()
    return ib


def test_block_tables_update_incrementally():
    ib = _batch()
    rows = ib.rows_of([10, 11, 12])
    assert torch.equal(ib.block_table[torch.from_numpy(rows)], torch.from_numpy(ib.block_table_np[rows]))
    ib.append_blocks(11, [20])
    assert ib._new_block_cells == [(int(rows[1]), 1, 20)]  # one block crosses, not the table
    ib.flush()
    assert ib.block_table[rows[1], :2].tolist() == [7, 20]
    # A finished sequence's row goes to a new one, cleared.
    ib.remove_request(10)
    ib.add_request(_new(13, SamplingParams()))
    ib.append_blocks(13, [30])
    ib.flush()
    assert ib.states[13].row == rows[0] and ib.block_table[rows[0], :3].tolist() == [30, 0, 0]


def test_sampling_batch_gathers_each_rows_parameters():
    ib = _batch()
    rows = ib.rows_of([12, 11, 10])  # any order of rows
    b = ib.sampling_batch(rows)
    torch.testing.assert_close(b.temperature, torch.tensor([0.0, 0.7, 0.0]))
    assert b.top_k.tolist() == [V, 5, V] and b.top_k.dtype == torch.long
    assert (b.all_greedy, b.all_random, b.greedy_mask.tolist()) == (False, False, [True, False, True])
    assert (b.need_top_k, b.need_top_p, b.need_min_p) == (True, False, False)
    assert b.penalty_rows.tolist() == [0] and b.penalty_slots.tolist() == [int(rows[0])]
    torch.testing.assert_close(b.presence, torch.tensor([0.5]))
    torch.testing.assert_close(b.repetition, torch.tensor([1.2]))
    assert b.seeded == [(1, token_seed(11, 0))] and b.max_num_logprobs == 2
    # Batch row 0: its logit_bias only; its 2 earlier outputs already reach min_tokens=2.
    bias_rows, toks, vals = b.bias
    assert bias_rows.tolist() == [0] and toks.tolist() == [3] and vals.tolist() == [1.5]
    # Penalty state: prompt mask and the counts of the outputs generated before a preemption.
    assert ib.prompt_mask[rows[0], [1, 2, 3]].all() and ib.output_counts[rows[0], 4] == 2


def test_sampling_batch_of_the_same_rows_follows_token_counts_and_new_sequences():
    """Decode steps over the same rows reuse what the rows' parameters fix, with seeds
    following each row's token count; a row given to a new sequence, even at the same place
    in the batch, samples with the new sequence's parameters."""
    ib = _batch()
    rows = ib.rows_of([10, 11])
    first = ib.sampling_batch(rows)
    ib.record_sampled(rows, torch.tensor([1, 2]))
    again = ib.sampling_batch(rows)
    assert first.seeded == [(1, token_seed(11, 0))] and again.seeded == [(1, token_seed(11, 1))]
    torch.testing.assert_close(again.temperature, first.temperature)
    ib.remove_request(10)
    ib.add_request(_new(13, SamplingParams(temperature=0.9, top_p=0.5)))
    ib.flush()
    assert np.array_equal(ib.rows_of([13, 11]), rows)
    b = ib.sampling_batch(rows)
    torch.testing.assert_close(b.temperature, torch.tensor([0.9, 0.7]))
    assert b.all_random and b.need_top_p and b.greedy_mask is None


def test_min_tokens_masks_stop_ids_until_reached():
    ib = InputBatch(2, 2, V, torch.device("cpu"))
    ib.add_request(_new(1, SamplingParams(min_tokens=2, stop_token_ids=[7])))
    ib.flush()
    rows = ib.rows_of([1])
    for step in range(3):
        b = ib.sampling_batch(rows)
        if step < 2:
            assert b.bias[1].tolist() == [7] and b.bias[2].tolist() == [float("-inf")]
        else:
            assert b.bias is None
        ib.record_sampled(rows, torch.tensor([9]))
    assert ib.num_sampled_np[rows[0]] == 3
    assert np.array_equal(ib.rows_of([1]), rows)


def test_each_scalar_sampling_field_fills_its_column():
    values = {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.05, "presence_penalty": 0.5,
              "frequency_penalty": -0.25, "repetition_penalty": 1.2}
    assert set(values) == set(SCALAR_SAMPLING_FIELDS)
    ib = InputBatch(max_num_seqs=2, max_blocks_per_seq=2, vocab_size=V, device=torch.device("cpu"))
    ib.add_request(_new(1, SamplingParams(**values)))
    row = ib.rows_of([1])[0]
    for column, name in enumerate(SCALAR_SAMPLING_FIELDS):
        assert ib.params_np[row, column] == np.float32(values[name]), name
