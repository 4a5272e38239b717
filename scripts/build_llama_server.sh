#!/usr/bin/env bash
# Build llama.cpp's own llama-server from the llama.cpp vendored in the pinned
# llama-cpp-python sdist, with the engine's CMake flags: the reference the serving benchmark
# compares LlamaFleet with (same sources, same kernels). Built once, kept under var/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
VERSION=0.3.36
FLAGS="-DGGML_RPC=ON -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
OUT=${LLAMA_SERVER_DIR:-var/llama-server}
BIN="$OUT/llama-server"
if [ -x "$BIN" ] && [ "$(cat "$OUT/VERSION" 2>/dev/null)" = "$VERSION $FLAGS" ]; then
  exit 0
fi
mkdir -p "$OUT"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "Building llama-server from llama-cpp-python $VERSION's vendored llama.cpp (about 6 minutes)..."
"$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
  -d "$work" "llama-cpp-python==$VERSION"
tar -xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work"
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
# shellcheck disable=SC2086
cmake -S "$src" -B "$work/build" $FLAGS -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF >"$OUT/cmake.log"
cmake --build "$work/build" --target llama-server -j"$(nproc)" >>"$OUT/cmake.log"
cp "$work/build/bin/llama-server" "$BIN"
echo "$VERSION $FLAGS" >"$OUT/VERSION"
echo "llama-server built: $BIN"
