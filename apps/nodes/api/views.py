from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from apps.accounts.permissions import IsOperator
from apps.nodes import services
from apps.nodes.api.permissions import HasNodeToken, node_token_ok
from apps.nodes.api.serializers import (
    LinkJobSerializer,
    NodeLinkSerializer,
    NodePriceSerializer,
    NodeSerializer,
)
from apps.nodes.models import LinkJob, Node, NodeLink
from controlplane import strictjson
from controlplane.errors import DomainError


class LinkJobViewSet(viewsets.ReadOnlyModelViewSet):
    """Rounds of link measurements, newest first, with their progress (operators)."""

    permission_classes = [IsOperator]
    queryset = LinkJob.objects.all()
    serializer_class = LinkJobSerializer


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

    @extend_schema(request=None, responses={202: LinkJobSerializer})
    @action(detail=False, methods=["post"], url_path="measure-links")
    def measure_links(self, request):
        """Start measuring links between ready nodes (a job: follow it at
        /api/v1/link-jobs/<id>/); GET links after."""
        job = services.start_link_job()
        return Response(LinkJobSerializer(job).data, status=202)

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


async def handle_heartbeat(authorization: str, body: bytes) -> tuple[int, dict]:
    """(status, JSON body) for an agent's report; the view and the ASGI lane share it."""
    if not node_token_ok(authorization):
        return 403, {"detail": HasNodeToken.message}
    try:
        payload = strictjson.loads(body or b"null")
    except strictjson.JSONError as exc:
        return 400, {"detail": f"the body is {exc}"}
    if not isinstance(payload, dict):
        return 400, {"detail": "the body must be a JSON object (a NodeStatus)"}
    try:
        return 200, await services.receive_heartbeat(payload)
    except DomainError as exc:
        return exc.status, {"detail": exc.message}


@csrf_exempt  # the node token, never a cookie
@require_POST
async def agent_heartbeat(request):
    """Agents register and report here (node token, not an API key). In production the web
    process answers this path before Django's middleware (controlplane/asgi.py): a thousand
    nodes report every few seconds, and most reports only need buffering."""
    try:
        body = request.body
    except RequestDataTooBig:
        return JsonResponse({"detail": "the body is too large"}, status=413)
    status, data = await handle_heartbeat(request.headers.get("Authorization", ""), body)
    return JsonResponse(data, status=status)


async def heartbeat_lane(scope, receive, send) -> None:
    """The heartbeat path as a bare ASGI app: no middleware (none applies to agents: no
    session, cookie, CSRF or static file), so no thread hop per report."""
    import json

    if scope["method"] != "POST":
        status, data = 405, {"detail": "POST only"}
    else:
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= settings.DATA_UPLOAD_MAX_MEMORY_SIZE:
                chunks.append(chunk)
            more = message.get("more_body", False)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if size > settings.DATA_UPLOAD_MAX_MEMORY_SIZE:
            status, data = 413, {"detail": "the body is too large"}
        else:
            status, data = await handle_heartbeat(
                headers.get("authorization", ""), b"".join(chunks)
            )
    body = json.dumps(data).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
