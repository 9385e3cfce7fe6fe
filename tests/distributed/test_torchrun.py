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


LLM_SCRIPT = """
import sys
from tandem import LLM, SamplingParams
llm = LLM({model!r}, tokenizer={tokenizer!r}, load_format="dummy", device="cpu", block_size=128, num_kv_blocks=16,
          max_model_len=128, data_parallel_size=2, enable_expert_parallel=True, all2all_backend="all_to_all")
outs = llm.generate({prompts!r}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
client = llm.engine.client
print("CLIENT", [c.__name__ for c in type(client).__mro__])
print("TOKENS", [o.outputs[0].token_ids for o in outs])
"""


def test_torchrun_llm_uses_the_one_client_protocol(tmp_path):
    """``LLM(data_parallel_size=2, enable_expert_parallel=True)`` in a torchrun script: rank 0's
    engine talks to both replicas' cores through a SyncMPClient (msgpack over zmq), no
    other data-parallel front end exists, and the tokens are the single-process ones."""
    import importlib.util
    import pathlib

    import tandem
    from tandem.config import embedded_default_model
    from tandem.sampling_params import SamplingParams

    assert importlib.util.find_spec("tandem.engine.dp_engine") is None
    for path in pathlib.Path(tandem.__file__).parent.rglob("*.py"):  # outputs are never pickled between ranks
        text = path.read_text()
        assert "gather_object" not in text and "broadcast_object_list" not in text, path
    (tmp_path / "config.json").write_text(json.dumps(dict(CONFIGS["qwen3_moe"], vocab_size=49152)))
    llm = make_llm(str(tmp_path), block_size=128, num_kv_blocks=16)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6,
                                                                                 ignore_eos=True), use_tqdm=False)]
    llm.engine.shutdown()
    script = tmp_path / "run.py"
    script.write_text(LLM_SCRIPT.format(model=str(tmp_path), tokenizer=embedded_default_model(), prompts=PROMPTS))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("CLIENT", "TOKENS"))]
    assert len(lines) == 2, proc.stdout  # rank 0 alone prints: the other rank exits inside LLM()
    assert "SyncMPClient" in lines[0], lines[0]
    assert lines[1] == f"TOKENS {want}"
