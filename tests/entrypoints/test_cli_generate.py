"""``tandem generate``: the completions on stdout, the speed line on stderr."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tandem.entrypoints.cli import generation_summary, main
from tandem.outputs import CompletionOutput, RequestOutput


def _out(prompt_len: int, n_tokens: list[int], arrival: float, first: float, end: float, cached: int = 0):
    comps = [CompletionOutput(i, "x", list(range(n)), finish_reason="length") for i, n in enumerate(n_tokens)]
    return RequestOutput("r", None, list(range(prompt_len)), comps, True, num_cached_tokens=cached,
                         metrics={"arrival_time": arrival, "first_token_time": first, "finished_time": end})


def test_summary_rates():
    outs = [_out(10, [5], 100.0, 100.5, 101.5), _out(30, [3, 3], 100.0, 101.0, 102.0, cached=16)]
    line = generation_summary(outs, load_s=1.25)
    # 10 + (30 - 16) prompt tokens by the last first token (1.0 s); 11 tokens - 3 firsts in 1.0 s.
    assert line == ("prompt: 24 tokens in 1.00 s (24.0 tok/s); generation: 8 tokens in 1.00 s (8.0 tok/s); "
                    "model load 1.2 s")


def test_summary_single_token_has_no_generation_rate():
    line = generation_summary([_out(4, [1], 5.0, 5.2, 5.2)], load_s=0.5)
    assert "generation: 0 tokens in 0.00 s (n/a)" in line


def test_generate_prints_speeds(capsys):
    main(["generate", "The capital of France is", "--max-tokens", "4", "--num-kv-blocks", "64",
          "--max-model-len", "256"])
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert re.search(r"prompt: \d+ tokens in [\d.]+ s \([\d.]+ tok/s\); generation: 3 tokens in [\d.]+ s "
                     r"\(([\d.]+ tok/s|n/a)\); model load [\d.]+ s; weights gguf quantized \+ \w+", captured.err), captured.err


def test_summary_names_the_weights_mode():
    line = generation_summary([_out(4, [3], 5.0, 5.2, 5.4)], load_s=0.5, weights="gguf quantized + bfloat16")
    assert line.endswith("; model load 0.5 s; weights gguf quantized + bfloat16")
    untimed = _out(4, [2], 0.0, 0.0, 0.0)
    untimed.metrics = {}
    assert generation_summary([untimed], load_s=1.0, weights="float32") == "model load 1.0 s; weights float32"


def test_summary_without_timings_keeps_the_load_time():
    out = _out(4, [2], 0.0, 0.0, 0.0)
    out.metrics = {}
    assert generation_summary([out], load_s=2.0) == "model load 2.0 s"


SMALL = ["--max-model-len", "256", "--num-kv-blocks", "64", "--temperature", "0"]


def _generate_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "tandem.entrypoints.cli", "generate", *args, *SMALL]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.getcwd()}


def test_one_prompt_streams_to_a_terminal_and_prints_the_same_text():
    """On a terminal the text arrives in pieces while it is generated; piped, it is one
    write at the end; the text is the same."""
    import pty

    cmd = _generate_cmd("Once upon a time", "--max-tokens", "40", "--ignore-eos")
    piped = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())
    assert piped.returncode == 0, piped.stderr
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, stdout=slave, stderr=subprocess.DEVNULL, env=_env())
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(60) == 0
    tty_text = b"".join(chunks).decode().replace("\r\n", "\n")
    assert tty_text == piped.stdout and piped.stdout.strip()
    assert len(chunks) >= 5, chunks  # 40 tokens arrive in many reads, not in one


def test_empty_completion_is_a_note_not_a_blank_line():
    # Greedy, the first token is " Paris": the stop string leaves no text.
    res = subprocess.run(_generate_cmd("The capital of France is", "--stop", " Paris", "--max-tokens", "8"),
                         capture_output=True, text=True, timeout=300, env=_env())
    assert res.returncode == 0, res.stderr
    assert res.stdout == ""
    assert "[empty completion: finish_reason stop" in res.stderr, res.stderr


def test_generate_with_speculation_prints_its_acceptance(capsys):
    """The embedded model as its own draft: every draft is accepted, and the run's acceptance
    is printed after the speed line, as the server logs it."""
    from tandem.config.model import embedded_default_model

    spec = f'{{"method": "draft_model", "model": "{embedded_default_model()}", "num_speculative_tokens": 2}}'
    main(["generate", "The capital of France is", "--max-tokens", "8", "--ignore-eos", "--speculative-config", spec,
          *SMALL])
    err = capsys.readouterr().err
    m = re.search(r"SpecDecoding metrics: Mean acceptance length: ([\d.]+), .*Accepted: (\d+) tokens, "
                  r"Drafted: (\d+) tokens", err)
    assert m, err
    assert float(m[1]) == 3.0 and m[2] == m[3] != "0"
