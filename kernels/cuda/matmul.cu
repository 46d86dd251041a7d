// Products straight from a GGUF matrix's blocks, W [n_out, n_in] row-major as stored in the file.
// gemv_blocks: decode (a few rows of x): one warp per output row, its lanes walking the row's
//   elements in order so each block's bytes are read by adjacent lanes; every x row of the call
//   (up to TS_MAX_ROWS) shares the weight read, which is what decode is bound by.
// dequant_f16: prefill: the matrix in float16 for cuBLAS (the launcher multiplies it with
//   gemmEx, f16 inputs, f32 accumulation and output), as llama.cpp's CUDA backend does.
#include "quant_blocks.cuh"

#ifndef TS_GEMV_WARPS
#define TS_GEMV_WARPS 4
#endif
#ifndef TS_MAX_ROWS
#define TS_MAX_ROWS 8
#endif

extern "C" __global__ void gemv_blocks(const ts_u8* __restrict__ w, int type, int n_out, int n_in,
                                       const float* __restrict__ x, int ldx, int n_rows,
                                       float* __restrict__ y, int ldy) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int o = blockIdx.x * TS_GEMV_WARPS + warp;
    if (o >= n_out) return;
    int be = ts_block_elems(type), bb = ts_block_bytes(type);
    const ts_u8* row = w + (long long)o * (n_in / be) * bb;
    float acc[TS_MAX_ROWS];
#pragma unroll
    for (int r = 0; r < TS_MAX_ROWS; r++) acc[r] = 0.0f;
    for (int e = lane; e < n_in; e += 32) {
        int b = e / be;
        float v = ts_block_value(type, row + (long long)b * bb, e - b * be);
#pragma unroll
        for (int r = 0; r < TS_MAX_ROWS; r++)
            if (r < n_rows) acc[r] += v * x[(long long)r * ldx + e];
    }
#pragma unroll
    for (int r = 0; r < TS_MAX_ROWS; r++) {
        float s = acc[r];
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, off);
        if (lane == 0 && r < n_rows) y[(long long)r * ldy + o] = s;
    }
}

// out[e] = element e of the matrix as float16 bits, e < n_out * n_in
extern "C" __global__ void dequant_f16(const ts_u8* __restrict__ w, int type, long long n_elems,
                                       ts_u16* __restrict__ out) {
    int be = ts_block_elems(type), bb = ts_block_bytes(type);
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n_elems;
         e += (long long)gridDim.x * blockDim.x) {
        long long b = e / be;
        out[e] = ts_float_to_half(ts_block_value(type, w + b * bb, (int)(e - b * be)));
    }
}

// out[i] = float32 of a float32 row-major x as float16 bits (the activations cuBLAS reads)
extern "C" __global__ void to_f16(const float* __restrict__ x, long long n, ts_u16* __restrict__ out) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = ts_float_to_half(x[i]);
}
