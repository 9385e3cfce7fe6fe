"""First use of the ``tandem`` command: ordinary mistakes end in one line naming the
problem (no traceback), checked before anything loads; ``--version``; the server says where
it listens and logs requests; client commands show progress."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

MISSING_MODEL = "/nonexistent/model-folder"  # loading it would fail with another message


def tandem(*args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem.entrypoints.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": os.getcwd()})


def assert_one_line_error(res: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    assert res.returncode == code, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("tandem ") and "error" in last, res.stderr
    for n in needles:
        assert n in last, last


def test_version():
    import tandem as pkg

    res = tandem("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"tandem {pkg.__version__}"


@pytest.mark.parametrize("args, needle", [
    (["serve", "--port", "99999"], "--port"),
    (["eval", "--task", "mmlu", "--limit", "0"], "--limit"),
    (["eval", "--task", "mmlu", "--limit", "-1"], "--limit"),
    (["generate", "hi", "--max-tokens", "0"], "--max-tokens"),
    (["bench", "serve", "--num-prompts", "0"], "--num-prompts"),
])
def test_bad_flag_values_are_rejected_while_parsing(args, needle):
    res = tandem(*args)
    assert_one_line_error(res, 2, needle)
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr  # no usage block


def _subcommand_flags():
    """(command, parser, action) of every argument of every ``tandem`` subcommand."""
    import argparse

    from tandem.entrypoints.cli import build_parser

    def walk(parser, name):
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub, p in a.choices.items():
                    yield from walk(p, f"{name} {sub}")
            elif not isinstance(a, (argparse._HelpAction, argparse._VersionAction)):
                yield name, parser, a

    return list(walk(build_parser(), "tandem"))


def test_every_flag_has_help_with_its_default():
    """A flag's default is in its help; one left unset (None) says what then happens."""
    missing = []
    for cmd, parser, a in _subcommand_flags():
        text = parser._get_formatter()._expand_help(a) if a.help else ""
        value_shown = a.default in (None, False) or str(a.default) in text
        if not text or not value_shown or (a.default is None and a.option_strings and not a.required
                                           and "default" not in text and "None:" not in text):
            missing.append(f"{cmd} {'/'.join(a.option_strings) or a.dest}: {text!r}")
    assert not missing, "\n".join(missing)


def test_eval_limit_help_says_the_whole_data_set():
    (limit,) = [a for cmd, _, a in _subcommand_flags() if cmd == "tandem eval" and a.dest == "limit"]
    assert "default: the whole data set" in limit.help


@pytest.mark.parametrize("cmd", [["generate", "hi"], ["serve"], ["bench", "throughput"]])
@pytest.mark.parametrize("flags, field", [
    (["--max-model-len", "0"], "--max-model-len"),
    (["--num-kv-blocks", "1"], "--num-kv-blocks"),
    (["--device", "tpu"], "device"),
    (["--generation-config", "/nonexistent"], "--generation-config"),
])
def test_engine_values_are_checked_before_loading(cmd, flags, field):
    """The model path does not exist: an error about the flag (named as the flag) proves
    nothing was loaded."""
    if field == "--generation-config" and cmd != ["generate", "hi"]:
        pytest.skip("one command suffices")
    assert_one_line_error(tandem(*cmd, "--model", MISSING_MODEL, *flags), 2, field)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda():
    assert_one_line_error(tandem("generate", "hi", "--model", MISSING_MODEL, "--device", "cuda"), 2, "cuda", "--device cpu")


@pytest.mark.parametrize("cmd", [["serve"], ["serve", "--api-server-count", "2"], ["bench", "throughput"],
                                 ["eval", "--task", "mmlu", "--limit", "2"]])
def test_bad_model_path_is_one_line(cmd):
    """As ``generate``: every command that starts an engine, spawned cores or not."""
    assert_one_line_error(tandem(*cmd, "--model", "/nonexistent.gguf"), 2, "'/nonexistent.gguf' does not exist")


def test_a_path_of_another_kind_is_one_line(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    assert_one_line_error(tandem("generate", "hi", "--model", str(tmp_path / "weights.bin")), 2, "is none of them")


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory) -> dict[str, str]:
    """An environment where importing torch fails: a command that answers in it answered
    before its heavy imports."""
    root = tmp_path_factory.mktemp("no_torch")
    (root / "torch").mkdir()
    (root / "torch" / "__init__.py").write_text("raise ImportError('torch was imported')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.getcwd()])}


@pytest.mark.parametrize("cmd", [["generate", "hi", "--model", MISSING_MODEL],
                                 ["serve", MISSING_MODEL],
                                 ["serve", "--served-model-name", "smol", MISSING_MODEL],  # the flag takes one value
                                 ["serve", "--api-server-count", "2", MISSING_MODEL],
                                 ["bench", "throughput", "--model", MISSING_MODEL]])
def test_missing_model_is_reported_before_heavy_imports(cmd, no_torch):
    res = subprocess.run([sys.executable, "-m", "tandem.entrypoints.cli", *cmd], capture_output=True, text=True,
                         timeout=120, env=no_torch)
    assert_one_line_error(res, 2, f"model {MISSING_MODEL!r} does not exist")


def test_llm_with_a_missing_model_answers_before_heavy_imports(no_torch):
    code = f"from tandem import LLM\ntry:\n    LLM(model={MISSING_MODEL!r})\nexcept ValueError as e:\n    print(e)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=no_torch)
    assert res.returncode == 0 and res.stdout.strip() == f"model {MISSING_MODEL!r} does not exist.", res.stderr


def test_no_flag_takes_a_variable_number_of_values_where_a_positional_follows():
    """``--served-model-name smol MODEL`` once served the embedded model as ``smol``: a flag
    with nargs "+", "*" or "?" takes the positional after it. None in a command that has one."""
    import argparse

    positional = {cmd for cmd, _, a in _subcommand_flags() if not a.option_strings}
    greedy = [f"{cmd} {'/'.join(a.option_strings)}" for cmd, _, a in _subcommand_flags()
              if cmd in positional and a.option_strings and a.nargs in ("+", "*", "?", argparse.REMAINDER)]
    assert positional and not greedy, greedy


def test_served_model_name_repeats():
    from tandem.entrypoints.cli import build_parser
    from tandem.entrypoints.openai.cli_args import served_names

    args = build_parser().parse_args(["serve", "--served-model-name", "a", "--served-model-name", "b", "m.gguf"])
    assert served_names(args) == ["a", "b"] and args.model_pos == "m.gguf"


def test_model_the_engine_core_rejects_is_one_line(tmp_path):
    """A folder that passes the front end's path check (it holds a config.json) but that the
    spawned core cannot load (no weights): the core's error, alone."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert_one_line_error(tandem("serve", str(tmp_path), "--port", "0"), 2, str(tmp_path), "safetensors")


def test_busy_port_is_reported_before_loading(tmp_path):
    """A folder of a config.json alone passes the path check, and loading it would fail with
    another message."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = tandem("serve", str(tmp_path), "--port", str(port))
    assert_one_line_error(res, 1, f"127.0.0.1:{port}", "in use")


def test_no_server_is_one_line():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert_one_line_error(tandem("bench", "serve", "--port", str(port), "--num-prompts", "2"), 1, "no server answers")
    assert_one_line_error(tandem("eval", "--task", "mmlu", "--limit", "2", "--base-url",
                                 f"http://127.0.0.1:{port}/v1"), 1, "no server answers")


def test_ctrl_c_during_generate_is_one_line(tmp_path, smol_tokenizer):
    import json

    from tests.distributed.conftest import CONFIGS

    (tmp_path / "config.json").write_text(json.dumps({**CONFIGS["llama"], "vocab_size": len(smol_tokenizer)}))
    smol_tokenizer.save_pretrained(tmp_path / "tok")
    cmd = [sys.executable, "-m", "tandem.entrypoints.cli", "generate", "Once upon a time", "--model", str(tmp_path),
           "--load-format", "dummy", "--tokenizer", str(tmp_path / "tok"), "--ignore-eos", "--max-model-len", "256",
           "--max-tokens", "250", "-n", "256", "--num-kv-blocks", "4200", "--no-enable-prefix-caching"]
    # SIGINT back to its default in the child: a suite started in the background by a
    # non-interactive shell ignores SIGINT, and the child would inherit that.
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # While loading or generating: either way one line. 256 x 250 tokens take well over the
    # 4 s even on a quiet machine (64 sequences could finish first).
    time.sleep(4)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    # 130 from the handler; under heavy load CPython sometimes ends itself by the same SIGINT
    # during teardown after the handler ran (-2): both are an interrupted exit.
    assert p.returncode in (130, -signal.SIGINT), err
    assert err.strip().splitlines()[-1] == "tandem generate: interrupted" and "Traceback" not in err, err


def test_server_logs_where_it_listens_and_each_request(server):
    import httpx

    httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=120)
    log = server.log()
    m = re.search(r"listening on (http://\S+): model .*max_model_len (\d+), max_num_seqs (\d+), "
                  r"max_num_batched_tokens (\d+), KV cache (\d+) tokens .*, api_server_count (\d+), pid", log)
    assert m and m.group(1) == server.url, log
    assert int(m.group(3)) >= 1 and int(m.group(4)) >= 1, log  # the limits it took
    assert m.group(6) == "1", log  # left out: one API server on the CPU (default_api_server_count)
    assert '"POST /v1/completions HTTP/1.1" 200' in log, log


def test_server_log_has_its_engine_cores_load_lines(server):
    """The engine core runs in a child process: its INFO lines (the weight loading's time, the
    KV cache's size) reach the server's log as the server's own do."""
    log = server.log()
    assert re.search(r"Loading model weights took \d+\.\d\d s", log), log
    assert re.search(r"KV cache: \d+ blocks of \d+ tokens \(\d+ usable tokens: one null block\), \d+\.\d\d GiB", log), log


def test_bench_serve_and_eval_show_progress(server):
    res = tandem("bench", "serve", "--base-url", server.url, "--num-prompts", "3", "--random-input-len", "8",
                 "--random-output-len", "2", "--disable-warmup")
    assert res.returncode == 0, res.stderr
    assert re.search(r"Requests: 100%\|.*\| 3/3", res.stderr), res.stderr
    res = tandem("eval", "--task", "mmlu", "--limit", "2", "--num-fewshot", "0", "--base-url", f"{server.url}/v1")
    assert res.returncode == 0, res.stderr
    assert re.search(r"Requests: 100%\|.*\| 2/2", res.stderr), res.stderr


@pytest.mark.parametrize("count", [1, 2])
def test_serve_builds_its_engine_for_serving(monkeypatch, count):
    """``tandem serve`` (one or several API servers) gives the engine the served usage
    context, which picks the served default token budget (tandem.platform)."""
    from tandem.config import EngineConfig
    from tandem.entrypoints import cli
    from tandem.entrypoints.openai import api_server, api_server_manager

    seen = []

    class Stop(Exception):
        pass

    def capture(*a, **kw):
        seen.extend(x for x in a if isinstance(x, EngineConfig))
        raise Stop

    monkeypatch.setattr(api_server, "run_server", capture)
    monkeypatch.setattr(api_server_manager, "run_multi_api_server", capture)
    args = cli.build_parser().parse_args(["serve", "--port", "0", "--api-server-count", str(count)])
    with pytest.raises(Stop):
        args.func(args)
    assert seen[0].scheduler_config.usage_context == "openai_api_server"


def _run_install_requirements() -> list[str]:
    """The requirements scripts/setup.sh installs: the core's and those of its extras."""
    import tomllib

    with open("scripts/setup.sh") as f:
        (extras,) = re.findall(r'pip install -q -e "\.\[([\w,]+)\]"', f.read())
    with open("pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    return project["dependencies"] + [r for e in extras.split(",") for r in project["optional-dependencies"][e]]


def test_the_run_install_covers_the_readme_commands():
    """Each package a README command needs beyond the core is in scripts/setup.sh's install
    (the tests, `tandem eval` and the ShareGPT data set say they need setup_dev.sh)."""
    needed = {"tandem bench serve ... --plot": "matplotlib", "tandem serve": "uvicorn", "tandem bench serve": "aiohttp",
              "benchmarks/serve_vs_offline.py": "httpx", "benchmarks/soak.py": "psutil"}
    names = {re.split(r"[\s<>=;\[!~]", r, maxsplit=1)[0].lower() for r in _run_install_requirements()}
    assert {cmd: pkg for cmd, pkg in needed.items() if pkg not in names} == {}


def test_a_flag_whose_package_is_missing_fails_before_the_run(tmp_path):
    """Without matplotlib, ``--plot`` is one line before any request (here: before the
    check for a server, which would fail the run at once otherwise)."""
    (tmp_path / "matplotlib").mkdir()
    (tmp_path / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd()])}
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = subprocess.run([sys.executable, "-m", "tandem.entrypoints.cli", "bench", "serve", "--port", str(port),
                          "--num-prompts", "2", "--plot"], capture_output=True, text=True, timeout=120, env=env)
    assert_one_line_error(res, 2, "--plot", "pip install matplotlib")


def test_flags_with_underscores_are_taken_as_vllm_takes_them():
    from tandem.entrypoints.cli import build_parser

    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    dashed = build_parser().parse_args(["serve", "m", "--max-model-len", "128", "--speculative-config", spec,
                                        "--enable-prefix-caching"])
    underscored = build_parser().parse_args(["serve", "m", "--max_model_len", "128", f"--speculative_config={spec}",
                                             "--enable_prefix_caching"])
    assert vars(underscored) == vars(dashed)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--max_modl_len", "128"])
