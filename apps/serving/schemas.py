"""The OpenAI-compatible request bodies, declared once: they validate every request (HTTP and
websocket) and feed the OpenAPI schema. Fields we do not implement yet are declared so that a
non-default value is refused by name, never silently ignored."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from apps.serving.services import GenerationParams, ServingError

#: A model's name: printable (it reaches the database and, once served, a metrics label).
Name = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]
Stop = Annotated[str, Field(min_length=1, max_length=1000)]
INT64 = 2**63


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class CalledFunction(_Strict):
    name: FunctionName
    arguments: Annotated[str, Field(max_length=1 << 20)] = Field(
        description="The arguments as a JSON object, in a string (as OpenAI sends them)."
    )


class ToolCall(_Strict):
    id: Annotated[str, Field(min_length=1, max_length=64)]
    type: Literal["function"]
    function: CalledFunction


class Message(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: Annotated[str, Field(max_length=256)] | None = None
    refusal: str | None = None  # what the SDK echoes back from an assistant message
    tool_calls: Annotated[list[ToolCall], Field(max_length=128)] | None = None
    tool_call_id: Annotated[str, Field(min_length=1, max_length=64)] | None = None

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def as_dict(self) -> dict:
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: Name
    max_tokens: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=1000)] | None = Field(None, description="llama.cpp's")
    repeat_penalty: Annotated[float, Field(ge=0, le=10)] | None = Field(
        None, description="llama.cpp's repetition penalty"
    )
    seed: Annotated[int, Field(ge=-INT64, lt=2**64)] | None = Field(
        None, description="Fixed seed for sampling; -1 (as in llama.cpp) means a random one."
    )
    stop: Stop | Annotated[list[Stop], Field(max_length=4)] | None = None
    n: Annotated[int, Field(ge=1, le=16)] | None = Field(
        None,
        description="Choices sampled from one evaluation of the prompt (its KV is copied), "
        "at most the replica's parallel slots.",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_prompt: bool = Field(
        True, description="llama.cpp's: reuse the cached prefix of an earlier prompt."
    )
    user: Annotated[str, Field(max_length=256)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = Field(
        None, description="Lowers every token already generated (of the last 64) by this much."
    )
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = Field(
        None,
        description="Lowers a token by this much for each time it was generated (of the last 64).",
    )
    logit_bias: Annotated[dict[str, Any], Field(max_length=0)] | None = None

    def params(self, **fields) -> GenerationParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return GenerationParams(
            model=self.model,
            max_tokens=self.max_tokens or 0,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            repeat_penalty=1.0 if self.repeat_penalty is None else self.repeat_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=None if self.seed in (None, -1) else self.seed % 2**64,
            stop=stop,
            cache_prompt=self.cache_prompt,
            n=self.n or 1,
            **fields,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ResponseFormatText(_Strict):
    type: Literal["text"]


class ResponseFormatJSONObject(_Strict):
    """Any JSON object."""

    type: Literal["json_object"]


class JSONSchemaSpec(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Annotated[str, Field(max_length=4096)] | None = None
    schema_: dict[str, Any] = Field(
        default_factory=dict, alias="schema", description="The JSON schema the answer matches."
    )
    strict: bool | None = None


class ResponseFormatJSONSchema(_Strict):
    """The answer matches the schema: decoded under a grammar made from it."""

    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


class FunctionDef(_Strict):
    name: FunctionName
    description: Annotated[str, Field(max_length=8192)] | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments.")
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


def call_schema(function: FunctionDef) -> dict:
    """The JSON a call of this function is: its name, then arguments matching its schema."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": function.name},
            "arguments": function.parameters or {"type": "object"},
        },
        "required": ["name", "arguments"],
    }


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[Message], Field(min_length=1, max_length=4096)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    response_format: (
        ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema | None
    ) = Field(
        None,
        discriminator="type",
        description="Structured outputs: decoded under a grammar (llama.cpp's), so the answer "
        "always parses, and matches the schema.",
    )
    tools: Annotated[list[Tool], Field(max_length=128)] | None = Field(
        None,
        description="Functions the model may call. The chat template renders them where it "
        "knows tools, else a system message describes them.",
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="required or a named function is enforced by a grammar: the answer is a "
        "valid call whose arguments match the function's schema. At most one call per turn.",
    )
    parallel_tool_calls: bool | None = Field(
        None, description="One call per turn is returned, whatever this says."
    )
    logprobs: bool | None = Field(
        None, description="Each token's log-probability under the model (its raw logits)."
    )
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = Field(
        None, description="With logprobs: also the likeliest tokens at each position."
    )

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        names = {t.function.name for t in self.tools or ()}
        if self.tool_choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and (
            self.tool_choice.function.name not in names
        ):
            raise ValueError(f"tool_choice names {self.tool_choice.function.name}, not a tool")
        if self.tools and self.response_format and self.response_format.type != "text":
            raise ValueError("give tools or a structured response_format, not both")
        return self

    @property
    def logprobs_k(self) -> int:
        """GenerationParams.logprobs: -1 for none, else how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else -1

    def generation(self) -> GenerationParams:
        params = self.params(messages=[m.as_dict() for m in self.messages])
        params.max_tokens = self.max_completion_tokens or params.max_tokens
        params.logprobs = self.logprobs_k
        fmt = self.response_format
        if isinstance(fmt, ResponseFormatJSONObject):
            params.json_schema = '{"type": "object"}'
        elif isinstance(fmt, ResponseFormatJSONSchema):
            params.json_schema = json.dumps(fmt.json_schema.schema_ or {"type": "object"})
        if self.tools:
            params.tools = json.dumps([t.model_dump(exclude_none=True) for t in self.tools])
            choice = self.tool_choice or "auto"
            functions = [t.function for t in self.tools]
            if isinstance(choice, NamedToolChoice):
                functions = [f for f in functions if f.name == choice.function.name]
                choice = "required"
            params.tool_choice = choice
            if choice == "required":
                schemas = [call_schema(f) for f in functions]
                params.json_schema = json.dumps(
                    schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
                )
        return params


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)]
    )
    echo: Literal[False] | None = None
    suffix: None = None
    best_of: Literal[1] | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = Field(
        None, description="Each token's log-probability, with this many likeliest alternatives."
    )

    def generation(self) -> GenerationParams:
        prompt = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        return self.params(prompt=prompt, logprobs=-1 if self.logprobs is None else self.logprobs)


class EmbeddingRequest(_Strict):
    """POST /v1/embeddings."""

    model: Name
    input: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=2048)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: None = Field(None, description="Not supported: the model's own size is returned.")
    user: Annotated[str, Field(max_length=256)] | None = None

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class GenerateMessage(ChatCompletionRequest):
    """A websocket `generate` frame: a chat (messages) or a completion (prompt)."""

    type: Literal["generate"]
    id: Annotated[str, Field(min_length=1, max_length=128)]
    messages: Annotated[list[Message], Field(min_length=1, max_length=4096)] | None = None
    prompt: Annotated[str, Field(min_length=1)] | None = None

    def generation(self) -> GenerationParams:
        if (self.messages is None) == (self.prompt is None):
            raise ServingError.invalid("give either 'messages' or 'prompt'", "messages")
        if self.tools:
            raise ServingError.invalid("tools are served on /v1/chat/completions", "tools")
        if (self.n or 1) > 1:
            raise ServingError.invalid("n > 1 is served on /v1 (one stream per socket id)", "n")
        if self.prompt is not None:
            return self.params(prompt=self.prompt, logprobs=self.logprobs_k)
        return super().generation()


class CancelMessage(_Strict):
    type: Literal["cancel"]
    id: Annotated[str, Field(min_length=1, max_length=128)]


# ---- errors ---------------------------------------------------------------------------------

_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def _param(loc: tuple) -> str:
    if loc[:1] == ("response_format",) and len(loc) > 2:
        loc = loc[:1] + loc[2:]  # pydantic names the tagged union's member (its "type") next
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or "-" in part or part.split("[")[0].lower() in _TYPE_NAMES:
            break  # pydantic names the union member it tried; the field is what matters
        else:
            out += f".{part}" if out else part
    return out or "body"


def bad_request(exc: ValidationError) -> ServingError:
    """The first problem of a validation error, in OpenAI's 400 shape with `param` set."""
    err = exc.errors(include_url=False, include_input=False)[0]
    param = _param(err["loc"])
    if err["type"] == "extra_forbidden":
        return ServingError.invalid(f"Unrecognized request argument supplied: {param}", param)
    if err["type"] == "missing":
        return ServingError.invalid(f"'{param}' is required", param)
    message = err["msg"]
    names = [part.split("[")[0] for part in param.split(".")]
    unsupported = next((_UNSUPPORTED[n] for n in names if n in _UNSUPPORTED), None)
    if unsupported and err["type"] in ("literal_error", "too_long", "none_required"):
        message = f"{unsupported} ({message})"
    elif names[-1] == "content":
        message = f"content must be a string or a list of text parts ({message})"
    return ServingError.invalid(f"'{param}': {message}", param)


_UNSUPPORTED = {
    "response_format": "response_format is text, json_object or json_schema",
    "logit_bias": "logit_bias is not implemented",
    "echo": "echo is not implemented",
    "best_of": "only best_of=1 is supported",
    "suffix": "suffix is not implemented",
    "dimensions": "dimensions is not supported: the model's own size is returned",
}


def parse(model: type[BaseModel], body):
    """Validate a parsed JSON body against a request model; ServingError 400 otherwise."""
    if not isinstance(body, dict):
        raise ServingError.invalid("the body must be a JSON object", "body")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise bad_request(exc) from None


# ---- responses (for the OpenAPI schema; the views build the same shapes) ----------------------


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: dict[str, str]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    system_fingerprint: str


class TextChoice(BaseModel):
    index: int
    text: str
    finish_reason: str
    logprobs: CompletionLogprobs | None


class TextCompletion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: CompletionUsage
    system_fingerprint: str


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of float32s")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]
