"""Pipeline parallelism's pieces below the engine: which decoder layers a stage holds, and
the stage-to-stage transfer of the residual stream.

A model of ``L`` decoder layers on ``pp_size`` stages: stage ``s`` holds layers ``[start,
end)`` (:func:`pp_layer_range`), the first stage the embedding too, the last the final norm and
the LM head (vLLM's ``get_pp_indices`` and ``PPMissingLayer``; GPipe, Huang et al. 2019, for
the split itself). Between two stages travels the residual stream as the layers carry it
(:class:`IntermediateTensors`: the last layer's output and the residual before its add, which
the next stage's first RMSNorm fuses), one ``send``/``recv`` of both stacked, over the
pipeline's process group (:func:`tandem.distributed.parallel_state.get_pp_group`: NCCL on
GPUs, gloo on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tandem import envs
from tandem.distributed import parallel_state as ps


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The decoder layers ``[start, end)`` of stage ``pp_rank`` of ``pp_size``.

    ``TANDEM_PP_LAYER_PARTITION`` (:mod:`tandem.envs`) gives each stage's count; unset, the
    layers are split as evenly as they go, the remainder one each on the stages before the
    last (the last also runs the LM head and the sampler; vLLM's rule).

    Raises:
        ValueError: a partition whose length is not ``pp_size`` or whose counts do not sum
            to ``num_layers``; fewer layers than stages.
    """
    counts = envs.TANDEM_PP_LAYER_PARTITION
    if counts is None:
        if num_layers < pp_size:
            raise ValueError(f"pipeline_parallel_size {pp_size} exceeds the model's {num_layers} decoder layers")
        counts = [num_layers // pp_size] * pp_size
        for i in range(num_layers % pp_size):
            counts[-2 - i] += 1
    elif len(counts) != pp_size or sum(counts) != num_layers:
        raise ValueError(f"TANDEM_PP_LAYER_PARTITION={','.join(map(str, counts))}: need {pp_size} stage counts "
                         f"summing to the model's {num_layers} decoder layers")
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


class PPMissingLayer(nn.Identity):
    """The place of a layer another pipeline stage holds: no parameters, and calling it is
    an error (so a stage can never run a layer it does not have)."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this layer lives on another pipeline stage")


@dataclass
class IntermediateTensors:
    """The residual stream between two pipeline stages: ``hidden`` (the last layer's output)
    and ``residual`` (the stream before it is added), each ``[num_tokens, hidden_size]`` in
    the model dtype."""

    hidden: torch.Tensor
    residual: torch.Tensor

    def send(self) -> None:
        """Send both to the next stage (blocking)."""
        dist.send(torch.stack([self.hidden, self.residual]).contiguous(), dst=_neighbour(+1),
                  group=ps.get_pp_group())

    @classmethod
    def recv(cls, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> IntermediateTensors:
        """Receive what the previous stage sent for a forward of ``num_tokens`` tokens (blocking)."""
        buf = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
        dist.recv(buf, src=_neighbour(-1), group=ps.get_pp_group())
        return cls(buf[0], buf[1])


def _neighbour(step: int) -> int:
    """Global rank of the stage ``step`` away from this one in its pipeline."""
    ranks = ps.get_pp_ranks()
    return ranks[ps.get_pp_rank() + step]


__all__ = ["IntermediateTensors", "PPMissingLayer", "pp_layer_range"]
