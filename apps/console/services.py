"""What the console's dashboard shows, as one JSON snapshot (the REST serializers' shapes)."""

from __future__ import annotations

from datetime import timedelta

from django.db.models import Avg, Count, Q, Sum
from django.utils import timezone

from apps.catalog.api.serializers import CatalogModelSerializer, QuantizeJobSerializer
from apps.catalog.models import CatalogModel, QuantizeJob
from apps.deployments.api.serializers import DeploymentSerializer
from apps.deployments.models import Deployment
from apps.deployments.placement import link_rows
from apps.nodes.api.serializers import NodeSerializer
from apps.nodes.models import Node
from apps.usage.models import UsageRecord

#: Figures (throughput, time to first token) cover this much recent traffic.
WINDOW = timedelta(minutes=5)


def snapshot() -> dict:
    rows = CatalogModel.objects.select_related("parent").prefetch_related(
        "pulls", "files", "variants", "deployments"
    )
    models = CatalogModelSerializer(rows, many=True).data
    for m in models:
        m.pop("chat_template", None)  # long, and not shown
        m.pop("bytes_per_layer", None)
    quantization_of = {m["name"]: m["quantization"] for m in models}
    recent = timezone.now() - timedelta(hours=1)
    quantizations = QuantizeJobSerializer(
        QuantizeJob.objects.filter(Q(finished_at__isnull=True) | Q(finished_at__gte=recent))
        .select_related("source", "result", "node")
        .order_by("-created_at")[:20],
        many=True,
    ).data
    since = timezone.now() - WINDOW
    figures = {
        row["deployment"]: {
            "requests": row["n"],
            "ttft_ms": row["ttft"],
            "tokens_per_s": (row["tokens"] / (row["seconds"] / 1000)) if row["seconds"] else None,
        }
        for row in UsageRecord.objects.filter(started_at__gte=since, outcome__in=["ok", "migrated"])
        .values("deployment")
        .annotate(
            n=Count("id"),
            ttft=Avg("time_to_first_token_ms"),
            tokens=Sum("completion_tokens"),
            seconds=Sum("duration_ms"),
        )
    }
    deployments = DeploymentSerializer(
        Deployment.objects.exclude(state=Deployment.State.STOPPED)
        .select_related("model")
        .prefetch_related("replica_set__node", "events"),
        many=True,
    ).data
    for d in deployments:
        d["figures"] = figures.get(d["name"])
        # A split runs one file: every stage holds tensors of this one quantization.
        d["quantization"] = quantization_of.get(d["model"], "")
    in_plans = {s["node"] for d in deployments if d["plan"] for s in d["plan"].get("stages", ())}
    return {
        "links": link_rows(in_plans),
        "nodes": NodeSerializer(Node.objects.all(), many=True).data,
        "models": models,
        "quantizations": quantizations,
        "deployments": deployments,
    }
