"""What this machine offers: memory, cores, accelerators."""

from __future__ import annotations

import os
import shutil


def meminfo() -> tuple[int, int]:
    """(total, available) physical memory in bytes, from /proc/meminfo."""
    values = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, rest = line.split(":", 1)
            values[key] = int(rest.split()[0]) * 1024
    return values["MemTotal"], values.get("MemAvailable", values.get("MemFree", 0))


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0))


def load_average() -> float:
    """The one-minute load average: how busy the cores are (runnable threads)."""
    return os.getloadavg()[0]


def accelerators() -> list[str]:
    """GPUs visible through nvidia-smi ("name, 24576 MiB"); empty on CPU-only machines.

    LLAMAFLEET_FAKE_ACCELERATOR_MIB reports a pretend one, so that the planner's partial
    offload (n_gpu_layers per node) can be exercised where there is no GPU; it says so in
    its name, and llama.cpp keeps every layer on the CPU regardless.
    """
    fake = os.environ.get("LLAMAFLEET_FAKE_ACCELERATOR_MIB", "")
    if fake.isdigit():
        return [f"fake accelerator (planning only, no device), {int(fake)} MiB"]
    if not shutil.which("nvidia-smi"):
        return []
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]
