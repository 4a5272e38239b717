"""What background jobs share (pulls, quantizations, link measurements): a row claimed with
a lease, a phase and progress, and an end in a final state whatever the task raises.

A task claims its job with a conditional UPDATE (PENDING -> RUNNING), so a second delivery
does nothing. The claim carries a lease past the task's time limit; a sweeper fails a
running job whose lease is over (its worker died) and sends again a pending one nobody
picked up (the broker was down when it was sent).
"""

from __future__ import annotations

from datetime import timedelta

from django.db import models
from django.utils import timezone

#: A pending job still not picked up after this long is sent again.
RESEND_AFTER_SECONDS = 120
LOST = "the job stopped without finishing (its worker was lost); start it again"


class Job(models.Model):
    """A claimed, leased run with a phase and progress.

    PROGRESS names the pair of fields that count done/total (bytes for a pull; tensors, then
    bytes, for a quantization; node pairs for link measurements)."""

    class State(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"

    PROGRESS = ("done", "total")

    state = models.CharField(max_length=20, choices=State.choices, default=State.PENDING)
    phase = models.CharField(max_length=200, blank=True)
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    #: Set at the claim: a running job past it lost its worker and is failed by the sweeper.
    lease_expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        abstract = True
        ordering = ["-created_at"]

    @property
    def progress(self) -> float | None:
        done, total = (getattr(self, f) for f in self.PROGRESS)
        return round(done / total, 4) if total else None

    @classmethod
    def claim(cls, pk: int, lease_seconds: float, **fields) -> bool:
        """Take a pending job (False: another worker has it, or it ran already)."""
        now = timezone.now()
        return bool(
            cls.objects.filter(pk=pk, state=cls.State.PENDING).update(
                state=cls.State.RUNNING,
                started_at=now,
                lease_expires_at=now + timedelta(seconds=lease_seconds),
                **fields,
            )
        )

    @classmethod
    def end(cls, pk: int, error: str = "", **fields) -> bool:
        """Put a running job in its final state: DONE, or FAILED with the error."""
        state = cls.State.FAILED if error else cls.State.DONE
        return bool(
            cls.objects.filter(pk=pk, state=cls.State.RUNNING).update(
                state=state, error=error, finished_at=timezone.now(), **fields
            )
        )

    @classmethod
    def expire(cls, send) -> dict:
        """Fail the running jobs whose lease is over, and send(pk) the pending ones nobody
        picked up. Returns the ids of both."""
        now = timezone.now()
        lost = list(
            cls.objects.filter(state=cls.State.RUNNING, lease_expires_at__lt=now).values_list(
                "pk", flat=True
            )
        )
        lost = [pk for pk in lost if cls.end(pk, error=LOST)]
        stale = list(
            cls.objects.filter(
                state=cls.State.PENDING,
                created_at__lt=now - timedelta(seconds=RESEND_AFTER_SECONDS),
            ).values_list("pk", flat=True)
        )
        for pk in stale:
            send(pk)
        return {"lost": lost, "resent": stale}
