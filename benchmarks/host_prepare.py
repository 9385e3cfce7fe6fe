"""Host cost of building one step's inputs for 256 decode sequences, timed in isolation.

Runs an engine on a tiny dummy model (``--model``: a folder with a config.json) until step
``--step``, which must be a decode step of ``--num-seqs`` sequences, and there times the
model runner's input building for that step ``--repeat`` times in place (median, ms):
``prepare_inputs`` (flat ids, positions, slot mapping, block table) and ``sampling_batch``
(the sampler's per-row inputs). Works on trees before and after the persistent input batch
(issue 15), so the two can be compared side by side with ``PYTHONPATH``.

    python benchmarks/host_prepare.py --model /tmp/tiny --context 400 --output-len 160 --step 100
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="folder with a config.json (random weights)")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--context", type=int, default=400, help="prompt tokens per sequence")
    ap.add_argument("--output-len", type=int, default=160)
    ap.add_argument("--step", type=int, default=100, help="the step timed (a decode step of every sequence)")
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()

    from tandem.config import embedded_default_model
    from tandem.entrypoints.llm import LLM
    from tandem.sampling_params import SamplingParams

    torch.set_num_threads(1)
    blocks = args.num_seqs * (-(-(args.context + args.output_len) // 16)) + 16
    llm = LLM(model=args.model, tokenizer=embedded_default_model(), load_format="dummy", num_kv_blocks=blocks,
              max_model_len=args.context + args.output_len + 16, max_num_seqs=args.num_seqs, async_output_proc=False)
    runner = llm.engine.runner
    prompts = torch.randint(1000, 49152, (args.num_seqs, args.context), generator=torch.Generator().manual_seed(0))
    res: dict[str, float] = {}
    calls = {"n": 0}

    def median_ms(fn, *a) -> float:
        ts = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            fn(*a)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    real = runner._prepare_inputs

    def timed(seqs):
        calls["n"] += 1
        if calls["n"] == args.step and len(seqs) == args.num_seqs:
            res["prepare_inputs_ms"] = median_ms(real, seqs)
            if hasattr(runner, "input_batch"):  # after issue 15
                ib = runner.input_batch
                res["sampling_batch_ms"] = median_ms(ib.sampling_batch, ib.rows_of([s.seq_id for s in seqs]))
            else:
                res["sampling_batch_ms"] = median_ms(runner._sampling_batch, [runner.states[s.seq_id] for s in seqs])
        return real(seqs)

    runner._prepare_inputs = timed
    llm.generate(prompts.tolist(), SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True),
                 use_tqdm=False)
    llm.engine.shutdown()
    if not res:
        raise SystemExit(f"step {args.step} was not a step of {args.num_seqs} sequences: change --step")
    res["sum_ms"] = res["prepare_inputs_ms"] + res["sampling_batch_ms"]
    print({k: round(v, 3) for k, v in res.items()})


if __name__ == "__main__":
    main()
