from django.db import transaction
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from apps.accounts.permissions import IsOperator
from apps.deployments import autoscaling, placement, services
from apps.deployments.api.serializers import (
    AutoscalingSerializer,
    CreateDeploymentSerializer,
    DeploymentSerializer,
    EventSerializer,
    PlanPreviewSerializer,
    PlanRequestSerializer,
    ScaleSerializer,
    ShardPlanSerializer,
)
from apps.deployments.models import Deployment, ScalingPolicy
from controlplane.errors import NotFound


class DeploymentViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """Deployments (desired state) with their replicas (actual state) and recent events.
    Operators only: applications see what is served at /v1/models."""

    permission_classes = [IsOperator]
    queryset = Deployment.objects.select_related("model").prefetch_related("replica_set__node")
    serializer_class = DeploymentSerializer
    lookup_field = "name"
    lookup_value_regex = "[^/]+"  # names may hold dots

    @extend_schema(request=CreateDeploymentSerializer, responses={202: DeploymentSerializer})
    def create(self, request):
        data = CreateDeploymentSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        with transaction.atomic():  # with a refused policy, no deployment either
            d = services.do_create(
                v.get("name") or v["model"],
                v["model"],
                v["replicas"],
                v.get("context_length"),
                v.get("parallel"),
                v.get("routing_policy"),
                v["batching"],
                v["swa_cache"],
                v["split_mode"],
                v["pin_nodes"],
                v["restart_policy"],
            )
            if "autoscaling" in v:
                autoscaling.do_set_policy(d, dict(v["autoscaling"]))
                d.refresh_from_db()
        return Response(DeploymentSerializer(d).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=PlanRequestSerializer, responses={200: PlanPreviewSerializer})
    @action(detail=False, methods=["post"])
    def plan(self, request):
        """Preview where a deployment would run, with reasons (or why it cannot); nothing
        is deployed or stored."""
        data = PlanRequestSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        model, context_length, parallel = services.check_create(
            "", v["model"], v["replicas"], v.get("context_length"), v.get("parallel"),
            v["split_mode"], v["pin_nodes"],
        )  # fmt: skip
        plan = placement.preview(
            model,
            context_length,
            parallel,
            v["replicas"],
            v["split_mode"],
            v["pin_nodes"],
            batching=v["batching"],
            swa_cache=v["swa_cache"],
        )
        shown = plan.as_dict()
        return Response(shown | placement.drawing(shown))

    @extend_schema(responses=ShardPlanSerializer(many=True))
    @action(detail=True, methods=["get"])
    def plans(self, request, name=None):
        """Every plan made for this deployment, newest first."""
        page = self.paginate_queryset(self.get_object().plans.prefetch_related("stages"))
        return self.get_paginated_response(ShardPlanSerializer(page, many=True).data)

    @extend_schema(request=ScaleSerializer, responses={202: DeploymentSerializer})
    @action(detail=True, methods=["post"])
    def scale(self, request, name=None):
        data = ScaleSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        d = services.do_scale(self.get_object(), data.validated_data["replicas"])
        return Response(DeploymentSerializer(d).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(
        methods=["PUT"], request=AutoscalingSerializer, responses={200: AutoscalingSerializer}
    )
    @extend_schema(methods=["GET"], responses={200: AutoscalingSerializer})
    @action(detail=True, methods=["get", "put"])
    def autoscaling(self, request, name=None):
        """The autoscaling policy (404 when there is none). PUT creates or changes it; fields
        left out keep their values. Mode shadow records decisions without acting on them."""
        d = self.get_object()
        if request.method == "GET":
            policy = ScalingPolicy.objects.filter(deployment=d).first()
            if policy is None:
                raise NotFound(f"{d.name} has no autoscaling policy")
            return Response(AutoscalingSerializer(policy).data)
        data = AutoscalingSerializer(data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        policy = autoscaling.do_set_policy(d, dict(data.validated_data))
        return Response(AutoscalingSerializer(policy).data)

    @extend_schema(request=None, responses={202: DeploymentSerializer})
    @action(detail=True, methods=["post"])
    def undeploy(self, request, name=None):
        d = services.do_undeploy(self.get_object())
        return Response(DeploymentSerializer(d).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: DeploymentSerializer})
    @action(detail=True, methods=["post"])
    def redeploy(self, request, name=None):
        d = services.do_redeploy(self.get_object())
        return Response(DeploymentSerializer(d).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(responses=EventSerializer(many=True))
    @action(detail=True, methods=["get"])
    def events(self, request, name=None):
        page = self.paginate_queryset(self.get_object().events.all())
        return self.get_paginated_response(EventSerializer(page, many=True).data)

    def perform_destroy(self, instance):
        services.do_delete(instance)
