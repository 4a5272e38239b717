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
import logging
from contextlib import aclosing

from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings

from apps.accounts.models import ApiKey
from apps.serving import schemas
from apps.serving.services import Finished, Piece, ServingError, generate
from apps.usage.services import Caller
from controlplane import strictjson

MAX_CONCURRENT = 16
log = logging.getLogger(__name__)


def _id_of(content) -> str:
    gid = content.get("id") if isinstance(content, dict) else None
    return gid if isinstance(gid, str) and len(gid) <= 128 else ""


class GenerationConsumer(AsyncJsonWebsocketConsumer):
    """Streams generations to an authenticated websocket."""

    async def connect(self):
        user = self.scope["user"]
        if not user.is_authenticated:
            await self.close(code=4401)
            return
        if self.scope.get("api_key") is None and not user.is_staff:
            await self.close(code=4403)  # the console is for operators; applications use keys
            return
        self.running: dict[str, asyncio.Task] = {}
        await self.accept()

    async def disconnect(self, code):
        for task in getattr(self, "running", {}).values():
            task.cancel()

    async def receive(self, text_data=None, bytes_data=None, **kwargs):
        """Every frame gets an answer, and the socket stays open whatever a frame holds."""
        if text_data is None:
            await self._error("", ServingError.invalid("send JSON text frames, not binary", "body"))
            return
        if len(text_data) > settings.DATA_UPLOAD_MAX_MEMORY_SIZE:
            await self._error("", ServingError.invalid("the frame is too large", "body"))
            return
        try:
            content = strictjson.loads(text_data)
        except strictjson.JSONError as exc:
            await self._error("", ServingError.invalid(f"the frame is {exc}", "body"))
            return
        try:
            await self._receive(content)
        except ServingError as err:
            await self._error(_id_of(content), err)

    async def _receive(self, content) -> None:
        kind = content.get("type") if isinstance(content, dict) else None
        if kind == "cancel":
            task = self.running.get(schemas.parse(schemas.CancelMessage, content).id)
            if task is not None:
                task.cancel()
            return
        if kind != "generate":
            raise ServingError.invalid("type must be 'generate' or 'cancel'", "type")
        message = schemas.parse(schemas.GenerateMessage, content)
        if message.id in self.running:
            raise ServingError.invalid("each generation needs a new id", "id")
        if len(self.running) >= MAX_CONCURRENT:
            raise ServingError.busy(
                f"at most {MAX_CONCURRENT} generations per socket", "too_many_generations"
            )
        params = message.generation()
        self.running[message.id] = asyncio.create_task(self._run(message.id, params))

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
        except Exception:
            log.exception("generation %s failed", gid)
            await self._error(gid, ServingError.internal())
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
