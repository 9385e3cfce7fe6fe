"""Standard rendezvous: ``torchrun`` (env://) starts 2 ranks of ``tandem generate
--data-parallel-size 2 --enable-expert-parallel``; global rank 0 prints the completions,
which equal the single-process ones, and every rank exits."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.distributed._harness import free_port
from tests.distributed.conftest import CONFIGS, make_llm

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,", "1, 2, 3,"]


def test_torchrun_dp2_ep2_cli(tmp_path):
    from tandem.config import embedded_default_model
    from tandem.sampling_params import SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(dict(CONFIGS["qwen3_moe"], vocab_size=49152)))
    engine = ["--model", str(tmp_path), "--tokenizer", embedded_default_model(), "--load-format", "dummy",
              "--device", "cpu", "--block-size", "128", "--num-kv-blocks", "16", "--max-model-len", "128"]
    llm = make_llm(str(tmp_path), block_size=128, num_kv_blocks=16)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                                     use_tqdm=False)]
    llm.engine.shutdown()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "tandem.entrypoints.cli", "generate", *PROMPTS, *engine, "--max-tokens", "6", "--ignore-eos",
           "--data-parallel-size", "2", "--enable-expert-parallel", "--all2all-backend", "all_to_all"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    blocks = proc.stdout.split("--- prompt ")[1:]
    got = [b.split("\n", 1)[1].rstrip("\n") for b in blocks]
    assert got == [w.rstrip("\n") for w in want]
