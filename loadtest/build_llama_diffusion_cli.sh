#!/usr/bin/env bash
# Builds llama.cpp's `llama-diffusion-cli` (the peer of loadtest/bench_diffusion.py, issue #30
# item 8) from the llama.cpp sources vendored in the llama-cpp-python 0.3.36 sdist, as
# docs/BENCHMARKS.md builds llama-server: native (without AMX where it faults: native_flags.sh), no BLAS, no curl/openssl, no tests.
#
#   loadtest/build_llama_diffusion_cli.sh [DIR]      # default DIR: /work/peer-diffusion
#
# DIR gets the sdist, its sources (DIR/llama_cpp_python-0.3.36) and the build tree (DIR/build);
# the binary is DIR/build/bin/llama-diffusion-cli (about 10-15 minutes on two cores).
# PYTHON (default python3) runs `pip download`; JOBS (default 2) is the build's parallelism.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)

VERSION=0.3.36
DIR=${1:-/work/peer-diffusion}
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-2}

mkdir -p "$DIR"
cd "$DIR"
SDIST=llama_cpp_python-$VERSION.tar.gz
if [ ! -f "$SDIST" ]; then
  "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d .
fi
SRC=$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp
if [ ! -d "$SRC" ]; then
  tar xzf "$SDIST"
fi
if [ ! -f "$SRC/examples/diffusion/diffusion-cli.cpp" ]; then
  echo "the sdist's llama.cpp has no examples/diffusion: no llama-diffusion-cli to build" >&2
  exit 1
fi

source "$HERE/native_flags.sh"
cmake -S "$SRC" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release "${NATIVE_FLAGS[@]}" -DGGML_BLAS=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON \
  -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
cmake --build "$DIR/build" --target llama-diffusion-cli -j"$JOBS"
echo "$DIR/build/bin/llama-diffusion-cli"
