from datetime import UTC

from django.http import HttpResponse
from django.utils.dateparse import parse_datetime
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response

from apps.accounts.permissions import IsApplication, IsOperator, is_operator
from apps.usage import services
from apps.usage.api.serializers import NewReportSerializer, ReportSerializer, UsageRecordSerializer
from apps.usage.models import Report, UsageRecord


class UsageViewSet(viewsets.ReadOnlyModelViewSet):
    """Usage records: an application's own, or everyone's for operators. Filters: ?model=,
    ?outcome=, ?since=."""

    permission_classes = [IsApplication]
    serializer_class = UsageRecordSerializer
    lookup_field = "request_id"

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # the schema generator has no caller
            return self.serializer_class.Meta.model.objects.none()
        qs = UsageRecord.objects.all()
        if not is_operator(self.request.user):
            qs = qs.filter(user=self.request.user)
        p = self.request.query_params
        if p.get("model"):
            qs = qs.filter(model=p["model"])
        if p.get("outcome"):
            qs = qs.filter(outcome=p["outcome"])
        if p.get("since"):
            try:
                since = parse_datetime(p["since"]) if len(p["since"]) < 40 else None
                if since is not None and since.tzinfo is not None:
                    since = since.astimezone(UTC)  # PostgreSQL takes offsets up to 15:59 only
            except (ValueError, OverflowError):
                since = None
            if since is None:
                raise ValidationError({"since": "must be an ISO 8601 date and time"})
            qs = qs.filter(started_at__gte=since)
        return qs

    @extend_schema(
        parameters=[
            OpenApiParameter("model", str),
            OpenApiParameter("outcome", str),
            OpenApiParameter("since", OpenApiTypes.DATETIME),
        ],
    )
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(
        parameters=[OpenApiParameter("hours", int, description="1 to 168; 24 by default")],
        responses={200: OpenApiTypes.OBJECT},
    )
    @action(detail=False, methods=["get"], url_path="by-key", permission_classes=[IsOperator])
    def by_key(self, request):
        """Operators: tokens and requests per API key for each of the last hours (the
        current one last), for every application at a glance."""
        raw = request.query_params.get("hours", "24")
        if not raw.isdigit() or not 1 <= int(raw) <= 168:
            raise ValidationError({"hours": "must be a whole number from 1 to 168"})
        return Response(services.usage_by_key(int(raw)))


class ReportViewSet(mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    """Cost reports (operators). Daily and weekly ones come from the beat schedule; POST
    {start, end} makes one for any period. Each has JSON here and CSV at .../csv/."""

    queryset = Report.objects.all()
    serializer_class = ReportSerializer
    permission_classes = [IsOperator]

    @extend_schema(request=NewReportSerializer, responses={201: ReportSerializer})
    def create(self, request):
        data = NewReportSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        report = services.save_report(Report.Kind.CUSTOM, v["start"], v["end"])
        return Response(ReportSerializer(report).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={(200, "text/csv"): str})
    @action(detail=True, methods=["get"])
    def csv(self, request, pk=None):
        report = self.get_object()
        response = HttpResponse(services.report_csv(report), content_type="text/csv")
        name = f"llamafleet-{report.kind}-{report.start:%Y%m%d}-{report.end:%Y%m%d}.csv"
        response["Content-Disposition"] = f'attachment; filename="{name}"'
        return response
