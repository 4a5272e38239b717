"""Pagination with bounds: a limit or offset out of range is a 400, never a database error."""

from rest_framework.exceptions import ValidationError
from rest_framework.pagination import LimitOffsetPagination

MAX_OFFSET = 2**31 - 1


class BoundedLimitOffsetPagination(LimitOffsetPagination):
    max_limit = 1000

    def _param(self, request, name: str, default: int, cap: int) -> int:
        raw = request.query_params.get(name)
        if raw is None or raw == "":
            return default
        if not (raw.isascii() and raw.isdigit()) or len(raw) > 12 or int(raw) > cap:
            raise ValidationError({name: f"must be an integer from 0 to {cap}"})
        return int(raw)

    def get_limit(self, request):
        limit = self._param(request, self.limit_query_param, self.default_limit, 10**12)
        return min(limit, self.max_limit) or self.default_limit

    def get_offset(self, request):
        return self._param(request, self.offset_query_param, 0, MAX_OFFSET)
