from django.urls import path
from rest_framework.routers import SimpleRouter

from apps.nodes.api.views import AgentHeartbeatView, AgentModelFileView, NodeViewSet

router = SimpleRouter()
router.register("nodes", NodeViewSet)
urlpatterns = router.urls + [
    path("agent/heartbeat", AgentHeartbeatView.as_view(), name="agent-heartbeat"),
    path("agent/models/<str:sha256>/file", AgentModelFileView.as_view(), name="agent-model-file"),
]
