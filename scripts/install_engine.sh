#!/usr/bin/env bash
# Install llama-cpp-python built from source with the RPC backend and portable CPU kernels,
# then verify what got installed (a cached wheel may have been built with other flags).
set -euo pipefail
PY=${1:-python}
VERSION=0.3.36
FLAGS="-DGGML_RPC=ON -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"

if "$PY" scripts/check_engine.py --quiet 2>/dev/null \
   && "$PY" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')"; then
  exit 0
fi
echo "Installing llama-cpp-python $VERSION (a first build from source takes about 8 minutes)..."
CMAKE_ARGS="$FLAGS" "$PY" -m pip install -q "llama-cpp-python==$VERSION"
if ! "$PY" scripts/check_engine.py; then
  echo "The cached build is not usable; rebuilding from source without the cache..."
  CMAKE_ARGS="$FLAGS" "$PY" -m pip install -q --force-reinstall --no-cache-dir \
    --no-binary llama-cpp-python --no-deps "llama-cpp-python==$VERSION"
  "$PY" scripts/check_engine.py
fi
