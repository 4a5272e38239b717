from rest_framework.routers import SimpleRouter

from apps.deployments.api.views import DeploymentViewSet

router = SimpleRouter()
router.register("deployments", DeploymentViewSet)
urlpatterns = router.urls
