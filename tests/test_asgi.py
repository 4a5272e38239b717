"""The ASGI entry point starts no thread before an API view runs.

Under ASGI, Django runs each sync piece of a request (a signal receiver, a middleware hook)
through asgiref's thread-sensitive hop, in a thread it starts for that request. Before a
stream's first token that cost a thread start and two hops (request_started's receivers and
the CSRF middleware's process_view). What is left is Django closing the response at the end.

Run in a fresh interpreter: other tests' Django test clients connect request_started's
receivers again, and this checks what the web process itself does.
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import asyncio, json
import asgiref.sync
from asgiref.testing import ApplicationCommunicator

hops = []
original = asgiref.sync.SyncToAsync.__call__

async def recording(self, *args, **kwargs):
    if self._thread_sensitive:
        hops.append(getattr(self.func, "__qualname__", repr(self.func)))
    return await original(self, *args, **kwargs)

asgiref.sync.SyncToAsync.__call__ = recording
from controlplane.asgi import application

async def request(method, path, body=b""):
    scope = {"type": "http", "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    comm = ApplicationCommunicator(application, scope)
    await comm.send_input({"type": "http.request", "body": body})
    start = await comm.receive_output(10)
    while (await comm.receive_output(10)).get("more_body"):
        pass
    await comm.wait(10)
    return start["status"]

async def main():
    out = {}
    for name, method, path, body in [
        ("api", "POST", "/v1/chat/completions", b'{"model": "m", "messages": []}'),
        ("form", "POST", "/console/login/", b""),
    ]:
        hops.clear()
        status = await request(method, path, body)
        out[name] = {"status": status, "hops": list(hops)}
    print(json.dumps(out))

asyncio.run(main())
"""


def test_an_api_request_hops_to_a_thread_only_to_close_and_a_form_is_still_checked():
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # No key: the API's own 401, its view reached with no hop on the way (the CSRF check of
    # an exempt view runs on the event loop, request_started has no sync receiver).
    assert out["api"]["status"] == 401
    assert out["api"]["hops"] == ["HttpResponseBase.close"], out["api"]
    # A form POST without a CSRF token is still refused, its check in the thread (it reads
    # the body).
    assert out["form"]["status"] == 403
    assert "CsrfViewMiddleware.process_view" in out["form"]["hops"], out["form"]
