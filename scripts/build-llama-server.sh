#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the llama-cpp-python sdist on PyPI (it vendors llama.cpp),
# offline apart from PyPI, and cache the binary by version so later runs skip the ~5-minute build.
#
# Usage: scripts/build-llama-server.sh            prints the binary's path (builds it if missing)
# Env:   KVGATE_LLAMA_CPP_PYTHON_VERSION  sdist version (default 0.3.36, llama.cpp commit 0c1e570)
#        XDG_CACHE_HOME                    cache root (default ~/.cache); binary under kvgate/llama-server/<version>/
# Needs: cmake, ninja (Debian: cmake ninja-build), a C++ compiler, python3 with pip.
set -euo pipefail
version=${KVGATE_LLAMA_CPP_PYTHON_VERSION:-0.3.36}
cache=${XDG_CACHE_HOME:-$HOME/.cache}/kvgate/llama-server/$version
bin=$cache/llama-server
if [[ -x $bin ]]; then
  echo "$bin"
  exit 0
fi
for tool in cmake ninja c++; do
  command -v "$tool" >/dev/null || { echo "build-llama-server: $tool is missing (apt-get install cmake ninja-build g++)" >&2; exit 2; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work" >&2
tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src=$work/llama_cpp_python-$version/vendor/llama.cpp
# LLAMA_USE_PREBUILT_UI defaults to ON and downloads the web UI at build time: off (offline).
# GGML_NATIVE=OFF: the cached binary must run on any x86-64 machine that shares the cache.
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF >&2
cmake --build "$work/build" --target llama-server -j "$(nproc)" >&2
mkdir -p "$cache"
cp "$work/build/bin/llama-server" "$bin.tmp"
mv "$bin.tmp" "$bin"
echo "$bin"
