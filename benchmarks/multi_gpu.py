"""Multi-GPU runs of one host (issues 8 and 19): DP + EP with NCCL all-to-all on a
DeepSeek-V2-Lite shape, and TP on a Llama-3.1-8B shape, dummy weights. Each part runs in
its own process (``--part``) under a time limit, so one failure does not hide the others.
``--data-parallel-size N`` (2, 4 or 8; default 2) sets the DP = EP size of the DeepSeek
parts:

* ``ds_parity``: greedy tokens (fp32, eager, mixed-length prompts, then three of them alone,
  leaving replicas idle when N > 3) of ``--data-parallel-size N --enable-expert-parallel
  --all2all-backend all_to_all`` equal to the single-GPU run;
* ``ds_parity_dbo``: the same with ``--enable-dbo``, every step of 2+ decode or 8+ prefill
  tokens split (no measured policy), so DBO on gives DBO off's tokens;
* ``ds_bench``: the seed workload (``tandem bench throughput``: 1000 prompts, 128 in, 256
  out, bf16, CUDA graphs) with DP=N + EP=N over NCCL ``all_to_all``, DBO off and on;
* ``ep_timing``: per-MoE-layer time of dispatch, expert compute and combine of the NCCL
  ``all_to_all`` backend at decode sizes (``--ep-tokens`` per rank), per rank (torchrun,
  N processes, one per GPU);
* ``tp_parity`` / ``tp_bench``: ``--tensor-parallel-size 2`` against TP=1: greedy tokens,
  and the seed workload's throughput at TP=1 (one GPU) and TP=2 side by side, at
  ``--max-num-seqs 256`` and at the engine's defaults;
* ``pp_parity`` / ``pp_bench`` (issue 50): ``--pipeline-parallel-size 2`` against one GPU:
  greedy tokens, and the seed workload at one GPU, PP=2 (one batch per stage in flight, the
  default), PP=2 with ``--no-async-output-proc`` (one batch at a time) and TP=2 side by
  side, with each stage's idle fraction (``pp_stage_idle_fractions``);
* ``ar_timing``: one TP all-reduce per primitive (NCCL, symmetric-memory one-shot and
  two-shot) and message size, in CUDA graphs (``tp_all_reduce.py``, two processes).

    python benchmarks/multi_gpu.py --out DIR [--data-parallel-size 8] [--parts ds_parity,ds_parity_dbo,ds_bench,ep_timing,tp_parity,tp_bench,pp_parity,pp_bench,ar_timing]

Results: ``DIR/multi_gpu_dp{N}.json`` (merged over calls with the same N, so the parts can
run in several calls) and one JSON file per run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from model_shapes import DEEPSEEK_V2_LITE, LLAMA_31_8B, seed_workload_command, tokenizer_dir, write_config_dir

HERE = os.path.dirname(os.path.abspath(__file__))
PARITY_LENS = [5, 37, 128, 11, 64, 3, 90, 23]


PARTS = ("ds_parity", "ds_parity_dbo", "ds_bench", "ep_timing", "tp_parity", "tp_bench", "pp_parity", "pp_bench",
         "ar_timing")
DS_PARTS = ("ds_parity", "ds_parity_dbo", "ds_bench", "ep_timing")  # use --data-parallel-size GPUs
DP_SIZES = (2, 4, 8)


def parity_prompts(vocab: int) -> list[list[int]]:
    return [[(1009 * i + 7 * j) % (vocab // 2) + vocab // 4 for j in range(n)] for i, n in enumerate(PARITY_LENS)]


def generate_ids(model: str, out: str, **engine) -> None:
    """Worker: greedy ids (fp32, eager) of the parity prompts, then of the first three alone
    (fewer requests than replicas: the others idle), written to ``out``."""
    from transformers import AutoConfig

    from tandem import LLM, SamplingParams

    vocab = AutoConfig.from_pretrained(model).vocab_size
    llm = LLM(model=model, tokenizer=tokenizer_dir(), load_format="dummy", dtype="float32", enforce_eager=True,
              max_model_len=512, max_num_seqs=16, **engine)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = parity_prompts(vocab)
    ids = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    ids += [o.outputs[0].token_ids for o in llm.generate(prompts[:3], params, use_tqdm=False)]
    with open(out, "w") as f:
        json.dump(ids, f)
    llm.engine.shutdown()


def ds_engine(dp: int, **extra) -> dict:
    """Engine arguments of the DeepSeek DP + EP parts."""
    return dict(data_parallel_size=dp, enable_expert_parallel=True, all2all_backend="all_to_all", **extra)


def cli_flags(engine: dict) -> list[str]:
    """Engine arguments as ``tandem`` command-line flags (True: a bare switch)."""
    flags = []
    for k, v in engine.items():
        flags += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return flags


def run(cmd: list[str], limit: float, env: dict | None = None) -> bool:
    print("+", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    try:
        rc = subprocess.run(cmd, timeout=limit, env={**os.environ, **(env or {})}).returncode
    except subprocess.TimeoutExpired:
        print(f"! timed out after {limit:.0f} s", flush=True)
        return False
    except OSError as e:  # e.g. the command is not on PATH: this part fails, the others still run
        print(f"! could not start: {e}", flush=True)
        return False
    print(f"= rc {rc} in {time.perf_counter() - t0:.1f} s", flush=True)
    return rc == 0


def parity(out: str, name: str, model: str, limit: float, engine: dict, gpus_ref: str = "0") -> dict:
    ref, got = os.path.join(out, f"{name}_ref.json"), os.path.join(out, f"{name}_par.json")
    me = [sys.executable, os.path.abspath(__file__), "--worker", model]
    ok_ref = run([*me, ref, "{}"], limit, {"CUDA_VISIBLE_DEVICES": gpus_ref})
    ok_par = run([*me, got, json.dumps(engine)], limit)
    res = dict(engine=engine, ran=ok_ref and ok_par)
    if res["ran"]:
        a, b = json.load(open(ref)), json.load(open(got))
        res["equal"] = a == b
        res["sequences_equal"] = sum(x == y for x, y in zip(a, b))
        res["sequences"] = len(a)
        res["first_divergence"] = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None) for x, y in zip(a, b)]
    print(f"{name}: {res}", flush=True)
    return res


def bench(out: str, name: str, model: str, limit: float, extra: list[str], env: dict | None = None,
          max_num_seqs: int | None = 256) -> dict | None:
    path = os.path.join(out, f"{name}.json")
    if not run(seed_workload_command(model, path, *extra, max_num_seqs=max_num_seqs), limit, env):
        return None
    with open(path) as f:
        return json.load(f)


def ep_timing_cmd(out: str, nproc: int = 2, tokens: str | None = None) -> list[str]:
    """``torchrun`` of ep_all2all_timing.py on ``nproc`` ranks with this interpreter
    (``torchrun`` itself may not be on PATH when the virtual environment is not activated);
    ``tokens``: its ``--tokens`` (per rank, comma-separated), default its own."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            os.path.join(HERE, "ep_all2all_timing.py"), "--out", out, *(["--tokens", tokens] if tokens else [])]


def tp_bench(out: str, model: str, limit: float) -> dict:
    """The seed workload at TP=1 (one GPU) and TP=2, side by side, at ``--max-num-seqs 256``
    and at the engine's defaults: ``{setting: {"tp1": result, "tp2": result, "ratio": x}}``."""
    res = {}
    for setting, seqs in (("256", 256), ("defaults", None)):
        one = bench(out, f"tp1_{setting}", model, limit, [], {"CUDA_VISIBLE_DEVICES": "0"}, seqs)
        two = bench(out, f"tp2_{setting}", model, limit, ["--tensor-parallel-size", "2"], None, seqs)
        ratio = two["requests_per_s"] / one["requests_per_s"] if one and two else None
        res[setting] = dict(tp1=one, tp2=two, ratio=ratio)
        print(f"tp_bench {setting}: TP=2 / TP=1 = {ratio}", flush=True)
    return res


PP_RUNS = (("gpu1", [], {"CUDA_VISIBLE_DEVICES": "0"}),
           ("pp2", ["--pipeline-parallel-size", "2"], None),
           ("pp2_one_batch", ["--pipeline-parallel-size", "2", "--no-async-output-proc"], None),
           ("tp2", ["--tensor-parallel-size", "2"], None))


def pp_bench(out: str, model: str, limit: float) -> dict:
    """The seed workload on one GPU, PP=2 (several batches in flight and one at a time) and
    TP=2, side by side at the engine's defaults: ``{run: result}`` plus each run's ratio to
    one GPU (PP=2 runs eager: its CUDA graphs are not captured yet)."""
    res = {name: bench(out, name, model, limit, flags, env, None) for name, flags, env in PP_RUNS}
    one = res["gpu1"]
    res["ratio_to_gpu1"] = {name: r["requests_per_s"] / one["requests_per_s"]
                            for name, r in res.items() if one and r and name != "gpu1"}
    print(f"pp_bench: ratios to one GPU {res['ratio_to_gpu1']}; stage idle "
          f"{ {n: (res[n] or {}).get('pp_stage_idle_fractions') for n in ('pp2', 'pp2_one_batch')} }", flush=True)
    return res


def all_reduce_timing_cmd(out: str, nproc: int = 2) -> list[str]:
    """``torchrun`` of tp_all_reduce.py on ``nproc`` ranks with this interpreter."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            os.path.join(HERE, "tp_all_reduce.py"), "--out", out]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line; every check runs before any part starts.

    Raises:
        SystemExit: an unknown part, a DP size not in ``DP_SIZES``, or (with CUDA) fewer
            GPUs than the DeepSeek parts need.
    """
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--data-parallel-size", "--dp", dest="dp", type=int, default=2, choices=DP_SIZES,
                    help="DP = EP size of the DeepSeek parts (GPUs they use)")
    ap.add_argument("--ep-tokens", default=None, help="ep_timing: tokens per rank, comma-separated "
                                                      "(default: ep_all2all_timing.py's)")
    ap.add_argument("--limit", type=float, default=400.0, help="seconds per process (the DBO seed workload takes minutes)")
    args = ap.parse_args(argv)
    args.parts = args.parts.split(",")
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {', '.join(unknown)}; available: {', '.join(PARTS)}")
    import torch

    need = max([args.dp if p in DS_PARTS else 2 for p in args.parts])
    if torch.cuda.is_available() and torch.cuda.device_count() < need:
        ap.error(f"parts {','.join(args.parts)} need {need} GPUs; {torch.cuda.device_count()} visible")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        generate_ids(argv[1], argv[2], **json.loads(argv[3]))
        return
    args = parse_args(argv)
    dp = args.dp
    os.makedirs(args.out, exist_ok=True)
    ds = write_config_dir(DEEPSEEK_V2_LITE, os.path.join(args.out, "deepseek_v2_lite"))
    llama = write_config_dir(LLAMA_31_8B, os.path.join(args.out, "llama31_8b"))
    # One summary per DP size, merged over calls (a call may run only some parts).
    summary = os.path.join(args.out, f"multi_gpu_dp{dp}.json")
    results: dict = json.load(open(summary)) if os.path.exists(summary) else {}
    results["data_parallel_size"] = dp
    # DBO parity: split every step that can be (no measured policy), so splits happen.
    dbo_all = dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=8,
                   dbo_measure_split=False)

    def save() -> None:
        with open(summary, "w") as f:
            json.dump(results, f, indent=2)

    for part in args.parts:
        if part == "ds_parity":
            results[part] = parity(args.out, part, ds, args.limit, ds_engine(dp))
        elif part == "ds_parity_dbo":
            results[part] = parity(args.out, part, ds, args.limit, ds_engine(dp, **dbo_all))
        elif part == "ds_bench":
            results[part] = {"dbo_off": bench(args.out, f"ds_dp{dp}_dbo_off", ds, args.limit, cli_flags(ds_engine(dp))),
                             "dbo_on": bench(args.out, f"ds_dp{dp}_dbo_on", ds, args.limit,
                                             cli_flags(ds_engine(dp, enable_dbo=True)))}
        elif part == "ep_timing":
            path = os.path.join(args.out, f"ep_timing_ep{dp}.json")
            ok = run(ep_timing_cmd(path, dp, args.ep_tokens), args.limit)
            results[part] = json.load(open(path)) if ok and os.path.exists(path) else None
        elif part == "tp_parity":
            results[part] = parity(args.out, part, llama, args.limit, dict(tensor_parallel_size=2))
        elif part == "tp_bench":
            results[part] = tp_bench(args.out, llama, args.limit)
        elif part == "pp_parity":
            results[part] = parity(args.out, part, llama, args.limit, dict(pipeline_parallel_size=2))
        elif part == "pp_bench":
            results[part] = pp_bench(args.out, llama, args.limit)
        elif part == "ar_timing":
            path = os.path.join(args.out, "tp_all_reduce_tp2.json")
            ok = run(all_reduce_timing_cmd(path), args.limit)
            results[part] = json.load(open(path)) if ok and os.path.exists(path) else None
        save()

    print("\n| run | requests/s | output tok/s |\n|---|---|---|")
    ds_bench = results.get("ds_bench") or {}
    rows = [(f"DeepSeek-V2-Lite DP={dp} EP={dp} all_to_all, DBO off", ds_bench.get("dbo_off")),
            (f"DeepSeek-V2-Lite DP={dp} EP={dp} all_to_all, DBO on", ds_bench.get("dbo_on")),
            *((f"Llama-3.1-8B TP={tp} ({setting})", (r or {}).get(f"tp{tp}"))
              for setting, r in (results.get("tp_bench") or {}).items() for tp in (1, 2)),
            *((f"Llama-3.1-8B {name} (defaults)", (results.get("pp_bench") or {}).get(name)) for name, _, _ in PP_RUNS)]
    for name, r in rows:
        if r:
            print(f"| {name} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.0f} |")
    for r in (results.get("ep_timing") or {}).get("rows", []):
        print(f"ep_timing {r['tokens_per_rank']} tokens/rank: dispatch {r['dispatch_ms']} ms, "
              f"experts {r['expert_ms']} ms, combine {r['combine_ms']} ms (per rank)")
    for r in (results.get("ar_timing") or {}).get("rows", []):
        print(f"ar_timing {r['tokens']} x {r['hidden']}: fastest {r['fastest_all_reduce']}, us per rank {r['per_rank_us']}")


if __name__ == "__main__":
    main()
