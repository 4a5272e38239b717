from django.urls import path

from apps.serving import views

urlpatterns = [
    path("chat/completions", views.chat_completions, name="chat-completions"),
    path("completions", views.completions, name="completions"),
    path("embeddings", views.embeddings, name="embeddings"),
    path("models", views.models, name="models"),
]
