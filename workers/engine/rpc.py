"""llama.cpp's RPC backend through ctypes: serve this machine's CPU to a head elsewhere, or
register remote servers as devices for a model that is split across machines.

The wheel installs each library twice (`libggml.so` and `libggml.so.0`); libllama links the
`.so.0` copies, so those are the ones to load, or the devices registered here would live in
a copy llama.cpp never sees. Both functions below run in child processes only: the server
never returns, and a dead server aborts the head's process.
"""

from __future__ import annotations

import ctypes
import os

import llama_cpp

_LIB_DIR = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
GGML_BACKEND_DEVICE_TYPE_CPU = 0


def _libs() -> tuple[ctypes.CDLL, ctypes.CDLL, ctypes.CDLL]:
    load = lambda name: ctypes.CDLL(os.path.join(_LIB_DIR, name), mode=ctypes.RTLD_GLOBAL)  # noqa: E731
    base, ggml, rpc = load("libggml-base.so.0"), load("libggml.so.0"), load("libggml-rpc.so.0")
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
    rpc.ggml_backend_rpc_start_server.argtypes = [
        ctypes.c_char_p,  # endpoint host:port
        ctypes.c_char_p,  # local cache directory, or NULL
        ctypes.c_size_t,  # threads
        ctypes.c_size_t,  # number of devices
        ctypes.c_void_p,  # ggml_backend_dev_t devices[]
    ]
    rpc.ggml_backend_rpc_get_device_memory.argtypes = [
        ctypes.c_char_p,  # endpoint
        ctypes.c_uint32,  # device index
        ctypes.POINTER(ctypes.c_size_t),  # free (out)
        ctypes.POINTER(ctypes.c_size_t),  # total (out)
    ]
    rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    base.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    base.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
    base.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
    base.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return base, ggml, rpc


def serve(endpoint: str, threads: int, cache_dir: str = "") -> None:
    """Serve this machine's CPU at endpoint (host:port); returns only if it cannot bind."""
    _, ggml, rpc = _libs()
    cpu = ggml.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    devices = (ctypes.c_void_p * 1)(cpu)
    rpc.ggml_backend_rpc_start_server(
        endpoint.encode(), cache_dir.encode() if cache_dir else None, threads, 1, devices
    )


def devices(endpoints: list[str]) -> ctypes.Array:
    """Register the servers; a NULL-terminated device array for llama_model_params.devices.

    Registration is per process and lasts for its life; the array names this model's
    devices only, so several models in one process could use different servers.
    """
    base, ggml, rpc = _libs()
    found: list[int] = []
    for endpoint in endpoints:
        reg = rpc.ggml_backend_rpc_add_server(endpoint.encode())
        if not reg:
            raise OSError(f"no rpc server answers at {endpoint}")
        ggml.ggml_backend_register(reg)
        found.extend(
            base.ggml_backend_reg_dev_get(reg, i)
            for i in range(base.ggml_backend_reg_dev_count(reg))
        )
    return (ctypes.c_void_p * (len(found) + 1))(*found, None)


def device_memory(endpoint: str) -> tuple[int, int]:
    """(free, total) bytes an rpc server's first device offers. Connecting runs ggml's HELLO
    handshake, which checks the protocol version; a failure may abort the process, so
    call this in a child (python -m workers.engine.rpc check ENDPOINT...)."""
    _, _, rpc = _libs()
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    rpc.ggml_backend_rpc_get_device_memory(endpoint.encode(), 0, free, total)
    return free.value, total.value


if __name__ == "__main__":
    import json
    import sys

    if sys.argv[1:2] == ["check"]:
        free, total = device_memory(sys.argv[2])
        print(json.dumps({"free_bytes": free, "total_bytes": total}), flush=True)
