"""The three roles every endpoint declares one of.

- an application: a non-staff account using API keys; inference, its own usage and keys;
- an operator: a staff account; the fleet, everyone's keys, quotas, prices, reports, metrics;
- the admin: a superuser; everything operators do, plus Django's admin site (operators have no
  model permissions there) and keys for other operators.

`Undeclared` is the default permission: a view that names no role is closed to everyone, and
the route-by-role test (tests/apps/accounts/test_roles.py) fails until it names one.
"""

from rest_framework.permissions import BasePermission


def is_operator(user) -> bool:
    return bool(user and user.is_authenticated and user.is_active and user.is_staff)


class Undeclared(BasePermission):
    message = "This endpoint declares no role; nobody may call it."

    def has_permission(self, request, view):
        return False


class IsApplication(BasePermission):
    """Any authenticated caller: what applications may do, operators may do too."""

    message = "An API key is required."

    def has_permission(self, request, view):
        return bool(request.user and request.user.is_authenticated)


class IsOperator(BasePermission):
    """Staff: the fleet and everyone's keys, usage and money."""

    message = "This is an operator's action; an application's key may not do it."

    def has_permission(self, request, view):
        return is_operator(request.user)
