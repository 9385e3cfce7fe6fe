"""Tensor, data and expert parallelism (vLLM's ``ParallelConfig``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tandem.config.utils import check_choices

All2AllBackend = Literal["auto", "local", "simulated", "allgather_reducescatter", "all_to_all"]


@dataclass
class ParallelConfig:
    """The ranks of the deployment and how MoE layers exchange tokens between them."""

    tensor_parallel_size: int = 1
    """Ranks sharding each layer's heads and MLP (Megatron-style TP)."""

    data_parallel_size: int = 1
    """Engine replicas, each with its own scheduler and KV cache (data-parallel attention);
    tensor_parallel_size x data_parallel_size processes are launched (or taken from torchrun's
    environment)."""

    enable_expert_parallel: bool = False
    """Shard MoE experts over all DP x TP ranks."""

    all2all_backend: All2AllBackend = "auto"
    """MoE dispatch/combine: local (EP=1), simulated (EP=1 data plus a modeled link delay:
    SimulatedLinkConfig), allgather_reducescatter or all_to_all (EP > 1, over
    torch.distributed); auto: local without EP, allgather_reducescatter with EP."""

    master_addr: str | None = None
    """Rendezvous address of the ranks. None: MASTER_ADDR from the environment, else 127.0.0.1."""

    master_port: int | None = None
    """Rendezvous port of the ranks. None: MASTER_PORT from the environment, else a free port."""

    def __post_init__(self) -> None:
        check_choices(self)
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size and data_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size} and {self.data_parallel_size}.")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port}.")

    @property
    def world_size(self) -> int:
        """Processes of the deployment: ``tensor_parallel_size * data_parallel_size``."""
        return self.tensor_parallel_size * self.data_parallel_size
