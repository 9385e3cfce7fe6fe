"""Offline throughput benchmark (``tandem bench throughput``), as vLLM's benchmark_throughput."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from tandem.benchmarks.datasets import constrained_indices, load_json_schema
from tandem.benchmarks.serve import spec_decode_result
from tandem.entrypoints.llm import spec_decode_counts
from tandem.outputs import RequestOutput
from tandem.sampling_params import RequestOutputKind, SamplingParams
from tandem.step_timing import StepSpan
from tandem.structured_output.params import StructuredOutputsParams
from tandem.triton_utils import record_jit_compiles


@dataclass
class ThroughputResult:
    num_prompts: int
    input_len: int
    output_len: int
    elapsed_s: float
    requests_per_s: float
    input_tokens_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    num_preemptions: int | None  # None: not reported by a DP/TP front-end
    # In-process runners on CUDA or on the CPU step thread: fraction of the timed wall time
    # the device had no step queued (gaps between one step's last kernel and the next step's
    # first; on the CPU between the step thread's work on two steps), and decode-step statistics.
    gpu_idle_fraction: float | None = None
    gpu_idle_fraction_decode: float | None = None
    decode_step_ms_at_max_batch: float | None = None
    max_decode_batch: int | None = None
    max_batch_context_tokens: int | None = None
    # The same runners: device time (s, first kernel to last of each step; on the CPU the
    # step thread's) and count of decode-only steps and of steps with prefill tokens.
    decode_steps_s: float | None = None
    num_decode_steps: int | None = None
    verify_steps_s: float | None = None  # steps verifying speculative drafts (no prompt tokens)
    num_verify_steps: int | None = None
    prefill_steps_s: float | None = None
    num_prefill_steps: int | None = None
    # In-process engine cores: host time of the core loop per step (schedule + prepare
    # inputs + update_from_output, ms; tandem.step_timing), median and p99 over the timed steps, and
    # each phase's median.
    host_step_ms_median: float | None = None
    host_step_ms_p99: float | None = None
    host_schedule_ms_median: float | None = None
    host_prepare_ms_median: float | None = None
    host_process_ms_median: float | None = None
    # Steps with constrained sequences (tandem.step_timing.GRAMMAR_PHASES), median ms over
    # the steps that recorded them: xgrammar's accept + bitmask fill on the core thread, and
    # the runner's bitmask copy + application; not in host_step_ms.
    host_grammar_ms_median: float | None = None
    host_bitmask_ms_median: float | None = None
    # In-process engine cores: Triton kernel variants first launched inside the timed run
    # (tandem.triton_utils.record_jit_compiles), i.e. compiles the warm-up did not cover.
    jit_compiles_timed: list[str] | None = None
    # Speculative decoding (an in-process engine core that verified drafts in the timed run),
    # vLLM's bench keys: accepted / draft tokens (%), tokens per verification (1 + accepted
    # drafts), verifications, draft and accepted tokens, acceptance by draft position (0..1).
    spec_decode_acceptance_rate: float | None = None
    spec_decode_acceptance_length: float | None = None
    spec_decode_num_drafts: int | None = None
    spec_decode_draft_tokens: int | None = None
    spec_decode_accepted_tokens: int | None = None
    spec_decode_per_position_acceptance_rates: list[float] | None = None
    # Pipeline parallelism: per stage, the fraction of the timed wall time it was not busy
    # with a step (its host time per step, tandem.worker.pipeline_stage; replica 0).
    pp_stage_idle_fractions: list[float] | None = None


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token-id prompts, avoiding the first 1000 ids (special tokens in most vocabularies)."""
    g = torch.Generator().manual_seed(seed)
    low = min(1000, vocab_size // 2)
    return torch.randint(low, vocab_size, (num_prompts, input_len), generator=g).tolist()


def run_throughput(llm, num_prompts: int, input_len: int, output_len: int, ignore_eos: bool = True,
                   seed: int = 0, structured_output_ratio: float = 0.0,
                   json_schema: dict | None = None) -> ThroughputResult:
    """Generate ``num_prompts`` random prompts of ``input_len`` tokens, greedy, ``output_len`` new
    tokens each; a ``structured_output_ratio`` share of them (chosen at random) constrained to
    ``json_schema`` (default: the serving benchmark's user profile schema), so that what
    constrained decoding costs per engine step shows in the host time and GPU idle figures
    (the warm-up constrains the same share, so the schema's grammar compiles before timing).

    Raises:
        ValueError: ``structured_output_ratio`` outside [0, 1].
    """
    prompts = random_prompts(num_prompts, input_len, llm.engine.vocab_size, seed)
    free = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=ignore_eos)
    params = _constrained_params(free, num_prompts, structured_output_ratio, json_schema, seed)
    # Warm-up outside the timed region: one batch of other random prompts (no prefix-cache
    # hits later) through chunked prefill, mixed and decode steps, so that first-call
    # allocations and kernels compiled on first use (Triton specialises on tile configs
    # that follow the token count, and on each size's divisibility) are not timed.
    max_num_seqs = llm.engine.resolved.max_num_seqs
    warm = random_prompts(min(num_prompts, max_num_seqs), input_len, llm.engine.vocab_size, seed + 1)
    warm_params = _constrained_params(SamplingParams(max_tokens=4, ignore_eos=True), len(warm),
                                      structured_output_ratio, json_schema, seed)
    llm.generate(warm, warm_params, use_tqdm=False)
    pre = _preemptions(llm)
    # Step timing needs the in-process runner; the DP/TP front-ends run the steps in other processes.
    runner = getattr(llm.engine, "runner", None)
    # The device's busy and idle time per step: CUDA events, or the CPU step thread's clock.
    if runner is not None and (runner.device.type == "cuda" or runner.runs_on_step_thread):
        runner.step_events = []
    # Host time per step: recorded by an in-process engine core only.
    host_timing = hasattr(llm.engine, "start_host_timing") and llm.engine.start_host_timing() is not None
    spec_before = spec_decode_counts(llm)
    busy_before = _stage_busy_s(llm)
    with record_jit_compiles() as compiled:
        start = time.perf_counter()
        outs = generate_with_progress(llm.engine, prompts, params, output_len)
        elapsed = time.perf_counter() - start
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    n_in = num_prompts * input_len
    res = ThroughputResult(num_prompts, input_len, output_len, elapsed, num_prompts / elapsed, n_in / elapsed,
                           n_out / elapsed, (n_in + n_out) / elapsed,
                           None if pre is None else _preemptions(llm) - pre)
    if runner is not None:
        res.jit_compiles_timed = list(compiled)
    if spec_before is not None:
        for key, value in (spec_decode_result(spec_decode_counts(llm) - spec_before) or {}).items():
            setattr(res, key, value)
    if busy_before is not None:
        busy = [b - a for a, b in zip(busy_before, _stage_busy_s(llm))]
        res.pp_stage_idle_fractions = [max(0.0, 1 - b / elapsed) for b in busy]
    if host_timing:
        _host_step_stats(llm.engine.stop_host_timing(), res)
    if runner is not None and runner.step_events:
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        _gpu_step_stats(runner.step_events, res)
        runner.step_events = None
    return res


class GenerationProgress:
    """The bar of a throughput run: tokens generated out of ``num_requests * output_len``,
    the finished requests after it. Requests of one length all finish at the end of the run,
    so a bar of finished requests sits at 0 until then; tokens move from the first step.

    Args:
        num_requests: requests in the run.
        output_len: most tokens a request generates.
    """

    def __init__(self, num_requests: int, output_len: int) -> None:
        self.num_requests = num_requests
        self.finished = 0
        self.bar = tqdm(total=num_requests * output_len, desc="Generated tokens", unit=" tokens", dynamic_ncols=True)
        self._show_finished()

    def _show_finished(self) -> None:
        self.bar.set_postfix_str(f"{self.finished}/{self.num_requests} requests finished", refresh=False)

    def on_step(self, generated: int, finished: int) -> None:
        """After an engine step: ``generated`` tokens so far in the run, ``finished``
        requests finished by this step."""
        if finished:
            self.finished += finished
            self._show_finished()
        self.bar.update(generated - self.bar.n)

    def close(self) -> None:
        """Leave the bar as it ended."""
        self.bar.close()


def generate_with_progress(engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                           output_len: int) -> list[RequestOutput]:
    """``LLM.generate`` of the prompts on ``engine`` (an ``LLMEngine``), with a
    :class:`GenerationProgress` bar moved after every step from the engine's generated-token
    counter. Returns the final outputs in prompt order."""
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"bench-{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, per_prompt):
        engine.add_request(rid, prompt, p.clone(output_kind=RequestOutputKind.FINAL_ONLY))
    base = engine.stats()["generation_tokens"]
    progress = GenerationProgress(len(ids), output_len)
    final: dict[str, RequestOutput] = {}
    try:
        while engine.has_unfinished_requests():
            done = [o for o in engine.step() if o.finished]
            for o in done:
                final[o.request_id] = o
            progress.on_step(engine.stats()["generation_tokens"] - base, len(done))
    finally:
        progress.close()
    return [final[i] for i in ids]


def _constrained_params(free: SamplingParams, num_prompts: int, ratio: float, schema: dict | None,
                        seed: int) -> SamplingParams | list[SamplingParams]:
    chosen = set(constrained_indices(num_prompts, ratio, seed))
    if not chosen:
        return free
    constrained = dataclasses.replace(free, structured_outputs=StructuredOutputsParams(
        json=schema if schema is not None else load_json_schema()))
    return [constrained if i in chosen else free for i in range(num_prompts)]


def _host_step_stats(times, res: ThroughputResult) -> None:
    summary = times.summary() if times is not None else None
    if summary is None:
        return
    res.host_step_ms_median, res.host_step_ms_p99 = summary["median_ms"], summary["p99_ms"]
    res.host_schedule_ms_median = summary["schedule_median_ms"]
    res.host_prepare_ms_median = summary["prepare_median_ms"]
    res.host_process_ms_median = summary["process_median_ms"]
    res.host_grammar_ms_median = summary.get("grammar_median_ms")
    res.host_bitmask_ms_median = summary.get("bitmask_median_ms")


def _gpu_step_stats(spans: list[StepSpan], res: ThroughputResult) -> None:
    """Idle gaps between consecutive steps and decode-step durations, from the steps' spans."""
    gaps = [max(0.0, spans[i - 1].end.elapsed_time(spans[i].start)) for i in range(1, len(spans))]
    res.gpu_idle_fraction = sum(gaps) / spans[0].start.elapsed_time(spans[-1].end)
    decode_gaps = [g for g, e in zip(gaps, spans[1:]) if e.decode_only]
    decode_time = sum(e.elapsed_ms() for e in spans[1:] if e.decode_only) + sum(decode_gaps)
    res.gpu_idle_fraction_decode = sum(decode_gaps) / decode_time if decode_time else None
    decodes = [e for e in spans if e.decode_only]
    verifies = [e for e in spans if e.verifies_drafts]
    prefills = [e for e in spans if not (e.decode_only or e.verifies_drafts)]
    res.num_decode_steps, res.num_verify_steps, res.num_prefill_steps = len(decodes), len(verifies), len(prefills)
    res.decode_steps_s = sum(e.elapsed_ms() for e in decodes) * 1e-3
    res.verify_steps_s = sum(e.elapsed_ms() for e in verifies) * 1e-3
    res.prefill_steps_s = sum(e.elapsed_ms() for e in prefills) * 1e-3
    if decodes:
        res.max_decode_batch = max(e.num_reqs for e in decodes)
        at_max = [e for e in decodes if e.num_reqs == res.max_decode_batch]
        res.decode_step_ms_at_max_batch = sorted(e.elapsed_ms() for e in at_max)[len(at_max) // 2]
        res.max_batch_context_tokens = at_max[len(at_max) // 2].context_tokens


def main(args: argparse.Namespace) -> None:
    from tandem.engine.arg_utils import EngineArgs
    from tandem.entrypoints.llm import LLM

    llm = LLM(**asdict(EngineArgs.from_cli_args(args)))
    schema = load_json_schema(args.json_schema_path) if args.json_schema_path else None
    res = run_throughput(llm, args.num_prompts, args.input_len, args.output_len, args.ignore_eos, args.seed,
                         args.structured_output_ratio, schema)
    print(f"Throughput: {res.requests_per_s:.2f} requests/s, {res.total_tokens_per_s:.1f} total tokens/s, "
          f"{res.input_tokens_per_s:.1f} input tokens/s, {res.output_tokens_per_s:.1f} output tokens/s "
          f"({res.num_prompts} prompts, {res.elapsed_s:.2f} s"
          + ("" if res.num_preemptions is None else f", {res.num_preemptions} preemptions") + ")")
    if res.host_step_ms_median is not None:
        print(f"Host time per step (schedule + prepare inputs + update_from_output): "
              f"median {res.host_step_ms_median:.3f} ms, "
              f"p99 {res.host_step_ms_p99:.3f} ms (medians: schedule {res.host_schedule_ms_median:.3f}, prepare "
              f"{res.host_prepare_ms_median:.3f}, process {res.host_process_ms_median:.3f} ms)")
    if res.host_grammar_ms_median is not None and res.host_bitmask_ms_median is not None:
        print(f"Constrained steps, medians: grammar (accept + bitmask fill, core thread) "
              f"{res.host_grammar_ms_median:.3f} ms, bitmask (copy + apply, runner) {res.host_bitmask_ms_median:.3f} ms")
    if res.spec_decode_acceptance_rate is not None:
        print(_spec_decode_line(res))
    elif (spec := llm.engine.config.speculative_config) is not None:
        limit = spec.disable_by_batch_size
        print("Speculative decoding: no drafts were verified in the timed run"
              + ("" if limit is None else f" (drafts are proposed while at most {limit} request"
                                          f"{'s are' if limit > 1 else ' is'} running: "
                                          f"speculative_config.disable_by_batch_size)"))
    if res.jit_compiles_timed:
        names = sorted({r.split("(", 1)[0] for r in res.jit_compiles_timed})
        print(f"Triton kernel variants built inside the timed run (the warm-up missed them): "
              f"{len(res.jit_compiles_timed)} ({', '.join(names)})")
    if res.pp_stage_idle_fractions is not None:
        print("Pipeline stages idle (host time not in a step, replica 0): "
              + ", ".join(f"stage {i} {100 * f:.1f}%" for i, f in enumerate(res.pp_stage_idle_fractions)))
    if res.gpu_idle_fraction is not None:
        # Without decode-only steps (e.g. --output-len 1) the decode statistics are None.
        device = "GPU" if llm.engine.resolved.device.startswith("cuda") else "Step thread"
        line = f"{device} idle between steps: {100 * res.gpu_idle_fraction:.2f}% of wall time"
        if res.gpu_idle_fraction_decode is not None:
            line += f" ({100 * res.gpu_idle_fraction_decode:.2f}% around decode steps)"
        if res.max_decode_batch is not None:
            line += f"; median decode step at batch {res.max_decode_batch}: {res.decode_step_ms_at_max_batch:.2f} ms"
        print(line)
        verify = (f"{res.verify_steps_s:.2f} s in {res.num_verify_steps} steps verifying drafts, "
                  if res.num_verify_steps else "")
        print(f"{device} time in steps: {res.decode_steps_s:.2f} s in {res.num_decode_steps} decode-only steps, "
              f"{verify}{res.prefill_steps_s:.2f} s in {res.num_prefill_steps} steps with prefill tokens")
    if args.output_json:
        with open(args.output_json, "w") as f:
            cfg = llm.engine.config
            # The settings that tell runs apart (quantization None: the checkpoint's own).
            json.dump(asdict(res) | {"async_output_proc": cfg.scheduler_config.async_output_proc,
                                     "model": cfg.model_config.model, "dtype": cfg.model_config.dtype,
                                     "quantization": cfg.model_config.quantization,
                                     "deterministic": cfg.model_config.deterministic,
                                     "kv_cache_dtype": cfg.cache_config.kv_cache_dtype}, f, indent=2)
    llm.engine.shutdown()


def _spec_decode_line(res: ThroughputResult) -> str:
    """The report's speculative-decoding line."""
    per_pos = ", ".join(f"{100 * r:.1f}%" for r in res.spec_decode_per_position_acceptance_rates)
    return (f"Speculative decoding: acceptance rate {res.spec_decode_acceptance_rate:.2f}% "
            f"({res.spec_decode_accepted_tokens} of {res.spec_decode_draft_tokens} draft tokens), "
            f"mean acceptance length {res.spec_decode_acceptance_length:.2f} tokens "
            f"({res.spec_decode_num_drafts} verifications); by draft position: {per_pos}")


def _stage_busy_s(llm) -> list[float] | None:
    """Replica 0's busy seconds so far per pipeline stage; None without pipeline parallelism."""
    if llm.engine.config.parallel_config.pipeline_parallel_size == 1:
        return None
    return llm.engine.client.debug_stats()[0]["pp_stage_busy_s"]


def _preemptions(llm) -> int | None:
    """Preemptions so far of an in-process engine; None for the DP/TP front-ends, whose
    schedulers live in the rank processes."""
    sched = getattr(llm.engine, "scheduler", None)
    return None if sched is None else sched.num_preemptions
