"""Verify the installed llama-cpp-python: RPC backend present, no native-only CPU kernels.

pip reuses a cached wheel whatever CMAKE_ARGS say, so the flags prove nothing: this looks
at what is installed. Exit status 0 when usable; otherwise it says what is wrong and how
to fix it.
"""

from __future__ import annotations

import ctypes
import os
import sys

FIX = (
    "Rebuild it: CMAKE_ARGS='-DGGML_RPC=ON -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON "
    "-DGGML_F16C=ON' pip install --force-reinstall --no-cache-dir --no-binary llama-cpp-python "
    "llama-cpp-python==0.3.36   (or: make engine-rebuild)"
)


def problems() -> list[str]:
    try:
        import llama_cpp
    except ImportError as exc:
        return [f"llama-cpp-python is not installed ({exc})"]
    found = []
    libdir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    try:
        # libllama links the .so.0 copies: symbols must be in those, not only in libggml-rpc.so.
        rpc = ctypes.CDLL(os.path.join(libdir, "libggml-rpc.so.0"))
        for symbol in ("ggml_backend_rpc_add_server", "ggml_backend_rpc_start_server"):
            if not hasattr(rpc, symbol):
                found.append(f"libggml-rpc.so.0 lacks {symbol}")
    except OSError:
        found.append("the RPC backend (libggml-rpc.so.0) is missing: built without -DGGML_RPC=ON")
    info = llama_cpp.llama_print_system_info().decode()
    if "AMX" in info:
        found.append(
            "the build has AMX kernels (a native build); they crash on the first decode here"
        )
    return found


def main() -> int:
    found = problems()
    if not found:
        if "--quiet" not in sys.argv:
            print("llama-cpp-python: RPC backend present, portable CPU build")
        return 0
    for p in found:
        print(f"llama-cpp-python: {p}", file=sys.stderr)
    print(FIX, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
