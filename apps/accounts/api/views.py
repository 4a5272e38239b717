from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.response import Response

from apps.accounts import services
from apps.accounts.api.serializers import ApiKeySerializer, NewApiKeySerializer
from apps.accounts.models import ApiKey


class ApiKeyViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.UpdateModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """Your API keys. Creating one returns the key once; deleting revokes it. Staff set limits:
    requests per minute, tokens per day and per month (429 beyond them)."""

    serializer_class = ApiKeySerializer

    def get_queryset(self):
        return ApiKey.objects.filter(owner=self.request.user)

    @extend_schema(request=ApiKeySerializer, responses=NewApiKeySerializer)
    def create(self, request):
        serializer = ApiKeySerializer(data=request.data, context={"request": request})
        serializer.is_valid(raise_exception=True)
        fields = dict(serializer.validated_data)
        key, raw = services.create_key(fields.pop("name"), owner=request.user, **fields)
        data = NewApiKeySerializer(key).data | {"key": raw}
        return Response(data, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance):
        services.revoke_key(instance)
