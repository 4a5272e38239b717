"""The ASGI entry point starts no thread for an OpenAI API request.

Under ASGI, Django runs each sync piece of a request (a signal receiver, a middleware hook)
through asgiref's thread-sensitive hop, in a thread it starts for that request. Before a
stream's first token that cost a thread start and two hops (request_started's receivers and
the CSRF middleware's process_view). What is left is Django closing the response at the end,
and for the API that runs in asgiref's one long-lived sync thread: no thread a request.

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

import threading

hops, started = [], []
original = asgiref.sync.SyncToAsync.__call__
original_start = threading.Thread.start

async def recording(self, *args, **kwargs):
    if self._thread_sensitive:
        in_context = asgiref.sync.SyncToAsync.thread_sensitive_context.get(None) is not None
        hops.append([getattr(self.func, "__qualname__", repr(self.func)), in_context])
    return await original(self, *args, **kwargs)

def start(self):
    started.append(self.name)
    return original_start(self)

asgiref.sync.SyncToAsync.__call__ = recording
threading.Thread.start = start
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
        # The first request also starts what lives as long as the process (asgiref's sync
        # thread, the default pool's first thread): the second shows what one request costs.
        ("api_first", "POST", "/v1/chat/completions", b'{"model": "m", "messages": []}'),
        ("api", "POST", "/v1/chat/completions", b'{"model": "m", "messages": []}'),
        ("form", "POST", "/console/login/", b""),
    ]:
        hops.clear()
        started.clear()
        status = await request(method, path, body)
        out[name] = {"status": status, "hops": list(hops), "threads_started": len(started)}
    print(json.dumps(out))

asyncio.run(main())
"""


def test_an_api_request_starts_no_thread_and_a_form_is_still_checked_in_its_own():
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # No key: the API's own 401, its view reached with no hop on the way (the CSRF check of
    # an exempt view runs on the event loop, request_started has no sync receiver).
    assert out["api"]["status"] == 401
    # Its one sync call, the close, runs outside a per-request context: no thread for it.
    assert out["api"]["hops"] == [["HttpResponseBase.close", False]], out["api"]
    assert out["api"]["threads_started"] == 0, out
    # A form POST without a CSRF token is still refused, its check in a thread of the
    # request's own (it reads the body), as all of Django outside the API keeps.
    assert out["form"]["status"] == 403
    assert ["CsrfViewMiddleware.process_view", True] in out["form"]["hops"], out["form"]
    assert out["form"]["threads_started"] >= 1, out
