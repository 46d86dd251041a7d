// Gated activations over [n, d] rows; gate and up may be column slices of one fused
// gate|up product (row strides ld_gate, ld_up), the output is contiguous.
#include "quant_blocks.cuh"

extern "C" __global__ void swiglu(const float* __restrict__ gate, int ld_gate, const float* __restrict__ up,
                                  int ld_up, int n, int d, float* __restrict__ out) {
    long long total = (long long)n * d;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / d; int c = (int)(i - r * d);
        float g = gate[r * ld_gate + c], u = up[r * ld_up + c];
        // silu(g) * u = g * u / (1 + exp(-g)); exp overflows to inf for g < -88, giving the right 0
        out[i] = (g * u) / (1.0f + expf(-g));
    }
}

extern "C" __global__ void gelu_tanh_gate(const float* __restrict__ gate, int ld_gate, const float* __restrict__ up,
                                          int ld_up, int n, int d, float* __restrict__ out) {
    long long total = (long long)n * d;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / d; int c = (int)(i - r * d);
        float g = gate[r * ld_gate + c], u = up[r * ld_up + c];
        float inner = g * (0.7978845608028654f + 0.044715f * 0.7978845608028654f * g * g);
        out[i] = 0.5f * g * (1.0f + tanhf(inner)) * u;
    }
}
