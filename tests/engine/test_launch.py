"""The engine-core processes' launch (tandem.engine.launch): each rank's launch struct, and the
process manager that spawns, watches and kills them, leaving no process behind."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys

import psutil
import pytest
import zmq

from tandem.engine import launch
from tandem.engine.arg_utils import EngineArgs
from tandem.engine.launch import CoreLaunch, CoreProcManager, EngineClientConfig, EngineZmqAddresses, rank_launches
from tandem.engine.messages import CoreMessage, EngineCoreReady, MsgpackDecoder


def _config():
    return EngineArgs(num_kv_blocks=64, max_model_len=256, device="cpu").create_engine_config()


def _gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def test_each_rank_gets_the_deployments_launch_with_its_ranks():
    base = CoreLaunch(_config(), EngineZmqAddresses([["ipc://x/in"]], ["ipc://x/out"]), parent_pid=1, world_size=4,
                      master_addr="10.0.0.1", master_port=29500, log_level="INFO")
    second_host = rank_launches(base, range(2, 4))
    assert [(lc.rank, lc.local_rank) for lc in second_host] == [(2, 0), (3, 1)]
    assert all(dataclasses.replace(lc, rank=0, local_rank=None) == base for lc in second_host)
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.rank = 1


def test_a_launched_core_is_watched_and_killed_without_leftovers():
    """The launcher's view spawns the rank and kills it with everything it started; an
    attached view (another process's cores) watches it through a pidfd and never kills it."""
    cores = CoreProcManager.launch(_config())
    ctx = zmq.Context()
    out = ctx.socket(zmq.PULL)
    try:
        out.bind(cores.addresses.outputs[0])
        assert out.poll(120_000), "no handshake from the rank"
        assert isinstance(MsgpackDecoder(CoreMessage).decode(out.recv()), EngineCoreReady)
        rank = psutil.Process(cores.pids[0])
        tree = [rank, *rank.children(recursive=True)]
        attached = CoreProcManager.attach(EngineClientConfig(cores.addresses, 0, cores.pids))
        attached.kill()
        assert not attached.owner and rank.is_running() and rank.status() != psutil.STATUS_ZOMBIE
        assert not cores.wait_for_exit(0) and cores.dead() == [] and cores.any_alive()
    finally:
        out.close(0)
        ctx.term()
        cores.close()
    assert _gone(tree, 10) == []
    assert not os.path.exists(cores.addresses.outputs[0].removeprefix("ipc://").rsplit("/", 1)[0])
    assert attached.wait_for_exit(10) and attached.dead() == [0]


def test_a_killed_process_is_reported_dead(tmp_path, monkeypatch):
    """``kill_spawned`` (a server stopped while it loads) kills what this process spawned;
    the manager then reports the process dead, by its exit code too."""
    monkeypatch.setattr(launch, "_spawned", set())  # other tests' engines are not ours to kill
    addrs = EngineZmqAddresses([[f"ipc://{tmp_path}/in"]], [f"ipc://{tmp_path}/out"])
    cores = CoreProcManager.spawn(CoreLaunch(_config(), addrs, os.getpid()), [0])
    try:
        assert launch.kill_spawned()
        assert cores.wait_for_exit(30)
        assert cores.dead() == cores.dead(count_clean_exits=False) == [0]
        assert cores.procs[0].exitcode == -signal.SIGKILL
        assert "out-of-memory killer" in launch.exit_reason(cores.procs[0].exitcode)
    finally:
        cores.close()
    assert not launch.kill_spawned()


@pytest.mark.parametrize("code, expected", [
    (1, "exit code 1"), (0, "exit code 0"), (None, "exit code unknown"),
    (-signal.SIGKILL, "signal 9 (SIGKILL: the kernel's out-of-memory killer, or kill -9)"),
    (-signal.SIGSEGV, "signal 11 (SIGSEGV: a crash in native code)"), (-signal.SIGTERM, "signal 15 (SIGTERM)"),
    (-200, "signal 200 (unknown signal)")])
def test_exit_reason_names_the_signal(code, expected):
    assert launch.exit_reason(code) == expected


def test_attaching_to_a_gone_process_raises():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with pytest.raises(ProcessLookupError, match=str(gone.pid)):
        CoreProcManager.attach(EngineClientConfig(EngineZmqAddresses([["ipc://x/in"]], ["ipc://x/out"]), 0,
                                                  [gone.pid]))


def test_a_model_whose_heads_do_not_split_over_the_tp_ranks_is_refused_before_any_rank_starts(embedded_model_path):
    """The embedded SmolLM2 has 9 attention heads and 3 KV heads: ``LLM(tensor_parallel_size=2)``
    is refused with the sizes that work, and no rank process was started; TP 3 passes the check."""
    import multiprocessing

    from tandem.engine.arg_utils import EngineArgs
    from tandem.entrypoints.llm import LLM

    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) must split .* \(9\) and .* \(3\): one of 1, 3, 9\."):
        LLM(embedded_model_path, tensor_parallel_size=2, device="cpu")
    assert not multiprocessing.active_children()
    launch.check_tensor_parallel_size(
        EngineArgs(model=embedded_model_path, tensor_parallel_size=3, device="cpu").create_engine_config())
