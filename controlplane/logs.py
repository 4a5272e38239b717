"""No log line carries a secret: API keys, bearer tokens and the configured tokens are masked
before any handler writes, including uvicorn's (which logs websocket URLs with ?api_key=)."""

from __future__ import annotations

import logging
import os
import re

_PATTERNS = [
    re.compile(r"(api_key=)[^&\s\"']+", re.IGNORECASE),
    re.compile(r"(Bearer\s+)[^\s\"']+", re.IGNORECASE),
    re.compile(r"()\blf-[A-Za-z0-9_\-]{8,}"),
]
_SECRET_ENV = (
    "LLAMAFLEET_SECRET_KEY",
    "LLAMAFLEET_NODE_TOKEN",
    "LLAMAFLEET_METRICS_TOKEN",
    "LLAMAFLEET_BOOTSTRAP_KEY",
    "HF_TOKEN",
)
MASK = "[redacted]"


def redact(text: str) -> str:
    for pattern in _PATTERNS:
        text = pattern.sub(lambda m: m.group(1) + MASK, text)
    for name in _SECRET_ENV:
        value = os.environ.get(name, "")
        if len(value) >= 8:
            text = text.replace(value, MASK)
    return text


def _clean(value):
    """The value, or its text with secrets masked when it holds any (numbers pass as they are,
    so %d still formats)."""
    if isinstance(value, (int, float)) or value is None:
        return value
    text = value if isinstance(value, str) else str(value)
    clean = redact(text)
    return value if clean == text else clean


class RedactSecrets(logging.Filter):
    """Masks secrets in the message, in each argument (keeping their number and order, which
    formatters such as uvicorn's access log unpack) and in the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = _clean(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(_clean(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: _clean(v) for k, v in record.args.items()}
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


def install() -> None:
    """Put the filter on every handler configured so far (root, uvicorn's, celery's)."""
    flt = RedactSecrets()
    loggers = [logging.getLogger()] + [
        logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
    ]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if not any(isinstance(f, RedactSecrets) for f in handler.filters):
                handler.addFilter(flt)
