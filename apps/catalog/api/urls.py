from rest_framework.routers import SimpleRouter

from apps.catalog.api.views import CatalogModelViewSet, PullJobViewSet

router = SimpleRouter()
router.register("models", CatalogModelViewSet)
router.register("pulls", PullJobViewSet)
urlpatterns = router.urls
