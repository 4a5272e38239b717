"""OpenAI-compatible HTTP endpoints (async views: a stream must not hold a thread)."""

from __future__ import annotations

import asyncio
import base64
import functools
import hmac
import json
import logging
import struct
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from apps.accounts.services import bearer_from_header, check_key
from apps.serving import metrics as serving_metrics
from apps.serving import schemas
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
from controlplane import strictjson
from controlplane.redis import client as redis_client

log = logging.getLogger(__name__)


def error_response(err: ServingError) -> JsonResponse:
    response = JsonResponse(err.body(), status=err.status)
    if err.retry_after is not None:
        response["Retry-After"] = str(err.retry_after)
    return response


async def _authenticate(request: HttpRequest) -> Caller:
    """Who is calling: an API key (Bearer); else 401. An operator's console session may read
    (GET: the playground lists models) but not generate: that is the websocket's, and a
    cross-site POST would carry the cookie without CSRF."""
    raw = bearer_from_header(request.headers.get("Authorization", ""))
    key = await check_key(raw) if raw else None
    if key is not None:
        return Caller.from_key(key)
    if not raw and request.method == "GET":
        user = await request.auser()
        if user.is_authenticated and user.is_staff:
            return Caller(user_id=user.pk, staff=True)
    raise ServingError(
        401,
        "Incorrect API key provided." if raw else "You didn't provide an API key.",
        code="invalid_api_key",
    )


def _parse_json(request: HttpRequest):
    try:
        return strictjson.loads(request.body or b"null")
    except strictjson.JSONError as exc:
        raise ServingError.invalid(f"the body is {exc}", "body") from None
    except RequestDataTooBig:
        raise ServingError(413, "the request body is too large", param="body") from None


def _sse(data) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n\n"


def _guarded(view):
    """No exception escapes a /v1 view: an unexpected one is logged and answered as a 500 in
    OpenAI's shape (never Django's HTML page)."""

    @functools.wraps(view)
    async def wrapper(request, *args, **kwargs):
        try:
            return await view(request, *args, **kwargs)
        except ServingError as err:
            return error_response(err)
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return error_response(ServingError.internal())

    return wrapper


#: While a stream waits for a replica of a model scaled to zero, a comment every this many
#: seconds keeps proxies and clients from timing the connection out.
KEEPALIVE_SECONDS = 5.0


async def _serve(request, model: type, shape: str) -> HttpResponse:
    try:
        caller = await _authenticate(request)
        body = schemas.parse(model, _parse_json(request))
        params, stream, include_usage = body.generation(), body.stream, body.include_usage
        events = generate(params, caller, "chat" if shape == "chat" else "completion")
        if stream:
            # Routed within a moment as a rule; a model scaled to zero takes longer, and the
            # stream then starts with keep-alive comments (a task only where that can happen).
            routed = asyncio.ensure_future(anext(events))
            try:
                await asyncio.wait([routed], timeout=KEEPALIVE_SECONDS)
            except asyncio.CancelledError:
                routed.cancel()
                raise
            if not routed.done():
                return _sse_response(
                    _stream_after_start(routed, events, params, shape, include_usage)
                )
            gen = routed.result()
        else:
            gen = await anext(events)  # routed: errors so far still get a status code
    except ServingError as err:
        return error_response(err)
    if stream:
        response = _sse_response(_stream(events, gen, params, shape, include_usage))
    else:
        async with aclosing(events):
            response = await _collect(events, gen, params, shape)
    response["X-LlamaFleet-Node"] = gen.target.node_name
    response["X-LlamaFleet-Replica"] = gen.target.replica_id
    return response


def _sse_response(chunks: AsyncIterator[bytes]) -> StreamingHttpResponse:
    response = StreamingHttpResponse(chunks, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response


async def _stream_after_start(
    routed: asyncio.Future, events, params, shape: str, include_usage: bool
) -> AsyncIterator[bytes]:
    """A stream whose replica is still starting: SSE comments until it is routed (clients
    ignore them), then the stream; a failure to start arrives as an error event."""
    try:
        while not routed.done():
            yield f": waiting for a replica of {params.model} to start\n\n".encode()
            await asyncio.wait([routed], timeout=KEEPALIVE_SECONDS)
        gen = routed.result()
    except ServingError as err:
        yield _sse(err.body())
        return
    finally:
        if not routed.done():  # the client went away while waiting
            routed.cancel()
            await events.aclose()
    async for chunk in _stream(events, gen, params, shape, include_usage):
        yield chunk


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


def _logprobs(entries: list, shape: str, offset: int = 0) -> dict | None:
    """OpenAI's logprobs of a run of tokens (pb.TokenLogprob): the chat shape, or the legacy
    completions one whose text offsets start at `offset` characters."""

    def token(piece: bytes) -> str:
        return piece.decode("utf-8", errors="replace")

    if shape == "chat":
        content = [
            {
                "token": token(e.piece),
                "logprob": e.logprob,
                "bytes": list(e.piece),
                "top_logprobs": [
                    {"token": token(t.piece), "logprob": t.logprob, "bytes": list(t.piece)}
                    for t in e.top
                ],
            }
            for e in entries
        ]
        return {"content": content, "refusal": None}
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(token(e.piece))
    return {
        "tokens": [token(e.piece) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token(t.piece): t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


def _tool_call(text: str, params: GenerationParams) -> dict | None:
    """The function call an answer is, when tools are in play: with tool_choice required (or
    a named function) the grammar made it one; with auto, when the text is a call of a tool."""
    if not params.tools or params.tool_choice == "none":
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    names = {t["function"]["name"] for t in json.loads(params.tools)}
    if not (
        isinstance(value, dict)
        and value.get("name") in names
        and isinstance(value.get("arguments"), dict)
    ):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": value["name"], "arguments": json.dumps(value["arguments"])},
    }


def _buffered(params: GenerationParams, shape: str) -> bool:
    """A streamed answer that may be a call is sent whole at its end (a call is one delta)."""
    return shape == "chat" and bool(params.tools) and params.tool_choice != "none"


async def _collect(
    events: AsyncIterator, gen: Generation, params: GenerationParams, shape: str
) -> HttpResponse:
    parts: list[list[str]] = [[] for _ in range(params.n)]
    entries: list[list] = [[] for _ in range(params.n)]
    try:
        async for ev in events:
            if isinstance(ev, Piece):
                parts[ev.choice].append(ev.text)
                entries[ev.choice].extend(ev.logprobs)
            else:
                finished = ev
    except ServingError as err:
        return error_response(err)
    ident, obj = _ids(gen, shape)
    reasons = finished.choice_reasons or [finished.finish_reason]
    choices = []
    for k in range(params.n):
        text = "".join(parts[k])
        reason = "stop" if reasons[k] == "cancelled" else reasons[k]
        logprobs = _logprobs(entries[k], shape) if params.logprobs >= 0 else None
        if shape != "chat":
            choices.append(
                {"index": k, "text": text, "finish_reason": reason, "logprobs": logprobs}
            )
            continue
        message = {"role": "assistant", "content": text}
        call = _tool_call(text, params)
        if call is not None:
            message, reason = (
                {"role": "assistant", "content": None, "tool_calls": [call]},
                "tool_calls",
            )
        choices.append(
            {"index": k, "message": message, "finish_reason": reason, "logprobs": logprobs}
        )
    body = {
        "id": ident,
        "object": obj,
        "created": now(),
        "model": params.model,
        "choices": choices,
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
    sent = [0] * params.n  # characters streamed per choice: the legacy text offsets

    def chunk(
        k: int, text: str | None, reason: str | None, first: bool = False, entries=(), call=None
    ) -> dict:
        logprobs = _logprobs(list(entries), shape, sent[k]) if params.logprobs >= 0 else None
        if shape == "chat":
            delta = (
                {"role": "assistant", "content": ""}
                if first
                else ({"content": text} if text is not None else {})
            )
            if call is not None:
                delta = {"tool_calls": [{"index": 0} | call]}
            choice = {"index": k, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        else:
            choice = {"index": k, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
        return base | {"choices": [choice]} | ({"usage": None} if include_usage else {})

    async with aclosing(events):  # a client that goes away frees its slot at once
        if shape == "chat":
            for k in range(params.n):
                yield _sse(chunk(k, None, None, first=True))
        try:
            held: list[list[Piece]] = [[] for _ in range(params.n)]
            buffered = _buffered(params, shape)
            async for ev in events:
                if isinstance(ev, Piece) and buffered:
                    held[ev.choice].append(ev)
                elif isinstance(ev, Piece):
                    yield _sse(chunk(ev.choice, ev.text, None, entries=ev.logprobs))
                    sent[ev.choice] += len(ev.text)
                else:
                    reasons = ev.choice_reasons or [ev.finish_reason]
                    for k in range(params.n):
                        reason = "stop" if reasons[k] == "cancelled" else reasons[k]
                        if held[k]:
                            text = "".join(p.text for p in held[k])
                            entries = [e for p in held[k] for e in p.logprobs]
                            call = _tool_call(text, params)
                            if call is not None:
                                yield _sse(chunk(k, None, None, entries=entries, call=call))
                                reason = "tool_calls"
                            else:
                                yield _sse(chunk(k, text, None, entries=entries))
                        yield _sse(chunk(k, None, reason))
                    if include_usage:
                        yield _sse(base | {"choices": [], "usage": _usage(ev)})
        except ServingError as err:
            # Headers are gone: the error travels as an event, and no [DONE] follows.
            yield _sse(err.body())
            return
        yield _sse(b"[DONE]")


@csrf_exempt  # API keys only: a session cannot POST here (see _authenticate)
@require_POST
@_guarded
async def chat_completions(request):
    return await _serve(request, schemas.ChatCompletionRequest, "chat")


@csrf_exempt
@require_POST
@_guarded
async def completions(request):
    return await _serve(request, schemas.CompletionRequest, "text")


@csrf_exempt
@require_POST
@_guarded
async def embeddings(request):
    """OpenAI's /v1/embeddings: mean-pooled, L2-normalised vectors from a deployed model."""
    caller = await _authenticate(request)
    body = schemas.parse(schemas.EmbeddingRequest, _parse_json(request))
    model, texts, encoding = body.model, body.texts, body.encoding_format
    vectors, n_tokens, target = await embed(model, texts, caller)

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
@_guarded
async def models(request):
    await _authenticate(request)
    return JsonResponse({"object": "list", "data": await served_models()})


@require_GET
@_guarded
async def metrics(request):
    """Prometheus metrics of this process: scrape with LLAMAFLEET_METRICS_TOKEN (read-only,
    for Prometheus) or an operator's API key as Bearer."""
    raw = bearer_from_header(request.headers.get("Authorization", ""))
    token = settings.METRICS_TOKEN
    if not (token and raw and hmac.compare_digest(raw.encode(), token.encode())):
        if not (await _authenticate(request)).staff:
            raise ServingError(403, "metrics are for operators", "permission_error")
    # The fleet gauges query the database: off the event loop.
    body = generate_latest() + await sync_to_async(generate_latest)(serving_metrics.FLEET)
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)


@require_GET
def health(request):
    """Liveness of the control plane process: open, answers without touching the database."""
    return JsonResponse({"status": "ok"})


@require_GET
async def ready(request):
    """Readiness: this process can reach the database and Redis (a load balancer or
    Kubernetes sends it traffic only then). Open, and it names what is down, not why."""
    checks = {}
    try:
        await _select_one()
        checks["database"] = "ok"
    except Exception as exc:  # any failure means not ready; the log has the detail
        log.warning("readiness: database: %s", exc)
        checks["database"] = "unavailable"
    try:
        async with asyncio.timeout(2):
            await redis_client().ping()
        checks["redis"] = "ok"
    except Exception as exc:
        log.warning("readiness: redis: %s", exc)
        checks["redis"] = "unavailable"
    ok = all(v == "ok" for v in checks.values())
    return JsonResponse(
        {"status": "ok" if ok else "unavailable", **checks}, status=200 if ok else 503
    )


@sync_to_async
def _select_one() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
