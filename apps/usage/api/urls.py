from rest_framework.routers import SimpleRouter

from apps.usage.api.views import ReportViewSet, UsageViewSet

router = SimpleRouter()
router.register("usage", UsageViewSet, basename="usage")
router.register("reports", ReportViewSet, basename="report")
urlpatterns = router.urls
