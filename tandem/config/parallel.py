"""Tensor, pipeline, data and expert parallelism (vLLM's ``ParallelConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tandem.config.utils import check_choices

All2AllBackend = Literal["auto", "local", "simulated", "allgather_reducescatter", "all_to_all"]


@dataclass
class ParallelConfig:
    """The ranks of the deployment and how MoE layers exchange tokens between them. Fields
    whose metadata says ``per_host`` differ from host to host by design (the multi-host
    handshake does not compare them)."""

    tensor_parallel_size: int = 1
    """Ranks sharding each layer's heads and MLP (Megatron-style TP)."""

    pipeline_parallel_size: int = 1
    """Stages the decoder layers are split into, one after another (each stage TP-sharded;
    the split: tandem.distributed.pipeline)."""

    data_parallel_size: int = 1
    """Engine replicas, each with its own scheduler and KV cache (data-parallel attention);
    tensor_parallel_size x pipeline_parallel_size x data_parallel_size processes are launched
    (or taken from torchrun's environment)."""

    enable_expert_parallel: bool = False
    """Shard MoE experts over the DP x TP ranks (of each pipeline stage)."""

    all2all_backend: All2AllBackend = "auto"
    """MoE dispatch/combine: local (EP=1), simulated (EP=1 data plus a modeled link delay:
    SimulatedLinkConfig), allgather_reducescatter or all_to_all (EP > 1, over
    torch.distributed); auto: local without EP, allgather_reducescatter with EP."""

    master_addr: str | None = field(default=None, metadata={"per_host": True})
    """Rendezvous address of the ranks. None: MASTER_ADDR from the environment, else 127.0.0.1."""

    master_port: int | None = field(default=None, metadata={"per_host": True})
    """Rendezvous port of the ranks. None: MASTER_PORT from the environment, else a free port."""

    data_parallel_size_local: int | None = field(default=None, metadata={"per_host": True})
    """Replicas on this host (several hosts: each runs data_parallel_size_local of the
    data_parallel_size replicas, TP inside the host). None: all of them."""

    data_parallel_start_rank: int = field(default=0, metadata={"per_host": True})
    """The first replica's data-parallel rank on this host (0 on the head; a --headless host
    takes the ranks from here to here + data_parallel_size_local - 1)."""

    pipeline_parallel_size_local: int | None = field(default=None, metadata={"per_host": True})
    """Pipeline stages on this host, of its one replica (several hosts: the stages of a
    replica spread over hosts; --data-parallel-size-local must then be 1). None: all."""

    pipeline_parallel_start_rank: int = field(default=0, metadata={"per_host": True})
    """The first stage on this host (0 on the head; a --headless host runs stages from here
    to here + pipeline_parallel_size_local - 1 of its replica)."""

    data_parallel_address: str | None = None
    """The head host's address, reachable from every host: its handshake port, the engine
    cores' sockets and the torch.distributed rendezvous listen there. Needed with several
    hosts; None: 127.0.0.1."""

    data_parallel_rpc_port: int | None = None
    """The head's handshake port (TCP) that --headless hosts join. Needed with several hosts;
    None: one host."""

    def __post_init__(self) -> None:
        check_choices(self)
        if min(self.tensor_parallel_size, self.pipeline_parallel_size, self.data_parallel_size) < 1:
            raise ValueError(f"tensor_parallel_size, pipeline_parallel_size and data_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size}, {self.pipeline_parallel_size} and "
                             f"{self.data_parallel_size}.")
        for name in ("master_port", "data_parallel_rpc_port"):
            port = getattr(self, name)
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"{name} must be in 1..65535, got {port}.")
        self._check_hosts()

    def _check_hosts(self) -> None:
        self._check_local_range("data_parallel")
        self._check_local_range("pipeline_parallel")
        local, size = self.pipeline_parallel_local_size, self.pipeline_parallel_size
        if local < size and self.data_parallel_local_size != 1:
            raise ValueError(f"a host with some of the pipeline stages (pipeline_parallel_size_local {local} < "
                             f"{size}) holds them for one replica: data_parallel_size_local must be 1, got "
                             f"{self.data_parallel_local_size}.")
        if self.multi_host and self.data_parallel_rpc_port is None:
            raise ValueError("data_parallel_rpc_port is required when data_parallel_size_local < "
                             "data_parallel_size or pipeline_parallel_size_local < pipeline_parallel_size (several "
                             "hosts): the head's handshake port.")

    def _check_local_range(self, kind: str) -> None:
        """``{kind}_start_rank`` + ``{kind}_size_local`` within ``{kind}_size`` (``kind``:
        data_parallel or pipeline_parallel: this host's replicas, or its stages)."""
        size, start = getattr(self, f"{kind}_size"), getattr(self, f"{kind}_start_rank")
        given = getattr(self, f"{kind}_size_local")
        local = size if given is None else given
        if local < 1 or local > size:
            raise ValueError(f"{kind}_size_local must be in 1..{kind}_size ({size}), got {local}.")
        if start < 0 or start + local > size:
            default = "" if given is not None else ", its default"
            raise ValueError(f"{kind}_start_rank ({start}) + {kind}_size_local ({local}{default}) must not exceed "
                             f"{kind}_size ({size}).")

    def check_host_role(self, headless: bool) -> None:
        """Refuse flags that do not fit this host's role (``headless``: ``tandem serve
        --headless``).

        Raises:
            ValueError: a headless host that runs every replica, or a head of several hosts
                whose first replica is not DP rank 0.
        """
        if headless and not self.multi_host:
            raise ValueError("--headless runs some of the replicas of a head on another host: it needs "
                             "--data-parallel-size-local < --data-parallel-size, --data-parallel-start-rank (or "
                             "--pipeline-parallel-size-local < --pipeline-parallel-size, "
                             "--pipeline-parallel-start-rank), --data-parallel-address and --data-parallel-rpc-port "
                             "of the head.")
        if not headless and self.multi_host and self.data_parallel_start_rank != 0:
            raise ValueError(f"data_parallel_start_rank must be 0 on the head (the host with the API server), got "
                             f"{self.data_parallel_start_rank}; the other hosts run with --headless.")
        if not headless and self.pipeline_parallel_start_rank != 0:
            raise ValueError(f"pipeline_parallel_start_rank must be 0 on the head (its replica's first stage), got "
                             f"{self.pipeline_parallel_start_rank}; the hosts of later stages run with --headless.")

    @property
    def data_parallel_local_size(self) -> int:
        """Replicas on this host (``data_parallel_size_local``, default all)."""
        return self.data_parallel_size if self.data_parallel_size_local is None else self.data_parallel_size_local

    @property
    def pipeline_parallel_local_size(self) -> int:
        """Stages on this host (``pipeline_parallel_size_local``, default all)."""
        return self.pipeline_parallel_size if self.pipeline_parallel_size_local is None \
            else self.pipeline_parallel_size_local

    @property
    def multi_host(self) -> bool:
        """The deployment spans several hosts (this one runs only some of its replicas, or
        some stages of its replica)."""
        return (self.data_parallel_local_size < self.data_parallel_size
                or self.pipeline_parallel_local_size < self.pipeline_parallel_size)

    @property
    def local_stages(self) -> set[tuple[int, int]]:
        """This host's ``(DP rank, pipeline stage)`` pairs."""
        pp_start = self.pipeline_parallel_start_rank
        return {(d, s) for d in range(self.data_parallel_start_rank,
                                      self.data_parallel_start_rank + self.data_parallel_local_size)
                for s in range(pp_start, pp_start + self.pipeline_parallel_local_size)}

    @property
    def model_on_one_rank(self) -> bool:
        """Every rank holds the whole model: no tensor or pipeline split, no experts sharded
        over replicas."""
        return self.replica_size == 1 and not (self.enable_expert_parallel and self.data_parallel_size > 1)

    @property
    def replica_size(self) -> int:
        """Processes of one DP replica: ``tensor_parallel_size * pipeline_parallel_size``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def local_ranks(self) -> range:
        """The global ranks of this host's processes: its replicas' stages and TP ranks
        (rank ``(dp * pp + stage) * tp + tp_rank``: consecutive for a host's replicas, or for
        its stages of one replica)."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        first = (self.data_parallel_start_rank * pp + self.pipeline_parallel_start_rank) * tp
        return range(first, first + self.data_parallel_local_size * self.pipeline_parallel_local_size * tp)

    @property
    def world_size(self) -> int:
        """Processes of the deployment: ``replica_size * data_parallel_size``."""
        return self.replica_size * self.data_parallel_size
