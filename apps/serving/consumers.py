"""The generation websocket: several generations per socket, each cancellable.

Client -> server:
  {"type": "generate", "id": "c1", "model": "...", "messages": [...] | "prompt": "...", ...}
  {"type": "cancel", "id": "c1"}
Server -> client:
  {"type": "start", "id", "node", "replica"}, {"type": "token", "id", "text", "index"},
  {"type": "done", "id", "finish_reason", "usage", "timings"},
  {"type": "error", "id", "error": {"message", "type", "param", "code"}}
Sampling fields are those of the OpenAI API. Closing the socket cancels what is running.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing

from channels.generic.websocket import AsyncJsonWebsocketConsumer

from apps.accounts.models import ApiKey
from apps.serving import openai
from apps.serving.services import Finished, Piece, ServingError, generate
from apps.usage.services import Caller

MAX_CONCURRENT = 16


class GenerationConsumer(AsyncJsonWebsocketConsumer):
    """Streams generations to an authenticated websocket."""

    async def connect(self):
        if not self.scope["user"].is_authenticated:
            await self.close(code=4401)
            return
        self.running: dict[str, asyncio.Task] = {}
        await self.accept()

    async def disconnect(self, code):
        for task in getattr(self, "running", {}).values():
            task.cancel()

    async def receive_json(self, content, **kwargs):
        kind = content.get("type") if isinstance(content, dict) else None
        gid = str(content.get("id", "")) if isinstance(content, dict) else ""
        if kind == "cancel":
            task = self.running.get(gid)
            if task is not None:
                task.cancel()
            return
        if kind != "generate":
            await self._error(
                gid, ServingError(400, "type must be 'generate' or 'cancel'", param="type")
            )
            return
        if not gid or gid in self.running:
            await self._error(
                gid, ServingError(400, "each generation needs a new, non-empty id", param="id")
            )
            return
        if len(self.running) >= MAX_CONCURRENT:
            await self._error(
                gid,
                ServingError(
                    429,
                    f"at most {MAX_CONCURRENT} generations per socket",
                    "rate_limit_error",
                    "too_many_generations",
                ),
            )
            return
        try:
            body = {k: v for k, v in content.items() if k not in ("type", "id", "stream")}
            parse = openai.chat_params if "messages" in body else openai.completion_params
            params, _, _ = parse(body)
        except ServingError as err:
            await self._error(gid, err)
            return
        self.running[gid] = asyncio.create_task(self._run(gid, params))

    async def _run(self, gid: str, params) -> None:
        try:
            key, user = self.scope.get("api_key"), self.scope["user"]
            if key is not None and not await ApiKey.objects.active().filter(pk=key.pk).aexists():
                await self._error(
                    gid, ServingError(401, "the API key was revoked", code="invalid_api_key")
                )
                await self.close(code=4401)
                return
            caller = Caller.from_key(key) if key else Caller(user_id=user.pk, staff=user.is_staff)
            async with aclosing(generate(params, caller, "websocket")) as events:
                await self._relay(gid, events)
        except ServingError as err:
            await self._error(gid, err)
        except asyncio.CancelledError:
            # Cancelled by the client: closing the event stream cancels the gRPC call.
            try:
                await self.send_json({"type": "done", "id": gid, "finish_reason": "cancelled"})
            except Exception:  # the socket may be gone already
                pass
        finally:
            self.running.pop(gid, None)

    async def _relay(self, gid: str, events) -> None:
        gen = await anext(events)
        await self.send_json(
            {
                "type": "start",
                "id": gid,
                "node": gen.target.node_name,
                "replica": gen.target.replica_id,
            }
        )
        async for ev in events:
            if isinstance(ev, Piece):
                await self.send_json(
                    {"type": "token", "id": gid, "text": ev.text, "index": ev.index}
                )
            elif isinstance(ev, Finished):
                await self.send_json(
                    {
                        "type": "done",
                        "id": gid,
                        "finish_reason": ev.finish_reason,
                        "usage": {
                            "prompt_tokens": ev.prompt_tokens,
                            "completion_tokens": ev.completion_tokens,
                            "cached_tokens": ev.cached_tokens,
                        },
                        "timings": {
                            "time_to_first_token": ev.time_to_first_token,
                            "decode_seconds": ev.decode_seconds,
                        },
                        "migrations": ev.migrations,
                    }
                )

    async def _error(self, gid: str, err: ServingError) -> None:
        await self.send_json({"type": "error", "id": gid} | err.body())
