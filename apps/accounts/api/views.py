from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.response import Response

from apps.accounts import services
from apps.accounts.api.serializers import ApiKeySerializer, NewApiKeySerializer
from apps.accounts.models import ApiKey


class ApiKeyViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """Your API keys. Creating one returns the key once; deleting revokes it."""

    serializer_class = ApiKeySerializer

    def get_queryset(self):
        return ApiKey.objects.filter(owner=self.request.user)

    @extend_schema(request=ApiKeySerializer, responses=NewApiKeySerializer)
    def create(self, request):
        serializer = ApiKeySerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        key, raw = services.create_key(serializer.validated_data["name"], owner=request.user)
        data = NewApiKeySerializer(key).data | {"key": raw}
        return Response(data, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance):
        services.revoke_key(instance)
