"""Deployment defaults: secrets never reach a log, the secrets file is private from its first
byte, and ggml RPC servers refuse wildcard or public addresses unless forced."""

from __future__ import annotations

import logging
import os
import stat
import sys
from pathlib import Path

import pytest

from controlplane.logs import MASK, RedactSecrets, redact
from tests.conftest import stack_module
from workers.agent.server import check_rpc_host


def test_redact_masks_keys_tokens_and_configured_secrets(monkeypatch):
    monkeypatch.setenv("LLAMAFLEET_NODE_TOKEN", "node-token-value-123456")
    line = (
        "('127.0.0.1', 5000) - \"WebSocket /ws/v1/generate?api_key=lf-AbCdEf0123456789&x=1\" "
        "Authorization: Bearer sk-whatever token node-token-value-123456 key lf-ZZZZZZZZZZZZ"
    )
    out = redact(line)
    for secret in ("lf-AbCdEf0123456789", "sk-whatever", "node-token-value-123456", "lf-ZZZZ"):
        assert secret not in out
    assert "api_key=" + MASK in out and "&x=1" in out


def test_the_filter_masks_arguments_and_tracebacks(capsys):
    logger = logging.getLogger("test.redact")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RedactSecrets())
    logger.addHandler(handler)
    try:
        logger.warning("calling with %s", "Bearer lf-secretsecretsecret")
        # uvicorn's access formatter unpacks five arguments: they must stay five.
        record = logging.LogRecord(
            "uvicorn.access",
            logging.INFO,
            "",
            0,
            '%s - "%s %s" %d',
            ("127.0.0.1:1", "GET", "/v1/models?api_key=lf-secretsecretsecret", 200),
            None,
        )
        assert RedactSecrets().filter(record) and record.args[2] == "/v1/models?api_key=" + MASK
        assert record.args[3] == 200 and record.getMessage().endswith(" 200")
        try:
            raise ValueError("bad key lf-secretsecretsecret")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    err = capsys.readouterr().err
    assert "lf-secretsecretsecret" not in err and err.count(MASK) >= 2


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "8.8.8.8", "2001:4860:4860::8888"])
def test_rpc_servers_refuse_wildcard_and_public_addresses(host):
    with pytest.raises(RuntimeError, match="no authentication"):
        check_rpc_host(host, allow_public=False)
    check_rpc_host(host, allow_public=True)  # forced


@pytest.mark.parametrize("host", ["127.0.0.1", "10.77.0.11", "192.168.1.5", "localhost"])
def test_rpc_servers_take_private_addresses(host):
    check_rpc_host(host, allow_public=False)


def test_the_secrets_file_is_created_private(tmp_path):
    stack = stack_module()
    old = os.umask(0)  # even under a permissive umask
    try:
        stack.Stack(tmp_path, 8000, 50051)
    finally:
        os.umask(old)
    env = tmp_path / "env"
    assert stat.S_IMODE(env.stat().st_mode) == 0o600
    assert "LLAMAFLEET_METRICS_TOKEN=" in env.read_text()


def _read_key_repeatedly(var: str, n: int) -> set[str]:
    """In another process: n stack commands starting, each reading the secrets file."""
    stack = stack_module()
    return {stack.Stack(Path(var), 8000, 50051).env["LLAMAFLEET_BOOTSTRAP_KEY"] for _ in range(n)}


def test_the_secrets_stay_what_they_are_while_commands_start_together(tmp_path, monkeypatch):
    """Every stack command reads the secrets file; one that read it while another rewrote it
    found it empty, made new secrets and saved them, and the running stack's API key no
    longer matched the file's (the bench got 401s). The file is now written only when a
    secret is new, under a lock, and replaced whole."""
    import multiprocessing

    for key in ("SECRET_KEY", "NODE_TOKEN", "METRICS_TOKEN", "BOOTSTRAP_KEY"):
        monkeypatch.delenv(f"LLAMAFLEET_{key}", raising=False)
    stack = stack_module()
    first = stack.Stack(tmp_path, 8000, 50051).env["LLAMAFLEET_BOOTSTRAP_KEY"]
    env = tmp_path / "env"
    written = env.stat()
    stack.Stack(tmp_path, 8000, 50051)
    assert (env.stat().st_ino, env.stat().st_mtime_ns) == (written.st_ino, written.st_mtime_ns)
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        seen = set().union(*pool.starmap(_read_key_repeatedly, [(str(tmp_path), 150)] * 4))
    assert seen == {first}
    assert stack.Stack(tmp_path, 8000, 50051).env["LLAMAFLEET_BOOTSTRAP_KEY"] == first
