"""What beam search costs (issue 49): ``LLM.beam_search`` against sampling the same number
of sequences (``generate`` with ``n`` = the beam width) and against transformers'
``generate(num_beams=...)``, on the same prompts, alternated over rounds.

Each mode generates ``--max-tokens`` tokens per sequence (EOS ignored, so every mode does the
same work); the table gives the median wall time per prompt batch, its spread, and the
ratio to sampling. The CPU load average is printed beside.

    python benchmarks/beam_search.py --beam-width 4 --max-tokens 32 --num-prompts 8 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from tandem import BeamSearchParams, SamplingParams
from tandem.entrypoints.llm import LLM

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,",
    "The three primary colors are", "Translate to French: I like cheese. ->", "1, 2, 3, 4,",
    "Q: What is the boiling point of water at sea level in Celsius?\nA:", "Here is the English alphabet: ABC",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-transformers", action="store_true", help="leave transformers out")
    args = ap.parse_args()
    prompts = (PROMPTS * (args.num_prompts // len(PROMPTS) + 1))[:args.num_prompts]
    llm = LLM(args.model, dtype=args.dtype)
    tok = llm.get_tokenizer()
    beam = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens, ignore_eos=True)
    sample = SamplingParams(n=args.beam_width, max_tokens=args.max_tokens, temperature=0.8, ignore_eos=True)
    modes = {"sample n": lambda: llm.generate(prompts, sample, use_tqdm=False),
             "beam search": lambda: llm.beam_search(prompts, beam)}
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM

        from tandem.config import embedded_default_model

        path = args.model or embedded_default_model()
        kw = {"gguf_file": os.path.basename(path)} if path.endswith(".gguf") else {}
        ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(path) if kw else path, **kw).eval()
        ref.generation_config.eos_token_id = None
        ids = [torch.tensor([tok.encode(p)]) for p in prompts]

        def hf() -> None:
            with torch.no_grad():
                for x in ids:
                    ref.generate(x, attention_mask=torch.ones_like(x), num_beams=args.beam_width,
                                 num_return_sequences=args.beam_width, max_new_tokens=args.max_tokens,
                                 do_sample=False, pad_token_id=tok.eos_token_id)
        modes["transformers beams"] = hf
    for fn in modes.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for m, fn in modes.items():
            t0 = time.perf_counter()
            fn()
            times[m].append(time.perf_counter() - t0)
    base = statistics.median(times["sample n"])
    print(f"\n{args.num_prompts} prompts, width {args.beam_width}, {args.max_tokens} tokens, {args.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| mode | median s | spread s | vs sample n |\n|---|---|---|---|")
    for m, ts in times.items():
        med = statistics.median(ts)
        print(f"| {m} | {med:.2f} | {min(ts):.2f}-{max(ts):.2f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
