// Paged attention for decode and prefill rows alike, over the block tables the CPU backend reads.
// One thread block per (query row, head); its warps split the row's visible keys, each lane owns
// head_dim / 32 dimensions, a warp keeps an online softmax (ts_softmax_push) and the warps merge
// at the end (ts_softmax_merge). The host gives each row its sequence and the end of its visible
// keys (causal: position + 1; non-causal: the whole context); a window > 0 starts the keys at
// end - window (llama.cpp: a query at p sees keys k with p - window < k <= p).
// GQA: head h reads KV head h / (heads / kv_heads). Keys and values are read in the pool's codec.
#include "quant_blocks.cuh"

#ifndef TS_ATTN_WARPS
#define TS_ATTN_WARPS 4
#endif
#define TS_MAX_DIMS_PER_LANE 8          // head_dim <= 256

extern "C" __global__ void paged_attention(
        const float* __restrict__ q, long long ld_q_row, long long ld_q_head,
        const ts_u8* __restrict__ k_cache, const ts_u8* __restrict__ v_cache, int codec,
        const int* __restrict__ tables, int max_blocks, const int* __restrict__ row_seq,
        const int* __restrict__ row_end, int window, float scale,
        int heads, int kv_heads, int head_dim, int block_size, int n_blocks, float* __restrict__ out) {
    __shared__ float s_m[TS_ATTN_WARPS], s_l[TS_ATTN_WARPS];
    __shared__ float s_acc[TS_ATTN_WARPS][32 * TS_MAX_DIMS_PER_LANE];
    int row = blockIdx.x, h = blockIdx.y;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int per_lane = head_dim >> 5;
    int kvh = h / (heads / kv_heads);
    int end = row_end[row];
    int start = window > 0 && end > window ? end - window : 0;
    const int* table = tables + (long long)row_seq[row] * max_blocks;
    int row_bytes = ts_kv_row_bytes(codec, head_dim);

    float qv[TS_MAX_DIMS_PER_LANE], acc[TS_MAX_DIMS_PER_LANE];
    const float* qr = q + row * ld_q_row + h * ld_q_head;
#pragma unroll
    for (int j = 0; j < TS_MAX_DIMS_PER_LANE; j++) {
        qv[j] = j < per_lane ? qr[lane + 32 * j] * scale : 0.0f;    // q * scale first, as the CPU backend
        acc[j] = 0.0f;
    }
    float m = ts_neg_inf(), l = 0.0f;
    for (int k = start + warp; k < end; k += TS_ATTN_WARPS) {
        long long off = (((long long)kvh * n_blocks + table[k / block_size]) * block_size + k % block_size) * row_bytes;
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < TS_MAX_DIMS_PER_LANE; j++)
            if (j < per_lane) dot += qv[j] * ts_kv_value(codec, k_cache + off, lane + 32 * j);
        for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xFFFFFFFFu, dot, o);
        float p, f = ts_softmax_push(&m, &l, dot, &p);
#pragma unroll
        for (int j = 0; j < TS_MAX_DIMS_PER_LANE; j++)
            if (j < per_lane) acc[j] = acc[j] * f + p * ts_kv_value(codec, v_cache + off, lane + 32 * j);
    }
    if (lane == 0) { s_m[warp] = m; s_l[warp] = l; }
    for (int j = 0; j < per_lane; j++) s_acc[warp][lane + 32 * j] = acc[j];
    __syncthreads();
    if (warp != 0) return;
    // warp 0 merges the other warps' states into its own
    for (int w = 1; w < TS_ATTN_WARPS; w++) {
        float f_self, f_other;
        ts_softmax_merge(&m, &l, s_m[w], s_l[w], &f_self, &f_other);
        for (int j = 0; j < per_lane; j++) acc[j] = acc[j] * f_self + s_acc[w][lane + 32 * j] * f_other;
    }
    float inv = l > 0.0f ? 1.0f / l : 0.0f;     // a row with no visible key gives zeros
    float* dst = out + ((long long)row * heads + h) * head_dim;
    for (int j = 0; j < per_lane; j++) dst[lane + 32 * j] = acc[j] * inv;
}
