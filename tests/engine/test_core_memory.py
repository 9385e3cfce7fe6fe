"""What bounds an engine core's memory under a varied load (issue 53): oneDNN's shape-keyed
caches held to :data:`tandem.envs.LIBRARY_CACHE_LIMITS` entries, so bfloat16 GEMMs of ever new
row counts (every prompt length) do not keep ~0.6 MB each; an idle core process gives the
free memory of its malloc arenas back."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

# One bf16 GEMM per row count 1..300 with a 576 x 576 weight (the embedded model's o_proj);
# prints the growth of glibc's bytes in use, in MB.
_GEMMS = """
import ctypes, sys, torch
from tandem import envs
if sys.argv[1] == "limits":
    envs.set_library_cache_limits()
libc = ctypes.CDLL("libc.so.6")
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
w = torch.randn(576, 576).bfloat16()
torch.nn.functional.linear(torch.randn(1, 576).bfloat16(), w)
before = libc.mallinfo2().uordblks
for m in range(2, 301):
    torch.nn.functional.linear(torch.randn(m, 576).bfloat16(), w)
print((libc.mallinfo2().uordblks - before) / 1e6)
"""


def _growth_mb(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", _GEMMS, mode], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads glibc's mallinfo2")
def test_library_cache_limits_bound_bf16_gemm_memory():
    unbounded = _growth_mb("defaults")
    if unbounded < 100:
        pytest.skip(f"this CPU's bf16 GEMMs keep no per-shape state ({unbounded:.0f} MB for 300 row counts)")
    assert _growth_mb("limits") < 60, f"without the limits: {unbounded:.0f} MB"


class _FakeCore:
    """What EngineCoreProc.run asks of a core: ``steps`` steps of work, then none."""

    engine_index = 0
    num_steps = 0
    runner = None

    def __init__(self, steps: int) -> None:
        self.steps_left = steps
        self.last_step_t = 0.0

    def ready_message(self):
        from tandem.engine.messages import EngineCoreOutputs

        return EngineCoreOutputs(0)

    def has_unfinished_requests(self) -> bool:
        return self.steps_left > 0

    def step(self) -> list:
        self.steps_left -= 1
        self.last_step_t = time.monotonic()
        return []

    def scheduler_stats(self):
        from tandem.engine.messages import SchedulerStats

        return SchedulerStats()

    def drain_in_flight(self) -> None:
        """Nothing is in flight: every step above returned at once."""


def test_an_idle_driver_releases_its_free_heap_once(monkeypatch, tmp_path):
    """IDLE_TRIM_S after its last step a driver gives its free heap back, once, then waits
    for input as long as it takes."""
    import zmq

    from tandem.engine import core_proc
    from tandem.engine.messages import EngineCoreRequestType

    released = []
    monkeypatch.setattr(core_proc, "IDLE_TRIM_S", 0.2)
    monkeypatch.setattr(core_proc, "release_free_heap", lambda: released.append(time.monotonic()))
    ctx = zmq.Context()
    front_in, front_out = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    front_in.bind(f"ipc://{tmp_path}/in")
    front_out.bind(f"ipc://{tmp_path}/out")
    core = _FakeCore(steps=3)
    proc = core_proc.EngineCoreProc(core, [f"ipc://{tmp_path}/in"], [f"ipc://{tmp_path}/out"])
    loop = threading.Thread(target=proc.run)
    loop.start()
    time.sleep(1.0)
    front_in.send_multipart((EngineCoreRequestType.SHUTDOWN.value, b""))
    loop.join(10)
    proc.close()
    front_in.close(linger=0)
    front_out.close(linger=0)
    ctx.term()
    assert not loop.is_alive() and core.steps_left == 0
    assert len(released) == 1 and released[0] - core.last_step_t >= 0.2


def test_idle_wait_ms():
    from tandem.engine.core_proc import IDLE_TRIM_S, idle_wait_ms

    assert idle_wait_ms(None) == -1
    assert idle_wait_ms(time.monotonic() - 2 * IDLE_TRIM_S) == 0
    assert 0 < idle_wait_ms(time.monotonic()) <= IDLE_TRIM_S * 1000
