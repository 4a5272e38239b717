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
    """GPUs visible through nvidia-smi; empty on CPU-only machines."""
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
