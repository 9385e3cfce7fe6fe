"""Several hosts behind one endpoint: the head's handshake with its ``--headless`` hosts and
the heartbeat that keeps each side aware of the other (vLLM's multi-node data parallelism:
``--data-parallel-address`` / ``--data-parallel-rpc-port`` / ``--headless``).

The head (``tandem serve ... --data-parallel-size-local L``) binds a zmq ROUTER on
``data_parallel_address:data_parallel_rpc_port``. Every headless host connects a DEALER and
sends a :class:`HostHello`: its Tandem version, its engine configuration and the data-parallel
ranks it runs. The head answers :class:`HostWelcome` (where its API servers' sockets and the
torch.distributed rendezvous listen) or :class:`HostRefused` with one line naming what
differs (version, model, a config field, a rank range taken or outside the deployment).

After the handshake both sides send :class:`Heartbeat` every :data:`HEARTBEAT_INTERVAL_S`;
silence longer than ``TANDEM_HOST_HEARTBEAT_TIMEOUT_S`` (a ``kill -9`` of the other side, a
lost network) or a :class:`HostStop` makes each take the other for gone: the head fails its
requests and stops; a headless host stops its engine cores. The engine cores themselves talk
to the head's API servers directly (the one client protocol, zmq over TCP), and meet the
other hosts' ranks in torch.distributed (EP all-to-all, DP lockstep, DBO agreement).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import asdict, fields
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from tandem import envs
from tandem.config import EngineConfig
from tandem.config.resolved import ResolvedConfig
from tandem.engine.messages import EngineCoreReady
from tandem.model_loader.generation_config import GenerationDefaults

logger = logging.getLogger(__name__)

# Seconds between two heartbeats of either side.
HEARTBEAT_INTERVAL_S = 1.0


class HostHello(msgspec.Struct, tag=True):
    version: str
    hostname: str
    pid: int
    start_rank: int
    local_size: int
    config: dict[str, Any]
    # The host's pipeline stages of its replica (all of them unless stages span hosts).
    stage_start: int = 0
    num_stages: int = 1


class HostWelcome(msgspec.Struct, tag=True):
    """``inputs[c][e]`` / ``outputs[c]``: the API servers' sockets (EngineZmqAddresses);
    ``master_addr:master_port``: the torch.distributed rendezvous store (served by the head)."""

    inputs: list[list[str]]
    outputs: list[str]
    master_addr: str
    master_port: int


class HostRefused(msgspec.Struct, tag=True):
    reason: str


class Heartbeat(msgspec.Struct, tag=True):
    pass


class HostStop(msgspec.Struct, tag=True):
    """The sender stops: ``error`` None for a normal shutdown, else why (a core died, a host
    was lost)."""

    error: str | None = None


HostMessage = HostHello | HostWelcome | HostRefused | Heartbeat | HostStop


class HostRefusedError(ValueError):
    """The head refused this host, or never answered; the message is one line."""


def comparable_config(config: EngineConfig) -> dict[str, Any]:
    """``config`` as flat ``group.field`` values, without the fields declared per host
    (``metadata={"per_host": True}``); an optional group that is off is one ``group: None``."""
    flat = {}
    for f in fields(config):
        group = getattr(config, f.name)
        if group is None:
            flat[f.name] = None
            continue
        values = asdict(group)
        for g in fields(group):
            if not g.metadata.get("per_host", False):
                flat[f"{f.name}.{g.name}"] = values[g.name]
    return flat


def config_difference(head: dict[str, Any], host: dict[str, Any]) -> str | None:
    """One line naming the settings that differ (:func:`comparable_config`'s), or None.

    The hosts compare what they were asked for, before any model loads: a field left unset
    shows as ``auto`` (each host's engine core resolves it, and :func:`replica_difference`
    compares what they resolved); an optional group as ``off`` / ``on`` (its fields are
    compared only where both sides have it)."""
    diffs = []
    for k in sorted(set(head) | set(host)):
        group, _, name = k.partition(".")
        if name and (group in head or group in host):  # the group is off on one side: its line says so
            continue
        shown_head, shown_host = _setting(head, k), _setting(host, k)
        if shown_head != shown_host:
            diffs.append(f"{name or group} {shown_head} (head) vs {shown_host} (this host)")
    return "; ".join(diffs) if diffs else None


def _setting(flat: dict[str, Any], key: str) -> str:
    """A compared value as a refusal shows it: never a bare None."""
    if key not in flat:  # only a whole group's key is missing: the group is on (its fields are there)
        return "on"
    value = flat[key]
    if value is None:
        return "auto" if "." in key else "off"
    return repr(value)


# What every replica must resolve alike: it decides a request's tokens (and the tensors of an
# expert-parallel all-to-all) whichever replica runs it. The limits and the KV cache follow each
# host's memory and may differ.
_SHARED_RESOLVED = ("dtype", "quantization", "all2all_backend", "generation_defaults")


def replica_difference(readies: list[EngineCoreReady]) -> str | None:
    """One line naming what a replica's core resolved (:class:`ResolvedConfig`) differently
    from replica 0's, with the hosts they run on, or None when they agree (e.g. hosts whose
    ``auto`` dtype differs because one CPU has native bf16 and the other not)."""
    diffs = []
    first = readies[0]
    for ready in readies[1:]:
        for name in _SHARED_RESOLVED:
            a, b = _resolved(first.resolved, name), _resolved(ready.resolved, name)
            if a != b:
                diffs.append(f"{name} {a} (replica {first.engine_index} on {first.host or '?'}) vs {b} "
                             f"(replica {ready.engine_index} on {ready.host or '?'})")
    return "; ".join(diffs) if diffs else None


def _resolved(resolved: ResolvedConfig, name: str) -> str:
    value = getattr(resolved, name)
    if isinstance(value, GenerationDefaults):  # the file read may sit at another path on each host
        return repr({"eos_token_ids": sorted(value.eos_token_ids), **value.sampling})
    return "none" if value is None else repr(value)


def _ranks(start: int, size: int) -> str:
    return f"{start}" if size == 1 else f"{start}-{start + size - 1}"


def _slots(hello: HostHello) -> set[tuple[int, int]]:
    """A host's ``(DP rank, stage)`` pairs."""
    return {(d, s) for d in range(hello.start_rank, hello.start_rank + hello.local_size)
            for s in range(hello.stage_start, hello.stage_start + hello.num_stages)}


def _label(hello: HostHello, pp: int) -> str:
    """``DP ranks 1`` (whole replicas), or ``DP ranks 0, stages 1-2``."""
    dp = f"DP ranks {_ranks(hello.start_rank, hello.local_size)}"
    return dp if hello.num_stages == pp else f"{dp}, stages {_ranks(hello.stage_start, hello.num_stages)}"


def _missing(slots: set[tuple[int, int]], pp: int) -> str:
    """What ``slots`` lack a host for: whole replicas by DP rank, else stages per replica."""
    dps = sorted({d for d, _ in slots})
    if all((d, s) in slots for d in dps for s in range(pp)):
        return f"data-parallel ranks {dps}"
    return "; ".join(f"pipeline stages {sorted(s for e, s in slots if e == d)} of data-parallel rank {d}" for d in dps)


class HeadHandshake:
    """The head's side: waits for the headless hosts, then watches them (one thread owns the
    socket).

    Args:
        config: the head's engine configuration (``parallel_config.multi_host``).
        welcome: what a joining host is told.

    Raises:
        ConnectionError: the handshake port cannot be bound.
    """

    def __init__(self, config: EngineConfig, welcome: HostWelcome) -> None:
        from tandem.version import tandem_version

        parallel = config.parallel_config
        self.version = tandem_version()
        self.config = comparable_config(config)
        self.welcome = welcome
        self.pp = parallel.pipeline_parallel_size
        # (DP rank, stage) pairs no host has joined for yet.
        self.missing = {(d, st) for d in range(parallel.data_parallel_size) for st in range(self.pp)} \
            - parallel.local_stages
        self.hosts: dict[bytes, tuple[str, str]] = {}  # identity -> (name, what it runs)
        self.last_seen: dict[bytes, float] = {}
        self.joined = threading.Event()
        self.lost: str | None = None
        # Readable once a host is lost (a process sentinel's peer for the clients' monitors).
        self.lost_r, self._lost_w = os.pipe()
        self._stop = threading.Event()
        self._stop_error: str | None = None
        self.ctx = zmq.Context(io_threads=1)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.addr = f"tcp://{parallel.data_parallel_address or '127.0.0.1'}:{parallel.data_parallel_rpc_port}"
        try:
            self.sock.bind(self.addr)
        except zmq.ZMQError as e:
            self.ctx.destroy(linger=0)
            self._close_pipe()
            raise ConnectionError(f"data_parallel_rpc_port: cannot listen on {self.addr}: {e}") from None
        self._thread = threading.Thread(target=self._serve, name="tandem-host-handshake", daemon=True)
        self._thread.start()

    def wait_for_hosts(self, timeout: float | None = None, check: Callable[[], None] | None = None) -> None:
        """Until every data-parallel rank has a host; ``check()`` is called every second
        meanwhile (the caller's own processes: it raises when one died).

        Raises:
            HostRefusedError: some ranks had no host within ``timeout`` s
                (``TANDEM_HOST_JOIN_TIMEOUT_S``) or a host was lost meanwhile.
        """
        timeout = envs.TANDEM_HOST_JOIN_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + timeout
        logger.info("waiting up to %.0f s for the hosts of %s to join on %s", timeout,
                    _missing(self.missing, self.pp), self.addr)
        while not self.joined.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
            if check is not None:
                check()
            if time.monotonic() >= deadline:
                break
        if not self.joined.is_set() or self.lost is not None:
            dp, stage = min(self.missing)
            flags = f"--data-parallel-start-rank {dp}" + (f" --pipeline-parallel-start-rank {stage}" if stage else "")
            raise HostRefusedError(self.lost or f"{_missing(self.missing, self.pp)} did not join within {timeout:.0f} s "
                                   f"(start their --headless hosts with {flags})")
        logger.info("every host joined: %s", ", ".join(f"{n} ({what})" for n, what in self.hosts.values()))

    def _check(self, hello: HostHello) -> str | None:
        if hello.version != self.version:
            return f"Tandem version {hello.version} differs from the head's {self.version}"
        diff = config_difference(self.config, hello.config)
        if diff is not None:
            return f"engine configuration differs: {diff}"
        if not _slots(hello) <= self.missing:
            free = _missing(self.missing, self.pp) if self.missing else "none"
            what = _label(hello, self.pp).replace("DP ranks", "data-parallel ranks", 1)
            return f"{what} are taken or outside the deployment (still free: {free.removeprefix('data-parallel ranks ')})"
        return None

    def _on_hello(self, ident: bytes, hello: HostHello, enc: msgspec.msgpack.Encoder) -> None:
        reason = self._check(hello)
        if reason is not None:
            logger.error("refused host %s (pid %d): %s", hello.hostname, hello.pid, reason)
            self.sock.send_multipart([ident, enc.encode(HostRefused(reason))])
            return
        self.missing -= _slots(hello)
        self.hosts[ident] = (hello.hostname, _label(hello, self.pp))
        self.last_seen[ident] = time.monotonic()
        self.sock.send_multipart([ident, enc.encode(self.welcome)])
        logger.info("host %s (pid %d) joined: %s", hello.hostname, hello.pid, _label(hello, self.pp))
        if not self.missing:
            self.joined.set()

    def _lose(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason
            logger.error("%s", reason)
            os.write(self._lost_w, b"x")
            self.joined.set()

    def _serve(self) -> None:
        try:
            self._serve_loop()
        except Exception as e:  # noqa: BLE001 - without this thread no host is watched: that is a lost deployment
            logger.exception("the host handshake thread failed")
            self._lose(f"the head's host handshake failed: {e!r}")

    def _serve_loop(self) -> None:
        enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(HostMessage)
        beat = enc.encode(Heartbeat())
        limit = envs.TANDEM_HOST_HEARTBEAT_TIMEOUT_S
        next_beat = 0.0
        while not self._stop.is_set():
            if self.sock.poll(int(HEARTBEAT_INTERVAL_S * 250)):
                frames = self.sock.recv_multipart()
                try:
                    ident, msg = frames[0], dec.decode(frames[-1])
                except (msgspec.DecodeError, IndexError) as e:  # not a Tandem host (a port scan, another version)
                    logger.warning("ignored a message on the handshake port that is not a host's: %s", e)
                    continue
                if isinstance(msg, HostHello):
                    self._on_hello(ident, msg, enc)
                elif ident in self.hosts:
                    self.last_seen[ident] = time.monotonic()
                    if isinstance(msg, HostStop):
                        name, what = self.hosts.pop(ident)
                        self._lose(f"host {name} ({what}) stopped: {msg.error or 'shut down'}")
            now = time.monotonic()
            for ident, (name, what) in list(self.hosts.items()):
                if now - self.last_seen[ident] > limit:
                    del self.hosts[ident]
                    self._lose(f"host {name} ({what}) is gone: no heartbeat for {limit:g} s")
            if now >= next_beat:
                next_beat = now + HEARTBEAT_INTERVAL_S
                for ident in self.hosts:
                    self.sock.send_multipart([ident, beat])
        stop = enc.encode(HostStop(self._stop_error))
        for ident in self.hosts:
            self.sock.send_multipart([ident, stop])
        self.sock.close(linger=1000)
        self.ctx.term()

    def close(self, error: str | None = None) -> None:
        """Tell the hosts that the head stops (``error``: why, else a normal shutdown)."""
        if self._stop.is_set():
            return
        self._stop_error = error
        self._stop.set()
        self._thread.join(5)
        os.write(self._lost_w, b"x")  # wakes a monitor waiting on lost_r (it sees the client stopping)
        os.close(self._lost_w)  # lost_r stays readable (EOF) for a monitor still waiting on it

    def _close_pipe(self) -> None:
        os.close(self.lost_r)
        os.close(self._lost_w)


class HeadLink:
    """A headless host's side: joins the head, then exchanges heartbeats (one thread).

    Raises:
        HostRefusedError: the head refused this host (its reason) or did not answer within
            ``TANDEM_HOST_JOIN_TIMEOUT_S``.
    """

    def __init__(self, config: EngineConfig) -> None:
        from tandem.version import tandem_version

        parallel = config.parallel_config
        self.addr = f"tcp://{parallel.data_parallel_address or '127.0.0.1'}:{parallel.data_parallel_rpc_port}"
        self.enc, self.dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(HostMessage)
        self.ctx = zmq.Context(io_threads=1)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(self.addr)
        logger.info("joining the head at %s (waiting up to %.0f s for it)", self.addr, envs.TANDEM_HOST_JOIN_TIMEOUT_S)
        hello = HostHello(tandem_version(), socket.gethostname(), os.getpid(), parallel.data_parallel_start_rank,
                          parallel.data_parallel_local_size, comparable_config(config),
                          parallel.pipeline_parallel_start_rank, parallel.pipeline_parallel_local_size)
        self.sock.send(self.enc.encode(hello))
        timeout = envs.TANDEM_HOST_JOIN_TIMEOUT_S
        if not self.sock.poll(int(timeout * 1000)):
            self.close()
            raise HostRefusedError(f"no answer from the head at {self.addr} within {timeout:.0f} s")
        try:
            reply = self.dec.decode(self.sock.recv())
        except msgspec.DecodeError as e:
            self.close()
            raise HostRefusedError(f"{self.addr} is not a Tandem head's handshake port: {e}") from None
        if isinstance(reply, HostRefused):
            self.close()
            raise HostRefusedError(f"the head at {self.addr} refused this host: {reply.reason}")
        assert isinstance(reply, HostWelcome), reply
        self.welcome = reply
        self.last_seen = time.monotonic()
        self._next_beat = 0.0

    def poll(self, timeout_s: float) -> str | None:
        """Heartbeats for up to ``timeout_s``; returns why the head is gone, or None.
        ``""``: the head shut down normally."""
        now = time.monotonic()
        if now >= self._next_beat:
            self._next_beat = now + HEARTBEAT_INTERVAL_S
            self.sock.send(self.enc.encode(Heartbeat()))
        if self.sock.poll(int(timeout_s * 1000)):
            while True:
                try:
                    msg = self.dec.decode(self.sock.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                except msgspec.DecodeError:
                    continue
                self.last_seen = time.monotonic()
                if isinstance(msg, HostStop):
                    return msg.error or ""
        limit = envs.TANDEM_HOST_HEARTBEAT_TIMEOUT_S
        if time.monotonic() - self.last_seen > limit:
            return f"the head at {self.addr} is gone: no heartbeat for {limit:g} s"
        return None

    def stop(self, error: str | None) -> None:
        """Tell the head that this host stops (``error``: why)."""
        self.sock.send(self.enc.encode(HostStop(error)), zmq.NOBLOCK)

    def close(self) -> None:
        self.sock.close(linger=1000)
        self.ctx.term()


__all__ = ["HeadHandshake", "HeadLink", "HostRefusedError", "HostWelcome", "comparable_config", "config_difference",
           "replica_difference"]
