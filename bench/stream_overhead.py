"""Single-stream overhead of the whole stack versus llama-cpp-python in-process.

Runs against a stack started with `make run` (URL and key from var/env), alternating the two
sides so that machine noise hits both alike, and writes bench/results/stream_overhead.json.
Usage: .venv/bin/python bench/stream_overhead.py [--rounds 5] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx
from llama_cpp import Llama

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
PROMPT = [{"role": "user", "content": "Write a long story about a dragon who learns to sail."}]


def in_process(llm: Llama, tokens: int) -> tuple[float, float, str]:
    llm.reset()  # prefill from scratch, as the engine does (no prompt-prefix cache yet)
    start = time.perf_counter()
    first, pieces = None, []
    for chunk in llm.create_chat_completion(PROMPT, temperature=0, max_tokens=tokens, stream=True):
        text = chunk["choices"][0]["delta"].get("content")
        if text:
            first = first or time.perf_counter()
            pieces.append(text)
    end = time.perf_counter()
    return first - start, (len(pieces) - 1) / (end - first), "".join(pieces)


def through_stack(url: str, key: str, tokens: int) -> tuple[float, float, str]:
    body = {
        "model": MODEL,
        "messages": PROMPT,
        "temperature": 0,
        "max_tokens": tokens,
        "stream": True,
    }
    start = time.perf_counter()
    first, pieces = None, []
    with httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        json=body,
        timeout=120,
        headers={"Authorization": f"Bearer {key}"},
    ) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:])["choices"]
            text = choices[0]["delta"].get("content") if choices else None
            if text:
                first = first or time.perf_counter()
                pieces.append(text)
    end = time.perf_counter()
    return first - start, (len(pieces) - 1) / (end - first), "".join(pieces)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    env = dict(line.split("=", 1) for line in (ROOT / "var/env").read_text().splitlines())
    url, key = "http://127.0.0.1:8000", env["LLAMAFLEET_BOOTSTRAP_KEY"]
    model = next((ROOT / "var/models").glob("sha256-b179c952*.gguf"))
    llm = Llama(str(model), n_ctx=2048, n_threads=2, verbose=False)
    through_stack(url, key, 8)  # warm the channel and the replica
    local, stack = [], []
    for _ in range(args.rounds):
        local.append(in_process(llm, args.tokens))
        stack.append(through_stack(url, key, args.tokens))
    same_text = all(s[2] == local[0][2] for s in stack + local)
    med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
    result = {
        "rounds": args.rounds,
        "max_tokens": args.tokens,
        "in_process": {"ttft_ms": 1000 * med(local, 0), "decode_tokens_per_s": med(local, 1)},
        "stack_sse": {"ttft_ms": 1000 * med(stack, 0), "decode_tokens_per_s": med(stack, 1)},
        "decode_ratio": med(stack, 1) / med(local, 1),
        "ttft_overhead_ms": 1000 * (med(stack, 0) - med(local, 0)),
        "same_text": same_text,
    }
    out = ROOT / "bench/results/stream_overhead.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
