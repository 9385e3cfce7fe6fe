"""The front end's Python path per output token, in process and without HTTP: AsyncLLM._on_outputs
(output processor, detokenizer, request streams) + OpenAIServing's streaming generators, fed
synthetic core outputs (token ids of README text) for B streams x T steps; prints the CPU time
per token and a digest of every SSE byte (created times zeroed), to check two trees write the same.

Usage: python benchmarks/frontend_inproc.py B T cmpl|chat (another tree: PYTHONPATH=<tree>;
the digest then compares the two trees' bytes).
"""
import asyncio, itertools, os, sys, time, types
from tandem.config import embedded_default_model
from tandem.model_loader.loader import load_tokenizer
from tandem.engine.async_llm import AsyncLLM
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from tandem.entrypoints.openai import protocol as P
from tandem.entrypoints.openai.serving import OpenAIServing

B, T, CHAT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "chat"
tok = load_tokenizer(embedded_default_model())
ids = tok.encode(open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read())

def make_llm() -> AsyncLLM:
    """An ``AsyncLLM`` without engine cores: its client and input processor are stand-ins
    (outputs are fed to ``_on_outputs`` by hand), so only the front end's own work is timed."""
    llm = AsyncLLM.__new__(AsyncLLM)
    llm.tokenizer, llm.output_processor = tok, OutputProcessor(tok)
    llm.stat_listeners, llm._streams, llm._counter, llm._id_tag = [], {}, itertools.count(), ""
    llm._tokens_reported = {"prompt_tokens": 0, "generation_tokens": 0}
    llm.num_requests, llm._stopped, llm._scheduler_stats = 0, False, {}
    llm.vocab_size, llm.max_model_len = 49152, 4096
    llm._stats_task, llm.log_stats_interval_s = None, None  # no periodic stats line
    llm.client = types.SimpleNamespace(is_alive=True, dead_error=None, start=lambda *a: None,
                                       add_requests=lambda r: None, abort_requests=lambda r: None)
    llm.processor = types.SimpleNamespace(process_inputs=lambda rid, p, sp, arr: (
        None, [EngineCoreRequest(rid, p, sp, sp.max_tokens, arr)]))
    return llm

async def main():
    llm = make_llm()
    serving = OpenAIServing(llm, ["m"])
    streams, nbytes = [], [0]
    for r in range(B):
        if CHAT:
            req = P.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": f"Hi {r}"}], max_tokens=T,
                                          stream=True, stream_options={"include_usage": True}, ignore_eos=True)
            streams.append(await serving.create_chat_completion(req, f"r{r}"))
        else:
            req = P.CompletionRequest(model="m", prompt=ids[r:r + 32], max_tokens=T, stream=True,
                                      stream_options={"include_usage": True}, ignore_eos=True)
            streams.append(await serving.create_completion(req, f"r{r}"))

    bodies = [[] for _ in streams]
    async def consume(s, body):
        async for chunk in s:
            nbytes[0] += len(chunk)
            body.append(chunk)
    tasks = [asyncio.create_task(consume(s, b)) for s, b in zip(streams, bodies)]
    for _ in range(3):
        await asyncio.sleep(0)
    core_ids = list(llm._streams)
    t0 = time.process_time()
    for t in range(T):
        outs = [EngineCoreOutput(cid, [ids[(k * 7 + t) % len(ids)]], finish_reason="length" if t == T - 1 else None)
                for k, cid in enumerate(core_ids)]
        llm._on_outputs(EngineCoreOutputs(outputs=outs))
        for _ in range(4):
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    dt = time.process_time() - t0
    import hashlib, re
    digest = hashlib.sha256("".join(sorted(re.sub(r'"created":\d+', '"created":0', "".join(b)) for b in bodies)).encode()).hexdigest()[:16]
    print(f"RESULT {'chat' if CHAT else 'cmpl'} {1e6 * dt / (B * T):.2f} us/token bytes={nbytes[0]} sha={digest}")
    serving.shutdown()

asyncio.run(main())
