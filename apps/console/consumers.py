"""The dashboard's live feed: a snapshot whenever it changes (checked every second)."""

from __future__ import annotations

import asyncio
import json

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.core.serializers.json import DjangoJSONEncoder

from apps.console.services import snapshot

INTERVAL = 1.0


class DashboardConsumer(AsyncWebsocketConsumer):
    async def connect(self):
        user = self.scope["user"]
        if not (user.is_authenticated and user.is_staff):
            await self.close(code=4403)
            return
        await self.accept()
        self._task = asyncio.create_task(self._feed())

    async def disconnect(self, code):
        task = getattr(self, "_task", None)
        if task is not None:
            task.cancel()

    async def _feed(self):
        last = None
        while True:
            data = json.dumps(await database_sync_to_async(snapshot)(), cls=DjangoJSONEncoder)
            if data != last:
                await self.send(text_data=data)
                last = data
            await asyncio.sleep(INTERVAL)
