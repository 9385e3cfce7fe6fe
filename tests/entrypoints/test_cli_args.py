"""Parsing the ``tandem`` command line: ``tandem serve``'s API-server count when left unset
(tandem.entrypoints.openai.cli_args); no abbreviated flags; errors naming the subcommand and
saying what a value should be (tandem.entrypoints.arg_types); the vLLM serve flags
``--api-key``, ``--chat-template`` and ``--enable-auto-tool-choice``."""

from __future__ import annotations

import argparse

import pytest

from tandem.engine.arg_utils import EngineArgs
from tandem.entrypoints.cli import build_parser
from tandem.entrypoints.openai.cli_args import (MAX_API_SERVERS_PER_REPLICA, api_keys, default_api_server_count,
                                                resolve_api_server_count)


@pytest.mark.parametrize("cpus, ranks, replicas, on_gpu, want", [
    (2, 1, 1, False, 1),     # the CPU: the engine uses every core
    (64, 1, 1, False, 1),
    (2, 1, 1, True, 1),      # a GPU with few CPUs: at least one server
    (16, 1, 1, True, 4),     # one H200 and its 16 cores: (16 - 1) // 3 = 5, capped at 4 for one replica
    (8, 1, 1, True, 2),
    (32, 2, 2, True, 8),     # two replicas: up to 4 each
    (128, 8, 2, True, 8),    # TP=4 x DP=2 on 8 GPUs: the cap counts replicas, not ranks
    (16, 16, 16, True, 1),   # every core taken by a rank
])
def test_default_api_server_count(cpus, ranks, replicas, on_gpu, want):
    got = default_api_server_count(cpus, ranks, replicas, on_gpu)
    assert got == want and 1 <= got <= MAX_API_SERVERS_PER_REPLICA * replicas


def test_a_given_count_wins_and_an_unset_one_is_resolved_for_the_host():
    cfg = EngineArgs(device="cpu").create_engine_config("openai_api_server")
    given = argparse.Namespace(api_server_count=3)
    assert resolve_api_server_count(given, cfg) == 3
    unset = argparse.Namespace(api_server_count=None)
    assert resolve_api_server_count(unset, cfg) == 1 and unset.api_server_count == 1


def _parse_error(capsys, *argv: str) -> str:
    """The one line ``tandem`` prints for a command line it refuses (exit 2)."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(list(argv))
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line


@pytest.mark.parametrize("argv, flag", [
    (["generate", "hi", "--max-token", "5"], "--max-token"),           # --max-tokens
    (["serve", "--max-num-seq", "3"], "--max-num-seq"),                # --max-num-seqs
    (["serve", "--served-model", "x"], "--served-model"),              # --served-model-name
    (["bench", "serve", "--num-prompt", "3"], "--num-prompt"),         # --num-prompts
    (["eval", "--task", "mmlu", "--lim", "3"], "--lim"),               # --limit
])
def test_an_abbreviated_flag_is_an_error(capsys, argv, flag):
    assert f"unrecognized arguments: {flag}" in _parse_error(capsys, *argv)


def test_no_parser_takes_abbreviations():
    import argparse

    def walk(parser):
        yield parser
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub in a.choices.values():
                    yield from walk(sub)

    parsers = list(walk(build_parser()))
    assert len(parsers) > 4 and not [p.prog for p in parsers if p.allow_abbrev]


@pytest.mark.parametrize("argv, command", [
    (["serve", "--no-such-flag"], "tandem serve"),
    (["serve", "--api-key"], "tandem serve"),  # a flag of this change, its value left out
    (["generate", "hi", "--no-such-flag"], "tandem generate"),
    (["bench", "serve", "--no-such-flag"], "tandem bench serve"),
    (["--no-such-flag", "serve"], "tandem"),  # before the subcommand: the top-level parser's
])
def test_an_error_points_to_its_own_subcommands_help(capsys, argv, command):
    line = _parse_error(capsys, *argv)
    assert line.startswith(f"{command}: error: ") and line.endswith(f"(see {command} --help)"), line


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "--max-tokens", "0"], "--max-tokens: expected a positive integer, got '0'"),
    (["generate", "hi", "--max-tokens", "many"], "--max-tokens: expected a positive integer, got 'many'"),
    (["generate", "hi", "--min-tokens", "-1"], "--min-tokens: expected an integer >= 0, got '-1'"),
    (["generate", "hi", "-n", "0"], "-n/--n: expected a positive integer, got '0'"),
    (["serve", "--port", "99999"], "--port: expected a TCP port in 0..65535, got '99999'"),
    (["bench", "throughput", "--structured-output-ratio", "nan"],
     "--structured-output-ratio: expected a number in [0, 1], got 'nan'"),
    (["generate", "hi", "--top-k", "all"], "--top-k: expected an integer, got 'all'"),  # type=int
    (["serve", "--max-num-seqs", "1.5"], "--max-num-seqs: expected an integer, got '1.5'"),  # an engine flag
    (["generate", "hi", "--temperature", "hot"], "--temperature: expected a number, got 'hot'"),  # type=float
])
def test_a_bad_value_says_what_was_expected(capsys, argv, message):
    prog = "tandem " + " ".join(a for a in argv[:2] if a in ("generate", "serve", "bench", "throughput"))
    assert _parse_error(capsys, *argv) == f"{prog}: error: {message} (see {prog} --help)"


def test_chat_template_from_a_file_or_inline(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}\n{% endfor %}")
    assert build_parser().parse_args(["serve", "--chat-template", str(path)]).chat_template == path.read_text()
    # On one line, as vLLM takes it: escapes are decoded; text beyond ASCII is kept.
    inline = r"{{ messages[0].content }}\n\tfin – 終"
    assert build_parser().parse_args(["serve", "--chat-template", inline]).chat_template == \
        "{{ messages[0].content }}\n\tfin – 終"
    assert build_parser().parse_args(["serve"]).chat_template is None


@pytest.mark.parametrize("value, reason", [("/nonexistent/template.jinja", "No such file or directory"),
                                           (".", "Is a directory")])
def test_chat_template_that_looks_like_a_path_and_cannot_be_read(capsys, value, reason):
    line = _parse_error(capsys, "serve", "--chat-template", value)
    assert line.startswith(f"tandem serve: error: --chat-template: cannot read the template file {value!r}: {reason}")


def test_api_keys_repeat_and_win_over_the_environment(monkeypatch):
    monkeypatch.setenv("TANDEM_API_KEY", " from-env\n")
    args = build_parser().parse_args(["serve", "--api-key", "k1", "--api-key", "k2", "m.gguf"])
    assert api_keys(args) == ["k1", "k2"] and args.model_pos == "m.gguf"
    assert api_keys(build_parser().parse_args(["serve"])) == ["from-env"]
    monkeypatch.setenv("TANDEM_API_KEY", "")
    assert api_keys(build_parser().parse_args(["serve"])) == []


def test_an_empty_api_key_is_refused(capsys):
    """``--api-key "$UNSET"`` would otherwise start a server open to anyone."""
    assert _parse_error(capsys, "serve", "--api-key", " ") == \
        "tandem serve: error: --api-key: expected a non-empty key (see tandem serve --help)"


def test_enable_auto_tool_choice_is_accepted_and_can_be_turned_off():
    parse = build_parser().parse_args
    assert parse(["serve"]).enable_auto_tool_choice is True
    args = parse(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])  # vLLM's command line
    assert args.enable_auto_tool_choice is True and args.tool_call_parser == "hermes"
    assert parse(["serve", "--no-enable-auto-tool-choice"]).enable_auto_tool_choice is False


def test_serve_refuses_a_tp_size_that_does_not_split_the_heads_before_anything_loads(embedded_model_path):
    """``tandem serve -tp 2`` on the embedded SmolLM2 (9 heads, 3 KV heads): refused by the config
    step on the main thread, before the server binds or a loading thread starts."""
    from tandem.entrypoints.openai.cli_args import serve_engine_config

    args = build_parser().parse_args(["serve", "--model", embedded_model_path, "-tp", "2"])
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) must split .*: one of 1, 3, 9\."):
        serve_engine_config(args)
    args = build_parser().parse_args(["serve", "--model", embedded_model_path, "-tp", "3"])
    assert serve_engine_config(args).parallel_config.tensor_parallel_size == 3
