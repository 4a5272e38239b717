"""What the console's dashboard shows, as one JSON snapshot (the REST serializers' shapes).

Only what changes with the fleet's rows: traffic figures come with the charts' points."""

from __future__ import annotations

from datetime import timedelta

from django.db.models import Q
from django.utils import timezone

from apps.catalog.api.serializers import CatalogModelSerializer, QuantizeJobSerializer
from apps.catalog.models import CatalogModel, QuantizeJob
from apps.deployments.api.serializers import DeploymentSerializer
from apps.deployments.models import Deployment
from apps.deployments.placement import link_rows
from apps.nodes.api.serializers import NodeSerializer
from apps.nodes.models import Node


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
    deployments = DeploymentSerializer(
        Deployment.objects.exclude(state=Deployment.State.STOPPED)
        .select_related("model", "autoscaling")
        .prefetch_related("replica_set__node", "replica_set__plan__stages", "events"),
        many=True,
    ).data
    for d in deployments:
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
