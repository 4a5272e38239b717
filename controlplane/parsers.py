"""The REST API's one parser: strict JSON (controlplane/strictjson.py)."""

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

from controlplane import strictjson


class StrictJSONParser(JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return strictjson.loads(stream.read() if stream is not None else b"")
        except strictjson.JSONError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
