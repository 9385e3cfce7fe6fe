"""``LLM(data_parallel_size=2)`` from code that the spawned ranks cannot (or must not)
re-run: a script piped to ``python -`` and a script without an ``if __name__ ==
"__main__"`` guard. Both work over gloo on the CPU and exit quietly: no traceback, no
TCPStore/gloo/NCCL message at teardown."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
from tandem import LLM, SamplingParams
llm = LLM({model!r}, tokenizer={tokenizer!r}, load_format="dummy", data_parallel_size=2, device="cpu",
          dtype="float32", num_kv_blocks=64, max_model_len=128)
outs = llm.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                    use_tqdm=False)
print("TOKENS", [o.outputs[0].token_ids for o in outs])
"""
NOISE = ("Traceback", "TCPStore", "gloo", "NCCL", "ProcessGroup", "Error", "rank(s)")


@pytest.fixture(scope="module")
def dp_script(tmp_path_factory, smol_tokenizer):
    from tests.distributed.conftest import CONFIGS

    d = tmp_path_factory.mktemp("dp_stdin")
    (d / "model").mkdir()
    (d / "model" / "config.json").write_text(json.dumps(CONFIGS["llama"]))
    smol_tokenizer.save_pretrained(d / "tokenizer")
    return SCRIPT.format(model=str(d / "model"), tokenizer=str(d / "tokenizer")), d


@pytest.mark.parametrize("how", ["stdin", "script_without_main_guard"])
def test_data_parallel_from_stdin_and_unguarded_script(dp_script, how):
    script, d = dp_script
    env = {**os.environ, "TANDEM_STARTUP_TIMEOUT_S": "180", "PYTHONPATH": os.getcwd()}
    if how == "stdin":
        args, stdin = [sys.executable, "-"], script
    else:
        (d / "run.py").write_text(script)
        args, stdin = [sys.executable, str(d / "run.py")], None
    res = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=420, env=env, cwd=str(d))
    assert res.returncode == 0, res.stderr[-3000:]
    tokens = [line for line in res.stdout.splitlines() if line.startswith("TOKENS")]
    assert len(tokens) == 1 and len(eval(tokens[0][len("TOKENS "):])[1]) == 4  # once: the ranks did not re-run it
    noisy = [line for line in res.stderr.splitlines() if any(n in line for n in NOISE)]
    assert not noisy, res.stderr[-3000:]
