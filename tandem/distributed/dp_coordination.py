"""One collective per step over the data-parallel group: what every rank runs.

Every DP rank calls :func:`coordinate_step` once per engine step with its own view
(tokens scheduled, whether it wants to split into two ubatches, whether it would run a
CUDA graph). One all-reduce (MAX) over ``[1 - wants_split, num_tokens, padded_tokens,
1 - graph_mode]`` yields the common decision (DESIGN.md, "Cross-rank agreement"):
split only when *every* rank wants to, graph mode only when every rank can, and pad every
rank to the largest token count. A rank with nothing scheduled still takes part and runs a
dummy batch when another rank has work, so that the MoE collectives match; it votes to split
(its dummy batch is padding only), so it never vetoes the busy ranks' split. In graph mode
the split vote is not used: every rank replays the capture size for ``max_tokens``, whose
split or plain form all ranks agreed on at capture (an idle rank replays it with padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class StepPlan:
    """The common decision of one step.

    ``max_tokens``: largest real token count on any rank (0: no rank runs a forward);
    ``padded_tokens``: token count every rank pads its forward to; ``split``: run as two
    ubatches; ``graph_mode``: replay CUDA graphs.
    """

    max_tokens: int
    padded_tokens: int
    split: bool
    graph_mode: bool


def coordinate_step(group: dist.ProcessGroup | None, num_tokens: int, padded_tokens: int, wants_split: bool,
                    graph_mode: bool) -> StepPlan:
    """Agree on a step across the DP group (no collective when ``group`` is None).

    Returns the plan every rank of the group follows.
    """
    if group is None or dist.get_world_size(group) == 1:
        return StepPlan(num_tokens, padded_tokens, wants_split, graph_mode)
    t = torch.tensor([int(not wants_split), num_tokens, padded_tokens, int(not graph_mode)], dtype=torch.int64)
    backend = dist.get_backend(group)
    if backend == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    no_split, max_tokens, padded, no_graph = t.tolist()
    return StepPlan(max_tokens, padded, split=not no_split and max_tokens > 0, graph_mode=not no_graph)
