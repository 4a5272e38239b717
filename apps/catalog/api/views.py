from django.http import FileResponse
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts.permissions import IsOperator
from apps.catalog import services, sources
from apps.catalog.api.serializers import (
    CatalogModelSerializer,
    KnownModelSerializer,
    PullJobSerializer,
    PullRequestSerializer,
)
from apps.catalog.models import CatalogModel, PullJob
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
    queryset = CatalogModel.objects.prefetch_related("pulls")
    serializer_class = CatalogModelSerializer
    lookup_field = "name"
    lookup_value_regex = "[^/]+"  # names may hold dots

    @extend_schema(request=PullRequestSerializer, responses={202: PullJobSerializer})
    @action(detail=False, methods=["post"])
    def pull(self, request):
        data = PullRequestSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        job = services.start_pull(data.validated_data["name"], data.validated_data["local_path"])
        return Response(PullJobSerializer(job).data, status=status.HTTP_202_ACCEPTED)

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


class AgentModelFileView(APIView):
    """Agents download model files here, by sha256 (node token, not an API key)."""

    authentication_classes = []
    permission_classes = [HasNodeToken]

    @extend_schema(responses={200: OpenApiResponse(description="the GGUF file")})
    def get(self, request, sha256):
        model = CatalogModel.objects.filter(sha256=sha256, state=CatalogModel.State.READY).first()
        if model is None or not model.path.exists():
            raise NotFound(f"no ready model with sha256 {sha256}")
        return FileResponse(open(model.path, "rb"), content_type="application/octet-stream")
