"""Host time per engine step: the engine core's loop, phase by phase, per step.

Drives an :class:`~tandem.engine.core.EngineCore` directly (no front end; ``--front-end``:
through ``tandem.LLM``, whose detokenization runs between core steps, as in ``tandem bench
throughput``) over the seed workload's request shape (default: 1000 random prompts, 128 in /
256 out, greedy, EOS ignored, ``max_num_seqs`` 256) and records the three phases of
:mod:`tandem.step_timing` per step: ``schedule``, ``prepare`` (the runner's input building)
and ``process`` (``update_from_output``). Decode steps (every scheduled sequence computes
one token) are reported apart from steps with prefill tokens, and the slowest 1 % of steps
with what they scheduled and the garbage collections that ran inside them
(``gc.callbacks``).

The default model is a tiny random Llama on the CPU: the phases do not run the forward or
the sampler, and their Python and numpy work depends on the batch, the block size and the
sequence lengths, not on the layer sizes. ``--model DIR --device cuda`` runs any model
folder (e.g. ``benchmarks/model_shapes.py llama-3.1-8b``) as the seed workload does (CUDA
graphs, the KV cache sized by memory). The default is synchronous output processing, so
each phase runs alone; ``--async-output-proc`` is the engine's default pipelining (on a CPU
the step thread then competes with the loop for the GIL).

One tree (the ``tandem`` on ``PYTHONPATH``), JSON summary on stdout::

    python benchmarks/host_step.py

Side by side: alternate runs of several trees (each run in a fresh process with
``PYTHONPATH`` set to the tree), ``--rounds`` times, then each tree's median and spread::

    python benchmarks/host_step.py --compare /tmp/before /work/wt/host7 --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

TINY_LLAMA = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
)


def _percentiles(xs: list[float]) -> dict[str, float]:
    import numpy as np

    if not xs:
        return {}
    a = np.asarray(xs)
    return {"n": len(xs), "median_ms": float(np.median(a)), "p99_ms": float(np.percentile(a, 99)),
            "max_ms": float(a.max())}


class _GCRecorder:
    """Start time, generation and duration of every garbage collection while attached."""

    def __init__(self) -> None:
        self.events: list[tuple[float, int, float]] = []
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.events.append((self._t0, info["generation"], time.perf_counter() - self._t0))


def run(args: argparse.Namespace) -> dict:
    """One run of the workload in this process; returns the summary."""
    import torch

    from tandem.config import embedded_default_model
    from tandem.engine.arg_utils import EngineArgs
    from tandem.engine.core import EngineCore
    from tandem.engine.messages import EngineCoreRequest
    from tandem.sampling_params import SamplingParams
    from tandem.step_timing import PHASES

    torch.set_num_threads(1)
    folder = args.model
    if folder is None:
        folder = tempfile.mkdtemp(prefix="host_step_")
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(TINY_LLAMA | {"vocab_size": args.vocab_size}, f)
    engine_args = dict(model=folder, tokenizer=args.tokenizer or embedded_default_model(), load_format="dummy",
                       dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                       max_num_seqs=args.max_num_seqs, async_output_proc=args.async_output_proc)
    if args.device == "cpu":  # else as `tandem bench throughput`: CUDA graphs, the KV cache sized by memory
        per_seq = -(-(args.input_len + args.output_len) // 16)
        engine_args.update(enforce_eager=True, num_kv_blocks=args.max_num_seqs * per_seq + 64)
    g = torch.Generator().manual_seed(args.seed)

    def params(out_len: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)

    if args.front_end:
        from tandem.entrypoints.llm import LLM

        llm = LLM(**engine_args)
        core = llm.engine.client.core

        def drain(n: int, out_len: int) -> dict[str, list[int]]:
            outs = llm.generate(prompts(n), params(out_len), use_tqdm=False)
            return {str(i): o.outputs[0].token_ids for i, o in enumerate(outs)}
    else:
        core = EngineCore(EngineArgs(**engine_args).create_engine_config())

        def drain(n: int, out_len: int) -> dict[str, list[int]]:
            for i, p in enumerate(prompts(n)):
                core.add_request(EngineCoreRequest(str(i), p, params(out_len).with_defaults(), out_len,
                                                   time.monotonic()))
            out: dict[str, list[int]] = {}
            while core.has_unfinished_requests():
                for o in core.step():
                    out.setdefault(o.request_id, []).extend(o.new_token_ids)
            return out

    def prompts(n: int) -> list[list[int]]:
        return torch.randint(1000, core.vocab_size, (n, args.input_len), generator=g).tolist()

    drain(args.max_num_seqs, 4)  # first-call allocations, not timed
    steps: dict[int, tuple[int, int, int]] = {}  # step id -> (sequences, tokens, KV blocks appended)
    scheduled: list = []  # the SchedulerOutput of the running iteration (summarised after it: not timed)
    real_schedule = core.scheduler.schedule

    def schedule():
        so = real_schedule()
        scheduled.append(so)
        return so

    core.scheduler.schedule = schedule
    windows: list[tuple[int, float, float]] = []  # (step id scheduled by the call, start, end)
    real_step = core.step

    def step():
        t0 = time.perf_counter()
        try:
            return real_step()
        finally:
            windows.append((core.scheduler._step_id, t0, time.perf_counter()))
            for so in scheduled:
                steps[so.step_id] = (len(so.scheduled), so.num_scheduled_tokens,
                                     sum(len(s.new_block_ids) for s in so.scheduled))
            scheduled.clear()

    core.step = step
    gcrec = _GCRecorder()
    gc.callbacks.append(gcrec)
    times = core.start_host_timing()
    t0 = time.perf_counter()
    outputs = drain(args.num_prompts, args.output_len)
    elapsed = time.perf_counter() - t0
    core.stop_host_timing()
    gc.callbacks.remove(gcrec)
    (llm.engine if args.front_end else core).shutdown()

    rows = {sid: r for sid, r in times.times.items() if len(r) == 3}
    total = {sid: 1e3 * sum(r.values()) for sid, r in rows.items()}
    decode = [sid for sid in rows if steps[sid][0] == steps[sid][1]]
    # Garbage collection inside each loop iteration (the iteration that scheduled step N;
    # with async output processing it also processed step N-1's outputs).
    gc_ms: dict[int, float] = {}
    gc_gen: dict[int, int] = {}
    events = sorted(gcrec.events)
    for sid, a, b in windows:
        inside = [e for e in events if a <= e[0] <= b]
        if inside:
            gc_ms[sid] = 1e3 * sum(e[2] for e in inside)
            gc_gen[sid] = max(e[1] for e in inside)
    res = {
        "tandem": os.path.dirname(os.path.dirname(sys.modules["tandem"].__file__)),
        "async_output_proc": args.async_output_proc, "elapsed_s": elapsed, "num_steps": len(windows),
        "all_steps": _percentiles(list(total.values())),
        "decode_steps": _percentiles([total[s] for s in decode]),
        "decode_phase_median_ms": {p: statistics.median(1e3 * rows[s][p] for s in decode) for p in PHASES},
        "decode_steps_appending_blocks": _percentiles([total[s] for s in decode if steps[s][2]]),
        "decode_steps_without_gc": _percentiles([total[s] for s in decode if s not in gc_ms]),
        "decode_steps_minus_gc": _percentiles([total[s] - gc_ms.get(s, 0.0) for s in decode]),
        "output_digest": hash(tuple(tuple(outputs[k]) for k in sorted(outputs))),
        "gc_collections": {str(g_): sum(1 for e in events if e[1] == g_) for g_ in (0, 1, 2)},
        "gc_ms_median_by_generation": {str(g_): 1e3 * statistics.median([e[2] for e in events if e[1] == g_] or [0.0])
                                       for g_ in (0, 1, 2)},
        "gc_ms_max_by_generation": {str(g_): 1e3 * max((e[2] for e in events if e[1] == g_), default=0.0)
                                    for g_ in (0, 1, 2)},
    }
    slow = sorted(total, key=total.get, reverse=True)[:max(1, len(total) // 100)]
    res["slowest_1pct"] = [
        {"step": s, "ms": round(total[s], 3), "seqs": steps[s][0], "tokens": steps[s][1], "new_blocks": steps[s][2],
         "gc_ms": round(gc_ms.get(s, 0.0), 3), "gc_generation": gc_gen.get(s),
         **{p: round(1e3 * rows[s][p], 3) for p in PHASES}}
        for s in slow]
    return res


def compare(args: argparse.Namespace, argv: list[str]) -> None:
    """Alternate runs of each tree ``--rounds`` times; print each run and each tree's summary."""
    base = [a for a in argv if a not in args.compare and a not in ("--compare",)]
    if "--rounds" in base:
        i = base.index("--rounds")
        del base[i:i + 2]
    per_tree: dict[str, list[dict]] = {t: [] for t in args.compare}
    for rnd in range(args.rounds):
        for tree in args.compare:
            env = dict(os.environ, PYTHONPATH=tree)
            load = os.getloadavg()[0]
            out = subprocess.run([sys.executable, os.path.abspath(__file__), *base], env=env, check=True,
                                 capture_output=True, text=True).stdout
            res = json.loads(out.strip().splitlines()[-1])
            res["load_avg_1min"] = load
            per_tree[tree].append(res)
            d, ph = res["decode_steps"], res["decode_phase_median_ms"]
            print(f"round {rnd} {tree}: decode median {d['median_ms']:.3f} ms p99 {d['p99_ms']:.3f} | "
                  f"schedule {ph['schedule']:.3f} prepare {ph['prepare']:.3f} process {ph['process']:.3f} | "
                  f"all steps p99 {res['all_steps']['p99_ms']:.3f} | gen2 GCs {res['gc_collections']['2']} | "
                  f"load {load:.1f} | digest {res['output_digest']}", flush=True)
            print("  slowest steps (ms, seqs, tokens, GC ms inside, schedule/prepare/process ms): " + "; ".join(
                f"{x['ms']:.1f} {x['seqs']} {x['tokens']} {x['gc_ms']:.1f} "
                f"{x['schedule']:.1f}/{x['prepare']:.1f}/{x['process']:.1f}" for x in res["slowest_1pct"][:5]),
                flush=True)
    for tree, runs in per_tree.items():
        med = [r["decode_steps"]["median_ms"] for r in runs]
        p99 = [r["all_steps"]["p99_ms"] for r in runs]
        print(f"{tree}: decode-step host time median of {len(runs)} runs {statistics.median(med):.3f} ms "
              f"(range {min(med):.3f}-{max(med):.3f}); all-step p99 {statistics.median(p99):.3f} ms "
              f"(range {min(p99):.3f}-{max(p99):.3f})")
    digests = {r["output_digest"] for runs in per_tree.values() for r in runs}
    print("greedy outputs identical across trees and runs" if len(digests) == 1 else
          f"greedy outputs DIFFER: {len(digests)} distinct digests")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--model", default=None,
                    help="a model folder (config.json; dummy weights), e.g. benchmarks/model_shapes.py's llama-3.1-8b "
                         "(default: a tiny Llama written to a temporary folder)")
    ap.add_argument("--tokenizer", default=None, help="default: the embedded SmolLM2's")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--vocab-size", type=int, default=4096,
                    help="the tiny model's (small: the lm head and the sampler are not timed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--async-output-proc", action="store_true", help="the engine's pipelining (default: off)")
    ap.add_argument("--front-end", action="store_true",
                    help="through tandem.LLM (in-process core, detokenization between steps), "
                         "as `tandem bench throughput`")
    ap.add_argument("--compare", nargs="+", metavar="TREE", help="trees to run alternately (PYTHONPATH each)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.compare:
        compare(args, argv)
    else:
        print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
