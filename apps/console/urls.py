from django.contrib.auth import views as auth_views
from django.urls import path

from apps.console import views

app_name = "console"
urlpatterns = [
    path(
        "login/",
        auth_views.LoginView.as_view(template_name="console/login.html"),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(next_page="console:login"), name="logout"),
    path("", views.dashboard, name="dashboard"),
    path("playground/", views.playground, name="playground"),
    path("reports/", views.reports, name="reports"),
    path("reports/<int:pk>/", views.reports, name="report"),
]
