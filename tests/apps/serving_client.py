"""Talking to the OpenAI-compatible endpoints through the real ASGI handler, for tests."""

from __future__ import annotations

import json
import os
import signal

from django.test import AsyncClient


async def post(key, body, path="/v1/chat/completions"):
    """POST a JSON body with a Bearer key (none when key is empty)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return await AsyncClient().post(
        path, json.dumps(body), content_type="application/json", headers=headers
    )


def sse_payloads(chunks: list[bytes]) -> list[str]:
    """The `data:` payloads of a Server-Sent Events body."""
    raw = b"".join(chunks).decode()
    return [line.removeprefix("data: ") for line in raw.split("\n\n") if line]


async def read_killing_replica(response, agents: dict, after: int) -> list[bytes]:
    """Read a streamed response; after `after` chunks, SIGKILL the engine serving it."""
    serving = agents[response["X-LlamaFleet-Replica"]]
    chunks = []
    async for chunk in response.streaming_content:
        chunks.append(chunk)
        if len(chunks) == after:
            os.kill(serving.engine_pid(serving.replica_id), signal.SIGKILL)
    return chunks
