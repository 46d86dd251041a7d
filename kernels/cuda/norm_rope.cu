// RMSNorm, RoPE (normal: adjacent pairs; NeoX: halves) and Gemma 3's QK-norm fused with RoPE.
// Rows are the last dimension of a contiguous array; a norm weight of w_rows rows is applied to
// row r with its row r % w_rows (QK-norm: one weight row per Q head then per K head).
// Sums of squares are taken in double, as ggml's rms_norm does (and kernels/cpu/elementwise.py).
#include "quant_blocks.cuh"

#ifndef TS_NORM_THREADS
#define TS_NORM_THREADS 256
#endif

// the row's 1 / sqrt(mean(x^2) + eps), every thread of the block gets it
__device__ float row_inv_rms(const float* x, int dim, float eps) {
    __shared__ double part[TS_NORM_THREADS];
    double s = 0.0;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s += (double)(x[i] * x[i]);
    part[threadIdx.x] = s;
    __syncthreads();
    for (int step = blockDim.x / 2; step > 0; step >>= 1) {
        if (threadIdx.x < step) part[threadIdx.x] += part[threadIdx.x + step];
        __syncthreads();
    }
    float mean = (float)(part[0] / dim);
    __syncthreads();                        // part[] is reused by the next call
    return 1.0f / sqrtf(mean + eps);
}

extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w, int dim, int w_rows,
                                    float eps, float* __restrict__ y) {
    long long r = blockIdx.x;
    const float* xr = x + r * dim;
    const float* wr = w + (r % w_rows) * dim;
    float inv = row_inv_rms(xr, dim, eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) y[r * dim + i] = (xr[i] * inv) * wr[i];
}

// pair j of a head: dims (2j, 2j+1) normally, (j, j + n_dims/2) for NeoX
__device__ __forceinline__ void pair_dims(int j, int n_dims, int neox, int* i0, int* i1) {
    *i0 = neox ? j : 2 * j;
    *i1 = neox ? j + n_dims / 2 : 2 * j + 1;
}

// x, y [n, heads, dim]; cos_t/sin_t [table rows, n_dims / 2] (built on the host in float64, as
// the CPU backend's, then rounded to float32); one block per (token, head)
extern "C" __global__ void rope(const float* __restrict__ x, const long long* __restrict__ pos, const float* __restrict__ cos_t,
                                const float* __restrict__ sin_t, int heads, int dim, int n_dims, int neox,
                                float* __restrict__ y) {
    long long t = blockIdx.x / heads;
    const float* src = x + (long long)blockIdx.x * dim;
    float* dst = y + (long long)blockIdx.x * dim;
    int half = n_dims / 2;
    const float* c = cos_t + pos[t] * half;
    const float* s = sin_t + pos[t] * half;
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        int i0, i1;
        pair_dims(j, n_dims, neox, &i0, &i1);
        ts_rope_pair(src[i0], src[i1], c[j], s[j], dst + i0, dst + i1);
    }
    for (int j = n_dims + threadIdx.x; j < dim; j += blockDim.x) dst[j] = src[j];
}

// Gemma 3: RMSNorm of each Q and K head with its weight row, then RoPE, one pass over the heads
extern "C" __global__ void qk_norm_rope(const float* __restrict__ x, const float* __restrict__ w, int w_rows, float eps,
                                        const long long* __restrict__ pos, const float* __restrict__ cos_t,
                                        const float* __restrict__ sin_t, int heads, int dim, int n_dims, int neox,
                                        float* __restrict__ y) {
    extern __shared__ float normed[];
    long long r = blockIdx.x, t = r / heads;
    const float* xr = x + r * dim;
    const float* wr = w + (r % w_rows) * dim;
    float inv = row_inv_rms(xr, dim, eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) normed[i] = (xr[i] * inv) * wr[i];
    __syncthreads();
    int half = n_dims / 2;
    const float* c = cos_t + pos[t] * half;
    const float* s = sin_t + pos[t] * half;
    float* dst = y + r * dim;
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        int i0, i1;
        pair_dims(j, n_dims, neox, &i0, &i1);
        ts_rope_pair(normed[i0], normed[i1], c[j], s[j], dst + i0, dst + i1);
    }
    for (int j = n_dims + threadIdx.x; j < dim; j += blockDim.x) dst[j] = normed[j];
}
