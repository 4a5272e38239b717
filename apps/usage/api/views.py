from django.http import HttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, permissions, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from apps.usage import services
from apps.usage.api.serializers import NewReportSerializer, ReportSerializer, UsageRecordSerializer
from apps.usage.models import Report, UsageRecord


class UsageViewSet(viewsets.ReadOnlyModelViewSet):
    """Usage records: yours, or everyone's for staff. Filters: ?model=, ?outcome=, ?since=."""

    serializer_class = UsageRecordSerializer
    lookup_field = "request_id"

    def get_queryset(self):
        qs = UsageRecord.objects.all()
        if not self.request.user.is_staff:
            qs = qs.filter(user=self.request.user)
        p = self.request.query_params
        if p.get("model"):
            qs = qs.filter(model=p["model"])
        if p.get("outcome"):
            qs = qs.filter(outcome=p["outcome"])
        if p.get("since"):
            qs = qs.filter(started_at__gte=p["since"])
        return qs

    @extend_schema(
        parameters=[OpenApiParameter("model", str), OpenApiParameter("outcome", str)],
    )
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)


class ReportViewSet(mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    """Cost reports (staff). Daily and weekly ones come from the beat schedule; POST
    {start, end} makes one for any period. Each has JSON here and CSV at .../csv/."""

    queryset = Report.objects.all()
    serializer_class = ReportSerializer
    permission_classes = [permissions.IsAdminUser]

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
