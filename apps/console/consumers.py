"""The dashboard's live feed: the snapshot when the socket opens, then the sections that
changed whenever the fleet changes (see live.py), and the charts' points: the last hour
when the socket opens, then each new one as beat takes it."""

from __future__ import annotations

import asyncio
import json

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer

from apps.console import live, series


class DashboardConsumer(AsyncWebsocketConsumer):
    async def connect(self):
        user = self.scope["user"]
        if not (user.is_authenticated and user.is_staff):
            await self.close(code=4403)
            return
        self._sent: dict[str, str] = {}
        self._lock = asyncio.Lock()
        await self.channel_layer.group_add(live.GROUP, self.channel_name)
        live.feed().join(self)
        await self.accept()
        await self.catch_up()
        points = await database_sync_to_async(series.history)()
        await self.send(
            text_data=json.dumps({"series": points, "step": series.STEP, "reset": True})
        )

    async def disconnect(self, code):
        if hasattr(self, "_sent"):
            live.feed().leave(self)
            await self.channel_layer.group_discard(live.GROUP, self.channel_name)

    async def fleet_changed(self, event):
        """Something the dashboard shows changed (announced by live.py)."""
        live.feed().changed(event["id"])
        await self.catch_up()

    async def series_point(self, event):
        """A point beat just took (sent to the group by series.record)."""
        await self.send(text_data=json.dumps({"series": [event["point"]], "step": series.STEP}))

    async def catch_up(self):
        """Send what changed since the last send (all of it the first time)."""
        async with self._lock:
            sections = await live.feed().current()
            if sections is self._sent:  # the Feed keeps its dict until something changes
                return
            first = not self._sent
            delta = {k: v for k, v in sections.items() if self._sent.get(k) != v}
            self._sent = sections
            if first:
                await self.send(text_data=live.message(sections))
            elif delta:
                await self.send(text_data=live.message(delta, "delta"))
