"""Multi-GPU runs of one host (issue 8): DP + EP with NCCL all-to-all on a DeepSeek-V2-Lite
shape, and TP on a Llama-3.1-8B shape, dummy weights. Each part runs in its own process
(``--part``) under a time limit, so one failure does not hide the others:

* ``ds_parity``: greedy tokens (fp32, eager, mixed-length prompts) of
  ``--data-parallel-size 2 --enable-expert-parallel --all2all-backend all_to_all`` equal to
  the single-GPU run;
* ``ds_bench``: the seed workload (``tandem bench throughput``: 1000 prompts, 128 in, 256
  out, bf16, CUDA graphs) with DP=2 + EP=2 over NCCL ``all_to_all``, DBO off and on;
* ``ep_timing``: per-MoE-layer time of dispatch, expert compute and combine of the NCCL
  ``all_to_all`` backend at decode sizes (torchrun, one process per GPU);
* ``tp_parity`` / ``tp_bench``: ``--tensor-parallel-size 2`` against TP=1, and its seed
  workload throughput.

    python benchmarks/multi_gpu.py --out DIR [--parts ds_parity,ds_bench,ep_timing,tp_parity,tp_bench]
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


def parity_prompts(vocab: int) -> list[list[int]]:
    return [[(1009 * i + 7 * j) % (vocab // 2) + vocab // 4 for j in range(n)] for i, n in enumerate(PARITY_LENS)]


def generate_ids(model: str, out: str, **engine) -> None:
    """Worker: greedy ids of the parity prompts (fp32, eager) written to ``out``."""
    from transformers import AutoConfig

    from tandem import LLM, SamplingParams

    vocab = AutoConfig.from_pretrained(model).vocab_size
    llm = LLM(model=model, tokenizer=tokenizer_dir(), load_format="dummy", dtype="float32", enforce_eager=True,
              max_model_len=512, max_num_seqs=16, **engine)
    outs = llm.generate(parity_prompts(vocab), SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                        use_tqdm=False)
    with open(out, "w") as f:
        json.dump([o.outputs[0].token_ids for o in outs], f)
    llm.engine.shutdown()


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


def bench(out: str, name: str, model: str, limit: float, extra: list[str]) -> dict | None:
    path = os.path.join(out, f"{name}.json")
    if not run(seed_workload_command(model, path, *extra), limit):
        return None
    with open(path) as f:
        return json.load(f)


def ep_timing_cmd(out: str) -> list[str]:
    """``torchrun`` of ep_all2all_timing.py with this interpreter (``torchrun`` itself may not
    be on PATH when the virtual environment is not activated)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            os.path.join(HERE, "ep_all2all_timing.py"), "--out", out]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        generate_ids(sys.argv[2], sys.argv[3], **json.loads(sys.argv[4]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="ds_parity,ds_bench,ep_timing,tp_parity,tp_bench")
    ap.add_argument("--limit", type=float, default=400.0, help="seconds per process (the DBO seed workload takes minutes)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ds = write_config_dir(DEEPSEEK_V2_LITE, os.path.join(args.out, "deepseek_v2_lite"))
    llama = write_config_dir(LLAMA_31_8B, os.path.join(args.out, "llama31_8b"))
    dp_ep = ["--data-parallel-size", "2", "--enable-expert-parallel", "--all2all-backend", "all_to_all"]
    results: dict = {}

    def save() -> None:
        with open(os.path.join(args.out, "multi_gpu.json"), "w") as f:
            json.dump(results, f, indent=2)

    for part in args.parts.split(","):
        if part == "ds_parity":
            results[part] = parity(args.out, part, ds, args.limit, dict(
                data_parallel_size=2, enable_expert_parallel=True, all2all_backend="all_to_all"))
        elif part == "ds_bench":
            results[part] = {"dbo_off": bench(args.out, "ds_dbo_off", ds, args.limit, dp_ep),
                             "dbo_on": bench(args.out, "ds_dbo_on", ds, args.limit, [*dp_ep, "--enable-dbo"])}
        elif part == "ep_timing":
            path = os.path.join(args.out, "ep_timing.json")
            ok = run(ep_timing_cmd(path), args.limit)
            results[part] = json.load(open(path)) if ok and os.path.exists(path) else None
        elif part == "tp_parity":
            results[part] = parity(args.out, part, llama, args.limit, dict(tensor_parallel_size=2))
        elif part == "tp_bench":
            results[part] = bench(args.out, "tp2", llama, args.limit, ["--tensor-parallel-size", "2"])
        else:
            raise SystemExit(f"unknown part {part!r}")
        save()

    print("\n| run | requests/s | output tok/s |\n|---|---|---|")
    rows = [("DeepSeek-V2-Lite DP=2 EP=2 all_to_all, DBO off", (results.get("ds_bench") or {}).get("dbo_off")),
            ("DeepSeek-V2-Lite DP=2 EP=2 all_to_all, DBO on", (results.get("ds_bench") or {}).get("dbo_on")),
            ("Llama-3.1-8B TP=2", results.get("tp_bench"))]
    for name, r in rows:
        if r:
            print(f"| {name} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.0f} |")


if __name__ == "__main__":
    main()
