"""The /v1 endpoints in the OpenAPI document. They are plain async Django views (a stream must
not hold a thread), which drf-spectacular cannot see, so this hook adds them from the pydantic
models that also validate their requests (apps/serving/schemas.py)."""

from __future__ import annotations

from pydantic.json_schema import models_json_schema

from apps.serving import schemas as s

_REF = "#/components/schemas/{model}"
_ERRORS = {
    "400": "Invalid request (`param` names the field)",
    "401": "No API key, or not a valid one",
    "403": "The key's role may not do this",
    "404": "No such model",
    "405": "Wrong method",
    "413": "The body is too large",
    "429": "Over a quota or the server's limit (see Retry-After)",
    "500": "Internal error",
    "502": "An agent failed",
    "503": "No replica serves the model now (see Retry-After)",
    "504": "An agent did not answer in time",
}


def _json(name: str) -> dict:
    return {"application/json": {"schema": {"$ref": _REF.format(model=name)}}}


def _errors(*codes: str) -> dict:
    return {c: {"description": _ERRORS[c], "content": _json("ErrorResponse")} for c in codes}


def _post(op_id: str, summary: str, request: type, response: type, stream: bool) -> dict:
    ok = _json(response.__name__)
    if stream:
        ok["text/event-stream"] = {
            "schema": {"type": "string", "description": "Server-sent events when stream is true"}
        }
    return {
        "post": {
            "operationId": op_id,
            "summary": summary,
            "tags": ["openai"],
            "security": [{"apiKey": []}],
            "requestBody": {"required": True, "content": _json(request.__name__)},
            "responses": {"200": {"description": "OK", "content": ok}}
            | _errors("400", "401", "404", "405", "413", "429", "500", "502", "503", "504"),
        }
    }


def add_openai_endpoints(result, generator, request, public):
    """drf-spectacular POSTPROCESSING_HOOKS entry."""
    models = [
        s.ChatCompletionRequest,
        s.CompletionRequest,
        s.EmbeddingRequest,
        s.ChatCompletion,
        s.TextCompletion,
        s.EmbeddingList,
        s.ModelList,
        s.ErrorResponse,
    ]
    _, top = models_json_schema(
        [(m, "validation" if m.__name__.endswith("Request") else "serialization") for m in models],
        ref_template=_REF,
    )
    components = result.setdefault("components", {})
    components.setdefault("schemas", {}).update(top.get("$defs", {}))
    components.setdefault("securitySchemes", {})["apiKey"] = {"type": "http", "scheme": "bearer"}
    paths = result.setdefault("paths", {})
    paths["/v1/chat/completions"] = _post(
        "openai_chat_completions",
        "OpenAI chat completions",
        s.ChatCompletionRequest,
        s.ChatCompletion,
        True,
    )
    paths["/v1/completions"] = _post(
        "openai_completions", "OpenAI completions", s.CompletionRequest, s.TextCompletion, True
    )
    paths["/v1/embeddings"] = _post(
        "openai_embeddings", "OpenAI embeddings", s.EmbeddingRequest, s.EmbeddingList, False
    )
    paths["/v1/models"] = {
        "get": {
            "operationId": "openai_models",
            "summary": "Models with a ready replica",
            "tags": ["openai"],
            "security": [{"apiKey": []}],
            "responses": {"200": {"description": "OK", "content": _json("ModelList")}}
            | _errors("401", "500"),
        }
    }
    return result
