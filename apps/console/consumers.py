"""The dashboard's live feed: a snapshot whenever it changes (checked every second), and the
charts' points: the last hour when the socket opens, then each new one as beat takes it."""

from __future__ import annotations

import asyncio
import json

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.core.serializers.json import DjangoJSONEncoder

from apps.console import series
from apps.console.services import snapshot

INTERVAL = 1.0


class DashboardConsumer(AsyncWebsocketConsumer):
    async def connect(self):
        user = self.scope["user"]
        if not (user.is_authenticated and user.is_staff):
            await self.close(code=4403)
            return
        await self.channel_layer.group_add(series.GROUP, self.channel_name)
        await self.accept()
        self._task = asyncio.create_task(self._feed())

    async def disconnect(self, code):
        task = getattr(self, "_task", None)
        if task is not None:
            task.cancel()
            await self.channel_layer.group_discard(series.GROUP, self.channel_name)

    async def series_point(self, event):
        """A point beat just took (sent to the group by series.record)."""
        await self.send(text_data=json.dumps({"series": [event["point"]], "step": series.STEP}))

    async def _feed(self):
        last = None
        while True:
            data = json.dumps(await database_sync_to_async(snapshot)(), cls=DjangoJSONEncoder)
            if data != last:
                await self.send(text_data=data)
                if last is None:  # the charts' hour, once the tables are drawn
                    points = await database_sync_to_async(series.history)()
                    await self.send(
                        text_data=json.dumps({"series": points, "step": series.STEP, "reset": True})
                    )
                last = data
            await asyncio.sleep(INTERVAL)
