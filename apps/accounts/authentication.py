"""DRF authentication with API keys (`Authorization: Bearer lf-...`)."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions

from apps.accounts.services import authenticate_key, bearer_from_header


class ApiKeyAuthentication(authentication.BaseAuthentication):
    """Authenticates the key's owner; request.auth is the ApiKey row."""

    def authenticate(self, request):
        header = request.META.get("HTTP_AUTHORIZATION", "")
        raw = bearer_from_header(header)
        if not raw:
            return None
        key = authenticate_key(raw)
        if key is None:
            raise exceptions.AuthenticationFailed("Invalid or revoked API key.")
        return key.owner, key

    def authenticate_header(self, request):
        return 'Bearer realm="llamafleet"'


class ApiKeyScheme(OpenApiAuthenticationExtension):
    target_class = ApiKeyAuthentication
    name = "apiKey"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "An API key (lf-...)"}
