"""Quantize a GGUF model with llama.cpp's quantizer, then measure source and result.

    python -m workers.engine.quantize --source F --out O --target Q4_K_M
        [--threads N] [--eval-text-file T]

Runs apart from the agent (a crash or its memory stays here). Writes JSON lines to stdout:
{"phase", "done", "total"} while working (tensors, from llama.cpp's own log of each tensor),
then {"result": {"seconds", "source": {...}, "result": {...}}} where each evaluation is
{"tokens", "mean_nll", "decode_tokens_per_second"}.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import sys
import time

#: The targets we offer, by llama.cpp's name, and their llama_ftype.
TARGETS = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17}
#: Sources worth quantizing: full precision, or Q8_0 (requantized, as llama.cpp allows).
SOURCES = {"ALL_F32", "F16", "BF16", "Q8_0"}
DECODE_TOKENS = 64
_TENSOR = re.compile(rb"\[\s*(\d+)/\s*(\d+)\]")


def emit(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def quantize(source: str, out: str, target: str, threads: int) -> None:
    import llama_cpp as L
    from llama_cpp._logger import llama_log_callback as default_log

    @L.llama_log_callback
    def on_log(level, text, user_data):
        m = _TENSOR.search(text or b"")
        if m:
            emit(phase=f"quantizing to {target}", done=int(m.group(1)), total=int(m.group(2)))

    L.llama_log_set(on_log, ctypes.c_void_p(0))
    params = L.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = TARGETS[target]
    params.allow_requantize = True  # a Q8_0 source
    if L.llama_model_quantize(source.encode(), out.encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize failed for {source}")
    L.llama_log_set(default_log, ctypes.c_void_p(0))  # back to llama-cpp-python's


def decode_speed(engine, n: int = DECODE_TOKENS) -> float:
    """Greedy tokens per second of one sequence after a short prompt."""
    import llama_cpp as L

    L.llama_memory_clear(L.llama_get_memory(engine.ctx), True)
    b = engine.batch
    prompt = engine.tokenize("The river town woke slowly", add_bos=True, special=False)

    def feed(tokens, start):
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i] = t, start + i, 1
            b.seq_id[i][0], b.logits[i] = 0, i == len(tokens) - 1
        b.n_tokens = len(tokens)
        if L.llama_decode(engine.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    feed(prompt, 0)
    sampler = L.llama_sampler_init_greedy()
    try:
        started, pos = time.perf_counter(), len(prompt)
        for _ in range(n):
            feed([L.llama_sampler_sample(sampler, engine.ctx, -1)], pos)
            pos += 1
        return n / (time.perf_counter() - started)
    finally:
        L.llama_sampler_free(sampler)


def evaluate(path: str, text: str, threads: int) -> dict:
    from workers.engine.core import BatchEngine
    from workers.engine.nll import mean_nll

    engine = BatchEngine(path, 512, 1, threads=threads, batch_invariant=True)
    try:
        tokens, nll = mean_nll(engine, text)
        return {
            "tokens": tokens,
            "mean_nll": nll,
            "decode_tokens_per_second": decode_speed(engine),
        }
    finally:
        engine.close()


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--source", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--target", required=True, choices=sorted(TARGETS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-text-file", default="")
    args = p.parse_args(argv)
    started = time.monotonic()
    emit(phase=f"quantizing to {args.target}", done=0, total=0)
    quantize(args.source, args.out, args.target, args.threads)
    seconds = time.monotonic() - started
    result: dict = {"seconds": seconds}
    if args.eval_text_file:
        with open(args.eval_text_file, encoding="utf-8") as f:
            text = f.read()
        emit(phase="measuring the source", done=0, total=2)
        result["source"] = evaluate(args.source, text, args.threads)
        emit(phase=f"measuring the {args.target} result", done=1, total=2)
        result["result"] = evaluate(args.out, text, args.threads)
    emit(result=result)


if __name__ == "__main__":
    main(sys.argv[1:])
