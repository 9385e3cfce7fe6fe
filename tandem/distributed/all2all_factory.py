"""Building all-to-all (MoE dispatch/combine) backends by name.

The interface and the single-rank backends live in :mod:`tandem.distributed.all2all`, the
torch.distributed ones in :mod:`tandem.distributed.ep_all2all`; this module imports both
(and neither imports it), so backend selection adds no import circle.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import get_args

import torch.distributed as dist

from tandem.config.parallel import All2AllBackend
from tandem.distributed.all2all import All2AllBackend, ExpertPlacement, LocalAll2All, SimulatedAll2All
from tandem.distributed.ep_all2all import AllGatherReduceScatterAll2All, AllToAllAll2All, EPBufferPool

logger = logging.getLogger(__name__)

ALL2ALL_BACKENDS = tuple(name for name in get_args(All2AllBackend) if name != "auto")
EP_BACKENDS = {"allgather_reducescatter": AllGatherReduceScatterAll2All, "all_to_all": AllToAllAll2All}


def get_all2all_backend(name: str, placement: ExpertPlacement | int, **kwargs) -> All2AllBackend:
    """Backend by name: ``local``, ``simulated`` (kwargs: ``link``, ``record``,
    ``rank_experts``), or the
    torch.distributed backends ``allgather_reducescatter`` / ``all_to_all`` (kwargs:
    ``group`` the EP process group, ``pool`` a shared buffer pool; see
    :mod:`tandem.distributed.ep_all2all`).

    Raises:
        ValueError: unknown name.
    """
    if name == "local":
        return LocalAll2All(placement)
    if name == "simulated":
        return SimulatedAll2All(placement, **kwargs)
    if name in EP_BACKENDS:
        if isinstance(placement, int):
            placement = ExpertPlacement(placement)
        return EP_BACKENDS[name](placement, kwargs.get("group"), kwargs.get("pool"))
    raise ValueError(f"unknown all2all backend {name!r}; available: {', '.join(ALL2ALL_BACKENDS)}")


def make_all2all_factory(name: str, *, group: dist.ProcessGroup | None = None, ep_size: int = 1, ep_rank: int = 0,
                         **kwargs) -> Callable[[int], All2AllBackend]:
    """A factory ``num_experts -> backend`` for the MoE layers of one model (the
    ``all2all=`` argument of the MoE model constructors). Multi-rank backends built by one
    factory share one :class:`EPBufferPool` (``factory.pool``).

    Args:
        name: ``local``, ``simulated`` (kwargs: ``link``, ``record``),
            ``allgather_reducescatter`` or ``all_to_all``.
        group / ep_size / ep_rank: the EP group and this rank's place in it.

    Raises:
        ValueError: unknown name, or a single-rank backend asked for ``ep_size > 1``.

    A multi-rank backend with ``ep_size == 1`` is the ``local`` one (nothing to exchange).
    """
    pool = EPBufferPool()

    if name in EP_BACKENDS and ep_size == 1:
        logger.info("all2all backend %s with one EP rank: using local", name)
        name = "local"

    def factory(num_experts: int) -> All2AllBackend:
        placement = ExpertPlacement(num_experts, ep_size, ep_rank)
        if name in EP_BACKENDS:
            return EP_BACKENDS[name](placement, group, pool)
        if ep_size > 1:
            raise ValueError(f"the {name!r} all2all backend runs on one rank; with expert parallelism use "
                             f"{' or '.join(EP_BACKENDS)}")
        return get_all2all_backend(name, placement, **kwargs)

    factory.pool = pool  # type: ignore[attr-defined]
    return factory
