"""OpenAI-compatible HTTP endpoints (async views: a stream must not hold a thread)."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from apps.accounts.services import authenticate_key, bearer_from_header
from apps.serving import openai
from apps.serving.services import (
    Finished,
    Generation,
    GenerationParams,
    Piece,
    ServingError,
    embed,
    generate,
    now,
    served_models,
)
from apps.usage.services import Caller


def error_response(err: ServingError) -> JsonResponse:
    response = JsonResponse(err.body(), status=err.status)
    if err.retry_after is not None:
        response["Retry-After"] = str(err.retry_after)
    return response


async def _authenticate(request: HttpRequest) -> Caller:
    """Who is calling: an API key (Bearer) or the console's session; else 401."""
    raw = bearer_from_header(request.headers.get("Authorization", ""))
    key = await sync_to_async(authenticate_key)(raw) if raw else None
    if key is not None:
        return Caller.from_key(key)
    if not raw:
        user = await request.auser()  # the console's session
        if user.is_authenticated:
            return Caller(user_id=user.pk, staff=user.is_staff)
    raise ServingError(
        401,
        "Incorrect API key provided." if raw else "You didn't provide an API key.",
        code="invalid_api_key",
    )


def _parse_json(request: HttpRequest):
    try:
        return json.loads(request.body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ServingError(400, f"the body is not valid JSON: {exc}", param="body") from None


def _sse(data) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n\n"


async def _serve(request, parse: Callable, shape: str) -> HttpResponse:
    try:
        caller = await _authenticate(request)
        params, stream, include_usage = parse(_parse_json(request))
        events = generate(params, caller, "chat" if shape == "chat" else "completion")
        gen = await anext(events)  # routed: errors so far still get a status code
    except ServingError as err:
        return error_response(err)
    if stream:
        response = StreamingHttpResponse(
            _stream(events, gen, params, shape, include_usage), content_type="text/event-stream"
        )
        response["Cache-Control"] = "no-cache"
        response["X-Accel-Buffering"] = "no"
    else:
        async with aclosing(events):
            response = await _collect(events, gen, params, shape)
    response["X-LlamaFleet-Node"] = gen.target.node_name
    response["X-LlamaFleet-Replica"] = gen.target.replica_id
    return response


def _usage(f: Finished) -> dict:
    return {
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": f.cached_tokens},
    }


def _ids(gen: Generation, shape: str) -> tuple[str, str]:
    if shape == "chat":
        return f"chatcmpl-{gen.id}", "chat.completion"
    return f"cmpl-{gen.id}", "text_completion"


async def _collect(
    events: AsyncIterator, gen: Generation, params: GenerationParams, shape: str
) -> HttpResponse:
    parts: list[str] = []
    try:
        async for ev in events:
            if isinstance(ev, Piece):
                parts.append(ev.text)
            else:
                finished = ev
    except ServingError as err:
        return error_response(err)
    text = "".join(parts)
    ident, obj = _ids(gen, shape)
    reason = "stop" if finished.finish_reason == "cancelled" else finished.finish_reason
    choice = (
        {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": reason,
            "logprobs": None,
        }
        if shape == "chat"
        else {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
    )
    body = {
        "id": ident,
        "object": obj,
        "created": now(),
        "model": params.model,
        "choices": [choice],
        "usage": _usage(finished),
        "system_fingerprint": f"llamafleet-{gen.target.deployment}",
    }
    return JsonResponse(body)


async def _stream(
    events: AsyncIterator,
    gen: Generation,
    params: GenerationParams,
    shape: str,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    ident, obj = _ids(gen, shape)
    obj += ".chunk" if shape == "chat" else ""
    created = now()
    base = {
        "id": ident,
        "object": obj,
        "created": created,
        "model": params.model,
        "system_fingerprint": f"llamafleet-{gen.target.deployment}",
    }

    def chunk(text: str | None, reason: str | None, first: bool = False) -> dict:
        if shape == "chat":
            delta = (
                {"role": "assistant", "content": ""}
                if first
                else ({"content": text} if text is not None else {})
            )
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
        return base | {"choices": [choice]} | ({"usage": None} if include_usage else {})

    async with aclosing(events):  # a client that goes away frees its slot at once
        if shape == "chat":
            yield _sse(chunk(None, None, first=True))
        try:
            async for ev in events:
                if isinstance(ev, Piece):
                    yield _sse(chunk(ev.text, None))
                else:
                    reason = "stop" if ev.finish_reason == "cancelled" else ev.finish_reason
                    yield _sse(chunk(None, reason))
                    if include_usage:
                        yield _sse(base | {"choices": [], "usage": _usage(ev)})
        except ServingError as err:
            # Headers are gone: the error travels as an event, and no [DONE] follows.
            yield _sse(err.body())
            return
        yield _sse(b"[DONE]")


@csrf_exempt
@require_POST
async def chat_completions(request):
    return await _serve(request, openai.chat_params, "chat")


@csrf_exempt
@require_POST
async def completions(request):
    return await _serve(request, openai.completion_params, "text")


@csrf_exempt
@require_POST
async def embeddings(request):
    """OpenAI's /v1/embeddings: mean-pooled, L2-normalised vectors from a deployed model."""
    try:
        caller = await _authenticate(request)
        model, texts, encoding = openai.embedding_params(_parse_json(request))
        vectors, n_tokens, target = await embed(model, texts, caller)
    except ServingError as err:
        return error_response(err)

    def encode(v: list[float]):
        if encoding == "float":
            return v
        return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()

    response = JsonResponse(
        {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": encode(v)}
                for i, v in enumerate(vectors)
            ],
            "model": model,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }
    )
    response["X-LlamaFleet-Node"] = target.node_name
    response["X-LlamaFleet-Replica"] = target.replica_id
    return response


@require_GET
async def models(request):
    try:
        await _authenticate(request)
    except ServingError as err:
        return error_response(err)
    return JsonResponse({"object": "list", "data": await served_models()})


@require_GET
async def metrics(request):
    """Prometheus metrics of this process; scrape with a staff user's API key as Bearer."""
    try:
        if not (await _authenticate(request)).staff:
            raise ServingError(403, "metrics are for staff keys", "permission_error")
    except ServingError as err:
        return error_response(err)
    return HttpResponse(generate_latest(), content_type=CONTENT_TYPE_LATEST)


@require_GET
def health(request):
    """Liveness of the control plane process: open, answers without touching the database."""
    return JsonResponse({"status": "ok"})
