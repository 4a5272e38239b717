from datetime import UTC

from django.http import HttpResponse
from django_filters import rest_framework as filters
from django_filters.rest_framework import DjangoFilterBackend
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


class UsageFilter(filters.FilterSet):
    model = filters.CharFilter(help_text="Only this model's records.")
    outcome = filters.ChoiceFilter(choices=UsageRecord.Outcome.choices)
    since = filters.IsoDateTimeFilter(
        method="started_since",
        help_text="Records that started at or after this ISO 8601 date and time.",
        error_messages={"invalid": "must be an ISO 8601 date and time"},
    )

    class Meta:
        model = UsageRecord
        fields = ["model", "outcome", "since"]

    def started_since(self, queryset, name, value):
        try:
            value = value.astimezone(UTC)  # PostgreSQL takes offsets up to 15:59 only
        except (OverflowError, ValueError):
            raise ValidationError({"since": "must be an ISO 8601 date and time"}) from None
        return queryset.filter(started_at__gte=value)


class UsageViewSet(viewsets.ReadOnlyModelViewSet):
    """Usage records: an application's own, or everyone's for operators. Filters: ?model=,
    ?outcome=, ?since=."""

    permission_classes = [IsApplication]
    serializer_class = UsageRecordSerializer
    lookup_field = "request_id"
    filter_backends = [DjangoFilterBackend]
    filterset_class = UsageFilter

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # the schema generator has no caller
            return self.serializer_class.Meta.model.objects.none()
        qs = UsageRecord.objects.all()
        if not is_operator(self.request.user):
            qs = qs.filter(user=self.request.user)
        return qs

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
