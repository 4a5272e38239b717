"""Test environment, loaded as a pytest plugin (-p) so it runs before Django reads settings."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("LLAMAFLEET_SECRET_KEY", "test-secret-key-not-for-production")
os.environ.setdefault("LLAMAFLEET_NODE_TOKEN", "test-node-token")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/15")
os.environ.setdefault("LLAMAFLEET_VAR_DIR", str(ROOT / "var" / "test"))
