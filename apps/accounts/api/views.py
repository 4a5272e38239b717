from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins, status, viewsets
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response

from apps.accounts import services
from apps.accounts.api.serializers import ApiKeySerializer, NewApiKeySerializer
from apps.accounts.models import ApiKey
from apps.accounts.permissions import IsApplication, is_operator


@extend_schema_view(list=extend_schema(parameters=[OpenApiParameter("owner", str)]))
class ApiKeyViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.UpdateModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """API keys. An application sees and makes its own keys, never with looser limits than
    the key it calls with; operators see everyone's (?owner=username) and set limits (requests
    per minute, tokens per day and month, counted across an application's keys; 429 beyond).
    Creating a key returns it once; deleting revokes it."""

    serializer_class = ApiKeySerializer
    permission_classes = [IsApplication]

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # the schema generator has no caller
            return self.serializer_class.Meta.model.objects.none()
        qs = ApiKey.objects.select_related("owner")
        if not is_operator(self.request.user):
            return qs.filter(owner=self.request.user)
        owner = self.request.query_params.get("owner")
        return qs.filter(owner__username=owner) if owner else qs

    @extend_schema(request=ApiKeySerializer, responses={201: NewApiKeySerializer})
    def create(self, request):
        if not is_operator(request.user) and not isinstance(request.auth, ApiKey):
            raise PermissionDenied("an application makes keys with one of its keys")
        serializer = ApiKeySerializer(data=request.data, context={"request": request})
        serializer.is_valid(raise_exception=True)
        fields = dict(serializer.validated_data)
        owner = fields.pop("owner", None) or request.user
        if not is_operator(request.user):
            fields["app"] = request.auth.app or request.auth.name
        key, raw = services.create_key(fields.pop("name"), owner=owner, **fields)
        data = NewApiKeySerializer(key).data | {"key": raw}
        return Response(data, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance):
        services.revoke_key(instance)
