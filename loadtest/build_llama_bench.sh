#!/usr/bin/env bash
# Builds llama.cpp's llama-bench (the peer of `bench_forward.py --depths`, issue #35) from the
# llama.cpp sources vendored in the llama-cpp-python sdist, natively for this CPU.
#   loadtest/build_llama_bench.sh [OUT_DIR]     (default /work/peer-bench; ~10 min on 2 cores)
# then: LLAMA_BENCH=OUT_DIR/build/bin/llama-bench python loadtest/bench_forward.py --depths ...
set -euo pipefail
OUT=${1:-/work/peer-bench}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if [ ! -d "$OUT/src" ]; then
  "$PY" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$OUT/sdist"
  mkdir -p "$OUT/src"
  tar -xzf "$OUT"/sdist/llama_cpp_python-*.tar.gz -C "$OUT/src" --strip-components=1
fi
# Some virtual machines list AMX among the CPU's flags but fault on its tile instructions (an
# "Illegal instruction" from llama-bench's first product): probe them, and build without AMX if so.
NO_AMX=()
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null && command -v cc >/dev/null; then
  PROBE=$(mktemp -d)
  cat > "$PROBE/amx.c" <<'C'
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    unsigned char cfg[64];
    if (syscall(SYS_arch_prctl, 0x1023, 18)) return 2;   /* ARCH_REQ_XCOMP_PERM: tile data */
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1; cfg[16] = 64; cfg[48] = 16;               /* palette 1, tile 0: 16 rows of 64 bytes */
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
C
  if ! { cc -O1 -mamx-tile "$PROBE/amx.c" -o "$PROBE/amx" && "$PROBE/amx"; } 2>/dev/null; then
    echo "this CPU lists AMX but cannot run its tile instructions here: building llama-bench without AMX"
    NO_AMX=(-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
            -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
  fi
  rm -rf "$PROBE"
fi
cmake -S "$OUT/src/vendor/llama.cpp" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON "${NO_AMX[@]}" \
  -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF
cmake --build "$OUT/build" --target llama-bench -j"$(nproc)"
echo "built $OUT/build/bin/llama-bench"
