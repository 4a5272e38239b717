from django.urls import path
from rest_framework.routers import SimpleRouter

from apps.catalog.api.views import (
    AgentModelFileView,
    CatalogModelViewSet,
    PullJobViewSet,
    QuantizeJobViewSet,
)

router = SimpleRouter()
router.register("models", CatalogModelViewSet)
router.register("pulls", PullJobViewSet)
router.register("quantizations", QuantizeJobViewSet)
urlpatterns = router.urls + [
    path("agent/models/<str:sha256>/file", AgentModelFileView.as_view(), name="agent-model-file"),
]
