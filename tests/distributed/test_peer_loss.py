"""Which failures are a lost peer rank (tandem.distributed.peer_loss)."""

import pytest
import torch.distributed as dist

from tandem.distributed.peer_loss import lost_peer_reason

GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:50102: "
        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application. "
        "Check the logs of the remote worker before reporting an error.")


def test_a_gloo_transport_error_is_one_line_without_its_source():
    reason = lost_peer_reason(RuntimeError(GLOO))
    assert reason.startswith("lost the connection to another rank")
    assert reason.endswith("Read error [127.0.0.1]:50102: Connection reset by peer")
    assert ".cc:" not in reason and "typically" not in reason


@pytest.mark.parametrize("exc", [dist.DistBackendError("NCCL error: remote process exited or there was a network error"),
                                 dist.DistNetworkError("failed to recv, got 0 bytes"),
                                 RuntimeError("Connection closed by peer [10.0.0.2]:29500")])
def test_the_transports_errors_are_lost_peers(exc):
    assert lost_peer_reason(exc) is not None


@pytest.mark.parametrize("exc", [RuntimeError("CUDA out of memory"), ValueError("Connection reset by peer"),
                                 RuntimeError(""), KeyError("x")])
def test_other_failures_are_not(exc):
    assert lost_peer_reason(exc) is None
