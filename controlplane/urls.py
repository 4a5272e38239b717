from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from apps.serving.views import health, metrics, ready

api_v1 = [
    path("", include("apps.accounts.api.urls")),
    path("", include("apps.nodes.api.urls")),
    path("", include("apps.catalog.api.urls")),
    path("", include("apps.deployments.api.urls")),
    path("", include("apps.usage.api.urls")),
    path("schema", SpectacularAPIView.as_view(), name="schema"),
    path("docs", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
]

urlpatterns = [
    path("healthz", health, name="health"),
    path("readyz", ready, name="ready"),
    path("metrics", metrics, name="metrics"),
    path("admin/", admin.site.urls),
    path("api/v1/", include(api_v1)),
    path("v1/", include("apps.serving.urls")),
    path("console/", include("apps.console.urls")),
]
