// K/V rows into the paged pool, [kv_heads, blocks, block_size, row_bytes] bytes in the pool's
// codec (f16 values, or ggml's q8_0/q4_0 blocks: the bytes of kernels/cpu/kv_codecs.py).
// The source rows may be a strided view (K is a slice of the fused Q|K heads): token stride
// ld_tok and head stride ld_head, in floats.
#include "quant_blocks.cuh"

// one thread per (token, head, 32-value block): a block's scale needs all 32 values
extern "C" __global__ void store_kv(const float* __restrict__ src, long long ld_tok, long long ld_head,
                                    const long long* __restrict__ slots, int n_tokens, int kv_heads, int head_dim,
                                    int codec, int block_size, int n_blocks, ts_u8* __restrict__ cache) {
    int per_row = head_dim / 32;
    long long total = (long long)n_tokens * kv_heads * per_row;
    int row_bytes = ts_kv_row_bytes(codec, head_dim);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        int blk = (int)(i % per_row);
        long long th = i / per_row;
        int h = (int)(th % kv_heads);
        long long t = th / kv_heads;
        long long slot = slots[t];
        if (slot < 0) continue;             // a padded row stores nothing
        long long block = slot / block_size, off = slot % block_size;
        ts_u8* row = cache + (((long long)h * n_blocks + block) * block_size + off) * row_bytes;
        const float* x = src + t * ld_tok + h * ld_head + blk * 32;
        if (codec == TS_KV_F16) {
            for (int j = 0; j < 32; j++) {
                ts_u16 b = ts_float_to_half(x[j]);
                row[2 * (blk * 32 + j)] = (ts_u8)(b & 0xFF);
                row[2 * (blk * 32 + j) + 1] = (ts_u8)(b >> 8);
            }
        } else if (codec == TS_KV_Q8_0) {
            ts_q8_0_encode(x, row + blk * 34);
        } else {
            ts_q4_0_encode(x, row + blk * 18);
        }
    }
}
