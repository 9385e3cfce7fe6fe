"""Host time of engine steps: the CPU work around each model step.

Per step (keyed by ``SchedulerOutput.step_id``) three phases are recorded in seconds:
``schedule`` (``Scheduler.schedule``), ``prepare`` (the model runner's input building:
per-sequence state, input ids, positions, slot mapping, block table and sampling tensors;
not the forward, not the sampling kernels, not the cross-rank collective) and ``process``
(``Scheduler.update_from_output``: placeholder accounting, token-id stop checks, freeing of
finished sequences). Their sum is the host time a step costs the engine core's loop, the
part that a faster GPU step exposes; the front end's detokenization runs beside the core
(another process, or between two core steps in process) and is not counted. Recorded by
``EngineCore.start_host_timing`` (``LLMEngine.start_host_timing`` with an in-process core).

Steps that sample constrained sequences also record :data:`GRAMMAR_PHASES`: ``grammar``
(the core thread's xgrammar work: advancing the matchers by the previous step's tokens and
filling this step's bitmask) and ``bitmask`` (the runner's copy and application of the
bitmask to the logits: on a GPU the launch, on the CPU the kernel itself). They are
reported beside the three phases, not in their sum: on a GPU both overlap the step's
forward.

:class:`StepSpan` is the other side: a step's span on the device (the GPU's stream, or the
CPU step thread), from which ``tandem bench throughput`` takes the idle time between steps.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PHASES = ("schedule", "prepare", "process")


class WallClockEvent:
    """``torch.cuda.Event(enable_timing=True)``'s timing interface on the host clock, for
    the CPU, where a step thread runs the steps (:mod:`tandem.worker.model_runner`): recorded
    on that thread, two events bound the thread's work on a step as CUDA events bound the
    GPU's."""

    def __init__(self) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: "WallClockEvent") -> float:
        """Milliseconds from this event to ``end``."""
        return (end.t - self.t) * 1e3


GRAMMAR_PHASES = ("grammar", "bitmask")


@dataclass
class StepSpan:
    """One model step's span on the device while a benchmark times steps (the model
    runner's ``step_events``): ``start`` / ``end`` are ``torch.cuda.Event``s on the GPU's
    stream or :class:`WallClockEvent`s of the CPU step thread (``end`` is recorded once the
    step has sampled); ``num_reqs`` its sequences, ``decode_only`` whether each had one new
    token, ``context_tokens`` the tokens its attention reads (sum of sequence lengths),
    ``verifies_drafts`` whether it verifies speculative drafts and holds no prompt tokens
    (every sequence's tokens are its last emitted one and drafts)."""

    start: Any
    num_reqs: int
    decode_only: bool
    context_tokens: int
    end: Any = None
    verifies_drafts: bool = False

    def elapsed_ms(self) -> float:
        """Milliseconds from ``start`` to ``end`` (events synchronized by the caller)."""
        return self.start.elapsed_time(self.end)


@dataclass
class StepHostTimes:
    """Seconds per phase per step id; filled while attached to an engine."""

    times: dict[int, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))

    def add(self, step_id: int, phase: str, seconds: float) -> None:
        """Record (accumulate) ``seconds`` of ``phase`` for step ``step_id``.

        Raises:
            ValueError: ``phase`` is not one of :data:`PHASES` or :data:`GRAMMAR_PHASES`.
        """
        if phase not in PHASES and phase not in GRAMMAR_PHASES:
            raise ValueError(f"phase must be one of {PHASES + GRAMMAR_PHASES}, got {phase!r}")
        row = self.times[step_id]
        row[phase] = row.get(phase, 0.0) + seconds

    def totals_ms(self, complete_only: bool = True) -> list[float]:
        """Per step: the sum of its phases in ms (only steps with every phase recorded when
        ``complete_only``; steps that sampled nothing have no ``process`` phase)."""
        return [1e3 * sum(r.get(p, 0.0) for p in PHASES) for r in self.times.values()
                if not complete_only or all(p in r for p in PHASES)]

    def summary(self) -> dict[str, float] | None:
        """``{"steps", "median_ms", "p99_ms", <phase>_median_ms...}`` over complete steps
        (every phase of :data:`PHASES` recorded), plus ``<phase>_median_ms`` of each of
        :data:`GRAMMAR_PHASES` over the complete steps that recorded it (absent when none
        did); None when no step is complete."""
        rows = [r for r in self.times.values() if all(p in r for p in PHASES)]
        if not rows:
            return None
        tot = np.array([sum(r[p] for p in PHASES) for r in rows]) * 1e3
        out = {"steps": float(len(rows)), "median_ms": float(np.median(tot)), "p99_ms": float(np.percentile(tot, 99))}
        for p in PHASES:
            out[f"{p}_median_ms"] = float(np.median([r[p] for r in rows]) * 1e3)
        for p in GRAMMAR_PHASES:
            vals = [r[p] for r in rows if p in r]
            if vals:
                out[f"{p}_median_ms"] = float(np.median(vals) * 1e3)
        return out
