from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts.permissions import IsOperator
from apps.nodes import services
from apps.nodes.api.permissions import HasNodeToken
from apps.nodes.api.serializers import NodeLinkSerializer, NodePriceSerializer, NodeSerializer
from apps.nodes.models import Node, NodeLink


class NodeViewSet(mixins.DestroyModelMixin, viewsets.ReadOnlyModelViewSet):
    """Nodes of the fleet with their capacity, liveness and what they hold. DELETE removes
    one that holds no live replica; an agent that reports again registers anew. Operators only."""

    permission_classes = [IsOperator]
    queryset = Node.objects.all()
    serializer_class = NodeSerializer
    lookup_field = "name"
    lookup_value_regex = "[^/]+"  # names may hold dots

    def perform_destroy(self, instance):
        services.remove_node(instance)

    @extend_schema(responses=NodeLinkSerializer(many=True))
    @action(detail=False, methods=["get"])
    def links(self, request):
        """Measured links between nodes (round trip, throughput), as the planner sees them."""
        page = self.paginate_queryset(NodeLink.objects.select_related("source", "target"))
        return self.get_paginated_response(NodeLinkSerializer(page, many=True).data)

    @extend_schema(request=None, responses={202: None})
    @action(detail=False, methods=["post"], url_path="measure-links")
    def measure_links(self, request):
        """Start measuring links between ready nodes (a background job); GET links after."""
        from apps.nodes.tasks import measure_links

        job = measure_links.delay()
        return Response({"task_id": job.id}, status=202)

    @extend_schema(request=None, responses={200: NodeSerializer})
    @action(detail=True, methods=["post"])
    def drain(self, request, name=None):
        """Stop routing new requests and replicas to the node; requests in flight finish."""
        node = services.set_draining(self.get_object(), True)
        return Response(NodeSerializer(node).data)

    @extend_schema(request=NodePriceSerializer, responses={200: NodeSerializer})
    @action(detail=True, methods=["post"])
    def price(self, request, name=None):
        """Set what an hour of the node costs; later hours are billed at it."""
        data = NodePriceSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        node = self.get_object()
        for field, value in data.validated_data.items():
            setattr(node, field, value)
        node.save(update_fields=list(data.validated_data))
        return Response(NodeSerializer(node).data)

    @extend_schema(request=None, responses={200: NodeSerializer})
    @action(detail=True, methods=["post"])
    def undrain(self, request, name=None):
        """Open a drained node to requests and replicas again."""
        node = services.set_draining(self.get_object(), False)
        return Response(NodeSerializer(node).data)


class AgentHeartbeatView(APIView):
    """Agents register and report here (node token, not an API key)."""

    authentication_classes = []
    permission_classes = [HasNodeToken]

    @extend_schema(request=dict, responses={200: OpenApiResponse(description="recorded")})
    def post(self, request):
        node = services.record_heartbeat(request.data)
        return Response({"node": node.name, "state": node.state})
