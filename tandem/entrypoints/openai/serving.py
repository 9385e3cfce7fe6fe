"""The OpenAI server's serving object (:class:`OpenAIServing`): completions, chat
completions and tokenization on top of one ``AsyncLLM``, sharing its front-end tokenizer
thread. Non-streaming requests ask the engine for one final output (``FINAL_ONLY``);
streaming ones for deltas (``DELTA``), each turned into one SSE chunk per choice
(:mod:`tandem.entrypoints.openai.streaming`).
"""

from __future__ import annotations

from tandem.entrypoints.openai import protocol as P
from tandem.entrypoints.openai.errors import OpenAIError, bad_request, error_body, model_not_found
from tandem.entrypoints.openai.serving_chat import OpenAIServingChat
from tandem.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tandem.entrypoints.openai.streaming import SSEStream

# What the HTTP layer takes from here besides the serving object.
__all__ = ["OpenAIError", "OpenAIServing", "SSEStream", "bad_request", "error_body", "model_not_found"]


class OpenAIServing(OpenAIServingCompletion, OpenAIServingChat):
    """Completions (:class:`OpenAIServingCompletion`), chat completions
    (:class:`OpenAIServingChat`, whose arguments it takes), tokenize/detokenize."""

    def _tokenize(self, req: P.TokenizeRequest) -> P.TokenizeResponse:
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages.", "prompt")
        if req.prompt is not None:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=add_special)
        else:
            conv = self._conversation(req.messages)
            text = self._apply_chat_template(conv, req.add_generation_prompt, req.continue_final_message, None)
            ids = self.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return P.TokenizeResponse(count=len(ids), max_model_len=self.llm.max_model_len, tokens=ids, token_strs=strs)

    async def tokenize(self, req: P.TokenizeRequest) -> P.TokenizeResponse:
        self.check_model(req.model)
        return await self._in_tokenizer(self._tokenize, req)

    async def detokenize(self, req: P.DetokenizeRequest) -> P.DetokenizeResponse:
        self.check_model(req.model)
        self._check_token_ids(req.tokens, "tokens")
        return P.DetokenizeResponse(prompt=await self._in_tokenizer(self.tokenizer.decode, req.tokens))

    def tokenizer_info(self) -> dict:
        tok = self.tokenizer
        return {
            "tokenizer_class": type(tok).__name__,
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.pad_token,
            "unk_token": tok.unk_token,
            "chat_template": tok.chat_template if isinstance(tok.chat_template, str) else None,
            "model_max_length": self.llm.max_model_len,
            "vocab_size": self.llm.vocab_size,
        }
