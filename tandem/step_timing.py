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
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

PHASES = ("schedule", "prepare", "process")


@dataclass
class StepHostTimes:
    """Seconds per phase per step id; filled while attached to an engine."""

    times: dict[int, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))

    def add(self, step_id: int, phase: str, seconds: float) -> None:
        """Record (accumulate) ``seconds`` of ``phase`` for step ``step_id``.

        Raises:
            ValueError: ``phase`` is not one of :data:`PHASES`.
        """
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        row = self.times[step_id]
        row[phase] = row.get(phase, 0.0) + seconds

    def totals_ms(self, complete_only: bool = True) -> list[float]:
        """Per step: the sum of its phases in ms (only steps with every phase recorded when
        ``complete_only``; steps that sampled nothing have no ``process`` phase)."""
        return [1e3 * sum(r.values()) for r in self.times.values() if not complete_only or len(r) == len(PHASES)]

    def summary(self) -> dict[str, float] | None:
        """``{"steps", "median_ms", "p99_ms", <phase>_median_ms...}`` over complete steps;
        None when none was recorded."""
        rows = [r for r in self.times.values() if len(r) == len(PHASES)]
        if not rows:
            return None
        tot = np.array([sum(r.values()) for r in rows]) * 1e3
        out = {"steps": float(len(rows)), "median_ms": float(np.median(tot)), "p99_ms": float(np.percentile(tot, 99))}
        for p in PHASES:
            out[f"{p}_median_ms"] = float(np.median([r[p] for r in rows]) * 1e3)
        return out
