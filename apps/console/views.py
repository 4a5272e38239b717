"""The web console: server-rendered pages, the session as login (CSRF on every form)."""

from __future__ import annotations

from datetime import UTC, datetime

from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_http_methods

from apps.usage.models import Report
from apps.usage.services import save_report


def _day(value: str) -> datetime:
    return datetime.strptime(value, "%Y-%m-%d").replace(tzinfo=UTC)


@staff_member_required(login_url="console:login")
@require_http_methods(["GET", "POST"])
def reports(request, pk: int | None = None):
    """Cost reports with charts; a form makes one for any period of whole days."""
    if request.method == "POST":
        try:
            start, end = _day(request.POST["start"]), _day(request.POST["end"])
            if end <= start:
                raise ValueError("the end must come after the start")
        except (KeyError, ValueError) as exc:
            messages.error(request, f"Not a period of days: {exc}")
            return redirect("console:reports")
        report = save_report(Report.Kind.CUSTOM, start, end)
        messages.success(request, f"Report for {start:%Y-%m-%d} to {end:%Y-%m-%d} made.")
        return redirect("console:report", pk=report.pk)
    recent = Report.objects.all()[:50]
    report = get_object_or_404(Report, pk=pk) if pk else recent.first()
    return render(request, "console/reports.html", {"report": report, "recent": recent})


@staff_member_required(login_url="console:login")
def dashboard(request):
    """Nodes, models and deployments, kept live by the /ws/v1/console feed."""
    from apps.catalog.sources import KNOWN_MODELS

    return render(request, "console/dashboard.html", {"known_models": sorted(KNOWN_MODELS)})


@staff_member_required(login_url="console:login")
def playground(request):
    """Chat with any deployed model over the generation websocket (operators: applications
    use the API with their keys)."""
    return render(request, "console/playground.html")
