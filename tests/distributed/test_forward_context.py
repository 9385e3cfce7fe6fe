"""The forward context: row phases of a forward, nesting."""

from __future__ import annotations

import numpy as np
import torch

from tandem.distributed.forward_context import ForwardContext, RowPhases, forward_context, get_forward_context


def test_row_phases_are_slices_when_generated_rows_lead():
    p = RowPhases.from_mask(np.array([True, True, False, False, False]), torch.device("cpu"))
    assert (p.generated, p.prompt, p.num_generated, p.num_prompt) == (slice(0, 2), slice(2, 5), 2, 3)
    p = RowPhases.from_mask(np.array([False, False]), torch.device("cpu"))
    assert (p.generated, p.prompt, p.num_prompt) == (slice(0, 0), slice(0, 2), 2)


def test_row_phases_are_indices_otherwise():
    p = RowPhases.from_mask(np.array([False, True, False, True]), torch.device("cpu"))
    assert p.generated.tolist() == [1, 3] and p.prompt.tolist() == [0, 2] and p.num_generated == 2


def test_contexts_nest():
    assert get_forward_context() is None
    with forward_context(ForwardContext(4)) as outer:
        with forward_context(ForwardContext(2, ubatch_id=1)):
            assert get_forward_context().ubatch_id == 1
        assert get_forward_context() is outer and outer.row_phases is None
    assert get_forward_context() is None
