"""Step statistics of ``tandem bench throughput`` from the steps' spans."""

from __future__ import annotations

import pytest

from tandem.benchmarks.throughput import ThroughputResult, _gpu_step_stats
from tandem.step_timing import StepSpan


class _Event:
    """Stands in for a CUDA timing event: a time stamp in ms."""

    def __init__(self, t: float) -> None:
        self.t = t

    def elapsed_time(self, other: "_Event") -> float:
        return other.t - self.t


def test_step_stats_split_decode_and_prefill_time():
    # (start ms, end ms, sequences, decode-only?, context tokens)
    steps = [(0, 10, 4, False, 40), (11, 14, 4, True, 44), (14, 17, 4, True, 48), (20, 30, 6, False, 60),
             (30, 34, 6, True, 66), (34, 38, 6, True, 72)]
    events = [StepSpan(_Event(a), n, d, c, _Event(b)) for a, b, n, d, c in steps]
    res = ThroughputResult(1, 1, 1, 1.0, 1.0, 1.0, 1.0, 1.0, 0)
    _gpu_step_stats(events, res)
    assert (res.num_decode_steps, res.num_prefill_steps) == (4, 2)
    assert res.decode_steps_s == pytest.approx(14e-3) and res.prefill_steps_s == pytest.approx(20e-3)
    assert res.gpu_idle_fraction == pytest.approx(4 / 38)  # gaps 1 + 3 over 38 ms
    assert res.max_decode_batch == 6 and res.decode_step_ms_at_max_batch == 4


def test_step_stats_count_steps_verifying_drafts_apart():
    """Speculative decoding: steps that verify drafts (multi-token, no prompt tokens) are
    neither decode-only steps nor steps with prefill tokens."""
    steps = [(0, 10, 1, False, False), (10, 13, 1, False, True), (13, 16, 1, False, True), (16, 17, 1, True, False)]
    events = [StepSpan(_Event(a), n, d, 20, _Event(b), verifies_drafts=v) for a, b, n, d, v in steps]
    res = ThroughputResult(1, 1, 1, 1.0, 1.0, 1.0, 1.0, 1.0, 0)
    _gpu_step_stats(events, res)
    assert (res.num_decode_steps, res.num_verify_steps, res.num_prefill_steps) == (1, 2, 1)
    assert res.verify_steps_s == pytest.approx(6e-3) and res.prefill_steps_s == pytest.approx(10e-3)


def test_step_stats_without_decode_steps():
    """``--output-len 1``: every step has prefill tokens; the decode statistics stay None."""
    events = [StepSpan(_Event(a), 4, False, 40, _Event(b)) for a, b in ((0, 10), (12, 20))]
    res = ThroughputResult(1, 1, 1, 1.0, 1.0, 1.0, 1.0, 1.0, 0)
    _gpu_step_stats(events, res)
    assert (res.num_decode_steps, res.num_prefill_steps) == (0, 2) and res.decode_steps_s == 0
    assert res.gpu_idle_fraction_decode is None and res.max_decode_batch is None
    assert res.gpu_idle_fraction == pytest.approx(2 / 20)


def test_host_step_stats_median_and_p99_over_complete_steps():
    from tandem.benchmarks.throughput import _host_step_stats
    from tandem.step_timing import StepHostTimes

    t = StepHostTimes()
    for step in range(1, 101):
        t.add(step, "schedule", 1e-3)
        t.add(step, "prepare", 2e-3 if step != 50 else 102e-3)
        t.add(step, "process", 0.5e-3)
    t.add(101, "schedule", 9.0)  # launched but never processed: not a complete step
    res = ThroughputResult(1, 1, 1, 1.0, 1.0, 1.0, 1.0, 1.0, 0)
    _host_step_stats(t, res)
    assert res.host_step_ms_median == pytest.approx(3.5)
    assert 3.5 < res.host_step_ms_p99 <= 103.5
    assert res.host_prepare_ms_median == pytest.approx(2.0) and res.host_process_ms_median == pytest.approx(0.5)
    with pytest.raises(ValueError, match="phase"):
        t.add(1, "forward", 1.0)


def test_host_step_stats_grammar_phases_beside_the_step_sum():
    """Constrained steps' grammar and bitmask times are reported over the steps that have
    them, and stay out of the per-step sum of schedule / prepare / process."""
    from tandem.benchmarks.throughput import _host_step_stats
    from tandem.step_timing import StepHostTimes

    t = StepHostTimes()
    for step in range(1, 11):
        for phase in ("schedule", "prepare", "process"):
            t.add(step, phase, 1e-3)
        if step % 2:
            t.add(step, "grammar", 4e-3)
            t.add(step, "bitmask", 2e-3)
    res = ThroughputResult(1, 1, 1, 1.0, 1.0, 1.0, 1.0, 1.0, 0)
    _host_step_stats(t, res)
    assert res.host_step_ms_median == pytest.approx(3.0)
    assert res.host_grammar_ms_median == pytest.approx(4.0) and res.host_bitmask_ms_median == pytest.approx(2.0)
    assert t.totals_ms() == pytest.approx([3.0] * 10)
    free = StepHostTimes()
    for phase in ("schedule", "prepare", "process"):
        free.add(1, phase, 1e-3)
    res = ThroughputResult(1, 1, 1, 1.0, 1.0, 1.0, 1.0, 1.0, 0)
    _host_step_stats(free, res)
    assert res.host_grammar_ms_median is None and res.host_bitmask_ms_median is None


def test_run_throughput_reports_host_time_of_the_in_process_core():
    """LLM's single-rank engine runs its core in process: the core's loop records every
    step's schedule / prepare / update_from_output time, and recording stops afterwards."""
    from tandem.benchmarks.throughput import run_throughput
    from tests.conftest import make_llm

    llm = make_llm(num_kv_blocks=64, max_model_len=256)
    res = run_throughput(llm, num_prompts=2, input_len=8, output_len=4)
    assert res.host_step_ms_median is not None and res.host_step_ms_median > 0
    assert res.host_step_ms_p99 >= res.host_step_ms_median
    assert min(res.host_schedule_ms_median, res.host_prepare_ms_median, res.host_process_ms_median) > 0
    assert llm.engine.core.step_times is None and llm.engine.runner.step_times is None
    assert res.jit_compiles_timed == []  # the interpreter builds no kernel variants
    # The CPU step thread's busy and idle time, as CUDA events give a GPU's.
    assert llm.engine.runner.runs_on_step_thread and llm.engine.runner.step_events is None
    assert 0 <= res.gpu_idle_fraction < 1 and res.num_decode_steps + res.num_prefill_steps >= 4
    assert res.decode_steps_s > 0 and res.max_decode_batch == 2


def test_wall_clock_events_time_the_step_thread_in_ms():
    from tandem.step_timing import WallClockEvent

    a, b = WallClockEvent(), WallClockEvent()
    a.record()
    b.record()
    assert 0 <= a.elapsed_time(b) < 1e3 and b.elapsed_time(a) <= 0


def test_run_throughput_reports_kernel_variants_built_in_the_timed_run_only(monkeypatch):
    """A Triton specialisation first met inside the timed generate (a compile the warm-up
    missed) is reported by name; one met in the warm-up is not."""
    import triton

    from tandem.benchmarks import throughput
    from tests.conftest import make_llm

    llm = make_llm(num_kv_blocks=64, max_model_len=256)
    calls = []

    def and_miss(generate):
        def run(*args, **kwargs):
            calls.append(1)
            hook = triton.knobs.runtime.jit_cache_hook
            if hook is not None:
                hook(key="k", repr=f"_kernel_{len(calls)}[num_warps=4](n: i32)", fn=None, compile={},
                     is_manual_warmup=False, already_compiled=False)
            return generate(*args, **kwargs)

        return run

    monkeypatch.setattr(llm, "generate", and_miss(llm.generate))  # the warm-up
    monkeypatch.setattr(throughput, "generate_with_progress", and_miss(throughput.generate_with_progress))
    res = throughput.run_throughput(llm, num_prompts=2, input_len=8, output_len=4)
    assert len(calls) == 2  # warm-up, then the timed run
    assert res.jit_compiles_timed == ["_kernel_2()"]


def test_run_throughput_constrains_the_asked_share_to_the_schema(monkeypatch):
    """``--structured-output-ratio``: that share of the requests (chosen at random) carries the
    schema's constraint, the others none, in the warm-up too; a ratio outside [0, 1] is a
    ValueError naming it, and the flag rejects it before anything loads."""
    from tandem.benchmarks import throughput
    from tests.conftest import make_llm

    llm = make_llm(num_kv_blocks=64, max_model_len=256)
    seen = []
    generate, timed = llm.generate, throughput.generate_with_progress
    monkeypatch.setattr(llm, "generate", lambda prompts, params, **kw: seen.append(params) or generate(prompts, params, **kw))
    monkeypatch.setattr(throughput, "generate_with_progress",
                        lambda engine, prompts, params, n: seen.append(params) or timed(engine, prompts, params, n))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    res = throughput.run_throughput(llm, num_prompts=4, input_len=8, output_len=6, structured_output_ratio=0.5,
                                    json_schema=schema)
    warm, timed = seen[-2], seen[-1]
    assert len(timed) == 4 and sum(p.structured_outputs is not None for p in timed) == 2
    # The warm-up compiles the schema's grammar before the timed run.
    assert sum(p.structured_outputs is not None for p in warm) == 2
    assert all(p.structured_outputs.json == schema for p in timed if p.structured_outputs is not None)
    assert res.requests_per_s > 0
    # The constrained steps' grammar work and bitmask application are reported.
    assert res.host_grammar_ms_median > 0 and res.host_bitmask_ms_median > 0
    with pytest.raises(ValueError, match="structured-output-ratio"):
        throughput.run_throughput(llm, num_prompts=2, input_len=8, output_len=2, structured_output_ratio=1.5)


def test_bench_throughput_flag_rejects_a_bad_ratio_while_parsing(capsys):
    from tandem.entrypoints.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "throughput", "--structured-output-ratio", "1.5"])
    assert "--structured-output-ratio: expected a number in [0, 1], got '1.5'" in capsys.readouterr().err


def test_bench_throughput_json_names_the_settings_that_tell_runs_apart(tmp_path):
    """``--output-json`` records dtype, quantization, KV cache dtype and deterministic mode
    beside the figures, so bf16 / FP8 / FP8-cache / deterministic result files can be told apart."""
    import json

    from tandem.benchmarks.throughput import main
    from tandem.entrypoints.cli import build_parser

    def run(*flags: str) -> dict:
        out = tmp_path / "res.json"
        main(build_parser().parse_args(["bench", "throughput", "--num-prompts", "2", "--input-len", "8",
                                        "--output-len", "2", "--max-model-len", "128", *flags,
                                        "--output-json", str(out)]))
        return json.loads(out.read_text())

    res = run("--quantization", "fp8", "--kv-cache-dtype", "fp8")
    assert (res["quantization"], res["kv_cache_dtype"], res["dtype"], res["deterministic"]) == ("fp8", "fp8", "auto",
                                                                                                 False)
    assert res["num_prompts"] == 2 and res["requests_per_s"] > 0
    assert res["spec_decode_acceptance_rate"] is None  # no speculation
    # FP8 weights are refused in deterministic mode; an FP8 KV cache is not.
    res = run("--kv-cache-dtype", "fp8", "--deterministic")
    assert (res["quantization"], res["kv_cache_dtype"], res["deterministic"]) == (None, "fp8", True)


def test_progress_moves_with_the_tokens_before_any_request_finishes(capsys):
    """``tandem bench throughput``'s bar counts generated tokens after every step (requests
    of one length all finish at the end), the finished requests after it."""
    from tandem.benchmarks.throughput import GenerationProgress

    progress = GenerationProgress(num_requests=4, output_len=10)
    progress.on_step(generated=4, finished=0)
    assert (progress.bar.n, progress.finished) == (4, 0)
    progress.on_step(generated=36, finished=0)
    progress.on_step(generated=40, finished=4)
    assert (progress.bar.n, progress.finished) == (40, 4)
    progress.close()
    err = capsys.readouterr().err
    assert "Generated tokens" in err and "40/40" in err and "4/4 requests finished" in err, err


class _FakeEngine:
    """Two requests of three tokens each, one token each per step (an ``LLMEngine``'s
    add_request / step / stats / has_unfinished_requests)."""

    def __init__(self) -> None:
        self.left: dict[str, int] = {}
        self.generated = 7  # tokens of earlier runs (the warm-up): not this run's

    def add_request(self, rid, prompt, params) -> None:
        from tandem.sampling_params import RequestOutputKind

        assert params.output_kind == RequestOutputKind.FINAL_ONLY
        self.left[rid] = params.max_tokens

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def stats(self) -> dict:
        return {"generation_tokens": self.generated}

    def step(self) -> list:
        from types import SimpleNamespace

        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            self.generated += 1
            if not self.left[rid]:
                del self.left[rid]
                outs.append(SimpleNamespace(request_id=rid, finished=True))
        return outs


def test_generate_with_progress_counts_every_step(monkeypatch):
    from tandem.benchmarks import throughput
    from tandem.sampling_params import SamplingParams

    seen = []
    on_step = throughput.GenerationProgress.on_step
    monkeypatch.setattr(throughput.GenerationProgress, "on_step",
                        lambda self, generated, finished: seen.append((generated, finished)) or on_step(self, generated,
                                                                                                     finished))
    outs = throughput.generate_with_progress(_FakeEngine(), [[1], [2]], SamplingParams(max_tokens=3), output_len=3)
    assert [o.request_id for o in outs] == ["bench-0", "bench-1"]
    assert seen == [(2, 0), (4, 0), (6, 2)]


def test_bench_throughput_reports_the_acceptance_the_engine_counted(tmp_path, monkeypatch, capsys):
    """With ``--speculative-config``, the acceptance printed and in the JSON is the change of
    the engine core's counters over the timed generate (the warm-up's drafts left out):
    acceptance rate (accepted / draft tokens, %), mean acceptance length (1 + accepted per
    verification), and the rate at each draft position."""
    import json

    from tandem.benchmarks import throughput
    from tandem.entrypoints.cli import build_parser

    seen = []
    timed = throughput.generate_with_progress

    def counted(engine, *args):
        seen.append(engine.core.debug_stats())
        outs = timed(engine, *args)
        seen.append(engine.core.debug_stats())
        return outs

    monkeypatch.setattr(throughput, "generate_with_progress", counted)
    # Drafts at every batch size: the run batches its prompts.
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "disable_by_batch_size": None}
    out = tmp_path / "res.json"
    throughput.main(build_parser().parse_args([
        "bench", "throughput", "--num-prompts", "2", "--input-len", "16", "--output-len", "32", "--max-model-len",
        "256", "--dtype", "float32", "--speculative-config", json.dumps(spec), "--output-json", str(out)]))
    before, after = seen
    drafts, draft_tokens, accepted = (after[k] - before[k] for k in (
        "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"))
    key = "spec_decode_num_accepted_tokens_per_pos"
    assert len(before[key]) == len(after[key]) == 3
    per_pos = [a - b for a, b in zip(after[key], before[key])]
    # Random prompts, greedy: the model repeats itself enough to draft, not always right.
    assert 0 < accepted < draft_tokens
    assert per_pos == sorted(per_pos, reverse=True) and sum(per_pos) == accepted
    res = json.loads(out.read_text())
    assert (res["spec_decode_num_drafts"], res["spec_decode_draft_tokens"], res["spec_decode_accepted_tokens"]) == \
        (drafts, draft_tokens, accepted)
    assert res["spec_decode_acceptance_rate"] == pytest.approx(100 * accepted / draft_tokens)
    assert res["spec_decode_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    assert res["spec_decode_per_position_acceptance_rates"] == pytest.approx([n / drafts for n in per_pos])
    assert (f"Speculative decoding: acceptance rate {res['spec_decode_acceptance_rate']:.2f}% ({accepted} of "
            f"{draft_tokens} draft tokens), mean acceptance length {res['spec_decode_acceptance_length']:.2f}"
            ) in capsys.readouterr().out


def test_bench_throughput_says_when_no_drafts_were_verified(capsys):
    """With a speculative config whose ``disable_by_batch_size`` the batch exceeds all along,
    the report says that no drafts were verified and why, instead of no line at all."""
    import json

    from tandem.benchmarks import throughput
    from tandem.entrypoints.cli import build_parser

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 1}
    throughput.main(build_parser().parse_args([
        "bench", "throughput", "--num-prompts", "2", "--input-len", "16", "--output-len", "8", "--max-model-len",
        "256", "--dtype", "float32", "--speculative-config", json.dumps(spec)]))
    out = capsys.readouterr().out
    assert "Speculative decoding: no drafts were verified in the timed run (drafts are proposed while at most " \
           "1 request is running: speculative_config.disable_by_batch_size)" in out, out
    assert "acceptance rate" not in out
