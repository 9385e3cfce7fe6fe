"""A step's device-side results: mapped tensor by tensor (the host copy) and turned into
the runner's host output with every field in place."""

from __future__ import annotations

import torch

from tandem.worker.step_results import PromptLogprobTensors, SampledLogprobTensors, StepResultTensors


def _results() -> StepResultTensors:
    return StepResultTensors(
        sampled=torch.tensor([5, 9]),
        logprobs=SampledLogprobTensors(torch.tensor([[5, 1], [9, 2]]), torch.tensor([[-0.5, -1.0], [-0.25, -2.0]]),
                                       torch.tensor([1, 1])),
        draft_token_ids=torch.tensor([[3, 4], [6, 7]]),
        prompt_logprobs={7: PromptLogprobTensors(1, torch.tensor([[2, 8]]), torch.tensor([[-1.5, -0.5]]),
                                                 torch.tensor([2]))})


def test_map_reaches_every_tensor():
    seen = []
    mapped = _results().map(lambda t: seen.append(t.shape) or t.clone())
    assert len(seen) == 1 + 3 + 1 + 3
    assert torch.equal(mapped.prompt_logprobs[7].token_ids, torch.tensor([[2, 8]]))


def test_to_output_fills_every_field():
    out = _results().to_output([11, 12], {1: [9, 4]}, {}, {1: 2})
    assert (out.seq_ids, out.sampled_token_ids) == ([11, 12], [5, 9])
    assert out.logprobs == [([5, 1], [-0.5, -1.0], 1), ([9, 2], [-0.25, -2.0], 1)]
    assert out.draft_token_ids == [[3, 4], [6, 7]]
    assert out.accepted_token_ids == {1: [9, 4]} and out.num_draft_tokens == {1: 2}
    plp = out.prompt_logprobs[7]
    assert (plp.start, plp.token_ids, plp.logprobs, plp.ranks) == (1, [[2, 8]], [[-1.5, -0.5]], [2])


def test_only_what_a_step_computed_is_set():
    out = StepResultTensors(sampled=torch.tensor([1])).to_output([3], {}, {}, {})
    assert out.logprobs is None and out.draft_token_ids is None and out.prompt_logprobs == {}
