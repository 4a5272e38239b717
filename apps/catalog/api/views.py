import asyncio
import re

from django.core.handlers.asgi import ASGIRequest
from django.http import StreamingHttpResponse
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts.permissions import IsOperator
from apps.catalog import quantization, services, sources
from apps.catalog.api.serializers import (
    CatalogModelSerializer,
    KnownModelSerializer,
    PullJobSerializer,
    PullRequestSerializer,
    QuantizeJobSerializer,
    QuantizeRequestSerializer,
)
from apps.catalog.models import CatalogModel, ModelFile, PullJob, QuantizeJob, store_path
from apps.nodes.api.permissions import HasNodeToken
from controlplane.errors import NotFound


class CatalogModelViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """Models in the catalog with their GGUF facts; pull new ones with POST /models/pull.
    Operators only."""

    permission_classes = [IsOperator]
    queryset = CatalogModel.objects.select_related("parent").prefetch_related(
        "pulls", "files", "variants", "deployments"
    )
    serializer_class = CatalogModelSerializer
    lookup_field = "name"
    lookup_value_regex = "[^/]+"  # names may hold dots

    @extend_schema(request=PullRequestSerializer, responses={202: PullJobSerializer})
    @action(detail=False, methods=["post"])
    def pull(self, request):
        data = PullRequestSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        job = services.start_pull(v["name"], v["local_path"], v["source"])
        return Response(PullJobSerializer(job).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=QuantizeRequestSerializer, responses={202: QuantizeJobSerializer})
    @action(detail=True, methods=["post"])
    def quantize(self, request, name=None):
        """Make a quantized variant of this model on a node of the fleet."""
        data = QuantizeRequestSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        job = quantization.start_quantize(
            self.get_object(), data.validated_data["target"], data.validated_data["name"]
        )
        return Response(QuantizeJobSerializer(job).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(responses=KnownModelSerializer(many=True))
    @action(detail=False, methods=["get"], pagination_class=None)
    def known(self, request):
        """Models that can be pulled by name."""
        return Response(
            [
                {"name": name, "description": s.description, "source": s.label, "sha256": s.sha256}
                for name, s in sorted(sources.KNOWN_MODELS.items())
            ]
        )

    def perform_destroy(self, instance):
        services.delete_model(instance)


class PullJobViewSet(viewsets.ReadOnlyModelViewSet):
    """Pull jobs and their progress (operators)."""

    permission_classes = [IsOperator]
    queryset = PullJob.objects.select_related("model")
    serializer_class = PullJobSerializer


class QuantizeJobViewSet(viewsets.ReadOnlyModelViewSet):
    """Quantization jobs and their progress (operators)."""

    permission_classes = [IsOperator]
    queryset = QuantizeJob.objects.select_related("source", "result", "node")
    serializer_class = QuantizeJobSerializer


class AgentModelFileView(APIView):
    """Agents download model files here, by the file's sha256 (a model's only file or one part
    of a split), with the node token rather than an API key.

    The body is an async iterator read in 1 MiB chunks: under ASGI Django would buffer a
    sync iterator (FileResponse included) whole, and a model can be tens of GB. A Range
    request (`bytes=N-`) gets the rest of the file, so an agent continues a broken download.
    """

    authentication_classes = []
    permission_classes = [HasNodeToken]
    CHUNK = 1 << 20

    @extend_schema(responses={200: OpenApiResponse(description="the GGUF file")})
    def get(self, request, sha256):
        ready = ModelFile.objects.filter(
            sha256=sha256, model__state=CatalogModel.State.READY
        ).exists()
        path = store_path(sha256)
        if not ready or not path.exists():
            raise NotFound(f"no ready model file with sha256 {sha256}")
        size = path.stat().st_size
        start = _range_start(request.headers.get("Range", ""), size)
        under_asgi = isinstance(request._request, ASGIRequest)
        chunks = _chunks if under_asgi else _sync_chunks  # each server's own kind of iterator
        response = StreamingHttpResponse(
            chunks(path, start, self.CHUNK),
            status=206 if start else 200,
            content_type="application/octet-stream",
        )
        response["Content-Length"] = str(size - start)
        response["Accept-Ranges"] = "bytes"
        response["ETag"] = f'"{sha256}"'
        if start:
            response["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
        return response


def _range_start(header: str, size: int) -> int:
    """The first byte asked for by `bytes=N-` (0 for no header, or one we do not serve)."""
    m = re.fullmatch(r"bytes=(\d{1,20})-", header.strip())
    start = int(m.group(1)) if m else 0
    return start if 0 < start < size else 0


def _sync_chunks(path, start: int, size: int):
    with open(path, "rb") as f:
        f.seek(start)
        while chunk := f.read(size):
            yield chunk


async def _chunks(path, start: int, size: int):
    """The file from `start`, read in a thread a chunk at a time."""
    f = await asyncio.to_thread(open, path, "rb")
    try:
        await asyncio.to_thread(f.seek, start)
        while chunk := await asyncio.to_thread(f.read, size):
            yield chunk
    finally:
        await asyncio.to_thread(f.close)
