import hmac

from django.conf import settings
from rest_framework.permissions import BasePermission

from apps.accounts.services import bearer_from_header


class HasNodeToken(BasePermission):
    """Agents authenticate with the node token shared with the control plane."""

    message = "A valid node token is required."

    def has_permission(self, request, view):
        return node_token_ok(request.META.get("HTTP_AUTHORIZATION", ""))


def node_token_ok(authorization: str) -> bool:
    """Whether an Authorization header carries the node token."""
    given = bearer_from_header(authorization)
    return bool(given) and hmac.compare_digest(given.encode(), settings.NODE_TOKEN.encode())
