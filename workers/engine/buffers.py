"""What llama.cpp allocates when it loads a model, by device, read from its own log.

The planner's memory estimate is checked against these numbers (tests, bench). Run as
`python -m workers.engine.buffers --model F --context N --parallel P [--rpc host:port ...]`:
it loads the model the way the engine does and prints the buffer sizes as JSON, in bytes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict

#: "CPU_Mapped model buffer size =  98.95 MiB", "RPC0[10.0.0.2:50052] KV buffer size = ..."
_LINE = re.compile(
    r"(?P<device>\S+)\s+(?P<kind>model|KV|compute|output)\s+buffer size\s*=\s*(?P<mib>[\d.]+) MiB"
)


def parse(log_text: str) -> dict[str, dict[str, int]]:
    """{device: {"model"|"kv"|"compute"|"output": bytes}} summed over the log's lines.

    Device names are normalised: CPU_Mapped, CPU_REPACK and CPU are all "CPU"; an RPC
    device is named by its endpoint.
    """
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for m in _LINE.finditer(log_text):
        device = m["device"]
        if device.startswith("CPU"):
            device = "CPU"
        elif "[" in device:  # RPC0[host:port]
            device = device[device.index("[") + 1 : device.rindex("]")]
        out[device][m["kind"].lower()] += int(float(m["mib"]) * 2**20)
    return {d: dict(kinds) for d, kinds in out.items()}


def measure(argv: list[str]) -> dict[str, dict[str, int]]:
    """Load a model as the engine would, with llama.cpp's log captured; its buffer sizes."""
    import llama_cpp as L

    from workers.engine.core import BatchEngine

    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--context", type=int, required=True)
    p.add_argument("--parallel", type=int, required=True)
    p.add_argument("--rpc", nargs="*", default=[])
    p.add_argument("--n-gpu-layers", type=int, default=-1)
    p.add_argument("--split-mode", type=int, default=1)
    p.add_argument("--tensor-split", type=float, nargs="*", default=[])
    p.add_argument("--invariant", action="store_true", help="the batch-invariant mode")
    p.add_argument("--swa-cache", choices=("full", "window"), default="full")
    args = p.parse_args(argv)
    chunks: list[str] = []

    @L.llama_log_callback
    def _log(_level, text, _user_data):
        chunks.append(text.decode(errors="replace"))

    L.llama_log_set(_log, None)
    BatchEngine(
        args.model,
        args.context,
        args.parallel,
        threads=1,
        rpc_servers=args.rpc,
        n_gpu_layers=args.n_gpu_layers,
        split_mode=args.split_mode,
        tensor_split=args.tensor_split or None,
        batch_invariant=args.invariant,
        swa_full=args.swa_cache == "full",
    )
    return parse("".join(chunks))


if __name__ == "__main__":
    json.dump(measure(sys.argv[1:]), sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
