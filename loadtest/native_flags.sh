# Sourced by the llama.cpp peer build scripts (build_llama_bench.sh, build_llama_diffusion_cli.sh):
# sets NATIVE_FLAGS, the cmake flags of a native build for this CPU. Some virtual machines list AMX
# among the CPU's flags but fault on its tile instructions (an "Illegal instruction" from the
# peer's first product): the probe below runs them, and where they fault the build leaves AMX out.
NATIVE_FLAGS=(-DGGML_NATIVE=ON)
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null && command -v cc >/dev/null; then
  _probe=$(mktemp -d)
  cat > "$_probe/amx.c" <<'C'
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
  if ! { cc -O1 -mamx-tile "$_probe/amx.c" -o "$_probe/amx" && "$_probe/amx"; } 2>/dev/null; then
    echo "this CPU lists AMX but cannot run its tile instructions here: building without AMX" >&2
    NATIVE_FLAGS+=(-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
                   -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
  fi
  rm -rf "$_probe"
fi
