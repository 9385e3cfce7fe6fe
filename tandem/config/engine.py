"""The whole engine configuration: one group per concern (vLLM's ``VllmConfig``).

Built from flat keyword arguments or flags by :class:`tandem.engine.arg_utils.EngineArgs`;
each group validates its own fields, this class the rules that span groups.
"""

from __future__ import annotations

import logging
import typing
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from tandem.config.cache import CacheConfig
from tandem.config.dbo import DBOConfig
from tandem.config.device import DeviceConfig
from tandem.config.load import LoadConfig
from tandem.config.model import ModelConfig, resolve_dtype
from tandem.config.parallel import ParallelConfig
from tandem.config.scheduler import SchedulerConfig
from tandem.config.simulated_link import SimulatedLinkConfig
from tandem.config.speculative import SpeculativeConfig
from tandem.config.utils import unwrap_optional

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    """Every knob of the engine, in groups (``config.cache_config.block_size``)."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    load_config: LoadConfig = field(default_factory=LoadConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    dbo_config: DBOConfig = field(default_factory=DBOConfig)
    simulated_link_config: SimulatedLinkConfig = field(default_factory=SimulatedLinkConfig)
    # An optional group, given whole as one JSON flag (None: off).
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.simulated_link_config.simulated_ep_rank_experts and self.parallel_config.all2all_backend != "simulated":
            raise ValueError("simulated_ep_rank_experts needs all2all_backend='simulated'.")
        if self.speculative_config is not None:
            self._resolve_speculative()
        if self.parallel_config.pipeline_parallel_size > 1:
            self._resolve_pipeline()

    def _resolve_pipeline(self) -> None:
        """Refuse, or turn off (as vLLM did for PP), what pipeline parallelism does not
        cover yet: dual-batch overlap; expert parallelism across data-parallel replicas (its
        replicas step in lockstep, idle ones with dummy batches, which a batch queue
        does not run); CUDA graphs (logged)."""
        if self.dbo_config.enable_dbo:
            raise ValueError("pipeline_parallel_size > 1 does not support enable_dbo yet.")
        par = self.parallel_config
        if par.enable_expert_parallel and par.data_parallel_size > 1:
            raise ValueError("pipeline_parallel_size > 1 does not support enable_expert_parallel with "
                             "data_parallel_size > 1 yet (expert parallelism over a stage's TP ranks does).")
        if not self.model_config.enforce_eager:
            logger.info("pipeline parallelism does not capture CUDA graphs yet: enforce_eager on")
            self.model_config.enforce_eager = True

    @property
    def max_concurrent_batches(self) -> int:
        """Batches in flight at once (vLLM V1's name): one per pipeline stage with
        asynchronous output processing, so that no stage waits for the others; else 1
        (the engine core's one-step-ahead loop, or a synchronous one)."""
        pp = self.parallel_config.pipeline_parallel_size
        return pp if pp > 1 and self.scheduler_config.async_output_proc else 1

    def _resolve_speculative(self) -> None:
        """Refuse what speculative decoding does not cover yet. (Asynchronous output
        processing stays as configured: the engine core runs a step with drafts
        synchronously and the others one step ahead, :meth:`EngineCore.step`.)"""
        par = self.parallel_config
        if par.world_size > 1 or par.enable_expert_parallel:
            raise ValueError("speculative_config does not support tensor, pipeline, data or expert parallelism yet.")
        if self.dbo_config.enable_dbo:
            raise ValueError("speculative_config does not support enable_dbo yet.")

    @classmethod
    def group_types(cls) -> dict[str, type]:
        """Group field name -> its config class, in declaration order, for the groups whose
        fields are flat engine arguments (each its own flag)."""
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in fields(cls) if not unwrap_optional(hints[f.name])[1]}

    @classmethod
    def json_groups(cls) -> dict[str, type]:
        """Group field name -> its config class, for the optional groups given whole as one
        JSON engine argument (``--speculative-config '{...}'``; None: off)."""
        hints = typing.get_type_hints(cls)
        return {f.name: unwrap_optional(hints[f.name])[0] for f in fields(cls) if unwrap_optional(hints[f.name])[1]}

    @property
    def torch_dtype(self) -> torch.dtype:
        """dtype of weights and activations on this config's device."""
        return resolve_dtype(self.model_config.dtype, self.device_config.torch_device, self.model_config.model)

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """dtype of the paged KV cache: the model dtype, or float8_e4m3fn."""
        import torch

        return self.torch_dtype if self.cache_config.kv_cache_dtype == "auto" else torch.float8_e4m3fn

    def resolve_limits(self, model_max_len: int) -> None:
        """Fill ``max_model_len`` from the model's context, and the batch limits left unset
        with the defaults of this device and use (:func:`tandem.platform.default_batch_limits`).

        Raises:
            ValueError: the limits are inconsistent (a prompt could never be scheduled).
        """
        from tandem.platform import default_batch_limits

        if self.model_config.max_model_len is None:
            self.model_config.max_model_len = model_max_len
        sched = self.scheduler_config
        seqs, tokens = default_batch_limits(self.device_config.torch_device, sched.usage_context)
        sched.resolve_limits(self.model_config.max_model_len, seqs, tokens)
