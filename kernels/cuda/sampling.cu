// Token choice on the device, so that only token ids return to the host.
// argmax_rows: the first index of each row's largest logit, -1 for a row with a NaN or infinite
//   logit (kernels/cpu/row_argmax.py's convention, which sends such rows to the host's checks).
// sample_sorted: rows already sorted best first (ids beside them): temperature, top-k, top-p and a
//   draw from ts_uniform(seed, counter), one thread block a row.
#include "quant_blocks.cuh"

#define TS_SAMPLE_THREADS 256

extern "C" __global__ void argmax_rows(const float* __restrict__ x, int vocab, long long* __restrict__ out) {
    __shared__ float s_v[TS_SAMPLE_THREADS];
    __shared__ int s_i[TS_SAMPLE_THREADS], s_bad[TS_SAMPLE_THREADS];
    const float* r = x + (long long)blockIdx.x * vocab;
    float best = ts_neg_inf();
    int idx = 0x7FFFFFFF, bad = 0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = r[i];
        if (!(v - v == 0.0f)) bad = 1;                  // NaN or infinite
        else if (v > best || (v == best && i < idx)) { best = v; idx = i; }
    }
    s_v[threadIdx.x] = best; s_i[threadIdx.x] = idx; s_bad[threadIdx.x] = bad;
    __syncthreads();
    for (int step = blockDim.x / 2; step > 0; step >>= 1) {
        if (threadIdx.x < step) {
            float v = s_v[threadIdx.x + step]; int i = s_i[threadIdx.x + step];
            if (v > s_v[threadIdx.x] || (v == s_v[threadIdx.x] && i < s_i[threadIdx.x])) {
                s_v[threadIdx.x] = v; s_i[threadIdx.x] = i;
            }
            s_bad[threadIdx.x] |= s_bad[threadIdx.x + step];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = s_bad[0] ? -1 : (long long)s_i[0];
}

// vals/ids [rows, vocab] sorted best first; weights scratch [rows, vocab]. top_k <= 0: no top-k;
// top_p >= 1: no top-p. Weights are exp((v - v0) / T); the kept set is the top-k, cut to the
// fewest leading entries whose weight reaches top_p of the top-k's; the draw is inverse-CDF.
extern "C" __global__ void sample_sorted(const float* __restrict__ vals, const long long* __restrict__ ids, int vocab,
                                         const float* __restrict__ temperature, const int* __restrict__ top_k,
                                         const float* __restrict__ top_p, const ts_u64* __restrict__ seeds,
                                         const ts_u64* __restrict__ counters, float* __restrict__ weights,
                                         long long* __restrict__ out) {
    __shared__ double s_sum[TS_SAMPLE_THREADS];
    __shared__ int s_cut;
    long long r = blockIdx.x;
    const float* v = vals + r * vocab;
    float* w = weights + r * vocab;
    int n = top_k[r] > 0 && top_k[r] < vocab ? top_k[r] : vocab;
    float inv_t = 1.0f / temperature[r];
    // contiguous chunks per thread, so that a chunk's prefix sums are in the sorted order
    int chunk = (n + blockDim.x - 1) / blockDim.x, lo = threadIdx.x * chunk;
    int hi = lo + chunk < n ? lo + chunk : n;
    double s = 0.0;
    for (int i = lo; i < hi; i++) { w[i] = expf((v[i] - v[0]) * inv_t); s += w[i]; }
    s_sum[threadIdx.x] = s;
    if (threadIdx.x == 0) s_cut = n;
    __syncthreads();
    if (threadIdx.x == 0) {                 // exclusive prefix over the chunks (256 adds)
        double run = 0.0;
        for (int t = 0; t < (int)blockDim.x; t++) { double c = s_sum[t]; s_sum[t] = run; run += c; }
        s_sum[0] = run;                     // slot 0's prefix is 0: keep the total there instead
    }
    __syncthreads();
    double total = s_sum[0];
    double before = threadIdx.x == 0 ? 0.0 : s_sum[threadIdx.x];
    if (top_p[r] < 1.0f) {                  // the first entry whose running sum reaches top_p * total
        double goal = (double)top_p[r] * total, run = before;
        for (int i = lo; i < hi; i++) { run += w[i]; if (run >= goal) { atomicMin(&s_cut, i + 1); break; } }
    }
    __syncthreads();
    int cut = s_cut;
    // the kept mass: the running sum at cut, taken by the one thread whose chunk holds entry
    // cut - 1 in the same order as above (no atomics: the draw must not vary between runs)
    __shared__ double s_kept;
    if (lo < cut && cut <= hi) {
        double run = before;
        for (int i = lo; i < cut; i++) run += w[i];
        s_kept = run;
    }
    __syncthreads();
    double target = ts_uniform(seeds[r], counters[r]) * s_kept;
    double run = before;
    __shared__ int s_pick;
    if (threadIdx.x == 0) s_pick = cut - 1;     // rounding may leave the target past the last sum
    __syncthreads();
    for (int i = lo; i < (hi < cut ? hi : cut); i++) { run += w[i]; if (run > target) { atomicMin(&s_pick, i); break; } }
    __syncthreads();
    if (threadIdx.x == 0) out[r] = ids[r * vocab + s_pick];
}
