from django.urls import path
from rest_framework.routers import SimpleRouter

from apps.nodes.api.views import LinkJobViewSet, NodeViewSet, agent_heartbeat

router = SimpleRouter()
router.register("nodes", NodeViewSet)
router.register("link-jobs", LinkJobViewSet)
urlpatterns = router.urls + [
    path("agent/heartbeat", agent_heartbeat, name="agent-heartbeat"),
]
