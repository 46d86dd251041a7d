// Host entry points over kernels/cuda/quant_blocks.cuh for tests/test_cuda_host_numerics.py: the
// header's __host__ __device__ functions, compiled by nvcc for the CPU into a shared library and
// called through ctypes, so their numerics are checked against numpy without a GPU.
#include "quant_blocks.cuh"

extern "C" {

void ts_dequant(int type, const ts_u8* blocks, long long n_blocks, float* out) {
    int be = ts_block_elems(type), bb = ts_block_bytes(type);
    for (long long b = 0; b < n_blocks; b++)
        for (int i = 0; i < be; i++) out[b * be + i] = ts_block_value(type, blocks + b * bb, i);
}

void ts_halves_to_floats(const ts_u16* h, long long n, float* out) {
    for (long long i = 0; i < n; i++) out[i] = ts_half_to_float(h[i]);
}

void ts_floats_to_halves(const float* x, long long n, ts_u16* out) {
    for (long long i = 0; i < n; i++) out[i] = ts_float_to_half(x[i]);
}

// rows [n_rows, head_dim] float32 -> the codec's row bytes, and back
void ts_kv_encode(int codec, const float* x, long long n_rows, int head_dim, ts_u8* out) {
    int rb = ts_kv_row_bytes(codec, head_dim);
    for (long long r = 0; r < n_rows; r++)
        for (int blk = 0; blk < head_dim / 32; blk++) {
            const float* src = x + r * head_dim + blk * 32;
            ts_u8* dst = out + r * rb;
            if (codec == TS_KV_F16)
                for (int j = 0; j < 32; j++) {
                    ts_u16 h = ts_float_to_half(src[j]);
                    dst[2 * (blk * 32 + j)] = (ts_u8)(h & 0xFF); dst[2 * (blk * 32 + j) + 1] = (ts_u8)(h >> 8);
                }
            else if (codec == TS_KV_Q8_0) ts_q8_0_encode(src, dst + blk * 34);
            else ts_q4_0_encode(src, dst + blk * 18);
        }
}

void ts_kv_decode(int codec, const ts_u8* rows, long long n_rows, int head_dim, float* out) {
    int rb = ts_kv_row_bytes(codec, head_dim);
    for (long long r = 0; r < n_rows; r++)
        for (int i = 0; i < head_dim; i++) out[r * head_dim + i] = ts_kv_value(codec, rows + r * rb, i);
}

void ts_rope_pairs(const float* x0, const float* x1, const float* c, const float* s, long long n, float* r0, float* r1) {
    for (long long i = 0; i < n; i++) ts_rope_pair(x0[i], x1[i], c[i], s[i], r0 + i, r1 + i);
}

// softmax(scores) . values as the attention kernel takes it: the keys split among `parts`
// interleaved states (warp w takes keys w, w + parts, ...), each pushed one score at a time,
// then merged into state 0
void ts_softmax_weighted(const float* scores, const float* values, int n, int parts, float* out) {
    float m[64], l[64], acc[64];
    for (int p = 0; p < parts; p++) { m[p] = ts_neg_inf(); l[p] = 0.0f; acc[p] = 0.0f; }
    for (int k = 0; k < n; k++) {
        int p = k % parts;
        float w, f = ts_softmax_push(&m[p], &l[p], scores[k], &w);
        acc[p] = acc[p] * f + w * values[k];
    }
    for (int p = 1; p < parts; p++) {
        float fs, fo;
        ts_softmax_merge(&m[0], &l[0], m[p], l[p], &fs, &fo);
        acc[0] = acc[0] * fs + acc[p] * fo;
    }
    *out = l[0] > 0.0f ? acc[0] / l[0] : 0.0f;
}

void ts_uniforms(ts_u64 seed, const ts_u64* counters, long long n, double* out) {
    for (long long i = 0; i < n; i++) out[i] = ts_uniform(seed, counters[i]);
}

}
