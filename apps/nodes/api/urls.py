from django.urls import path
from rest_framework.routers import SimpleRouter

from apps.nodes.api.views import AgentHeartbeatView, NodeViewSet

router = SimpleRouter()
router.register("nodes", NodeViewSet)
urlpatterns = router.urls + [
    path("agent/heartbeat", AgentHeartbeatView.as_view(), name="agent-heartbeat"),
]
