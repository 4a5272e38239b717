"""Parsing OpenAI-shaped request bodies into GenerationParams, with OpenAI-shaped errors."""

from __future__ import annotations

from apps.serving.services import GenerationParams, ServingError

ROLES = {"system", "user", "assistant", "developer"}


def _bad(message: str, param: str) -> ServingError:
    return ServingError(400, message, param=param)


def _number(body: dict, key: str, default, lo, hi, kind=float):
    value = body.get(key, default)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (kind is int and not float(value).is_integer())
    ):
        raise _bad(f"'{key}' must be {'an integer' if kind is int else 'a number'}", key)
    if not lo <= value <= hi:
        raise _bad(f"'{key}' must be between {lo} and {hi}, got {value}", key)
    return kind(value)


def _content(value, i: int) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: only text is supported
        texts = []
        for part in value:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise _bad("only text content parts are supported", f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    if value is None:
        return ""
    raise _bad("content must be a string or a list of text parts", f"messages[{i}].content")


def _common(body: dict) -> dict:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required", "model")
    if body.get("n", 1) not in (1, None):
        raise _bad("only n=1 is supported", "n")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if (
        not isinstance(stop, list)
        or len(stop) > 4
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise _bad("'stop' must be a string or a list of up to 4 non-empty strings", "stop")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad("'seed' must be an integer", "seed")
    cache_prompt = body.get("cache_prompt", True)
    if not isinstance(cache_prompt, bool):
        raise _bad("'cache_prompt' must be a boolean", "cache_prompt")
    return {
        "cache_prompt": cache_prompt,
        "model": model,
        "max_tokens": _number({"max_tokens": max_tokens}, "max_tokens", 0, 1, 1 << 20, int)
        if max_tokens is not None
        else 0,
        "temperature": _number(body, "temperature", 1.0, 0, 2),
        "top_p": _number(body, "top_p", 1.0, 0, 1),
        "top_k": _number(body, "top_k", 0, 0, 1000, int),
        "repeat_penalty": _number(body, "repeat_penalty", 1.0, 0, 10),
        "seed": seed,
        "stop": stop,
    }


def chat_params(body) -> tuple[GenerationParams, bool, bool]:
    """(params, stream, include_usage) of a /v1/chat/completions body."""
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object", "body")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    parsed = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(f"messages[{i}].role must be one of {sorted(ROLES)}", f"messages[{i}].role")
        role = "system" if m["role"] == "developer" else m["role"]
        parsed.append({"role": role, "content": _content(m.get("content"), i)})
    stream, include_usage = _stream_flags(body)
    return GenerationParams(messages=parsed, **_common(body)), stream, include_usage


def completion_params(body) -> tuple[GenerationParams, bool, bool]:
    """(params, stream, include_usage) of a /v1/completions body."""
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object", "body")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise _bad("'prompt' must be a non-empty string", "prompt")
    stream, include_usage = _stream_flags(body)
    return GenerationParams(prompt=prompt, **_common(body)), stream, include_usage


def embedding_params(body) -> tuple[str, list[str], str]:
    """(model, texts, encoding_format) of a /v1/embeddings body."""
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object", "body")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required", "model")
    texts = body.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if (
        not isinstance(texts, list)
        or not 1 <= len(texts) <= 2048
        or not all(isinstance(t, str) and t for t in texts)
    ):
        raise _bad("'input' must be a non-empty string or a list of 1 to 2048 of them", "input")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise _bad("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    if body.get("dimensions") is not None:
        raise _bad("'dimensions' is not supported: the model's own size is returned", "dimensions")
    return model, texts, encoding


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    return stream, bool(options.get("include_usage"))
