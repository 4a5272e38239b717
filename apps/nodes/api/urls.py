from django.urls import path
from rest_framework.routers import SimpleRouter

from apps.nodes.api.views import NodeViewSet, agent_heartbeat

router = SimpleRouter()
router.register("nodes", NodeViewSet)
urlpatterns = router.urls + [
    path("agent/heartbeat", agent_heartbeat, name="agent-heartbeat"),
]
