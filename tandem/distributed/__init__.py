"""Distributed pieces: expert placement and the all-to-all (dispatch/combine) backends.

Process groups, DP coordination and the multi-rank backends (``allgather_reducescatter``,
``all_to_all``) build on :mod:`tandem.distributed.all2all`'s interface.
"""

from tandem.distributed.all2all import (
    All2AllBackend,
    ExpertPlacement,
    LocalAll2All,
    SimulatedAll2All,
    get_all2all_backend,
)

__all__ = ["All2AllBackend", "ExpertPlacement", "LocalAll2All", "SimulatedAll2All", "get_all2all_backend"]
