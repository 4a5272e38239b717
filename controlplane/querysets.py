"""A queryset whose bulk updates are announced, as saves are by post_save.

QuerySet.update() sends no signal, and much state moves through it (conditional UPDATEs
claim work once). Caches that must notice those changes, like the serving routing table,
listen to `rows_updated` as well as to post_save and post_delete.
"""

from __future__ import annotations

import django.dispatch
from django.db import models

#: Sent after QuerySet.update() with the model class as sender, the row count and the
#: names of the fields written.
rows_updated = django.dispatch.Signal()


class SignallingQuerySet(models.QuerySet):
    """QuerySet.update() that sends rows_updated when it changed rows."""

    def update(self, **kwargs):
        n = super().update(**kwargs)
        if n:
            rows_updated.send(sender=self.model, rows=n, fields=frozenset(kwargs))
        return n

    update.alters_data = True
