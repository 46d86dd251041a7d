// Rows of an embedding table left in its GGUF encoding (llama.cpp's get_rows): one thread block a
// row, every element decoded from its block; the table stays quantized on the device.
#include "quant_blocks.cuh"

extern "C" __global__ void embed_rows(const ts_u8* __restrict__ table, int type, int n_cols, int n_rows,
                                      const long long* __restrict__ ids, float* __restrict__ out) {
    long long id = ids[blockIdx.x];
    float* dst = out + (long long)blockIdx.x * n_cols;
    if (id < 0 || id >= n_rows) {           // the launcher checks ids; NaN marks a row it missed
        for (int i = threadIdx.x; i < n_cols; i += blockDim.x) dst[i] = ts_bits_float(0x7FC00000u);
        return;
    }
    int be = ts_block_elems(type), bb = ts_block_bytes(type);
    const ts_u8* row = table + id * (long long)(n_cols / be) * bb;
    for (int i = threadIdx.x; i < n_cols; i += blockDim.x) {
        int b = i / be;
        dst[i] = ts_block_value(type, row + (long long)b * bb, i - b * be);
    }
}
