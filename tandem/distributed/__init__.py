"""Distributed pieces: expert placement and the all-to-all (dispatch/combine) backends.

* :mod:`~tandem.distributed.all2all`: the dispatch/combine contract, ``local`` and
  ``simulated``; :mod:`~tandem.distributed.ep_all2all`: ``allgather_reducescatter`` and
  ``all_to_all`` over torch.distributed (EP > 1); :mod:`~tandem.distributed.all2all_factory`:
  backends by name.
* :mod:`~tandem.distributed.parallel_state`: the DP x TP world, its TP / DP / EP groups.
* :mod:`~tandem.distributed.launch`: spawning the ranks on one machine, or torchrun/env://.
* :mod:`~tandem.distributed.forward_context`: the per-forward facts layers read (the model
  runner's per-step agreement is :mod:`tandem.worker.step_plan`).
"""

from tandem.distributed.all2all import (
    All2AllBackend,
    ExpertPlacement,
    LocalAll2All,
    SimulatedAll2All,
)
from tandem.distributed.all2all_factory import get_all2all_backend

__all__ = ["All2AllBackend", "ExpertPlacement", "LocalAll2All", "SimulatedAll2All", "get_all2all_backend"]
