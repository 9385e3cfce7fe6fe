"""Telling a lost peer rank apart from other failures.

When a rank's process or host is gone, the collectives and point-to-point transfers of the
ranks still running fail with the transport's own text (gloo: ``RuntimeError: [.../pair.cc:537]
Read error [127.0.0.1]:50102: Connection reset by peer. This is typically caused by ...``;
NCCL: ``DistBackendError``). :func:`lost_peer_reason` turns such a failure into one line a
client can read; a failure of anything else is not one.
"""

from __future__ import annotations

import re

import torch.distributed as dist

# Text of the transports' errors when the other end is gone (gloo's TCP pair, NCCL, the TCP store).
_LOST_PEER = re.compile(r"Connection (reset|closed) by peer|Broken pipe|Socket Timeout|remote process exited"
                        r"|Connection refused|Timed out waiting for|NCCL communicator was aborted", re.I)
_SOURCE_PREFIX = re.compile(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*")


def lost_peer_reason(exc: BaseException) -> str | None:
    """One line saying that another rank of the deployment is gone, with the transport's own
    reason (its source location and advice stripped); None when ``exc`` is not such a failure.

    Args:
        exc: an exception raised by a ``torch.distributed`` call (``RuntimeError`` from gloo,
            ``DistBackendError`` / ``DistNetworkError`` from NCCL and the stores).
    """
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if not (isinstance(exc, dist.DistError) or _LOST_PEER.search(text)):
        return None
    detail = _SOURCE_PREFIX.sub("", text).split(". This is typically", 1)[0].rstrip(".")
    return ("lost the connection to another rank of this deployment (its process or its host is gone; "
            f"see that host's log): {detail}")


__all__ = ["lost_peer_reason"]
