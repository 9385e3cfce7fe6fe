"""The model runner's split step: a step with constrained sequences stops at its logits, and
``sample_tokens`` samples it with the grammar bitmask applied to those sequences' rows only."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tandem.core.sched_output import NewRequestData, ScheduledSequence, SchedulerOutput
from tandem.sampling_params import SamplingParams
from tandem.structured_output.bitmask import GrammarBitmask
from tandem.worker.model_runner import ModelRunner

V = 40


class _FixedLogitsModel(torch.nn.Module):
    """Records each forward's input ids; its greedy token is always 0 (logits fall with the id)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[int]] = []

    def forward(self, input_ids, positions, kv_caches, meta):
        self.seen.append(input_ids.tolist())
        return input_ids.float()[:, None].expand(-1, 4)

    def compute_logits(self, hidden):
        return -torch.arange(V, dtype=torch.float32).expand(hidden.shape[0], V).clone()


def _prefill(seq_id: int, blocks: list[int]) -> ScheduledSequence:
    params = SamplingParams(temperature=0).with_defaults()
    return ScheduledSequence(seq_id, 0, 3, [1, 2, 3], False, True, blocks,
                             NewRequestData(seq_id, [1, 2, 3], [], params, False))


def _runner(model):
    return ModelRunner(model, [], block_size=4, vocab_size=V, max_num_seqs=4, device=torch.device("cpu"),
                       max_model_len=32, step_thread=ThreadPoolExecutor(1))


def test_constrained_step_samples_after_bitmask():
    model = _FixedLogitsModel()
    runner = _runner(model)
    try:
        so = SchedulerOutput(0, [_prefill(0, [0]), _prefill(1, [1])], 6, structured_output_seq_ids=[1])
        assert runner.execute_model(so) is None
        allowed = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
        allowed[0, 0] = 1 << 5  # only token 5
        out = runner.sample_tokens(GrammarBitmask([1], allowed)).result()
        assert out.seq_ids == [0, 1]
        assert out.sampled_token_ids == [0, 5]  # the unconstrained row keeps its greedy token

        # The next step's inputs take the constrained sample from the device.
        decode = [ScheduledSequence(sid, 3, 1, [], True, True, []) for sid in (0, 1)]
        out = runner.execute_model(SchedulerOutput(1, decode, 2)).result()
        assert model.seen[-1] == [0, 5]
        assert out.sampled_token_ids == [0, 0]
    finally:
        runner.shutdown()


def test_unconstrained_step_samples_at_once():
    runner = _runner(_FixedLogitsModel())
    try:
        handle = runner.execute_model(SchedulerOutput(0, [_prefill(0, [0])], 3))
        assert handle is not None and handle.result().sampled_token_ids == [0]
    finally:
        runner.shutdown()


def test_cpu_step_thread_env(monkeypatch):
    """CPU steps run on the worker thread unless TANDEM_CPU_STEP_THREAD=off; never on CUDA."""
    from tandem.worker.model_runner import cpu_step_thread

    monkeypatch.delenv("TANDEM_CPU_STEP_THREAD", raising=False)
    assert cpu_step_thread(torch.device("cpu"))
    assert not cpu_step_thread(torch.device("cuda"))
    monkeypatch.setenv("TANDEM_CPU_STEP_THREAD", "off")
    assert not cpu_step_thread(torch.device("cpu"))
    monkeypatch.setenv("TANDEM_CPU_STEP_THREAD", "sometimes")
    with pytest.raises(ValueError, match="TANDEM_CPU_STEP_THREAD"):
        cpu_step_thread(torch.device("cpu"))


class _PhaseRecordingModel(_FixedLogitsModel):
    """Has a layer following token phases (as a GGUF model's); records the phases its
    ``compute_logits`` runs under (a quantized LM head reads them from the forward context)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Module()
        self.head.uses_row_phases = True
        self.logits_phases: list[tuple[int, int]] = []

    def compute_logits(self, hidden):
        from tandem.distributed.forward_context import get_forward_context

        phases = get_forward_context().row_phases
        assert phases.num_rows == hidden.shape[0]
        self.logits_phases.append((phases.num_generated, phases.num_rows))
        return super().compute_logits(hidden)


def test_logits_rows_carry_their_token_phase():
    """A prompt's last row (its first sample) is a prompt row, a decode's row a generated
    one, also when both are in one step."""
    model = _PhaseRecordingModel()
    runner = _runner(model)
    try:
        runner.execute_model(SchedulerOutput(0, [_prefill(0, [0]), _prefill(1, [1])], 6)).result()
        assert model.logits_phases[-1] == (0, 2)
        decode = ScheduledSequence(0, 3, 1, [], True, True, [])
        runner.execute_model(SchedulerOutput(1, [decode, _prefill(2, [2])], 4)).result()
        assert model.logits_phases[-1] == (1, 2)
    finally:
        runner.shutdown()
