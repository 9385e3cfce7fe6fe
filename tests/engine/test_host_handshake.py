"""The head's handshake with ``--headless`` hosts and the heartbeats (in one process, over
loopback TCP): a matching host is welcomed; a differing version, config field or rank
range is refused with one line naming it; a host that never joins, or goes silent, is
reported; the head's stop reaches the host."""

from __future__ import annotations

import select
import socket
import time

import pytest

from tandem.distributed.launch import free_port
from tandem.engine.arg_utils import EngineArgs
from tandem.engine.host_handshake import (HeadHandshake, HeadLink, HostRefusedError, HostWelcome, comparable_config,
                                          config_difference)


def _config(port: int, start: int = 0, **kw):
    return EngineArgs(data_parallel_size=3, data_parallel_size_local=1, data_parallel_start_rank=start,
                      data_parallel_address="127.0.0.1", data_parallel_rpc_port=port, **kw).create_engine_config()


WELCOME = HostWelcome([["tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "tcp://127.0.0.1:3"]], ["tcp://127.0.0.1:4"],
                      "127.0.0.1", 5)


@pytest.fixture
def head():
    port = free_port()
    hs = HeadHandshake(_config(port), WELCOME)
    yield hs, port
    hs.close()


def test_per_host_fields_are_not_compared():
    a, b = comparable_config(_config(1234)), comparable_config(_config(1234, start=2, master_port=99))
    assert config_difference(a, b) is None
    diff = config_difference(a, comparable_config(_config(1234, max_model_len=64)))
    assert diff == "max_model_len auto (head) vs 64 (this host)"


def test_a_refusal_names_unset_fields_auto_and_optional_groups_off():
    """Never a bare None: an unset field is left to each host's engine core ("auto"); a
    group given to one side only is "on" there and "off" on the other, its fields unlisted."""
    spec = {"method": "ngram", "num_speculative_tokens": 2}  # one rank: speculation is not data-parallel yet
    head = comparable_config(EngineArgs().create_engine_config())
    host = comparable_config(EngineArgs(max_num_seqs=8, speculative_config=spec).create_engine_config())
    diff = config_difference(head, host)
    assert diff == "max_num_seqs auto (head) vs 8 (this host); speculative_config off (head) vs on (this host)"
    assert config_difference(host, head) == ("max_num_seqs 8 (head) vs auto (this host); "
                                             "speculative_config on (head) vs off (this host)")


def _ready(engine_index: int, host: str, **resolved):
    from tandem.config.resolved import ResolvedConfig
    from tandem.engine.messages import EngineCoreReady
    from tandem.model_loader.generation_config import GenerationDefaults

    fields = dict(dtype="bfloat16", quantization=None, all2all_backend=None, device="cpu", max_model_len=4096,
                  max_num_seqs=256, max_num_batched_tokens=2048, num_kv_blocks=100,
                  generation_defaults=GenerationDefaults(frozenset({2}), {"temperature": 0.6}, f"/{host}/g.json"))
    return EngineCoreReady(engine_index, ResolvedConfig(**(fields | resolved)), 100, [2], (1, 64), {}, host)


def test_replicas_are_compared_on_what_they_resolved():
    """Limits and cache sizes follow each host's memory; the dtype, the quantization and the
    generation defaults decide the tokens and must agree (the file may sit anywhere)."""
    from tandem.engine.host_handshake import replica_difference

    assert replica_difference([_ready(0, "a"), _ready(1, "b", max_model_len=2048, num_kv_blocks=50)]) is None
    diff = replica_difference([_ready(0, "a"), _ready(1, "b", dtype="float32"), _ready(2, "c", quantization="gguf")])
    assert diff == ("dtype 'bfloat16' (replica 0 on a) vs 'float32' (replica 1 on b); "
                    "quantization none (replica 0 on a) vs 'gguf' (replica 2 on c)")


def test_matching_hosts_are_welcomed_and_beat(head, monkeypatch):
    hs, port = head
    links = [HeadLink(_config(port, start=s)) for s in (1, 2)]
    try:
        assert all(link.welcome == WELCOME for link in links)
        hs.wait_for_hosts(timeout=5)
        assert sorted(what for _, what in hs.hosts.values()) == ["DP ranks 1", "DP ranks 2"]
        for _ in range(3):
            assert all(link.poll(0.4) is None for link in links)
        assert hs.lost is None
    finally:
        for link in links:
            link.close()


@pytest.mark.parametrize("case, expected", [
    ("config", "engine configuration differs: max_model_len auto (head) vs 64 (this host)"),
    ("rank_taken", "data-parallel ranks 0 are taken or outside the deployment (still free: [1, 2])"),
    ("version", "Tandem version 9.9.9 differs from the head's"),
])
def test_a_differing_host_is_refused_in_one_line(head, monkeypatch, case, expected):
    hs, port = head
    cfg = _config(port, start=0 if case == "rank_taken" else 1, **({"max_model_len": 64} if case == "config" else {}))
    if case == "version":
        monkeypatch.setattr("tandem.version.tandem_version", lambda: "9.9.9")
    with pytest.raises(HostRefusedError) as e:
        HeadLink(cfg)
    msg = str(e.value)
    assert "\n" not in msg and expected in msg and f"127.0.0.1:{port} refused this host" in msg


def test_ranks_that_never_join_are_named(head):
    hs, port = head
    link = HeadLink(_config(port, start=1))
    try:
        with pytest.raises(HostRefusedError, match=r"data-parallel ranks \[2\] did not join within 1 s .*"
                                                   r"--data-parallel-start-rank 2"):
            hs.wait_for_hosts(timeout=1)
    finally:
        link.close()


def test_a_silent_host_is_lost_and_a_stopped_head_reaches_its_hosts(monkeypatch):
    monkeypatch.setenv("TANDEM_HOST_HEARTBEAT_TIMEOUT_S", "2.5")  # heartbeats come every second
    port = free_port()
    hs = HeadHandshake(_config(port), WELCOME)
    try:
        quiet, beating = HeadLink(_config(port, start=1)), HeadLink(_config(port, start=2))
        hs.wait_for_hosts(timeout=5)
        deadline = time.monotonic() + 5
        while hs.lost is None and time.monotonic() < deadline:
            assert beating.poll(0.2) is None  # only the quiet one stops beating
        assert hs.lost == f"host {socket.gethostname()} (DP ranks 1) is gone: no heartbeat for 2.5 s"
        assert select.select([hs.lost_r], [], [], 0)[0]  # the clients' monitors wake on it
        hs.close("host lost")
        deadline = time.monotonic() + 5
        while (gone := beating.poll(0.2)) is None and time.monotonic() < deadline:
            pass
        assert gone == "host lost"
    finally:
        hs.close()
        quiet.close()
        beating.close()


def test_a_head_that_vanishes_is_noticed(monkeypatch):
    import msgspec
    import zmq

    monkeypatch.setenv("TANDEM_HOST_HEARTBEAT_TIMEOUT_S", "1")
    port = free_port()
    ctx = zmq.Context()
    head = ctx.socket(zmq.ROUTER)  # welcomes, then stays silent (as after a kill -9)
    head.bind(f"tcp://127.0.0.1:{port}")
    try:
        from threading import Thread

        def welcome() -> None:
            ident, _ = head.recv_multipart()
            head.send_multipart([ident, msgspec.msgpack.encode(WELCOME)])

        t = Thread(target=welcome)
        t.start()
        link = HeadLink(_config(port, start=1))
        t.join()
        deadline = time.monotonic() + 5
        while (gone := link.poll(0.2)) is None and time.monotonic() < deadline:
            pass
        assert gone == f"the head at tcp://127.0.0.1:{port} is gone: no heartbeat for 1 s"
        link.close()
    finally:
        head.close(linger=0)
        ctx.term()


def test_flags_that_do_not_fit_the_host_role_are_refused():
    single = EngineArgs(data_parallel_size=2).create_engine_config().parallel_config
    with pytest.raises(ValueError, match="--headless runs some of the replicas"):
        single.check_host_role(headless=True)
    single.check_host_role(headless=False)
    with pytest.raises(ValueError, match="data_parallel_start_rank must be 0 on the head"):
        _config(1234, start=1).parallel_config.check_host_role(headless=False)
    _config(1234, start=1).parallel_config.check_host_role(headless=True)
    with pytest.raises(ValueError, match="data_parallel_rpc_port is required"):
        EngineArgs(data_parallel_size=2, data_parallel_size_local=1).create_engine_config()
    with pytest.raises(ValueError, match="must not exceed data_parallel_size"):
        EngineArgs(data_parallel_size=2, data_parallel_size_local=1, data_parallel_start_rank=2,
                   data_parallel_rpc_port=1234).create_engine_config()
    with pytest.raises(ValueError, match=r"data_parallel_size_local \(2, its default\)"):
        EngineArgs(data_parallel_size=2, data_parallel_start_rank=1).create_engine_config()


def _stage_config(port: int, start: int, local: int = 1, pp: int = 3):
    from tandem.engine.arg_utils import EngineArgs

    return EngineArgs(pipeline_parallel_size=pp, pipeline_parallel_size_local=local, pipeline_parallel_start_rank=start,
                      data_parallel_address="127.0.0.1", data_parallel_rpc_port=port).create_engine_config()


def test_hosts_of_a_replicas_later_stages_join_and_missing_stages_are_named():
    """Pipeline stages over hosts: the head holds stage 0, hosts join with stages 1 and 2;
    a stage taken twice is refused, and one never joined is named with its flags."""
    port = free_port()
    hs = HeadHandshake(_stage_config(port, 0), WELCOME)
    links = []
    try:
        links.append(HeadLink(_stage_config(port, 1)))
        with pytest.raises(HostRefusedError, match=r"data-parallel ranks 0, stages 1 are taken or outside the "
                                                   r"deployment \(still free: pipeline stages \[2\] of data-parallel rank 0\)"):
            HeadLink(_stage_config(port, 1))
        with pytest.raises(HostRefusedError, match=r"pipeline stages \[2\] of data-parallel rank 0 did not join "
                                                   r"within 1 s .*--data-parallel-start-rank 0 "
                                                   r"--pipeline-parallel-start-rank 2"):
            hs.wait_for_hosts(timeout=1)
        links.append(HeadLink(_stage_config(port, 2)))
        hs.wait_for_hosts(timeout=5)
        assert sorted(what for _, what in hs.hosts.values()) == ["DP ranks 0, stages 1", "DP ranks 0, stages 2"]
    finally:
        for link in links:
            link.close()
        hs.close()


def test_stage_hosts_config_and_their_ranks():
    from tandem.engine.arg_utils import EngineArgs

    later = EngineArgs(pipeline_parallel_size=4, tensor_parallel_size=2, pipeline_parallel_size_local=2,
                       pipeline_parallel_start_rank=2, data_parallel_address="127.0.0.1",
                       data_parallel_rpc_port=1234).create_engine_config().parallel_config
    assert later.multi_host and later.local_ranks == range(4, 8) and later.local_stages == {(0, 2), (0, 3)}
    later.check_host_role(headless=True)
    with pytest.raises(ValueError, match="pipeline_parallel_start_rank must be 0 on the head"):
        later.check_host_role(headless=False)
    with pytest.raises(ValueError, match="data_parallel_size_local must be 1"):
        EngineArgs(pipeline_parallel_size=2, pipeline_parallel_size_local=1, data_parallel_size=2,
                   data_parallel_rpc_port=1234).create_engine_config()
    with pytest.raises(ValueError, match=r"pipeline_parallel_start_rank \(2\) \+ pipeline_parallel_size_local \(1\) must "
                                         r"not exceed pipeline_parallel_size \(2\)"):
        EngineArgs(pipeline_parallel_size=2, pipeline_parallel_size_local=1, pipeline_parallel_start_rank=2,
                   data_parallel_rpc_port=1234).create_engine_config()
    with pytest.raises(ValueError, match="data_parallel_rpc_port is required"):
        EngineArgs(pipeline_parallel_size=2, pipeline_parallel_size_local=1).create_engine_config()
    # DP x PP with whole replicas per host, as before: replica 1's ranks.
    dp = EngineArgs(pipeline_parallel_size=2, data_parallel_size=2, data_parallel_size_local=1,
                    data_parallel_start_rank=1, data_parallel_rpc_port=1234).create_engine_config().parallel_config
    assert dp.local_ranks == range(2, 4)


def test_stray_messages_on_the_handshake_port_are_ignored(head):
    import zmq

    hs, port = head
    ctx = zmq.Context()
    stray = ctx.socket(zmq.DEALER)
    stray.connect(f"tcp://127.0.0.1:{port}")
    stray.send(b"GET / HTTP/1.1")
    stray.send_multipart([b"a", b"b"])
    link = HeadLink(_config(port, start=1))  # the head still answers
    try:
        assert link.welcome == WELCOME and hs._thread.is_alive()
    finally:
        link.close()
        stray.close(linger=0)
        ctx.term()
