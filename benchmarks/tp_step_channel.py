"""Host cost of handing a step's ``SchedulerOutput`` from the TP driver to a follower over
gloo: ``torch.distributed.broadcast_object_list`` (pickle; Tandem before session 14) against
:class:`tandem.engine.rank_core.TPStepChannel` (typed msgpack). A decode step of ``n``
sequences (one new token each, a new KV block every 16th), both methods alternated over
``--repeats`` rounds of ``--iters`` back-to-back messages; median, min and max milliseconds
per message as each rank sees it (the driver encodes and sends, the follower receives and
decodes; a loop of them runs at the pace of the slower side), and each codec's encode and
decode time and bytes in one process, for that decode step and for a prefill step of ``n``
new requests (whose sampling parameters are validated again when decoded). Two processes
on the CPU:

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/tp_step_channel.py --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time

import torch.distributed as dist


def decode_step(n: int):
    from tandem.core.sched_output import ScheduledSequence, SchedulerOutput

    return SchedulerOutput(1, [ScheduledSequence(i, 200, 1, [], True, True, [] if i % 16 else [1000 + i])
                               for i in range(n)], n)


def prefill_step(n: int):
    """``n`` new requests of 128 prompt tokens (default sampling parameters), 8 KV blocks each."""
    from tandem.core.sched_output import NewRequestData, ScheduledSequence, SchedulerOutput
    from tandem.sampling_params import SamplingParams

    def prompt(i: int) -> list[int]:
        return [(i * 131 + j * 7) % 50000 for j in range(128)]

    return SchedulerOutput(1, [ScheduledSequence(i, 0, 128, prompt(i), False, True, list(range(8 * i, 8 * i + 8)),
                                                 NewRequestData(i, prompt(i), [], SamplingParams(max_tokens=256), False))
                               for i in range(n)], 128 * n)


def codec_ms(fn, k: int = 200, rounds: int = 7) -> float:
    """Median milliseconds of one ``fn()`` over ``rounds`` rounds of ``k`` calls."""
    xs = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        xs.append((time.perf_counter() - t0) * 1e3 / k)
    return round(statistics.median(xs), 4)


def codec(so, channel) -> dict:
    """Encode / decode cost and bytes of ``so``, pickled and as the channel's msgpack."""
    pb, mb = pickle.dumps(so), channel._enc.encode(so)
    return dict(pickle=dict(bytes=len(pb), encode_ms=codec_ms(lambda: pickle.dumps(so)),
                            decode_ms=codec_ms(lambda: pickle.loads(pb))),
                msgpack=dict(bytes=len(mb), encode_ms=codec_ms(lambda: channel._enc.encode(so)),
                             decode_ms=codec_ms(lambda: channel._steps.decode(mb))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="256,1024")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from tandem.distributed import parallel_state as ps
    from tandem.engine.rank_core import TPStepChannel

    info = ps.init_distributed(tp_size=2)
    group, src = ps.get_tp_cpu_group(), ps.get_tp_src_rank()
    channel = TPStepChannel()
    driver = info.rank == src

    def pickled(so):
        box = [so]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    def typed(so):
        if driver:
            channel.send(so)
            return so
        return channel.recv_step()

    rows = []
    for n in (int(b) for b in args.batches.split(",")):
        so = decode_step(n)
        times: dict[str, list[float]] = {"pickle": [], "msgpack": []}
        for _ in range(args.repeats):
            for name, fn in (("pickle", pickled), ("msgpack", typed)):
                dist.barrier(group=group)
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    got = fn(so)
                times[name].append((time.perf_counter() - t0) * 1e3 / args.iters)
                assert got == so
        mine = {k: dict(median=round(statistics.median(v), 4), min=round(min(v), 4), max=round(max(v), 4))
                for k, v in times.items()}
        both = [None, None]
        dist.all_gather_object(both, mine, group=group)
        row = dict(batch=n, driver=both[0], follower=both[1], codec=codec(so, channel) if driver else None,
                   codec_prefill=codec(prefill_step(n), channel) if driver else None)
        rows.append(row)
        if driver:
            print(json.dumps(row), flush=True)
    if driver:
        with open(args.out, "w") as f:
            json.dump(dict(iters=args.iters, repeats=args.repeats, rows=rows), f, indent=2)
    ps.destroy_distributed()


if __name__ == "__main__":
    main()
