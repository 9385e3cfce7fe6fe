"""The link model of the ``simulated`` all-to-all backend (tandem.distributed.all2all.LinkModel)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SimulatedLinkConfig:
    """An expert-parallel exchange timed on one GPU: the data stays local and each dispatch and
    combine waits as long as the modeled link would take. The defaults model one inter-node
    RDMA NIC per GPU at EP=8."""

    simulated_link_gbps: float = 40.0
    """Bandwidth of the simulated link, GB/s."""

    simulated_link_latency_us: float = 20.0
    """Latency of one simulated exchange, microseconds."""

    simulated_ep_size: int = 8
    """EP group size the simulated link models."""

    simulated_ep_rank_experts: bool = False
    """Compute like one rank of that EP group: each MoE layer holds only num_experts /
    simulated_ep_size experts and every (token, expert) pair runs on local expert
    id % that, the load a rank gets when all ranks route alike. Timing only: outputs are not
    the model's."""

    def __post_init__(self) -> None:
        if self.simulated_ep_size < 1:
            raise ValueError(f"simulated_ep_size must be >= 1, got {self.simulated_ep_size}.")
        if self.simulated_link_gbps <= 0:
            raise ValueError(f"simulated_link_gbps must be positive, got {self.simulated_link_gbps}.")
        if self.simulated_link_latency_us < 0:
            raise ValueError(f"simulated_link_latency_us must be >= 0, got {self.simulated_link_latency_us}.")
