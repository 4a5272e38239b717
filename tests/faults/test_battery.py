"""The fault battery: the whole stack as separate processes, two web processes and two agents
(one replica each), a private Redis and a private PostgreSQL, and 16 streams in flight when
each fault strikes. For each fault it measures streams completed and lost, usage records
lost, the time until a new request is served and until both replicas are back, and the
fleet's state after; then it checks the targets. The figures go to var/test/faults.json and
README.md's table (`pytest -m faults -s` prints them).

The last two faults strike a layer split of the same model over both agents, deployed
beside the two replicas: its rpc stage is killed, then the link between head and stage is
cut for a while (iptables drops the stage's port; the agents share this machine's loopback).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from glob import glob
from pathlib import Path
from unittest import mock

import httpx
import pytest

from tests.conftest import ROOT, free_port, stack_module

pytestmark = [pytest.mark.faults, pytest.mark.e2e]
logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise

MODEL = "smollm2-135m-instruct"
DEPLOYMENT = "faults"
STREAMS = 16
MAX_TOKENS = 32
RESULTS = ROOT / "var/test/faults.json"
PG_DOWN_SECONDS = 30
#: Every web process serves again within this many seconds of PostgreSQL's return.
DB_BACK_SECONDS = 15
SPLIT = "faults-split"
#: Where diagnose() shows the start of a log's last traceback from.
TRACEBACK_MARKS = ("Unrecoverable", "CRITICAL", "Traceback (most recent call last)")
LINK_CUT_SECONDS = 10


class PrivatePostgres:
    """A PostgreSQL of its own (initdb into a temporary folder), to stop without touching
    anything else. Runs as the postgres user, as PostgreSQL insists."""

    def __init__(self, port: int):
        self.port = port
        self.root = Path(tempfile.mkdtemp(prefix="lf-faults-pg-"))
        os.chmod(self.root, 0o755)
        self.bin = Path(sorted(glob("/usr/lib/postgresql/*/bin"))[-1])
        self.data = self.root / "data"
        self.data.mkdir()
        shutil.chown(self.data, "postgres", "postgres")
        shutil.chown(self.root, "postgres", "postgres")
        self._as_postgres(str(self.bin / "initdb"), "-D", str(self.data), "--auth=trust",
                          "-U", "postgres")  # fmt: skip

    def _as_postgres(self, *argv: str) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", *argv], check=True,
                       capture_output=True, timeout=120)  # fmt: skip

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1"
        self._as_postgres(str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", opts, "-w",
                          "-l", str(self.root / "pg.log"), "start")  # fmt: skip

    def stop(self) -> None:
        self._as_postgres(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w",
                          "stop")  # fmt: skip

    def remove(self) -> None:
        try:
            self.stop()
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, smollm2_path):
    if os.geteuid() != 0 or not glob("/usr/lib/postgresql/*/bin/initdb"):
        pytest.skip("the fault battery needs root and PostgreSQL's server binaries")
    pg = PrivatePostgres(free_port())
    pg.start()
    var = tmp_path_factory.mktemp("faults-var")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMAFLEET_", "DJANGO_"))}
    env |= {
        "LLAMAFLEET_VAR_DIR": str(var),
        "DATABASE_URL": pg.url,
        "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",  # its own: started, then killed
        "LLAMAFLEET_BOOTSTRAP_KEY": "lf-faults-bootstrap-key-00000000000",
        "LLAMAFLEET_HEARTBEAT_SECONDS": "1",
        "LLAMAFLEET_HEARTBEAT_TIMEOUT": "6",
        # Two agents share this machine's 2 cores: one decode thread per engine, or their
        # threads spin against each other (see "Not yet" in README.md).
        "LLAMAFLEET_AGENT_THREADS": "1",
    }
    module = stack_module()
    with mock.patch.dict(os.environ, env, clear=True):
        stack = module.Stack(var, free_port(), free_port(), free_port())
    web2_port = free_port()
    try:
        stack.up(MODEL, 300)
        stack.web("web2", web2_port)
        agent2 = (free_port(), free_port())
        stack.agent("agent2", "node-b", *agent2)
        f = Fleet(stack, pg, [stack.url, f"http://127.0.0.1:{web2_port}"])
        f.agent2 = agent2
        f.wait(lambda: f.get("/healthz", base=f.urls[1]) is not None, 60, "second web process")
        f.wait(lambda: len([n for n in f.api("/api/v1/nodes/")["results"]
                            if n["state"] == "ready"]) == 2, 60, "second agent")  # fmt: skip
        # Two replicas with more slots than there are streams: a new request finds a free
        # slot unless the fault itself stops it (so the time until serving is back is the
        # fault's, not a queue's).
        resp = f.post(f"/api/v1/deployments/{MODEL}/undeploy/", {})
        assert resp.status_code in (200, 202), resp.text
        f.wait(lambda: f.get(f"/api/v1/deployments/{MODEL}/")["state"] == "stopped", 60,
               "default deployment stopped")  # fmt: skip
        resp = f.post("/api/v1/deployments/", {"name": DEPLOYMENT, "model": MODEL,
                      "replicas": 2, "parallel": 12, "context_length": 1024})  # fmt: skip
        assert resp.status_code == 202, resp.text
        f.wait(f.healed, 180, "two replicas")
        nodes = {r["node"] for r in f.deployment()["replica_set"] if r["state"] == "ready"}
        assert len(nodes) == 2, nodes  # one replica on each agent
        yield f
    finally:
        with mock.patch.dict(os.environ, env, clear=True):
            stack.down()
        pg.remove()


class Fleet:
    def __init__(self, stack, pg: PrivatePostgres, urls: list[str]):
        self.stack, self.pg, self.urls = stack, pg, urls
        self.key = stack.env["LLAMAFLEET_BOOTSTRAP_KEY"]
        self.headers = {"Authorization": f"Bearer {self.key}"}
        self.agent2: tuple[int, int] = (0, 0)  # its listen and metrics ports
        self.expect = {DEPLOYMENT: 2}  # deployment -> replicas ready when healed
        self.last_results: list[dict] = []  # what each stream of the last strike got

    def get(self, path: str, base: str | None = None):
        try:
            r = httpx.get((base or self.urls[0]) + path, headers=self.headers, timeout=10)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def api(self, path: str) -> dict:
        body = self.get(path)
        assert body is not None, path
        return body

    def post(self, path: str, body: dict):
        return httpx.post(self.urls[0] + path, json=body, headers=self.headers, timeout=30)

    @staticmethod
    def wait(ready, seconds: float, what: str, explain=None) -> float:
        """Seconds until ready() holds; else an AssertionError, with explain()'s text."""
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            try:
                if ready():
                    return time.monotonic() - start
            except (httpx.HTTPError, AssertionError, KeyError, TypeError):
                pass
            time.sleep(0.25)
        detail = f"\n{explain()}" if explain is not None else ""
        raise AssertionError(f"{what}: not within {seconds} s{detail}")

    def diagnose(self, deployment: str) -> str:
        """What a failed wait leaves to read: the deployment's replicas and latest events,
        what the nodes report, and the last lines of the control plane's and agents' logs
        (the stack's folder is a temporary one, gone after the run)."""
        out = []
        d = self.get(f"/api/v1/deployments/{deployment}/") or {}
        out.append(f"{deployment}: {d.get('state')}, replicas: " + json.dumps(
            [{k: r.get(k) for k in ("id", "node", "state", "error")}
             for r in d.get("replica_set", ())]))  # fmt: skip
        events = (self.get(f"/api/v1/deployments/{deployment}/events/") or {}).get("results", [])
        out += [f"  event: {json.dumps(e)}" for e in events[:15]]
        for n in (self.get("/api/v1/nodes/") or {}).get("results", []):
            out.append(f"node {n['name']}: {n['state']}, heartbeat {n['heartbeat_age_seconds']}"
                       f" s ago, replicas {json.dumps(n['reported_replicas'])}, rpc servers "
                       f"{json.dumps(n['rpc_servers'])}")  # fmt: skip
        for proc in ("worker", "agent", "agent2"):
            path = self.stack.log_dir / f"{proc}.log"
            lines = path.read_text(errors="replace").splitlines() if path.exists() else []
            # The tail of a long traceback hides what it began with (CI once showed only the
            # end of the worker's "Unrecoverable error"): the start of the last one first.
            starts = [i for i, x in enumerate(lines) if any(m in x for m in TRACEBACK_MARKS)]
            if starts:
                head = lines[max(starts[-1] - 2, 0) : starts[-1] + 12]
                out += [f"--- {proc}.log (the start of its last traceback)", *head]
            lines = [x for x in lines if " Task apps." not in x][-30:]  # not Celery's own
            out += [f"--- {proc}.log (last {len(lines)} lines)", *lines]
        return "\n".join(out)

    def deployment(self) -> dict:
        return self.api(f"/api/v1/deployments/{DEPLOYMENT}/")

    def healed(self, struck: float | None = None) -> bool:
        """Every replica expected ready; after a fault (struck), each also confirmed by its
        agent in a report sent since (a replica whose agent died is still listed ready until
        the restarted agent reports; that is not healed)."""
        ready: set[str] = set()
        for name, replicas in self.expect.items():
            d = self.get(f"/api/v1/deployments/{name}/")
            mine = {r["id"] for r in (d or {}).get("replica_set", ()) if r["state"] == "ready"}
            if len(mine) != replicas:
                return False
            ready |= mine
        if struck is None:
            return True
        since = time.monotonic() - struck
        confirmed = {
            r["replica_id"]
            for n in (self.get("/api/v1/nodes/") or {}).get("results", [])
            if n["heartbeat_age_seconds"] is not None and n["heartbeat_age_seconds"] < since
            for r in n["reported_replicas"]
            if r["state"] == "ready"
        }
        return ready <= confirmed

    def engine_pids(self) -> list[int]:
        return [r["pid"] for n in self.api("/api/v1/nodes/")["results"]
                for r in n["reported_replicas"] if r.get("pid")]  # fmt: skip

    def new_key(self, app: str) -> str:
        r = self.post("/api/v1/api-keys/", {"name": app, "app": app})
        assert r.status_code == 201, r.text
        return r.json()["key"]


def stream(url: str, key: str, i: int) -> dict:
    """One streamed chat to the end; what came back."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Count from {i} to {i + 60}, one per line."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    began = time.monotonic()
    seen = {"id": "", "pieces": 0, "usage": None}  # its id, the text pieces and usage it got
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=180,
                          headers={"Authorization": f"Bearer {key}"}) as r:  # fmt: skip
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}", "seconds": 0.0}
            done, finish = False, None
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return {"ok": False, "error": chunk["error"].get("message", "error"),
                                **seen}  # fmt: skip
                    seen["id"] = chunk.get("id", "").removeprefix("chatcmpl-")
                    seen["usage"] = chunk.get("usage") or seen["usage"]
                    for c in chunk.get("choices") or ():
                        finish = c.get("finish_reason") or finish
                        seen["pieces"] += bool((c.get("delta") or {}).get("content"))
            ok = done and finish is not None and seen["usage"] is not None
            took = time.monotonic() - began
            return {"ok": ok, "error": "" if ok else "cut short", "seconds": took, **seen}
    except httpx.HTTPError as exc:
        return {"ok": False, "error": type(exc).__name__, "seconds": time.monotonic() - began,
                **seen}  # fmt: skip


def served(url: str, key: str) -> str:
    """A new request: "" when it is served, else what went wrong."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    try:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30,
                       headers={"Authorization": f"Bearer {key}"})  # fmt: skip
        return "" if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:120]}"
    except httpx.HTTPError as exc:
        return type(exc).__name__


def strike(f: Fleet, name: str, fault, restore, *, urls: list[str] | None = None) -> dict:
    """16 streams, the fault once they are flowing, then restore and measure."""
    urls = urls or f.urls
    f.wait(f.healed, 240, f"{name}: a healed fleet to start from")
    for u in f.urls:  # a restarted web process takes seconds to import Django
        f.wait(lambda u=u: f.get("/healthz", base=u) is not None, 60, f"{name}: {u} up")
    key = f.new_key(f"fault-{name}")
    back: dict = {}
    with ThreadPoolExecutor(STREAMS) as pool:
        futures = [pool.submit(stream, urls[i % len(urls)], key, i) for i in range(STREAMS)]
        time.sleep(1.5)  # every stream admitted and decoding (or queued for a slot)
        struck = time.monotonic()
        fault()

        def probe():  # a new request until one is served; then both replicas, until back
            while time.monotonic() - struck < 300 and "seconds" not in back:
                for u in f.urls:
                    why = served(u, f.key)
                    if not why:
                        back["seconds"] = time.monotonic() - struck
                        break
                    back.setdefault("failures", set()).add(why)
                time.sleep(0.25)
            while time.monotonic() - struck < 300:
                try:
                    if f.healed(struck):
                        back["healed"] = time.monotonic() - struck
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        restore()
        results = f.last_results = [fu.result() for fu in futures]
        prober.join(300)  # the streams have ended: serving and replicas are back by now
    healed = back.get("healed", float("nan"))
    # Records are written in the background (and wait out a database that was away).
    counted: list = []

    def all_recorded():
        got = f.get(f"/api/v1/usage/?limit=1000&since={time.strftime('%Y-%m-%d')}T00:00:00Z")
        counted[:] = [r for r in (got or {}).get("results", []) if r["app"] == f"fault-{name}"]
        return len(counted) >= STREAMS

    try:
        f.wait(all_recorded, 60, f"{name}: usage records")
    except AssertionError:
        pass
    after = []
    for dep in f.expect:
        d = f.get(f"/api/v1/deployments/{dep}/") or {"state": "not answering", "replicas": 0,
                                                    "replica_set": []}  # fmt: skip
        ready = sum(r["state"] == "ready" for r in d["replica_set"])
        after.append(f"{d['state']}, {ready} of {d['replicas']} replicas ready")
    if len(after) > 1:
        after = [f"{dep}: {a}" for dep, a in zip(f.expect, after, strict=True)]
    row = {
        "fault": name,
        "streams": STREAMS,
        "completed": sum(r["ok"] for r in results),
        "lost": sum(not r["ok"] for r in results),
        "errors": sorted({r["error"] for r in results if not r["ok"]}),
        "usage_records_lost": STREAMS - len(counted),
        "outcomes": sorted(r["outcome"] for r in counted),
        "streams_by_deployment": dict(Counter(r["deployment"] for r in counted)),
        "slowest_stream_seconds": round(max(r["seconds"] for r in results), 2),
        "serving_back_seconds": round(back.get("seconds", float("nan")), 2),
        "new_requests_failed_with": sorted(back.get("failures", ())),
        "replicas_back_seconds": round(healed, 2),
        "state_after": "; ".join(after),
    }
    print(json.dumps(row))
    _save(row)
    return row


def _save(row: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    rows = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    rows[row["fault"]] = row
    RESULTS.write_text(json.dumps(rows, indent=2))


def kill(f: Fleet, proc: str) -> None:
    pid = f.stack.pid(proc)
    assert pid, proc
    os.kill(pid, signal.SIGKILL)
    try:  # started by this process (stack.up ran here): reap it, or it lingers as a zombie
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


# ---- the faults (in this order: each starts from a healed fleet) ----------------------------


def test_no_fault_the_baseline(fleet):
    """The same 16 streams with nothing struck: 8 slots over two replicas, so a new request
    waits for a slot this long anyway."""
    row = strike(fleet, "none (baseline)", lambda: None, lambda: None)
    assert row["completed"] == STREAMS and row["usage_records_lost"] == 0, row


def test_kill_an_engine(fleet):
    row = strike(fleet, "engine kill -9", lambda: os.kill(fleet.engine_pids()[0], 9), lambda: None)
    assert row["completed"] == STREAMS and row["usage_records_lost"] == 0, row


def test_kill_an_agent(fleet):
    f = fleet
    row = strike(
        f, "agent kill -9", lambda: kill(f, "agent2"),
        lambda: (time.sleep(2), f.stack.agent("agent2", "node-b", *f.agent2)),
    )  # fmt: skip
    assert row["completed"] == STREAMS and row["usage_records_lost"] == 0, row


def test_kill_one_of_two_web_processes(fleet):
    f = fleet
    port = int(f.urls[1].rsplit(":", 1)[1])
    row = strike(
        f, "web kill -9 (1 of 2)", lambda: kill(f, "web2"),
        lambda: (time.sleep(2), f.stack.web("web2", port)),
    )  # fmt: skip
    # Streams through the killed process end with a connection error; the others complete.
    assert row["completed"] >= STREAMS // 2 and row["usage_records_lost"] == 0, row
    # Its records stay running; the sweeper (run now, not in a minute) settles them with the
    # tokens the agents counted, which the dead process could not write.
    f.stack.manage("shell", "-c", "from apps.usage.services import settle_interrupted as s; s(0)")
    got = f.get(f"/api/v1/usage/?limit=1000&since={time.strftime('%Y-%m-%d')}T00:00:00Z")
    cut = [r for r in got["results"] if r["app"] == f"fault-{row['fault']}"
           and r["error_code"] == "interrupted"]  # fmt: skip
    # Each cut stream's record is among them, holding at least the tokens its client saw
    # before the cut (a piece of text is one token or more), and its prompt once anything
    # was generated.
    records = {r["request_id"]: r for r in cut}
    lost = [s for s in f.last_results if not s["ok"]]
    for s in lost:
        if s["id"]:
            r = records.pop(s["id"])
            assert r["completion_tokens"] >= s["pieces"], (r, s)
            assert r["prompt_tokens"] > 0 or not r["completion_tokens"], (r, s)
    # A stream that ended just as the process died may have reached its client whole while
    # its final record (written after the stream, never before it) did not: settled, it
    # holds exactly the tokens its client was told.
    # The others are cut streams that had not yet got their id.
    whole = {s["id"]: s["usage"] for s in f.last_results if s["ok"]}
    settled_whole = {rid: r for rid, r in records.items() if rid in whole}
    for rid, r in settled_whole.items():
        u = whole[rid]
        assert (r["prompt_tokens"], r["completion_tokens"]) == (
            u["prompt_tokens"], u["completion_tokens"]), (r, u)  # fmt: skip
    assert len(cut) - len(settled_whole) == row["lost"], (cut, row)
    assert sum(s["pieces"] for s in lost) > 0, lost  # the fault struck mid-stream
    settled = sorted(r["completion_tokens"] for r in cut)
    print(f"{len(cut)} interrupted records settled with the agents' counts: {settled} tokens "
          f"(their clients saw {sorted(s['pieces'] for s in lost)} pieces)")  # fmt: skip


@pytest.mark.parametrize("proc", ["worker", "beat"])
def test_kill_a_celery_process(fleet, proc):
    f = fleet
    row = strike(f, f"{proc} kill -9", lambda: kill(f, proc),
                 lambda: (time.sleep(2), f.stack.control_plane()))  # fmt: skip
    assert row["completed"] == STREAMS and row["usage_records_lost"] == 0, row


def test_restart_redis(fleet):
    f = fleet
    row = strike(f, "redis restart", lambda: kill(f, "redis"),
                 lambda: (time.sleep(2), f.stack.ensure_redis()))  # fmt: skip
    assert row["completed"] == STREAMS and row["usage_records_lost"] == 0, row


def test_stop_postgresql_for_30_seconds(fleet):
    """The streams in flight complete, and every web process serves new requests soon after
    PostgreSQL is back: its connection pool tries again when a request needs it, not after
    a backoff that had grown over the outage (one web process then failed every request
    for 26 s and more, which the next fault's streams met)."""
    f = fleet
    back: list[float] = []

    def restore():
        time.sleep(PG_DOWN_SECONDS)
        f.pg.start()
        back.append(time.monotonic())

    row = strike(f, f"postgresql stopped {PG_DOWN_SECONDS} s", f.pg.stop, restore)
    assert row["completed"] == STREAMS and row["usage_records_lost"] == 0, row
    for u in f.urls:
        while (why := served(u, f.key)) and time.monotonic() - back[0] < DB_BACK_SECONDS:
            time.sleep(0.25)
        waited = time.monotonic() - back[0]
        assert not why, f"{u} still failing {waited:.1f} s after PostgreSQL came back: {why}"


# ---- a split beside the replicas: its stage killed, its link cut ------------------------------


@pytest.fixture
def split(fleet):
    """A layer split of the same model over both agents (head on the first, stage on node-b)
    beside the two replicas: requests for the model go to all three."""
    f = fleet
    resp = f.post("/api/v1/deployments/", {
        "name": SPLIT, "model": MODEL, "replicas": 1, "parallel": 4, "context_length": 1024,
        "split_mode": "layer", "pin_nodes": [socket.gethostname(), "node-b"],
    })  # fmt: skip
    assert resp.status_code == 202, resp.text
    f.expect = {DEPLOYMENT: 2, SPLIT: 1}
    explain = functools.partial(f.diagnose, SPLIT)
    try:
        f.wait(f.healed, 240, "the split beside the replicas", explain)
        yield f
    finally:
        f.expect = {DEPLOYMENT: 2}
        f.post(f"/api/v1/deployments/{SPLIT}/undeploy/", {})
        f.wait(lambda: f.get(f"/api/v1/deployments/{SPLIT}/")["state"] == "stopped", 120,
               "the split stopped", explain)  # fmt: skip
        resp = httpx.delete(f"{f.urls[0]}/api/v1/deployments/{SPLIT}/", headers=f.headers)
        assert resp.status_code == 204, resp.text  # the next fault deploys it afresh


def stage_server(f: Fleet) -> dict:
    """The rpc server node-b runs for the split, as its reports say. The split can be ready
    before node-b's next report (one a second) lists its server: wait for that report."""
    found: list[dict] = []

    def listed() -> bool:
        [node] = [n for n in f.api("/api/v1/nodes/")["results"] if n["name"] == "node-b"]
        found[:] = [s for s in node["rpc_servers"] if s["running"]]
        return len(found) == 1

    f.wait(listed, 30, "node-b reporting the split's rpc server")
    return found[0]


def test_kill_a_split_stage(split):
    """The head's engine fails at its next token; its streams move to the whole replicas,
    and the restart policy brings the split back (its stage's rpc server started anew)."""
    f = split
    pid = stage_server(f)["pid"]
    row = strike(f, "rpc stage kill -9", lambda: os.kill(pid, signal.SIGKILL), lambda: None)
    assert row["completed"] == STREAMS and row["usage_records_lost"] == 0, row


@pytest.mark.skipif(not shutil.which("iptables"), reason="needs iptables")
def test_cut_the_link_between_a_split_head_and_its_stage(split):
    f = split
    port = stage_server(f)["endpoint"].rsplit(":", 1)[1]
    rule = ["INPUT", "-i", "lo", "-p", "tcp", "--dport", port, "-j", "DROP"]

    def iptables(*args: str) -> None:
        subprocess.run(["iptables", *args], check=True, capture_output=True)

    try:
        row = strike(
            f, f"split link cut {LINK_CUT_SECONDS} s", lambda: iptables("-I", *rule),
            lambda: (time.sleep(LINK_CUT_SECONDS), iptables("-D", *rule)),
        )  # fmt: skip
    finally:
        subprocess.run(["iptables", "-D", *rule], capture_output=True)  # if still there
    assert row["completed"] == STREAMS and row["usage_records_lost"] == 0, row
