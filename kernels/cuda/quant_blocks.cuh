// Numerics shared by the CUDA kernels and by the host tests (tests/cuda_host/host_numerics.cu):
// decoding one element of a GGUF block of each supported type, the KV pool's q8_0/q4_0 codecs,
// float16 conversions, RoPE's rotation of a pair, the online-softmax steps and the sampler's
// counter-based uniform. Everything is `__host__ __device__` so the very code the kernels run is
// compared on the CPU against the project's numpy references (shared/dequant.py,
// kernels/cpu/kv_codecs.py) without a GPU.
//
// No header is included: the file must compile under NVRTC (CuPy's RawModule, no host standard
// headers) and under nvcc alike. Products and sums that the numpy references round separately are
// written with __fmul_rn/__fadd_rn on the device: nvcc would otherwise contract them into FMAs and
// the results would stop being bit-identical to ggml's scalar reference.
#pragma once

#ifdef __CUDA_ARCH__
#define TS_MUL(a, b) __fmul_rn((a), (b))
#define TS_ADD(a, b) __fadd_rn((a), (b))
#define TS_SUB(a, b) __fsub_rn((a), (b))
#else
#define TS_MUL(a, b) ((a) * (b))
#define TS_ADD(a, b) ((a) + (b))
#define TS_SUB(a, b) ((a) - (b))
#endif

#define TS_INLINE __host__ __device__ __forceinline__

// GGML type numbers (ggml.h's enum ggml_type): the Python side passes them unchanged.
#define TS_F32 0
#define TS_F16 1
#define TS_Q4_0 2
#define TS_Q4_1 3
#define TS_Q5_0 6
#define TS_Q5_1 7
#define TS_Q8_0 8
#define TS_Q4_K 12
#define TS_Q5_K 13
#define TS_Q6_K 14
#define TS_BF16 30

// KV pool codecs (kernels/cpu/kv_codecs.py's numbers)
#define TS_KV_F16 0
#define TS_KV_Q8_0 1
#define TS_KV_Q4_0 2

typedef unsigned char ts_u8;
typedef unsigned short ts_u16;
typedef unsigned int ts_u32;
typedef unsigned long long ts_u64;

TS_INLINE ts_u32 ts_float_bits(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    union { float f; ts_u32 u; } c; c.f = f; return c.u;
#endif
}

TS_INLINE float ts_bits_float(ts_u32 u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    union { float f; ts_u32 u; } c; c.u = u; return c.f;
#endif
}

// float16 bits -> float32, exact. The device takes the hardware conversion (same values).
TS_INLINE float ts_half_to_float(ts_u16 h) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    ts_u32 sign = (ts_u32)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    if (exp == 0x1Fu) return ts_bits_float(sign | 0x7F800000u | (man << 13));   // inf, NaN
    if (exp == 0) {
        if (man == 0) return ts_bits_float(sign);
        while (!(man & 0x400u)) { man <<= 1; exp--; }                            // subnormal
        exp++; man &= 0x3FFu;
    }
    return ts_bits_float(sign | ((exp + 112u) << 23) | (man << 13));
#endif
}

// float32 -> float16 bits, round to nearest even, inf past 65504 (F16C's and ggml's rounding).
TS_INLINE ts_u16 ts_float_to_half(float f) {
#ifdef __CUDA_ARCH__
    ts_u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    ts_u32 x = ts_float_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
    if (ax >= 0x7F800000u) return (ts_u16)(sign | 0x7C00u | (ax > 0x7F800000u ? 0x200u | ((ax >> 13) & 0x3FFu) : 0));
    if (ax >= 0x477FF000u) return (ts_u16)(sign | 0x7C00u);                    // rounds past 65504
    if (ax < 0x38800000u) {                                                     // subnormal half or 0
        if (ax < 0x33000000u) return (ts_u16)sign;                             // below half the least subnormal
        ts_u32 e = ax >> 23, m = (ax & 0x7FFFFFu) | 0x800000u, shift = 126u - e;    // value = m * 2^(e-150)
        ts_u32 q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (ts_u16)(sign | q);
    }
    ts_u32 r = ax - 0x38000000u;                                                // rebias exponent 127 -> 15
    ts_u32 q = r >> 13, rem = r & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) q++;                     // may carry into the exponent
    return (ts_u16)(sign | q);
#endif
}

TS_INLINE float ts_f16_at(const ts_u8* p) { return ts_half_to_float((ts_u16)(p[0] | (p[1] << 8))); }

TS_INLINE int ts_block_elems(int type) {
    return (type == TS_Q4_K || type == TS_Q5_K || type == TS_Q6_K) ? 256
         : (type == TS_F32 || type == TS_F16 || type == TS_BF16) ? 1 : 32;
}

TS_INLINE int ts_block_bytes(int type) {
    switch (type) {
        case TS_F32: return 4;   case TS_F16: return 2;   case TS_BF16: return 2;
        case TS_Q4_0: return 18; case TS_Q4_1: return 20; case TS_Q5_0: return 22; case TS_Q5_1: return 24;
        case TS_Q8_0: return 34; case TS_Q4_K: return 144; case TS_Q5_K: return 176; case TS_Q6_K: return 210;
        default: return 0;
    }
}

// Q4_0/Q4_1/Q5_*: element i < 16 is qs[i]'s low nibble, i >= 16 qs[i - 16]'s high nibble
TS_INLINE int ts_nibble32(const ts_u8* qs, int i) { return i < 16 ? (qs[i] & 15) : (qs[i - 16] >> 4); }

TS_INLINE int ts_q5_high(const ts_u8* qh, int i) { return ((qh[i >> 3] >> (i & 7)) & 1) << 4; }

// get_scale_min_k4 (ggml-quants.c): 6-bit scale and min of sub-block s (0..7)
TS_INLINE void ts_scale_min_k4(const ts_u8* sc, int s, int* scale, int* min) {
    if (s < 4) { *scale = sc[s] & 63; *min = sc[s + 4] & 63; }
    else {
        *scale = (sc[s + 4] & 0xF) | ((sc[s - 4] >> 6) << 4);
        *min = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
    }
}

// Element i of one block of `type` at `b`, in float32, with ggml's reference arithmetic.
TS_INLINE float ts_block_value(int type, const ts_u8* b, int i) {
    switch (type) {
        case TS_F32: return ts_bits_float((ts_u32)b[0] | ((ts_u32)b[1] << 8) | ((ts_u32)b[2] << 16) | ((ts_u32)b[3] << 24));
        case TS_F16: return ts_f16_at(b);
        case TS_BF16: return ts_bits_float(((ts_u32)b[0] | ((ts_u32)b[1] << 8)) << 16);
        case TS_Q4_0: return TS_MUL((float)(ts_nibble32(b + 2, i) - 8), ts_f16_at(b));
        case TS_Q4_1: return TS_ADD(TS_MUL((float)ts_nibble32(b + 4, i), ts_f16_at(b)), ts_f16_at(b + 2));
        case TS_Q5_0: return TS_MUL((float)((ts_nibble32(b + 6, i) | ts_q5_high(b + 2, i)) - 16), ts_f16_at(b));
        case TS_Q5_1: return TS_ADD(TS_MUL((float)(ts_nibble32(b + 8, i) | ts_q5_high(b + 4, i)), ts_f16_at(b)),
                                    ts_f16_at(b + 2));
        case TS_Q8_0: return TS_MUL((float)(signed char)b[2 + i], ts_f16_at(b));
        case TS_Q4_K: case TS_Q5_K: {
            int s = i >> 5, l = i & 31, sc, mn;
            ts_scale_min_k4(b + 4, s, &sc, &mn);
            const ts_u8* qs = b + (type == TS_Q4_K ? 16 : 48);
            int q = (qs[32 * (s >> 1) + l] >> (4 * (s & 1))) & 15;
            if (type == TS_Q5_K) q |= ((b[16 + l] >> s) & 1) << 4;
            float dl = TS_MUL(ts_f16_at(b), (float)sc), ml = TS_MUL(ts_f16_at(b + 2), (float)mn);
            return TS_SUB(TS_MUL((float)q, dl), ml);
        }
        case TS_Q6_K: {
            int h = i >> 7, k = (i >> 5) & 3, l = i & 31;
            int lo = (b[64 * h + 32 * (k & 1) + l] >> (4 * (k >> 1))) & 15;
            int hi = (b[128 + 32 * h + l] >> (2 * k)) & 3;
            float dl = TS_MUL(ts_f16_at(b + 208), (float)(signed char)b[192 + (i >> 4)]);
            return TS_MUL((float)((lo | (hi << 4)) - 32), dl);
        }
        default: return 0.0f;
    }
}

// ---- KV codecs: quantize_row_q8_0_ref / quantize_row_q4_0_ref on one block of 32 values ----

TS_INLINE float ts_absf(float x) { return x < 0.0f ? -x : x; }

// C's roundf (halves away from zero) of |x| <= 2^31, exact: the sum is taken in double
TS_INLINE int ts_round_away(float x) {
    double a = (double)ts_absf(x) + 0.5;
    int r = (int)a;                 // truncation of a non-negative value: floor
    return x < 0.0f ? -r : r;
}

// dst: 34 bytes (f16 d, 32 int8 codes)
TS_INLINE void ts_q8_0_encode(const float* x, ts_u8* dst) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) { float a = ts_absf(x[j]); amax = amax > a ? amax : a; }
    float d = amax / 127.0f;
    float inv = d != 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < 32; j++) dst[2 + j] = (ts_u8)(ts_round_away(TS_MUL(x[j], inv)) & 0xFF);
    ts_u16 h = ts_float_to_half(d);
    dst[0] = (ts_u8)(h & 0xFF); dst[1] = (ts_u8)(h >> 8);
}

// dst: 18 bytes (f16 d, 16 bytes of 4-bit codes, low nibbles first); the largest magnitude codes to -8
TS_INLINE void ts_q4_0_encode(const float* x, ts_u8* dst) {
    float amax = 0.0f, vmax = 0.0f;
    for (int j = 0; j < 32; j++) if (amax < ts_absf(x[j])) { amax = ts_absf(x[j]); vmax = x[j]; }
    float d = vmax / -8.0f;
    float inv = d != 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < 16; j++) {
        int lo = (int)TS_ADD(TS_MUL(x[j], inv), 8.5f), hi = (int)TS_ADD(TS_MUL(x[j + 16], inv), 8.5f);
        lo = lo < 15 ? lo : 15; hi = hi < 15 ? hi : 15;
        dst[2 + j] = (ts_u8)(lo | (hi << 4));
    }
    ts_u16 h = ts_float_to_half(d);
    dst[0] = (ts_u8)(h & 0xFF); dst[1] = (ts_u8)(h >> 8);
}

// value i (0..head_dim-1) of one token's K or V row of one KV head in the pool's codec
TS_INLINE float ts_kv_value(int codec, const ts_u8* row, int i) {
    if (codec == TS_KV_F16) return ts_f16_at(row + 2 * i);
    const ts_u8* b = row + (i >> 5) * (codec == TS_KV_Q8_0 ? 34 : 18);
    return ts_block_value(codec == TS_KV_Q8_0 ? TS_Q8_0 : TS_Q4_0, b, i & 31);
}

TS_INLINE int ts_kv_row_bytes(int codec, int head_dim) {
    return codec == TS_KV_F16 ? 2 * head_dim : (head_dim >> 5) * (codec == TS_KV_Q8_0 ? 34 : 18);
}

// ---- RoPE: the rotation of one pair (x0, x1) by the angle whose cosine and sine are c, s ----
TS_INLINE void ts_rope_pair(float x0, float x1, float c, float s, float* r0, float* r1) {
    *r0 = TS_SUB(TS_MUL(x0, c), TS_MUL(x1, s));
    *r1 = TS_ADD(TS_MUL(x0, s), TS_MUL(x1, c));
}

// ---- online softmax: running max m and sum l of exp(score - m) ----
TS_INLINE float ts_neg_inf() { return ts_bits_float(0xFF800000u); }

TS_INLINE float ts_exp(float x) {
#ifdef __CUDA_ARCH__
    return expf(x);         // not __expf: the weights are compared with numpy's softmax
#else
    return __builtin_expf(x);
#endif
}

// one more score: returns the factor the running accumulator is scaled by, *p the new key's weight
TS_INLINE float ts_softmax_push(float* m, float* l, float score, float* p) {
    float m_new = *m > score ? *m : score;
    float f = *m == ts_neg_inf() ? 0.0f : ts_exp(*m - m_new);
    *p = ts_exp(score - m_new);
    *l = *l * f + *p;
    *m = m_new;
    return f;
}

// merge the state (m2, l2) into (m, l): *f_self and *f_other scale the two accumulators
TS_INLINE void ts_softmax_merge(float* m, float* l, float m2, float l2, float* f_self, float* f_other) {
    float m_new = *m > m2 ? *m : m2;
    *f_self = *m == ts_neg_inf() ? 0.0f : ts_exp(*m - m_new);
    *f_other = m2 == ts_neg_inf() ? 0.0f : ts_exp(m2 - m_new);
    *l = *l * *f_self + l2 * *f_other;
    *m = m_new;
}

// ---- sampling: a uniform double in [0, 1) from (seed, counter), splitmix64's finalizer ----
TS_INLINE double ts_uniform(ts_u64 seed, ts_u64 counter) {
    ts_u64 z = seed + (counter + 1ull) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}
