"""OpenAI API requests, responses and stream chunks, with vLLM's extensions.

Requests and whole responses are pydantic v2 models: requests are validated field by
field. Streamed chunks, and the logprobs and usage they share with whole responses, are
msgspec structs, declared once here: a chunk goes out per token per choice and is only
ever encoded (by :mod:`tandem.entrypoints.openai.streaming`'s encoder), which msgspec does
without building a pydantic model per token. A whole response holds those structs as they
are (``_Wire``).

Field names, defaults and shapes follow the OpenAI API reference for ``/v1/completions``
and ``/v1/chat/completions``; the extra sampling fields (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``allowed_token_ids``, ``bad_words``, ``return_tokens_as_token_ids``, ``prompt_logprobs``,
chat ``echo``, ...) are vLLM's; ``regex``, ``ebnf``, ``stop_regex`` and the choices'
``matched_stop`` are SGLang's. A request field that is not declared here is rejected (400
naming it, as OpenAI does), never silently dropped. Range checks that depend on the model (context
length, vocabulary) happen in the engine; the others here or in ``SamplingParams``.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from pydantic import BaseModel, ConfigDict, Field, InstanceOf, PlainSerializer, StrictBool

MAX_LOGPROBS = 20  # most top logprobs per token (vLLM's default max_logprobs)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class OpenAIRequestModel(OpenAIBaseModel):
    """A request body (or part of one): fields it does not declare are rejected."""

    model_config = ConfigDict(extra="forbid")


_S = TypeVar("_S", bound=msgspec.Struct)
# A response field holding a struct of this module as it is, written as the struct
# encodes: what a whole response and a stream chunk both hold is declared once.
_Wire = Annotated[InstanceOf[_S], PlainSerializer(msgspec.to_builtins)]


# ------------------------------------------------------------------- errors
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ------------------------------------------------------------------- common
class StreamOptions(OpenAIRequestModel):
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class UsageInfo(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class JsonSchemaResponseFormat(OpenAIBaseModel):
    name: str | None = None
    description: str | None = None
    # "schema" would shadow a pydantic BaseModel attribute.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaResponseFormat | None = None
    # structural_tag: xgrammar's structural tag, given whole (vLLM passes it through).
    model_config = ConfigDict(extra="allow")


class _SamplingFields(OpenAIRequestModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int | None = Field(default=1, ge=1, le=128)
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(default=0, ge=0, le=INT64_MAX)
    ignore_eos: StrictBool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    request_id: str | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Tokens in logprobs spelled ``token_id:N`` (for tokens that are not valid UTF-8 alone).
    return_tokens_as_token_ids: StrictBool | None = None
    # Not with ``stream``.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Structured outputs: OpenAI's response_format and vLLM's extensions (at most one).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # SGLang extensions: structured outputs (regex: xgrammar's dialect; ebnf: xgrammar's
    # EBNF, as vLLM's ``grammar``), and regexes (Python's dialect) that stop as ``stop``.
    regex: str | None = None
    ebnf: str | None = None
    stop_regex: str | list[str] | None = None
    # vLLM extensions: beam search with ``n`` beams (tandem.beam_search).
    use_beam_search: StrictBool = False
    length_penalty: float = 1.0
    early_stopping: StrictBool = False


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token
    ids, or a list of token-id lists (one choice group per prompt)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    # OpenAI's and vLLM's default; an explicit null generates up to the context's end.
    max_tokens: int | None = Field(default=16, le=INT64_MAX)
    echo: StrictBool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    # vLLM extensions
    add_special_tokens: StrictBool = True


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``; the prompt is the model's chat template applied to
    ``messages``. Without ``max_tokens`` / ``max_completion_tokens`` the output may run
    to the end of the context (vLLM's default)."""

    # Checked by tandem.entrypoints.chat_utils, the offline API's rule too, so that an error
    # names the message field (``messages[0].content``) rather than only ``messages``.
    messages: list[Any]
    max_tokens: int | None = Field(default=None, le=INT64_MAX)
    max_completion_tokens: int | None = Field(default=None, le=INT64_MAX)
    logprobs: StrictBool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    # vLLM extensions
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # The last message's content before each choice's content, when that message is the
    # assistant's (one being continued).
    echo: StrictBool = False


# -------------------------------------------------------------- completions
class CompletionLogProbs(msgspec.Struct):
    text_offset: list[int] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    tokens: list[str] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: _Wire[CompletionLogProbs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # SGLang extension: what ended a "stop" choice (``serving_engine.matched_stop``).
    matched_stop: int | str | None = None
    # vLLM extension (with ``prompt_logprobs`` in the request): per prompt position,
    # token id -> logprob; the first position is None.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: _Wire[UsageInfo] | None = None


class CompletionResponseStreamChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # SGLang extension: what ended a "stop" choice (``serving_engine.matched_stop``).
    matched_stop: int | str | None = None


class CompletionStreamResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# --------------------------------------------------------------------- chat
class ChatCompletionLogProb(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = msgspec.field(default_factory=list)


class ChatCompletionLogProbs(msgspec.Struct):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: _Wire[ChatCompletionLogProbs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # SGLang extension: what ended a "stop" choice (``serving_engine.matched_stop``).
    matched_stop: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: _Wire[UsageInfo]
    # vLLM extension (with ``prompt_logprobs`` in the request), as in completions choices.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    """The name goes in a call's first delta only; the arguments may come in pieces."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """A call's id and type go in its first delta only, as OpenAI sends them."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    """A chat stream delta; unset (None) fields are left out, as OpenAI sends it."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # SGLang extension: what ended a "stop" choice (``serving_engine.matched_stop``).
    matched_stop: int | str | None = None


class ChatCompletionStreamResponse(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ------------------------------------------------------------------- models
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tandem"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ----------------------------------------------------------------- tokenize
class TokenizeRequest(OpenAIRequestModel):
    """``POST /tokenize``: either ``prompt`` or ``messages`` (chat template applied)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None  # checked as the chat endpoint's
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    return_token_strs: StrictBool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIRequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
