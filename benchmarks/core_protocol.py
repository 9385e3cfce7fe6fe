"""What the engine-core protocol costs per step across hosts: a decode step's
``EngineCoreOutputs`` (``n`` sequences, one new token each, the scheduler stats) from a core
process to a front end, over zmq ``ipc://`` (every replica on the head) and ``tcp://``
loopback (a ``--headless`` host's cores), the sockets and codec the engine uses
(:mod:`tandem.engine.messages`, PUSH -> PULL without high-water mark).

Per transport and ``n``: the message's bytes, the encode and decode host time (the same on
either transport), and the
one-way latency of a step's message (half the round trip of a ping-pong: the front end
answers each step message with a 1-byte message, as a busy core gets the next requests),
over ``--iters`` messages per round, transports alternated over ``--repeats`` rounds;
median, min and max. The cross-host cost per step is the TCP latency minus the IPC one (a
real network adds its own wire time, which no protocol removes). One message per step and
front end: a step's outputs go in one ``EngineCoreOutputs`` to each front end.

    python benchmarks/core_protocol.py --sizes 256 1024 --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import time

import zmq


def decode_outputs(n: int):
    from tandem.engine.messages import EngineCoreOutput, EngineCoreOutputs, SchedulerStats

    outs = [EngineCoreOutput(f"cmpl-{i:032x}-0", [1000 + i]) for i in range(n)]
    return EngineCoreOutputs(0, outs, SchedulerStats(n, 0, 0.5, 0, 0, 0, 1000, 4000))


def _echo(addr_in: str, addr_out: str, count: int) -> None:
    """The core's peer: answers each message with one byte."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(addr_in)
    push.connect(addr_out)
    for _ in range(count):
        pull.recv(copy=False)
        push.send(b"x")
    pull.close(linger=0)
    push.close(linger=1000)
    ctx.term()


def one_way_ms(addr_in: str, addr_out: str, payload: bytes, iters: int) -> float:
    """Half the median round trip of ``payload`` (ms), through a peer process."""
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.setsockopt(zmq.SNDHWM, 0)
    push.bind(addr_in)
    pull.bind(addr_out)
    peer = mp.get_context("spawn").Process(target=_echo, args=(addr_in, addr_out, iters + 10))
    peer.start()
    times = []
    for i in range(iters + 10):
        t0 = time.perf_counter()
        push.send(payload, copy=False)
        pull.recv()
        if i >= 10:  # warm-up: connections, first allocations
            times.append((time.perf_counter() - t0) * 500)
    peer.join()
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()
    return statistics.median(times)


def codec_us(n: int, iters: int) -> tuple[int, float, float]:
    from tandem.engine.messages import CoreMessage, MsgpackDecoder, MsgpackEncoder

    msg, enc, dec = decode_outputs(n), MsgpackEncoder(), MsgpackDecoder(CoreMessage)
    data = enc.encode(msg)
    t0 = time.perf_counter()
    for _ in range(iters):
        enc.encode(msg)
    t1 = time.perf_counter()
    for _ in range(iters):
        dec.decode(data)
    t2 = time.perf_counter()
    return len(data), (t1 - t0) / iters * 1e6, (t2 - t1) / iters * 1e6


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 1024], help="sequences per decode step")
    ap.add_argument("--iters", type=int, default=300, help="messages per round")
    ap.add_argument("--repeats", type=int, default=5, help="rounds, transports alternated")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    args = ap.parse_args()
    from tandem.distributed.launch import free_port
    from tandem.engine.messages import MsgpackEncoder

    results = {}
    for n in args.sizes:
        payload = MsgpackEncoder().encode(decode_outputs(n))
        lat: dict[str, list[float]] = {"ipc": [], "tcp": []}
        codec: dict[str, list[float]] = {"encode": [], "decode": []}
        for _ in range(args.repeats):
            size, enc, dec = codec_us(n, args.iters)
            codec["encode"].append(enc)
            codec["decode"].append(dec)
            with tempfile.TemporaryDirectory() as d:
                lat["ipc"].append(one_way_ms(f"ipc://{d}/in", f"ipc://{d}/out", payload, args.iters))
            lat["tcp"].append(one_way_ms(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", payload,
                                         args.iters))
        added = [t - i for t, i in zip(lat["tcp"], lat["ipc"])]
        enc_us, dec_us = statistics.median(codec["encode"]), statistics.median(codec["decode"])
        results[n] = {"bytes": size, "encode_us": _summary(codec["encode"]), "decode_us": _summary(codec["decode"]), "messages_per_step": 1,
                      "ipc_ms": _summary(lat["ipc"]), "tcp_ms": _summary(lat["tcp"]), "tcp_added_ms": _summary(added)}
        r = results[n]
        print(f"n={n}: {size} B, encode {enc_us:.0f} us, decode {dec_us:.0f} us; one-way ipc "
              f"{r['ipc_ms']['median']:.3f} ms, tcp {r['tcp_ms']['median']:.3f} ms, tcp - ipc "
              f"{r['tcp_added_ms']['median']:+.3f} ms ({r['tcp_added_ms']['min']:+.3f}..{r['tcp_added_ms']['max']:+.3f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
