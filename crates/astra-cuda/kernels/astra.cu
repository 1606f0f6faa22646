// astra's CUDA kernels, compiled at run time by NVRTC for the device present.
//
// Compiled after a prelude of #defines generated from astra-cuda's src/shared.rs: the
// layouts, limits and codes the Rust launchers share with these kernels (Q8K_*, T_*,
// HELD_*, CHUNK, MAX_HEAD_DIM, QUANT_*, GLU_*).
//
// Header-free (NVRTC ships no CUDA headers): f16 conversions are inline PTX, types are
// spelled out. Weight blocks are read as stored in GGUF (byte structs, unaligned), with
// the layouts of ggml; the scalar references are astra-quant's dot/scalar.rs and
// quantize.rs, whose arithmetic these kernels follow operation for operation where the
// CPU engine's bits are the target (activation quantization, per-block integer sums).

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef short i16;

#define WARP 32

// Every kernel starts here. In the variant compiled with ASTRA_PDL (the kernels of
// recorded decode steps, launched as programmatic dependents of the kernel before
// them: launch.rs), it waits for that kernel's completion and memory before reading
// anything, and at once lets the next kernel be scheduled; in the other, nothing (the
// instructions cost time in grids of many small CTAs even where no launch depends).
//
// Such a kernel may start while the one before it still runs: before waiting, a kernel
// asks the caches for the weights it will read (PDL_PREFETCH: bytes no kernel writes),
// so that once the wait ends they come from L1 or L2 rather than from memory.
#if defined(ASTRA_PDL) && __CUDA_ARCH__ >= 900
#define PDL 1
#define PDL_START                                              \
    asm volatile("griddepcontrol.wait;" ::: "memory");         \
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#else
#define PDL 0
#define PDL_START
#endif
#define PDL_PREFETCH(p, bytes) \
    if (PDL) prefetch_weights((const u8*)(p), (bytes));

// The 128-byte line holding p asked of L2, or of the SM's L1 (read-only data only: L1
// is not kept coherent with other SMs' stores). L1 for a warp's matrix rows and L2 for
// norm weights measured fastest (commit 4682455).
__device__ __forceinline__ void l2_line(const void* p) { asm volatile("prefetch.L2 [%0];" ::"l"(p)); }
__device__ __forceinline__ void l1_line(const void* p) { asm volatile("prefetch.L1 [%0];" ::"l"(p)); }

// The lines of weights [p, p + bytes) asked of L1, spread over the lanes of a warp (none
// for a null p).
__device__ __forceinline__ void prefetch_weights(const u8* p, long bytes) {
    if (!p) return;
    for (long o = (long)(threadIdx.x % 32) * 128; o < bytes; o += 32 * 128) l1_line(p + o);
}
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// f32 → f16 bits (round to nearest even) in the low half of a 32-bit register: the
// packed conversion keeps byte extraction of the result well defined (bytes taken from
// a 16-bit asm output came out wrong under NVRTC 13).
__device__ __forceinline__ unsigned int f2h(float f) {
    unsigned int r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(0.0f), "f"(f));
    return r & 0xffffu;
}

// An f16 stored little-endian at an arbitrary byte address.
__device__ __forceinline__ float ldh(const u8* p) { return h2f((u16)p[0] | ((u16)p[1] << 8)); }

__device__ __forceinline__ float ldf(const u8* p) {
    unsigned int b = (unsigned int)p[0] | ((unsigned int)p[1] << 8) | ((unsigned int)p[2] << 16) | ((unsigned int)p[3] << 24);
    return __int_as_float((int)b);
}

__device__ __forceinline__ int ldi16(const u8* p) { return (int)(i16)((u16)p[0] | ((u16)p[1] << 8)); }

// Round to nearest, ties to even, for |v| < 2^22 (ggml's nearest_int), with no fused
// multiply-add around it.
__device__ __forceinline__ int nearest_int(float v) {
    int bits = __float_as_int(__fadd_rn(v, 12582912.0f));
    return (bits & 0x007fffff) - 0x00400000;
}

// x normalized by an RMSNorm scale and weighted.
__device__ __forceinline__ float normed(float x, float scale, float w) { return __fmul_rn(__fmul_rn(x, scale), w); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ int warp_sum_int(int v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// v[u] summed over the warp for each of N u (a power of two up to 32) in fewer
// shuffles than N warp_sums (nine rather than forty for eight): each exchange halves the
// values a lane keeps, so that a lane ends with the sum for u = warp_sum_n_row<N>(lane),
// the same bits in the 32 / N lanes that hold it (each addition is of the same two
// values in either lane). (A warp_sum per row in the held kernels was tried and measured
// slower, commit 3725071.)
template <int N>
__device__ __forceinline__ float warp_sum_n(float* v) {
    int lane = threadIdx.x % WARP, bit = WARP / 2;
#pragma unroll
    for (int half = N / 2; half > 0; half /= 2, bit /= 2) {
        bool upper = lane & bit;
#pragma unroll
        for (int j = 0; j < half; j++) {
            float send = upper ? v[j] : v[j + half], keep = upper ? v[j + half] : v[j];
            v[j] = keep + __shfl_xor_sync(0xffffffffu, send, bit);
        }
    }
    float s = v[0];
#pragma unroll
    for (; bit > 0; bit /= 2) s += __shfl_xor_sync(0xffffffffu, s, bit);
    return s;
}

// The u whose sum warp_sum_n<N> leaves in `lane`: its bits 16, 8, ... as u's bits from
// the highest down.
template <int N>
__device__ __forceinline__ int warp_sum_n_row(int lane) {
    int u = 0;
    for (int half = N / 2, bit = WARP / 2; half > 0; half /= 2, bit /= 2) u = 2 * u + ((lane & bit) != 0);
    return u;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// ---------------------------------------------------------------------------------
// Activation quantization (bit-identical to astra-quant's quantize_q8_0/q8_1/q8_k).

// One 32-block quantized by one warp, lane l holding value l: Q8_0: d(f16) qs[32];
// Q8_1: d(f16) s(f16) qs[32].
__device__ __forceinline__ void q8_32_block(float v, u8* blk, int with_sum) {
    int lane = threadIdx.x % WARP;
    float amax = warp_max(fabsf(v));
    float d = __fdiv_rn(amax, 127.0f);
    float id = amax != 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
    int q = nearest_int(__fmul_rn(v, id));
    int head = with_sum ? 4 : 2;
    blk[head + lane] = (u8)(i8)q;
    int sum = warp_sum_int(q);
    if (lane == 0) {
        unsigned int hd = f2h(d);
        blk[0] = (u8)(hd & 0xff);
        blk[1] = (u8)(hd >> 8);
        if (with_sum) {
            unsigned int hs = f2h(__fmul_rn(d, (float)sum));
            blk[2] = (u8)(hs & 0xff);
            blk[3] = (u8)(hs >> 8);
        }
    }
}

// Q8_K as the kernels keep it: the values of astra-quant's block (d(f32) qs[256]
// bsums[16](i16), 292 bytes) with the quants first, then the sums and d, padded to 304
// bytes, so that every block starts on a 16-byte boundary and a lane reads its quants
// in 16-byte loads (faster than the stored order's 4-byte reads, commit 50226f0). The
// bytes past d are never written or read. Q8K_BYTES, Q8K_SUMS (the sums' offset) and
// Q8K_D (d's offset) come from the prelude.

// One 256-block quantized by each group of 256 threads of the CTA (up to four groups),
// thread t of a group holding value t, in the layout above. Every thread of the CTA
// calls it together (it synchronizes the CTA); a group with `active` false computes
// along and writes nothing.
__device__ void q8_k_block(float v, u8* blk, bool active) {
    __shared__ float s_amax[4][8], s_val[4][8];
    __shared__ int s_idx[4][8];
    __shared__ int s_q[4][256];
    int g = threadIdx.x / 256, t = threadIdx.x % 256;
    // The first element of the largest magnitude, and its value.
    float a = fabsf(v), best_v = v;
    int idx = t;
    for (int o = WARP / 2; o > 0; o >>= 1) {
        float a2 = __shfl_xor_sync(0xffffffffu, a, o);
        int i2 = __shfl_xor_sync(0xffffffffu, idx, o);
        float v2 = __shfl_xor_sync(0xffffffffu, best_v, o);
        if (a2 > a || (a2 == a && i2 < idx)) {
            a = a2;
            idx = i2;
            best_v = v2;
        }
    }
    __syncthreads();  // the shared arrays may still be read for the previous block
    if ((t & 31) == 0) {
        s_amax[g][t / 32] = a;
        s_idx[g][t / 32] = idx;
        s_val[g][t / 32] = best_v;
    }
    __syncthreads();
    float amax = s_amax[g][0], vmax = s_val[g][0];
    int best = s_idx[g][0];
    for (int w = 1; w < 8; w++) {
        if (s_amax[g][w] > amax || (s_amax[g][w] == amax && s_idx[g][w] < best)) {
            amax = s_amax[g][w];
            best = s_idx[g][w];
            vmax = s_val[g][w];
        }
    }
    bool zero = amax == 0.0f;
    float iscale = zero ? 0.0f : __fdiv_rn(-127.0f, vmax);
    int q = zero ? 0 : min(nearest_int(__fmul_rn(iscale, v)), 127);
    s_q[g][t] = q;
    __syncthreads();
    if (!active) return;
    if (zero) {
        blk[t] = 0;
        if (t < 32) blk[Q8K_SUMS + t] = 0;
        if (t < 4) blk[Q8K_D + t] = 0;
        return;
    }
    blk[t] = (u8)(i8)q;
    if (t < 16) {
        int s = 0;
        for (int j = 0; j < 16; j++) s += s_q[g][16 * t + j];
        *(i16*)(blk + Q8K_SUMS + 2 * t) = (i16)s;
    }
    if (t == 0) *(float*)(blk + Q8K_D) = __fdiv_rn(1.0f, iscale);
}

__device__ float glu_value(float g, float u, int act);

// The activation quantized is x, or, where `up` is given, the gated product
// glu_value(x, up, act) (the feed-forward's activation fused into its quantization).

// One warp per 32-block; grid (blocks per row, rows).
extern "C" __global__ void quantize_q8_32(const QuantizeQ8_32Args kargs) { UNPACK_QuantizeQ8_32Args(kargs)
    PDL_START
    int b = blockIdx.x, row = blockIdx.y, lane = threadIdx.x;
    long i = (long)row * cols + b * 32 + lane;
    float v = up ? glu_value(x[i], up[i], act) : x[i];
    q8_32_block(v, out + ((long)row * (cols / 32) + b) * (with_sum ? 36 : 34), with_sum);
}

// One 256-thread CTA per 256-block; grid (blocks per row, rows).
extern "C" __global__ void quantize_q8_k(const QuantizeQ8KArgs kargs) { UNPACK_QuantizeQ8KArgs(kargs)
    PDL_START
    int b = blockIdx.x, row = blockIdx.y;
    long i = (long)row * cols + b * 256 + threadIdx.x;
    float v = up ? glu_value(x[i], up[i], act) : x[i];
    q8_k_block(v, out + ((long)row * (cols / 256) + b) * Q8K_BYTES, true);
}

// ---------------------------------------------------------------------------------
// One block of a weight row against one activation block: the block's float
// contribution (and, for types with a minimum, the minimum's apart).

__device__ __forceinline__ float blk_q4_0(const u8* w, const u8* a) {
    const u8* qs = w + 2;
    const i8* y = (const i8*)(a + 2);
    int isum = 0;
    for (int j = 0; j < 16; j++) {
        isum += ((qs[j] & 15) - 8) * y[j];
        isum += ((qs[j] >> 4) - 8) * y[j + 16];
    }
    return (float)isum * (ldh(w) * ldh(a));
}

__device__ __forceinline__ float blk_q4_1(const u8* w, const u8* a, float* mins) {
    const u8* qs = w + 4;
    const i8* y = (const i8*)(a + 4);
    int isum = 0;
    for (int j = 0; j < 16; j++) {
        isum += (qs[j] & 15) * y[j];
        isum += (qs[j] >> 4) * y[j + 16];
    }
    *mins += ldh(w + 2) * ldh(a + 2);
    return (float)isum * (ldh(w) * ldh(a));
}

__device__ __forceinline__ float blk_q5_0(const u8* w, const u8* a) {
    unsigned int qh = (unsigned int)w[2] | ((unsigned int)w[3] << 8) | ((unsigned int)w[4] << 16) | ((unsigned int)w[5] << 24);
    const u8* qs = w + 6;
    const i8* y = (const i8*)(a + 2);
    int isum = 0;
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 15) | (((qh >> j) & 1) << 4);
        int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        isum += (lo - 16) * y[j] + (hi - 16) * y[j + 16];
    }
    return (float)isum * (ldh(w) * ldh(a));
}

__device__ __forceinline__ void scale_min_k4(int j, const u8* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Q4_K: d dmin scales[12] qs[128]; activation Q8_K.
__device__ __forceinline__ float blk_q4_k(const u8* w, const u8* a) {
    const u8* scales = w + 4;
    const u8* qs = w + 16;
    const i8* y = (const i8*)a;
    int isum = 0, msum = 0;
    for (int g = 0; g < 8; g++) {
        int sc, m;
        scale_min_k4(g, scales, &sc, &m);
        int gsum = 0;
        for (int l = 0; l < 32; l++) {
            int k = 32 * g + l;
            u8 byte = qs[32 * (k / 64) + (k % 32)];
            int code = ((k / 32) % 2 == 0) ? (byte & 15) : (byte >> 4);
            gsum += code * y[k];
        }
        isum += sc * gsum;
        msum += m * (ldi16(a + Q8K_SUMS + 4 * g) + ldi16(a + Q8K_SUMS + 2 + 4 * g));
    }
    float da = ldf(a + Q8K_D);
    return (float)isum * (ldh(w) * da) - (float)msum * (ldh(w + 2) * da);
}

// Q6_K: ql[128] qh[64] scales[16](i8) d(f16); activation Q8_K.
__device__ __forceinline__ float blk_q6_k(const u8* w, const u8* a) {
    const u8* ql = w;
    const u8* qh = w + 128;
    const i8* scales = (const i8*)(w + 192);
    const i8* y = (const i8*)a;
    int isum = 0;
    for (int k = 0; k < 256; k++) {
        int n = k / 128, r = (k % 128) / 32, l = k % 32;
        u8 qlb = ql[64 * n + 32 * (r % 2) + l];
        int low = r < 2 ? (qlb & 15) : (qlb >> 4);
        int high = (qh[32 * n + l] >> (2 * r)) & 3;
        int q = (low | (high << 4)) - 32;
        isum += scales[k / 16] * q * y[k];
    }
    return (float)isum * (ldh(w + 208) * ldf(a + Q8K_D));
}

// Weight type codes T_Q4_0 … T_IQ2_S (GGUF's ggml type ids) come from the prelude.

// The IQ2_S codebook (1024 points of eight magnitudes), written from the host's copy
// of the table when the module loads.
__device__ unsigned long long iq2s_grid[1024];

// IQ2_S: d(f16) qs[64] (grid indices' low bits, then signs) qh[8] scales[8];
// activation Q8_K. Group l (8 weights) of 32-weight group g: grid point
// qs[4g + l] | (qh[g] << (8 - 2l) & 0x300), signs qs[32 + 4g + l]; each half of g has
// the 4-bit scale s, weight scale d (2s + 1) / 8.
__device__ __forceinline__ float blk_iq2_s(const u8* w, const u8* a) {
    const u8* qs = w + 2;
    const u8* qh = w + 66;
    const u8* scales = w + 74;
    const i8* y = (const i8*)a;
    int isum = 0;
    for (int g = 0; g < 8; g++) {
        for (int half = 0; half < 2; half++) {
            int hsum = 0;
            for (int l = 2 * half; l < 2 * half + 2; l++) {
                unsigned long long grid = iq2s_grid[qs[4 * g + l] | (((int)qh[g] << (8 - 2 * l)) & 0x300)];
                int signs = qs[32 + 4 * g + l];
                for (int j = 0; j < 8; j++) {
                    int v = (int)((grid >> (8 * j)) & 0xff) * y[32 * g + 8 * l + j];
                    hsum += (signs >> j) & 1 ? -v : v;
                }
            }
            int s = (scales[g] >> (4 * half)) & 15;
            isum += (2 * s + 1) * hsum;
        }
    }
    return (float)isum * (ldh(w) * ldf(a + Q8K_D)) * 0.125f;
}

// Stores a matrix kernel's result, or adds it to what is there (the residual add
// fused into the product: the same single rounding as a separate add).
__device__ __forceinline__ void put(float* out, long i, float v, int acc) {
    out[i] = acc ? __fadd_rn(out[i], v) : v;
}

// out[t * rows + r] = Σ_b block(w[r][b], a[t][b]): one warp per weight row, lanes over
// its blocks; grid (ceil(rows / 4), tokens), 128 threads. For the types without kernels
// of their own (not Q8_0, whose device layout only its kernels read).
extern "C" __global__ void matvec(const MatvecArgs kargs) { UNPACK_MatvecArgs(kargs)
    PDL_START
    int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    int r = blockIdx.x * 4 + warp;
    int t = blockIdx.y;
    if (r >= rows) return;
    const u8* wr = w + (long)r * nb * wbytes;
    const u8* at = a + (long)t * nb * abytes;
    float sum = 0.0f, mins = 0.0f;
    for (int b = lane; b < nb; b += WARP) {
        const u8* wb = wr + (long)b * wbytes;
        const u8* ab = at + (long)b * abytes;
        switch (ty) {
            case T_Q4_0: sum += blk_q4_0(wb, ab); break;
            case T_Q4_1: sum += blk_q4_1(wb, ab, &mins); break;
            case T_Q5_0: sum += blk_q5_0(wb, ab); break;
            case T_Q4_K: sum += blk_q4_k(wb, ab); break;
            case T_Q6_K: sum += blk_q6_k(wb, ab); break;
            case T_IQ2_S: sum += blk_iq2_s(wb, ab); break;
        }
    }
    float total = warp_sum(sum) + warp_sum(mins);
    if (lane == 0) put(out, (long)t * rows + r, total, acc);
}

// Σ of four signed byte products, added to c.
__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// The same with a's bytes unsigned (0..255).
__device__ __forceinline__ int dp4a_us(int a, int b, int c) {
    int r;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// Row r of the three matrices of a three-matrix launch taken in turn (rows of rb bytes);
// null past their end. (Sharing this helper with the held kernels' three-matrix
// launches was tried and measured slower, commit 3343df7.)
__device__ __forceinline__ const u8* row_of_3(const u8* w0, const u8* w1, const u8* w2, int r0, int r1, int r2, int r, long rb) {
    if (r < r0) return w0 + r * rb;
    if (r < r0 + r1) return w1 + (r - r0) * rb;
    if (r < r0 + r1 + r2) return w2 + (r - r0 - r1) * rb;
    return nullptr;
}

// Each warp-cooperative matrix kernel is a row function (one warp, row r, the T
// tokens from T·blockIdx.y on) and its launches: one matrix, and up to three
// matrices of one type and width against the same activations (Q, K and V; gate and
// up) in one grid whose blocks cover the three matrices' rows in turn; each with one
// token per warp (decode) and, for most types, with eight (prefill: a weight block is
// loaded once for the eight). Every (row, token) sum is computed by the same lanes in
// the same order in all of them, so a result does not depend on the launch that made
// it. The launch offsets the activations to the warp's first token. BOUNDS, where
// given, are the entry's launch bounds (MATVEC_KERNELS_BOUNDED: the one-token entries').
#define MATVEC_ENTRY(name, suffix, T, WBYTES, ABYTES, BOUNDS)                                  \
    extern "C" __global__ void BOUNDS name##suffix(const MatvecOneArgs kargs) { UNPACK_MatvecOneArgs(kargs)                      \
        int r = blockIdx.x * 4 + threadIdx.x / WARP;                                            \
        long rb = (long)nb * (WBYTES);                                                          \
        if (r < rows) PDL_PREFETCH(w + r * rb, rb);                                             \
        PDL_START                                                                               \
        const u8* at = a + (long)blockIdx.y * (T) * nb * (ABYTES);                              \
        if (r < rows) name##_row<T>(w, at, out, rows, nb, r, acc, tokens);                      \
    }                                                                                           \
    extern "C" __global__ void BOUNDS name##_3##suffix(const MatvecThreeArgs kargs) { UNPACK_MatvecThreeArgs(kargs)   \
        int r = blockIdx.x * 4 + threadIdx.x / WARP;                                            \
        long rb = (long)nb * (WBYTES);                                                          \
        PDL_PREFETCH(row_of_3(w0, w1, w2, r0, r1, r2, r, rb), rb);                              \
        PDL_START                                                                               \
        const u8* at = a + (long)blockIdx.y * (T) * nb * (ABYTES);                              \
        if (r < r0) name##_row<T>(w0, at, o0, r0, nb, r, 0, tokens);                            \
        else if (r < r0 + r1) name##_row<T>(w1, at, o1, r1, nb, r - r0, 0, tokens);             \
        else if (r < r0 + r1 + r2) name##_row<T>(w2, at, o2, r2, nb, r - r0 - r1, 0, tokens);   \
    }
#define MATVEC_KERNELS_BOUNDED(name, WBYTES, ABYTES, BOUNDS) \
    MATVEC_ENTRY(name, , 1, WBYTES, ABYTES, BOUNDS) MATVEC_ENTRY(name, _8, 8, WBYTES, ABYTES, )
#define MATVEC_KERNELS(name, WBYTES, ABYTES) MATVEC_KERNELS_BOUNDED(name, WBYTES, ABYTES, )
// Q4_1: one token per warp only (its eight-token form was tried and measured slower,
// commit 6f4ffab).
#define MATVEC_KERNELS_1(name, WBYTES, ABYTES) MATVEC_ENTRY(name, , 1, WBYTES, ABYTES, )

// The first token of a row function's warp and how many of its T it has.
#define ROW_TOKENS(T)              \
    int t0 = blockIdx.y * (T);     \
    int nt = min((T), tokens - t0);

// Q4_K × Q8_K, four lanes per 256-block. Lane c of a block reads quant bytes
// 16c..16c+15 and 64 + 16c..64 + 16c + 15 (two 16-byte loads that the block's four
// lanes make together as 64 consecutive bytes): their low and high nibbles are the
// weights of the 16-element pieces p, p + 2, p + 8 and p + 10, p = 4(c/2) + c%2
// (`piece`), in groups g, g + 1, g + 4 and g + 5, g = 2(c/2). The block's d, dmin and
// scales come in one more load, the activations' four pieces in four 16-byte loads
// (again 64 consecutive bytes for the four lanes, as Q8K_BYTES keeps the quants in
// order), with their four 16-element sums. Rows are 16-byte aligned (144-byte blocks).
// (Where each lane read its own 32 consecutive quant bytes and 64 activations, every
// 16-byte load of the four lanes used half of four 32-byte sectors; this layout
// measured the same or slightly faster, commit 0fb21ed.)
//
// The activations of a Q4_K block's four pieces that lane c of its four reads: the 64
// quants, the four 16-element sums and the block's d.
struct Q8KPieces {
    int y[16];
    int sums[4];
    float d;
};

__device__ __forceinline__ Q8KPieces q8k_pieces(const u8* ab, int c) {
    int half = c / 2, piece = 4 * half + c % 2;
    Q8KPieces p;
    int4 y0 = *(const int4*)(ab + 16 * piece), y1 = *(const int4*)(ab + 16 * piece + 32);
    int4 y2 = *(const int4*)(ab + 16 * piece + 128), y3 = *(const int4*)(ab + 16 * piece + 160);
    p.y[0] = y0.x, p.y[1] = y0.y, p.y[2] = y0.z, p.y[3] = y0.w;
    p.y[4] = y1.x, p.y[5] = y1.y, p.y[6] = y1.z, p.y[7] = y1.w;
    p.y[8] = y2.x, p.y[9] = y2.y, p.y[10] = y2.z, p.y[11] = y2.w;
    p.y[12] = y3.x, p.y[13] = y3.y, p.y[14] = y3.z, p.y[15] = y3.w;
    // The 16-element sums of pieces p, p + 2 (words half, half + 1 of the first eight)
    // and p + 8, p + 10 (of the second), halves c % 2.
    uint2 s0 = *(const uint2*)(ab + Q8K_SUMS + 8 * half), s1 = *(const uint2*)(ab + Q8K_SUMS + 16 + 8 * half);
    int sh = 16 * (c % 2);
    p.sums[0] = (int)(i16)(s0.x >> sh), p.sums[1] = (int)(i16)(s0.y >> sh);
    p.sums[2] = (int)(i16)(s1.x >> sh), p.sums[3] = (int)(i16)(s1.y >> sh);
    p.d = *(const float*)(ab + Q8K_D);
    return p;
}

// A Q4_K block's part that lane c of its four computes: header h (d, dmin, the 12
// scale bytes), quant bytes 16c.. (q0) and 80 + 16c.. (q1), against the activations'
// pieces.
__device__ __forceinline__ float q4_k_pieces_dot(uint4 h, int4 q0, int4 q1, const Q8KPieces& a, int c) {
    int half = c / 2;
    int qlo[4] = {q0.x, q0.y, q0.z, q0.w}, qhi[4] = {q1.x, q1.y, q1.z, q1.w};
    // Scale bytes g and g + 1 of each third of the 12 (scale_min_k4, two at a time):
    // six-bit scales and minimums of groups g, g + 1, then those of g + 4, g + 5.
    unsigned int s_a = (h.y >> (16 * half)) & 0xffffu, s_b = (h.z >> (16 * half)) & 0xffffu, s_e = (h.w >> (16 * half)) & 0xffffu;
    unsigned int sc01 = s_a & 0x3f3fu, m01 = s_b & 0x3f3fu;
    unsigned int sc45 = (s_e & 0x0f0fu) | ((s_a >> 2) & 0x3030u), m45 = ((s_e >> 4) & 0x0f0fu) | ((s_b >> 2) & 0x3030u);
    float dw = h2f((u16)(h.x & 0xffffu)), mw = h2f((u16)(h.x >> 16));
    // The high nibbles are taken in place, as sixteen times their values (unsigned
    // bytes), and their sums divided by 16 exactly: one operation a word, not two.
    int d0 = 0, d1 = 0, d2 = 0, d3 = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        d0 = dp4a(qlo[i] & 0x0f0f0f0f, a.y[i], d0);
        d1 = dp4a_us(qlo[i] & 0xf0f0f0f0, a.y[4 + i], d1);
        d2 = dp4a(qhi[i] & 0x0f0f0f0f, a.y[8 + i], d2);
        d3 = dp4a_us(qhi[i] & 0xf0f0f0f0, a.y[12 + i], d3);
    }
    d1 >>= 4, d3 >>= 4;
    int isum = (int)(sc01 & 0xffu) * d0 + (int)(sc01 >> 8) * d1 + (int)(sc45 & 0xffu) * d2 + (int)(sc45 >> 8) * d3;
    int msum = (int)(m01 & 0xffu) * a.sums[0] + (int)(m01 >> 8) * a.sums[1] + (int)(m45 & 0xffu) * a.sums[2] + (int)(m45 >> 8) * a.sums[3];
    return (float)isum * (dw * a.d) - (float)msum * (mw * a.d);
}

// One warp per row, eight blocks per warp step, for rows longer than the held-
// activations kernel below takes. (Two rows per warp sharing the activations was tried
// and measured slower, commit 50226f0.) Each (row, token) sum is the same lanes' in the
// same order for any T.
template <int T>
__device__ __forceinline__ void matvec_q4_k_row(const u8* w, const u8* a, float* out, int rows, int nb, int r, int acc, int tokens) {
    ROW_TOKENS(T)
    int lane = threadIdx.x % WARP, c = lane % 4;
    const u8* wr = w + (long)r * nb * 144;
    float sum[T];
#pragma unroll
    for (int k = 0; k < T; k++) sum[k] = 0.0f;
#pragma unroll 2
    for (int b = lane / 4; b < nb; b += 8) {
        const u8* wb = wr + (long)b * 144;
        uint4 h = *(const uint4*)wb;
        int4 q0 = *(const int4*)(wb + 16 + 16 * c), q1 = *(const int4*)(wb + 80 + 16 * c);
#pragma unroll
        for (int k = 0; k < T; k++) {
            if (k >= nt) break;
            sum[k] += q4_k_pieces_dot(h, q0, q1, q8k_pieces(a + ((long)k * nb + b) * Q8K_BYTES, c), c);
        }
    }
#pragma unroll
    for (int k = 0; k < T; k++) {
        float total = warp_sum(sum[k]);
        if (lane == 0 && k < nt) put(out, (long)(t0 + k) * rows + r, total, acc);
    }
}
// One token per warp: at most 40 registers a thread, so that twelve CTAs fit an SM
// rather than nine (measured faster in decode, commit 0fb21ed). The eight-token
// kernels, which decode does not launch, keep what they need.
#define Q4_K_DECODE_BOUNDS __launch_bounds__(128, 12)
MATVEC_KERNELS_BOUNDED(matvec_q4_k, 144, Q8K_BYTES, Q4_K_DECODE_BOUNDS)

// The held-activations kernels below: rows whose loads a lane has in flight at a time
// (warp_sum_n takes their sums together), the most warps of a CTA, and the most rows a
// CTA takes with one token and with eight (their sums wait in shared memory until the
// CTA's warps have all made theirs). (The one-token limit is the larger so that a long
// output matrix takes fewer waves of CTAs: measured faster, commit ca6b78e.)
// HELD_WARPS, HELD_MAX_ROWS_1 and HELD_MAX_ROWS_8 come from the prelude.
#define HELD_ROWS 4

// A matrix product with the activations held in registers: a CTA of up to HELD_WARPS
// warps takes a row's blocks together, each lane its part of the row as the lane type
// K says (K::Weights, loaded by K::load from the part's start, K::offset bytes into
// the row; K::dot of them with the token's K::Acts), and runs down up to `per_cta`
// consecutive rows of one of up to three matrices, HELD_ROWS rows' loads in flight at
// a time. The first ceil(r0 / per_cta) CTAs take the first matrix's rows, the next the
// second's, then the third's, so that a lane's parts of a CTA's rows are one pointer
// stepped by a row's bytes. (Rows spanning the matrices, each row's address made from
// its index, made a longer loop and measured slower, commit 192d746.) With one token
// the activations are read once per CTA, not once per row, so that the L1 reads of a
// row are its weights alone. Each (row, token) sum is the lanes' parts added across
// the warp, the rows' together (warp_sum_n), and then over the warps in order, for one
// token or eight alike. per_cta ≤ HELD_MAX_ROWS_1 or _8; grid (the three matrices'
// CTAs, token groups), 32 per warp threads.
template <int T, class K>
__device__ __forceinline__ void matvec_held(const u8* w0, const u8* w1, const u8* w2, const u8* a, float* o0, float* o1, float* o2, int r0,
                                            int r1, int r2, int nb, int per_cta, int acc, int tokens) {
    const int U = HELD_ROWS;
    __shared__ float part[(T == 1 ? HELD_MAX_ROWS_1 : HELD_MAX_ROWS_8) * T][HELD_WARPS];
    ROW_TOKENS(T)
    int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    K lanes(nb);
    // This CTA's matrix (weights, output, rows) and rows [first, last) of it.
    int cta = blockIdx.x, ctas0 = (r0 + per_cta - 1) / per_cta, ctas1 = (r1 + per_cta - 1) / per_cta;
    const u8* matrix = w0;
    float* out = o0;
    int rows = r0;
    if (cta >= ctas0 + ctas1) cta -= ctas0 + ctas1, matrix = w2, out = o2, rows = r2;
    else if (cta >= ctas0) cta -= ctas0, matrix = w1, out = o1, rows = r1;
    int first = cta * per_cta, last = min(rows, first + per_cta);
    // (Opaque to the compiler, which would otherwise make each row's address again
    // from its index in every step.)
    long rb;
    asm("mov.b64 %0, %1;" : "=l"(rb) : "l"(K::row_bytes(nb)));
    // This lane's part of the CTA's first row.
    const u8* row = matrix + first * rb + lanes.offset();
    if (PDL && lanes.on)
        for (int u = 0; u < U && first + u < last; u++) lanes.prefetch(row + u * rb);
    PDL_START
    const u8* at = a + (long)t0 * K::act_row_bytes(nb);
    typename K::Acts held;
    if (T == 1 && lanes.on) held = lanes.acts(at);
    // The row of the U whose sum this lane ends with.
    int mine = warp_sum_n_row<U>(lane);
    for (int r = first; r < last; r += U, row += U * rb) {
        typename K::Weights w[U];
        const u8* p = row;
#pragma unroll
        for (int u = 0; u < U; u++, p += rb)
            if (lanes.on && r + u < last) w[u] = lanes.load(p);
#pragma unroll
        for (int k = 0; k < T; k++) {
            float v[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                v[u] = 0.0f;
                if (lanes.on && r + u < last && k < nt) v[u] = lanes.dot(w[u], T == 1 ? held : lanes.acts(at + k * K::act_row_bytes(nb)));
            }
            float s = warp_sum_n<U>(v);
            if (lane % (WARP / U) == 0 && r + mine < last) part[(r + mine - first) * T + k][warp] = s;
        }
    }
    // Once every warp has made its sums: each (row, token)'s over the warps in order.
    __syncthreads();
    for (int i = threadIdx.x; i < (last - first) * T; i += blockDim.x) {
        int k = i % T;
        if (k < nt) {
            float total = part[i][0];
            for (int j = 1; j < (int)(blockDim.x / WARP); j++) total += part[i][j];
            put(out, (long)(t0 + k) * rows + first + i / T, total, acc);
        }
    }
}

// A held-activations kernel's entry for lane type K and T tokens a CTA, and its entries
// of one token per CTA (`name`) and eight (`name`_8).
#define HELD_ENTRY(name, K, T)                                                                                         \
    extern "C" __global__ void __launch_bounds__(WARP * HELD_WARPS) name(const MatvecHeldArgs kargs) { UNPACK_MatvecHeldArgs(kargs)                                                                   \
        matvec_held<T, K>(w0, w1, w2, a, o0, o1, o2, r0, r1, r2, nb, per_cta, acc, tokens);                           \
    }
#define HELD_ENTRIES(name, K) HELD_ENTRY(name, K, 1) HELD_ENTRY(name##_8, K, 8)

// Q4_K × Q8_K held (matvec_q4_k_held): lane l of warp w takes the four pieces of block
// 8w + l/4 that lane c = l % 4 takes in matvec_q4_k_row; W = ceil(nb / 8) warps, nb ≤
// 8·HELD_WARPS. The per-row kernel reads the activations for every row, which loads
// its L1 data pipe; this one reads them once per CTA (measured faster, commit a6bedeb).
// (Each CTA quantizing its activations itself from the f32 row, so that no kernel runs
// between the one making the row and the product, was tried and measured far slower,
// commit a6bedeb.)
struct Q4KHeldLanes {
    struct Weights {
        uint4 h;
        int4 q0, q1;
    };
    typedef Q8KPieces Acts;
    int b, c;
    bool on;
    __device__ Q4KHeldLanes(int nb) : b(8 * (threadIdx.x / WARP) + threadIdx.x % WARP / 4), c(threadIdx.x % 4), on(b < nb) {}
    static __device__ long row_bytes(int nb) { return (long)nb * 144; }
    static __device__ long act_row_bytes(int nb) { return (long)nb * Q8K_BYTES; }
    // The lane's part of a row starts at its block.
    __device__ long offset() const { return (long)b * 144; }
    __device__ void prefetch(const u8* part) const {
        if (c < 3) l1_line(part + 48 * c);
    }
    __device__ Weights load(const u8* part) const {
        return {*(const uint4*)part, *(const int4*)(part + 16 + 16 * c), *(const int4*)(part + 80 + 16 * c)};
    }
    __device__ Acts acts(const u8* at) const { return q8k_pieces(at + (long)b * Q8K_BYTES, c); }
    __device__ float dot(const Weights& w, const Acts& y) const { return q4_k_pieces_dot(w.h, w.q0, w.q1, y, c); }
};
HELD_ENTRIES(matvec_q4_k_held, Q4KHeldLanes)

// A word of four bytes at a 2-byte aligned address.
__device__ __forceinline__ int ld4_2(const u8* p) {
    const u16* h = (const u16*)p;
    return (int)((unsigned int)h[0] | ((unsigned int)h[1] << 16));
}

// Q6_K × Q8_K, eight lanes per 256-block and four blocks per warp step: lane p takes
// 32 weights, quarter p % 4 of half p / 4 (weights 128(p/4) + 32(p%4) + l): four low
// bits from ql (nibble (p%4)/2 of bytes 64(p/4) + 32(p%2) + l), two high bits from qh
// (bits 2(p%4) of bytes 32(p/4) + l), offset by −32 into signed bytes; its two
// 16-weight halves take scales 8(p/4) + 2(p%4) and + 1. The eight lanes' integer sums
// are added exactly (shuffles) before the block's one float product. Blocks (210
// bytes) are 2-byte aligned; a lane reads its 32 activations in two 16-byte loads.
template <int T>
__device__ __forceinline__ void matvec_q6_k_row(const u8* w, const u8* a, float* out, int rows, int nb, int r, int acc, int tokens) {
    ROW_TOKENS(T)
    int lane = threadIdx.x % WARP;
    const u8* wr = w + (long)r * nb * 210;
    int p = lane % 8, n = p / 4, qr = p % 4;
    float sum[T];
    for (int k = 0; k < T; k++) sum[k] = 0.0f;
    // Every lane runs every step (the shuffles need the whole warp); lanes past the
    // last block contribute zero.
    for (int b0 = 0; b0 < nb; b0 += 4) {
        int b = b0 + lane / 8;
        int q[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int sc0 = 0, sc1 = 0;
        float dw = 0.0f;
        if (b < nb) {
            const u8* wb = wr + (long)b * 210;
            const u8* ql = wb + 64 * n + 32 * (qr % 2);
            const u8* qh = wb + 128 + 32 * n;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                unsigned int lo = ((unsigned int)ld4_2(ql + 4 * i) >> (4 * (qr / 2))) & 0x0f0f0f0fu;
                unsigned int hi = (((unsigned int)ld4_2(qh + 4 * i) >> (2 * qr)) & 0x03030303u) << 4;
                q[i] = (int)__vsub4(lo | hi, 0x20202020u);
            }
            const i8* sc = (const i8*)(wb + 192) + 8 * n + 2 * qr;
            sc0 = sc[0];
            sc1 = sc[1];
            dw = ldh(wb + 208);
        }
#pragma unroll
        for (int k = 0; k < T; k++) {
            if (k >= nt) break;
            int part = 0;
            const u8* ab = a + ((long)k * nb + b) * Q8K_BYTES;
            if (b < nb) {
                const int4* yv = (const int4*)(ab + 128 * n + 32 * qr);
                int4 y0 = yv[0], y1 = yv[1];
                int half0 = dp4a(q[3], y0.w, dp4a(q[2], y0.z, dp4a(q[1], y0.y, dp4a(q[0], y0.x, 0))));
                int half1 = dp4a(q[7], y1.w, dp4a(q[6], y1.z, dp4a(q[5], y1.y, dp4a(q[4], y1.x, 0))));
                part = sc0 * half0 + sc1 * half1;
            }
            part += __shfl_xor_sync(0xffffffffu, part, 1);
            part += __shfl_xor_sync(0xffffffffu, part, 2);
            part += __shfl_xor_sync(0xffffffffu, part, 4);
            if (b < nb && p == 0) sum[k] += (float)part * (dw * *(const float*)(ab + Q8K_D));
        }
    }
#pragma unroll
    for (int k = 0; k < T; k++) {
        float total = warp_sum(sum[k]);
        if (lane == 0 && k < nt) put(out, (long)(t0 + k) * rows + r, total, acc);
    }
}
MATVEC_KERNELS(matvec_q6_k, 210, Q8K_BYTES)

// Q4_1 × Q8_1, four lanes per 32-block and eight blocks per warp step: lane p takes
// quant bytes 4p..4p+3 (weights 4p + i in the low nibbles, 16 + 4p + i in the high);
// lane 0 of each block adds the minimum's term. Blocks (20 and 36 bytes) are 4-byte
// aligned; d and m of a block are read as one word. One warp per row; grid
// (ceil(rows / 4), ceil(tokens / T)), 128 threads. (Two rows per warp sharing the
// activations' loads, as Q4_K once decoded, was tried and measured slower here, commit
// eb64b43.)
template <int T>
__device__ __forceinline__ void matvec_q4_1_row(const u8* w, const u8* a, float* out, int rows, int nb, int r, int acc, int tokens) {
    ROW_TOKENS(T)
    int lane = threadIdx.x % WARP;
    const u8* wr = w + (long)r * nb * 20;
    int p = lane % 4;
    float sum[T], mins[T];
    for (int k = 0; k < T; k++) sum[k] = mins[k] = 0.0f;
#pragma unroll 2
    for (int b = lane / 4; b < nb; b += 8) {
        const u8* wb = wr + (long)b * 20;
        int q = *(const int*)(wb + 4 + 4 * p);
        unsigned int wdm = *(const unsigned int*)wb;
#pragma unroll
        for (int k = 0; k < T; k++) {
            if (k >= nt) break;
            const u8* ab = a + ((long)k * nb + b) * 36;
            int isum = dp4a(q & 0x0f0f0f0f, *(const int*)(ab + 4 + 4 * p), 0);
            isum = dp4a((q >> 4) & 0x0f0f0f0f, *(const int*)(ab + 20 + 4 * p), isum);
            unsigned int ads = *(const unsigned int*)ab;
            sum[k] += (float)isum * (h2f((u16)(wdm & 0xffffu)) * h2f((u16)(ads & 0xffffu)));
            if (p == 0) mins[k] += h2f((u16)(wdm >> 16)) * h2f((u16)(ads >> 16));
        }
    }
#pragma unroll
    for (int k = 0; k < T; k++) {
        float total = warp_sum(sum[k]) + warp_sum(mins[k]);
        if (lane == 0 && k < nt) put(out, (long)(t0 + k) * rows + r, total, acc);
    }
}
MATVEC_KERNELS_1(matvec_q4_1, 20, 36)

// Q5_0 × Q8_0, four lanes per 32-block and eight blocks per warp step: lane p takes
// weights 4p + i and 16 + 4p + i, their fifth bits from qh; codes are offset by -16 into
// signed bytes. Blocks (22 and 34 bytes) are 2-byte aligned.
template <int T>
__device__ __forceinline__ void matvec_q5_0_row(const u8* w, const u8* a, float* out, int rows, int nb, int r, int acc, int tokens) {
    ROW_TOKENS(T)
    int lane = threadIdx.x % WARP;
    const u8* wr = w + (long)r * nb * 22;
    int p = lane % 4;
    float sum[T];
    for (int k = 0; k < T; k++) sum[k] = 0.0f;
#pragma unroll 2
    for (int b = lane / 4; b < nb; b += 8) {
        const u8* wb = wr + (long)b * 22;
        unsigned int qh = (unsigned int)ld4_2(wb + 2);
        unsigned int q = (unsigned int)ld4_2(wb + 6 + 4 * p);
        unsigned int lo = 0, hi = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            unsigned int byte = (q >> (8 * i)) & 0xff;
            unsigned int cl = (byte & 15) | (((qh >> (4 * p + i)) & 1) << 4);
            unsigned int ch = (byte >> 4) | (((qh >> (16 + 4 * p + i)) & 1) << 4);
            lo |= ((cl - 16) & 0xff) << (8 * i);
            hi |= ((ch - 16) & 0xff) << (8 * i);
        }
        float dw = ldh(wb);
#pragma unroll
        for (int k = 0; k < T; k++) {
            if (k >= nt) break;
            const u8* ab = a + ((long)k * nb + b) * 34;
            int isum = dp4a((int)lo, ld4_2(ab + 2 + 4 * p), 0);
            isum = dp4a((int)hi, ld4_2(ab + 18 + 4 * p), isum);
            sum[k] += (float)isum * (dw * ldh(ab));
        }
    }
#pragma unroll
    for (int k = 0; k < T; k++) {
        float total = warp_sum(sum[k]);
        if (lane == 0 && k < nt) put(out, (long)(t0 + k) * rows + r, total, acc);
    }
}
MATVEC_KERNELS(matvec_q5_0, 22, 34)

// The 32 quants of a Q8_0 block (34 bytes, 2-byte aligned) as eight words, read with
// 16-bit loads (the activations' blocks, as quantize_q8_32 stores them).
__device__ __forceinline__ void q8_words(const u8* blk, int* out) {
    const u16* h = (const u16*)(blk + 2);
#pragma unroll
    for (int i = 0; i < 8; i++) out[i] = (int)((unsigned int)h[2 * i] | ((unsigned int)h[2 * i + 1] << 16));
}

// Q8_0 weights as the device keeps them (backend.rs, `q8_0_rows_to_device`): each row's
// nb·32 quants, block b's at 32·b, then its nb f16 scales: the stored row's bytes in
// another order, so that rows keep their size and place (r·34·nb) and a block's quants
// are read in wide loads. A row's alignment is that of 34·nb, q8_0_align's.
__device__ __forceinline__ float q8_0_scale(const u8* row, int nb, int b) { return h2f(*(const u16*)(row + 32 * nb + 2 * b)); }

// The widest load (2, 4, 8 or 16 bytes) that every row of nb Q8_0 blocks allows.
__device__ __forceinline__ int q8_0_align(int nb) {
    int bytes = 34 * nb;
    return min(bytes & -bytes, 16);
}

// 16 bytes at p as four words, in loads of `align` bytes (p a multiple of it; the
// branch is the same for a whole launch).
__device__ __forceinline__ int4 ld16(const u8* p, int align) {
    int4 v;
    if (align >= 16) {
        v = *(const int4*)p;
    } else if (align == 8) {
        int2 a = ((const int2*)p)[0], b = ((const int2*)p)[1];
        v.x = a.x, v.y = a.y, v.z = b.x, v.w = b.y;
    } else if (align == 4) {
        const int* w = (const int*)p;
        v.x = w[0], v.y = w[1], v.z = w[2], v.w = w[3];
    } else {
        v.x = ld4_2(p), v.y = ld4_2(p + 4), v.z = ld4_2(p + 8), v.w = ld4_2(p + 12);
    }
    return v;
}

// Q8_0 × Q8_0, a lane per block, for rows longer than the held-activations kernel
// below takes: the block's quants in two 16-byte loads, the warp's 32 blocks 1,024
// consecutive bytes. One warp per row; grid (ceil(rows / 4), ceil(tokens / T)), 128
// threads.
template <int T>
__device__ __forceinline__ void matvec_q8_0_row(const u8* w, const u8* a, float* out, int rows, int nb, int r, int acc, int tokens) {
    ROW_TOKENS(T)
    int lane = threadIdx.x % WARP, align = q8_0_align(nb);
    const u8* wr = w + (long)r * nb * 34;
    float sum[T];
    for (int k = 0; k < T; k++) sum[k] = 0.0f;
    for (int b = lane; b < nb; b += WARP) {
        int4 lo = ld16(wr + 32 * b, align), hi = ld16(wr + 32 * b + 16, align);
        int x[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        float dw = q8_0_scale(wr, nb, b);
#pragma unroll
        for (int k = 0; k < T; k++) {
            if (k >= nt) break;
            const u8* ab = a + ((long)k * nb + b) * 34;
            int y[8];
            q8_words(ab, y);
            int isum = 0;
#pragma unroll
            for (int i = 0; i < 8; i++) isum = dp4a(x[i], y[i], isum);
            sum[k] += (float)isum * (dw * h2f(*(const u16*)ab));
        }
    }
#pragma unroll
    for (int k = 0; k < T; k++) {
        float total = warp_sum(sum[k]);
        if (lane == 0 && k < nt) put(out, (long)(t0 + k) * rows + r, total, acc);
    }
}
MATVEC_KERNELS(matvec_q8_0, 34, 34)

// Q8_0 × Q8_0 held (matvec_q8_0_held): lane i of the CTA takes the 16 quant bytes 16i..
// of a row (half i % 2 of block i / 2) in one load of the device layout above, and its
// block's scale; W = ceil(nb / 16) warps, nb ≤ 16·HELD_WARPS. A lane's part of a row is
// (int sum)·(dw·da). This layout measured faster than a lane per block of the stored
// one, and four rows at a time (HELD_ROWS: fewer registers, so more CTAs an SM) faster
// than eight (commit 3725071). (Loading the next four rows
// while these four are summed was tried and measured slower, commit 3725071.)
struct Q8_0HeldLanes {
    struct Weights {
        int4 q;
        float d;
    };
    typedef Weights Acts;
    // scale: from the lane's quants to its block's scale.
    int i, b, scale, align;
    bool on;
    __device__ Q8_0HeldLanes(int nb) : i(threadIdx.x), b(threadIdx.x / 2), scale(32 * nb + 2 * b - 16 * i), align(q8_0_align(nb)), on(b < nb) {}
    static __device__ long row_bytes(int nb) { return (long)nb * 34; }
    static __device__ long act_row_bytes(int nb) { return (long)nb * 34; }
    // The lane's part of a row starts at its 16 quant bytes.
    __device__ long offset() const { return 16L * i; }
    __device__ void prefetch(const u8* part) const {
        if (i % 8 == 0) l1_line(part);
    }
    __device__ Weights load(const u8* part) const { return {ld16(part, align), h2f(*(const u16*)(part + scale))}; }
    // The activations' blocks as quantize_q8_32 stores them (2-byte aligned).
    __device__ Acts acts(const u8* at) const {
        const u8* ab = at + (long)b * 34;
        return {ld16(ab + 2 + 16 * (i % 2), 2), ldh(ab)};
    }
    __device__ float dot(const Weights& w, const Acts& y) const {
        int isum = dp4a(w.q.x, y.q.x, 0);
        isum = dp4a(w.q.y, y.q.y, isum);
        isum = dp4a(w.q.z, y.q.z, isum);
        isum = dp4a(w.q.w, y.q.w, isum);
        return (float)isum * (w.d * y.d);
    }
};
HELD_ENTRIES(matvec_q8_0_held, Q8_0HeldLanes)

// ---------------------------------------------------------------------------------
// Tiled products of batches (mmq_*): the integer dot products on the tensor cores,
// each weight block loaded once for every token of a tile. A CTA takes 16 rows and
// 8·NT tokens, its MMQ_WARPS warps every MMQ_WARPS-th block of the rows from the
// warp's index on. Grid (row tiles of up to three matrices, token tiles). Each warp
// sums a (row, token)'s block contributions in block order, each block's as the scalar
// statement computes it (blk_q4_k; the integer sum times both scales for Q8_0; blk_q4_1
// with its minimum's term added to the block's), every rounding spelled out; the warps'
// sums are then added in warp order. A token's result so depends on its own
// activations alone, whatever else is in the batch and whichever tile it falls in. The
// order differs from the per-token kernels', so these run only where batching may
// change the last bits (not --deterministic).

// c += A·B over k = 32 for one 16×8 tile (mma.m16n8k32, s8 × s8 → s32). Lane l, with
// g = l / 4 and q = l % 4, holds in a[0..3] row g at k 4q..4q+3, row g+8 there, row g
// at k 16+4q.., row g+8 there; in b0, b1 column g at k 4q.. and 16+4q..; and gets in
// c[0..3] the entries (g, 2q), (g, 2q+1), (g+8, 2q), (g+8, 2q+1). Bytes in a word are
// in k order.
__device__ __forceinline__ void mma_s8_add(int c[4], const unsigned int a[4], int b0, int b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

// c = A·B: mma_s8_add from zero.
__device__ __forceinline__ void mma_s8(int c[4], const unsigned int a[4], int b0, int b1) {
    c[0] = c[1] = c[2] = c[3] = 0;
    mma_s8_add(c, a, b0, b1);
}

// Asynchronous copies from global to shared memory (cp.async, sm_80 on): 16 bytes
// (both addresses 16-byte aligned) or 4, waited for by groups.
__device__ __forceinline__ unsigned int shared_addr(const void* p) {
    unsigned int a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void copy_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void copy_async4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(shared_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N committed groups are still copying.
template <int N>
__device__ __forceinline__ void copy_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// A CTA's rows and tokens: RT row tiles of 16 (rows row0..row0 + 16·RT) of the
// matrix of the three that CTA blockIdx.x falls in, the lane's rows of the first (ra,
// ra + 8) and the CTA's first token.
template <int RT>
struct MmqTile {
    const u8* w;
    float* out;
    int rows, row0, ra, tok0;
    __device__ MmqTile(const u8* w0, const u8* w1, const u8* w2, float* o0, float* o1, float* o2, int r0, int r1, int r2, int nt) {
        int cta = blockIdx.x, c0 = ((r0 + 15) / 16 + RT - 1) / RT, c1 = ((r1 + 15) / 16 + RT - 1) / RT;
        if (cta < c0) {
            w = w0, out = o0, rows = r0;
        } else if (cta < c0 + c1) {
            cta -= c0, w = w1, out = o1, rows = r1;
        } else {
            cta -= c0 + c1, w = w2, out = o2, rows = r2;
        }
        row0 = cta * 16 * RT;
        ra = row0 + threadIdx.x % WARP / 4;
        tok0 = blockIdx.y * 8 * nt;
    }
    // A row to read: past the end, the last (its results are not stored).
    __device__ int row(int r) const { return min(r, rows - 1); }
    // Row tile r's sums, the warps' added in warp order and stored: sum[n][e] of lane
    // l holds token tok0 + 8n + 2(l % 4) + e % 2 of row ra + 16r + 8(e / 2). `part`
    // is shared memory of MMQ_WARPS·NT·4·WARP floats, free until the CTA is
    // synchronized at the start.
    template <int NT>
    __device__ void store(const float (&sum)[NT][4], int r, int acc, int tokens, float* part) const {
        int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
        __syncthreads();
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) part[((warp * NT + n) * 4 + e) * WARP + lane] = sum[n][e];
        __syncthreads();
        for (int k = threadIdx.x; k < NT * 4 * WARP; k += WARP * MMQ_WARPS) {
            int l = k % WARP, e = k / WARP % 4, n = k / (4 * WARP);
            float v = part[(n * 4 + e) * WARP + l];
#pragma unroll
            for (int w = 1; w < MMQ_WARPS; w++) v = __fadd_rn(v, part[((w * NT + n) * 4 + e) * WARP + l]);
            int t = tok0 + 8 * n + 2 * (l % 4) + e % 2, rr = row0 + 16 * r + l / 4 + 8 * (e / 2);
            if (t < tokens && rr < rows) put(out, (long)t * rows + rr, v, acc);
        }
    }
    // The same for a CTA of one row tile, with its own shared memory.
    template <int NT>
    __device__ void store(const float (&sum)[NT][4], int acc, int tokens) const {
        __shared__ float part[MMQ_WARPS * NT * 4 * WARP];
        store<NT>(sum, 0, acc, tokens, part);
    }
};

// A lane's activation rows (abytes each) in each token tile: column g's, the mma's, and
// tokens 2q and 2q + 1, its results'; past the batch, its last token.
template <int NT>
struct MmqActs {
    const u8* col[NT];
    const u8* res[NT][2];
    __device__ MmqActs(const MmqTile<1>& tl, const u8* a, long abytes, int tokens) {
        int g = threadIdx.x % WARP / 4, q = threadIdx.x % 4;
#pragma unroll
        for (int n = 0; n < NT; n++) {
            int t = tl.tok0 + 8 * n;
            col[n] = a + min(t + g, tokens - 1) * abytes;
            res[n][0] = a + min(t + 2 * q, tokens - 1) * abytes;
            res[n][1] = a + min(t + 2 * q + 1, tokens - 1) * abytes;
        }
    }
};

// Q4_K × Q8_K: sub-block j of a block (32 weights, nibble j % 2 of quant bytes
// 32(j / 2)..) is one mma; its integer sums times the rows' 6-bit scales are added
// exactly, and the block's minimums come from the activations' 16-sums. A CTA takes
// RT row tiles. A warp copies each of its blocks' activations (quants and 16-sums, the
// tokens' rows MMQ_STAGE bytes apart, then their d) into its part of shared memory in
// 16-byte loads, and every row tile's mma reads them there: the global reads of a
// block's activations are wide and made once for the CTA's 16·RT rows, rather than in
// 4-byte loads, eight tokens' rows apart, for each row tile. NS token tiles are copied at a time: one where the CTA has
// one row tile (its weights stay in registers over the token tiles), all NT otherwise.
//
// The mma's k runs over a sub-block's positions in another order, the same for both
// operands: lane (g, q) holds positions 8q..8q+7 (k 4q.. and 16 + 4q..), so that a
// row's weights and a token's activations are each one 8-byte load. A sum of products
// does not depend on the order of its terms.
#define MMQ_STAGE 288
static_assert(Q8K_SUMS == 256 && Q8K_D == MMQ_STAGE, "staged Q8_K layout");

// The shared memory of mmq_q4_k's CTA: each warp's staged activations, and later the
// warps' sums (MmqTile::store).
__device__ constexpr int mmq_ns(int nt, int rt) { return rt == 1 ? 1 : nt; }
__device__ constexpr int mmq_warp_stage(int nt, int rt) { return mmq_ns(nt, rt) * 8 * (MMQ_STAGE + 4); }
__device__ constexpr int mmq_smem(int nt, int rt) {
    return MMQ_WARPS * mmq_warp_stage(nt, rt) > MMQ_WARPS * nt * 4 * WARP * 4 ? MMQ_WARPS * mmq_warp_stage(nt, rt)
                                                                             : MMQ_WARPS * nt * 4 * WARP * 4;
}

// A row tile's Q4_K block b in a lane's registers: rows ra and ra + 8 (h), their
// scales, minimums and quant bytes 32c + 8q.. (q = lane % 4).
struct Q4KFrag {
    uint2 qv[2][4];
    int sc[2][8], mn[2][8];
    float d[2], dmin[2];
    template <int RT>
    __device__ __forceinline__ void load(const MmqTile<RT>& tl, int ra, int nb, int b) {
        from(tl.w + ((long)tl.row(ra) * nb + b) * 144, tl.w + ((long)tl.row(ra + 8) * nb + b) * 144);
    }
    // From the blocks of rows ra (b0) and ra + 8 (b1), in global or shared memory.
    __device__ __forceinline__ void from(const u8* b0, const u8* b1) {
        const int q = threadIdx.x % 4;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const u8* blk = h ? b1 : b0;
            uint4 head = *(const uint4*)blk;
            d[h] = h2f((u16)(head.x & 0xffffu));
            dmin[h] = h2f((u16)(head.x >> 16));
            u8 scales[12];
            unsigned int s3[3] = {head.y, head.z, head.w};
#pragma unroll
            for (int i = 0; i < 12; i++) scales[i] = (u8)(s3[i / 4] >> (8 * (i % 4)));
#pragma unroll
            for (int j = 0; j < 8; j++) scale_min_k4(j, scales, &sc[h][j], &mn[h][j]);
#pragma unroll
            for (int c = 0; c < 4; c++) qv[h][c] = *(const uint2*)(blk + 16 + 32 * c + 8 * q);
        }
    }
};

// One row tile's block (f) against a token tile's block, added to the lane's sums:
// col is the Q8_K block of the lane's mma column (token g), res[e] those of its
// results' tokens 2q + e, dy[e] their d.
__device__ __forceinline__ void mmq_q4_k_part(const Q4KFrag& f, const u8* col, const u8* const (&res)[2], const float (&dy)[2], float (&sum)[4]) {
    const int q = threadIdx.x % 4;
    int is[4] = {0, 0, 0, 0};
#pragma unroll
    for (int j = 0; j < 8; j++) {
        int c = j / 2, sh = 4 * (j % 2);
        unsigned int aw[4] = {(f.qv[0][c].x >> sh) & 0x0f0f0f0fu, (f.qv[1][c].x >> sh) & 0x0f0f0f0fu,
                              (f.qv[0][c].y >> sh) & 0x0f0f0f0fu, (f.qv[1][c].y >> sh) & 0x0f0f0f0fu};
        uint2 bv = *(const uint2*)(col + 32 * j + 8 * q);
        int cc[4];
        mma_s8(cc, aw, (int)bv.x, (int)bv.y);
        is[0] += f.sc[0][j] * cc[0];
        is[1] += f.sc[0][j] * cc[1];
        is[2] += f.sc[1][j] * cc[2];
        is[3] += f.sc[1][j] * cc[3];
    }
#pragma unroll
    for (int e = 0; e < 2; e++) {
        const u8* ay = res[e];
        uint4 s0 = *(const uint4*)(ay + Q8K_SUMS), s1 = *(const uint4*)(ay + Q8K_SUMS + 16);
        unsigned int sw[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
        int ms[2] = {0, 0};
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int pair = (int)(i16)(sw[j] & 0xffffu) + (int)(i16)(sw[j] >> 16);
            ms[0] += f.mn[0][j] * pair;
            ms[1] += f.mn[1][j] * pair;
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float part = __fsub_rn(__fmul_rn((float)is[2 * h + e], __fmul_rn(f.d[h], dy[e])), __fmul_rn((float)ms[h], __fmul_rn(f.dmin[h], dy[e])));
            sum[2 * h + e] = __fadd_rn(sum[2 * h + e], part);
        }
    }
}

template <int NT, int RT>
__device__ __forceinline__ void mmq_q4_k(const MmqTile<RT>& tl, const u8* a, int nb, int acc, int tokens) {
    constexpr int NS = mmq_ns(NT, RT);
    __shared__ __align__(16) u8 smem[mmq_smem(NT, RT)];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, g = lane / 4, q = lane % 4;
    u8* stage = smem + warp * mmq_warp_stage(NT, RT);
    float* sd = (float*)(stage + NS * 8 * MMQ_STAGE);
    const long abytes = (long)nb * Q8K_BYTES;
    float sum[RT][NT][4] = {};
    for (int b = warp; b < nb; b += MMQ_WARPS) {
        Q4KFrag f;
        if (RT == 1) f.load(tl, tl.ra, nb, b);
#pragma unroll
        for (int n0 = 0; n0 < NT; n0 += NS) {
            __syncwarp();
            const u8* ab = a + (long)b * Q8K_BYTES;
            for (int k = lane; k < NS * 8 * (MMQ_STAGE / 16); k += WARP) {
                int t = k / (MMQ_STAGE / 16), piece = k % (MMQ_STAGE / 16);
                long tok = min(tl.tok0 + 8 * n0 + t, tokens - 1);
                *(uint4*)(stage + t * MMQ_STAGE + 16 * piece) = *(const uint4*)(ab + tok * abytes + 16 * piece);
            }
            if (lane < NS * 8) sd[lane] = *(const float*)(ab + (long)min(tl.tok0 + 8 * n0 + lane, tokens - 1) * abytes + Q8K_D);
            __syncwarp();
#pragma unroll
            for (int r = 0; r < RT; r++) {
                if (RT > 1) f.load(tl, tl.ra + 16 * r, nb, b);
#pragma unroll
                for (int n = 0; n < NS; n++) {
                    const u8* ts = stage + n * 8 * MMQ_STAGE;
                    const u8* const res[2] = {ts + 2 * q * MMQ_STAGE, ts + (2 * q + 1) * MMQ_STAGE};
                    const float dy[2] = {sd[8 * n + 2 * q], sd[8 * n + 2 * q + 1]};
                    mmq_q4_k_part(f, ts + g * MMQ_STAGE, res, dy, sum[r][n0 + n]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RT; r++) tl.template store<NT>(sum[r], r, acc, tokens, (float*)smem);
}

// The same products for wide token tiles (NT of 4 and 8), with the activations read
// straight from global memory: a warp's staging of one token tile at a time waits on
// its loads once per tile, which costs these more than the narrow loads do.
template <int NT, int RT>
__device__ __forceinline__ void mmq_q4_k_direct(const MmqTile<RT>& tl, const u8* a, int nb, int acc, int tokens) {
    static_assert(RT == 1, "one row tile a CTA");
    MmqActs<NT> at(tl, a, (long)nb * Q8K_BYTES, tokens);
    float sum[NT][4] = {};
    for (int b = threadIdx.x / WARP; b < nb; b += MMQ_WARPS) {
        Q4KFrag f;
        f.load(tl, tl.ra, nb, b);
        const long off = (long)b * Q8K_BYTES;
#pragma unroll
        for (int n = 0; n < NT; n++) {
            const u8* const res[2] = {at.res[n][0] + off, at.res[n][1] + off};
            const float dy[2] = {*(const float*)(res[0] + Q8K_D), *(const float*)(res[1] + Q8K_D)};
            mmq_q4_k_part(f, at.col[n] + off, res, dy, sum[n]);
        }
    }
    tl.template store<NT>(sum, acc, tokens);
}

// Q4_K × Q8_K for batches of 32 and 64 tokens (NT token tiles of 8): a CTA of NT
// warps takes 16·RT rows and 8·NT tokens, a warp one token tile against every row
// tile. Block by block, the CTA copies its rows' weights and its tokens' quants and d
// into shared memory (cp.async into two buffers, the next block's copy running under
// this one's products), so that the activations come from global memory once for
// 16·RT rows, in 16-byte pieces. A block's minimum term is an mma too: each row's
// sub-block minimums, repeated over the sub-block's 32 positions, times the quants
// give the same integers as the minimums times the 16-sums, without reading those.
// Each (row, token) adds its blocks in block order, each as blk_q4_k computes it, so
// results can differ in the last bits from the narrower tiles' (whose warps split the
// blocks).
#define MMQ_W_ROW 160 // a weight block's bytes in shared memory (144, padded against bank conflicts)
template <int NT, int RT>
struct MmqManyStage {
    u8 q[8 * NT][MMQ_STAGE];
    float d[8 * NT];
    u8 w[16 * RT][MMQ_W_ROW];
};

template <int NT, int RT>
__device__ __forceinline__ void mmq_many_copy(MmqManyStage<NT, RT>& st, const MmqTile<RT>& tl, const u8* a, int nb, int b, int tokens) {
    const long abytes = (long)nb * Q8K_BYTES;
    for (int k = threadIdx.x; k < 8 * NT * 16; k += WARP * NT) {
        int t = k / 16, piece = k % 16;
        const u8* src = a + (long)min(tl.tok0 + t, tokens - 1) * abytes + (long)b * Q8K_BYTES + 16 * piece;
        copy_async16(&st.q[t][16 * piece], src);
    }
    if (threadIdx.x < 8 * NT) {
        const u8* src = a + (long)min(tl.tok0 + (int)threadIdx.x, tokens - 1) * abytes + (long)b * Q8K_BYTES + Q8K_D;
        copy_async4(&st.d[threadIdx.x], src);
    }
    for (int k = threadIdx.x; k < 16 * RT * 9; k += WARP * NT) {
        int r = k / 9, piece = k % 9;
        copy_async16(&st.w[r][16 * piece], tl.w + ((long)tl.row(tl.row0 + r) * nb + b) * 144 + 16 * piece);
    }
    copy_async_commit();
}

template <int NT, int RT>
__device__ __forceinline__ void mmq_q4_k_many(const MmqTile<RT>& tl, const u8* a, int nb, int acc, int tokens) {
    __shared__ __align__(16) MmqManyStage<NT, RT> stage[2];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, g = lane / 4, q = lane % 4;
    float sum[RT][4] = {};
    mmq_many_copy(stage[0], tl, a, nb, 0, tokens);
    for (int b = 0; b < nb; b++) {
        if (b + 1 < nb) {
            mmq_many_copy(stage[(b + 1) % 2], tl, a, nb, b + 1, tokens);
            copy_async_wait<1>();
        } else {
            copy_async_wait<0>();
        }
        __syncthreads();
        const MmqManyStage<NT, RT>& st = stage[b % 2];
        uint2 bv[8];
#pragma unroll
        for (int j = 0; j < 8; j++) bv[j] = *(const uint2*)(st.q[8 * warp + g] + 32 * j + 8 * q);
        const float dy[2] = {st.d[8 * warp + 2 * q], st.d[8 * warp + 2 * q + 1]};
#pragma unroll
        for (int r = 0; r < RT; r++) {
            Q4KFrag f;
            f.from(st.w[16 * r + g], st.w[16 * r + g + 8]);
            int is[4] = {0, 0, 0, 0}, ms[4] = {0, 0, 0, 0};
#pragma unroll
            for (int j = 0; j < 8; j++) {
                int c = j / 2, sh = 4 * (j % 2);
                unsigned int aw[4] = {(f.qv[0][c].x >> sh) & 0x0f0f0f0fu, (f.qv[1][c].x >> sh) & 0x0f0f0f0fu,
                                      (f.qv[0][c].y >> sh) & 0x0f0f0f0fu, (f.qv[1][c].y >> sh) & 0x0f0f0f0fu};
                int cc[4];
                mma_s8(cc, aw, (int)bv[j].x, (int)bv[j].y);
                is[0] += f.sc[0][j] * cc[0];
                is[1] += f.sc[0][j] * cc[1];
                is[2] += f.sc[1][j] * cc[2];
                is[3] += f.sc[1][j] * cc[3];
                unsigned int m0 = (unsigned int)f.mn[0][j] * 0x01010101u, m1 = (unsigned int)f.mn[1][j] * 0x01010101u;
                unsigned int am[4] = {m0, m1, m0, m1};
                mma_s8_add(ms, am, (int)bv[j].x, (int)bv[j].y);
            }
#pragma unroll
            for (int e = 0; e < 2; e++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    float part = __fsub_rn(__fmul_rn((float)is[2 * h + e], __fmul_rn(f.d[h], dy[e])),
                                           __fmul_rn((float)ms[2 * h + e], __fmul_rn(f.dmin[h], dy[e])));
                    sum[r][2 * h + e] = __fadd_rn(sum[r][2 * h + e], part);
                }
        }
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < RT; r++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int t = tl.tok0 + 8 * warp + 2 * q + e % 2, row = tl.row0 + 16 * r + g + 8 * (e / 2);
            if (t < tokens && row < tl.rows) put(tl.out, (long)t * tl.rows + row, sum[r][e], acc);
        }
}

// mmq_q4_k_many's products with each warp taking one row tile against two token
// tiles (RT = 2, NT warps: warp w takes row tile w % 2 and token tiles w / 2 and
// w / 2 + NT / 2), so that a row tile's block is unpacked once for two token tiles
// rather than once for each. Every (row, token) adds the same parts in the same order
// as in mmq_q4_k_many: the same bits.
template <int NT>
__device__ __forceinline__ void mmq_q4_k_pair(const MmqTile<2>& tl, const u8* a, int nb, int acc, int tokens) {
    __shared__ __align__(16) MmqManyStage<NT, 2> stage[2];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, g = lane / 4, q = lane % 4;
    const int r = warp % 2, tt[2] = {warp / 2, warp / 2 + NT / 2};
    float sum[2][4] = {};
    mmq_many_copy(stage[0], tl, a, nb, 0, tokens);
    for (int b = 0; b < nb; b++) {
        if (b + 1 < nb) {
            mmq_many_copy(stage[(b + 1) % 2], tl, a, nb, b + 1, tokens);
            copy_async_wait<1>();
        } else {
            copy_async_wait<0>();
        }
        __syncthreads();
        const MmqManyStage<NT, 2>& st = stage[b % 2];
        Q4KFrag f;
        f.from(st.w[16 * r + g], st.w[16 * r + g + 8]);
        int is[2][4] = {}, ms[2][4] = {};
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int c = j / 2, sh = 4 * (j % 2);
            unsigned int aw[4] = {(f.qv[0][c].x >> sh) & 0x0f0f0f0fu, (f.qv[1][c].x >> sh) & 0x0f0f0f0fu,
                                  (f.qv[0][c].y >> sh) & 0x0f0f0f0fu, (f.qv[1][c].y >> sh) & 0x0f0f0f0fu};
            unsigned int m0 = (unsigned int)f.mn[0][j] * 0x01010101u, m1 = (unsigned int)f.mn[1][j] * 0x01010101u;
            unsigned int am[4] = {m0, m1, m0, m1};
#pragma unroll
            for (int u = 0; u < 2; u++) {
                uint2 bv = *(const uint2*)(st.q[8 * tt[u] + g] + 32 * j + 8 * q);
                int cc[4];
                mma_s8(cc, aw, (int)bv.x, (int)bv.y);
                is[u][0] += f.sc[0][j] * cc[0];
                is[u][1] += f.sc[0][j] * cc[1];
                is[u][2] += f.sc[1][j] * cc[2];
                is[u][3] += f.sc[1][j] * cc[3];
                mma_s8_add(ms[u], am, (int)bv.x, (int)bv.y);
            }
        }
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const float dy[2] = {st.d[8 * tt[u] + 2 * q], st.d[8 * tt[u] + 2 * q + 1]};
#pragma unroll
            for (int e = 0; e < 2; e++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    float part = __fsub_rn(__fmul_rn((float)is[u][2 * h + e], __fmul_rn(f.d[h], dy[e])),
                                           __fmul_rn((float)ms[u][2 * h + e], __fmul_rn(f.dmin[h], dy[e])));
                    sum[u][2 * h + e] = __fadd_rn(sum[u][2 * h + e], part);
                }
        }
        __syncthreads();
    }
#pragma unroll
    for (int u = 0; u < 2; u++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int t = tl.tok0 + 8 * tt[u] + 2 * q + e % 2, row = tl.row0 + 16 * r + g + 8 * (e / 2);
            if (t < tokens && row < tl.rows) put(tl.out, (long)t * tl.rows + row, sum[u][e], acc);
        }
}

// A word of a Q8_0 row's quants (at a multiple of 4 from the row's start) in loads its
// alignment allows.
__device__ __forceinline__ unsigned int ld4_row(const u8* p, int align) {
    return align >= 4 ? *(const unsigned int*)p : (unsigned int)ld4_2(p);
}

// Q8_0 × Q8_0 (the device layout of q8_0_scale): one mma a block.
template <int NT, int RT>
__device__ __forceinline__ void mmq_q8_0(const MmqTile<RT>& tl, const u8* a, int nb, int acc, int tokens) {
    const int q = threadIdx.x % 4, align = q8_0_align(nb);
    const long abytes = (long)nb * 34;
    const u8* wr[2] = {tl.w + (long)tl.row(tl.ra) * nb * 34, tl.w + (long)tl.row(tl.ra + 8) * nb * 34};
    MmqActs<NT> at(tl, a, abytes, tokens);
    float sum[NT][4] = {};
    for (int b = threadIdx.x / WARP; b < nb; b += MMQ_WARPS) {
        unsigned int aw[4] = {ld4_row(wr[0] + 32 * b + 4 * q, align), ld4_row(wr[1] + 32 * b + 4 * q, align),
                              ld4_row(wr[0] + 32 * b + 16 + 4 * q, align), ld4_row(wr[1] + 32 * b + 16 + 4 * q, align)};
        float dw[2] = {q8_0_scale(wr[0], nb, b), q8_0_scale(wr[1], nb, b)};
#pragma unroll
        for (int n = 0; n < NT; n++) {
            const u8* ab = at.col[n] + (long)b * 34;
            int cc[4];
            mma_s8(cc, aw, ld4_2(ab + 2 + 4 * q), ld4_2(ab + 18 + 4 * q));
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float dy = ldh(at.res[n][e] + (long)b * 34);
#pragma unroll
                for (int h = 0; h < 2; h++) sum[n][2 * h + e] = __fadd_rn(sum[n][2 * h + e], __fmul_rn((float)cc[2 * h + e], __fmul_rn(dw[h], dy)));
            }
        }
    }
    tl.template store<NT>(sum, acc, tokens);
}

// Q4_1 × Q8_1: one mma a block (its 16 quant bytes' low nibbles weights 0..15, high
// nibbles 16..31), the minimum's term m·s added to the block's part. Blocks (20 and 36
// bytes) are 4-byte aligned.
template <int NT, int RT>
__device__ __forceinline__ void mmq_q4_1(const MmqTile<RT>& tl, const u8* a, int nb, int acc, int tokens) {
    const int q = threadIdx.x % 4;
    const long abytes = (long)nb * 36;
    const u8* wr[2] = {tl.w + (long)tl.row(tl.ra) * nb * 20, tl.w + (long)tl.row(tl.ra + 8) * nb * 20};
    MmqActs<NT> at(tl, a, abytes, tokens);
    float sum[NT][4] = {};
    for (int b = threadIdx.x / WARP; b < nb; b += MMQ_WARPS) {
        unsigned int qs[2] = {*(const unsigned int*)(wr[0] + (long)b * 20 + 4 + 4 * q), *(const unsigned int*)(wr[1] + (long)b * 20 + 4 + 4 * q)};
        unsigned int aw[4] = {qs[0] & 0x0f0f0f0fu, qs[1] & 0x0f0f0f0fu, (qs[0] >> 4) & 0x0f0f0f0fu, (qs[1] >> 4) & 0x0f0f0f0fu};
        unsigned int dm[2] = {*(const unsigned int*)(wr[0] + (long)b * 20), *(const unsigned int*)(wr[1] + (long)b * 20)};
#pragma unroll
        for (int n = 0; n < NT; n++) {
            const u8* ab = at.col[n] + (long)b * 36;
            int cc[4];
            mma_s8(cc, aw, *(const int*)(ab + 4 + 4 * q), *(const int*)(ab + 20 + 4 * q));
#pragma unroll
            for (int e = 0; e < 2; e++) {
                unsigned int ds = *(const unsigned int*)(at.res[n][e] + (long)b * 36);
                float dy = h2f((u16)(ds & 0xffffu)), sy = h2f((u16)(ds >> 16));
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    float dw = h2f((u16)(dm[h] & 0xffffu)), mw = h2f((u16)(dm[h] >> 16));
                    float part = __fadd_rn(__fmul_rn((float)cc[2 * h + e], __fmul_rn(dw, dy)), __fmul_rn(mw, sy));
                    sum[n][2 * h + e] = __fadd_rn(sum[n][2 * h + e], part);
                }
            }
        }
    }
    tl.template store<NT>(sum, acc, tokens);
}

#define MMQ_ENTRY_OF(name, fn, NT, RT)                                                                                  \
    extern "C" __global__ void __launch_bounds__(WARP * MMQ_WARPS) name##_##NT##_##RT(const MatvecHeldArgs kargs) { UNPACK_MatvecHeldArgs(kargs) \
        PDL_START                                                                                                        \
        MmqTile<RT> tl(w0, w1, w2, o0, o1, o2, r0, r1, r2, NT);                                                          \
        fn<NT, RT>(tl, a, nb, acc, tokens);                                                                              \
    }
#define MMQ_ENTRY_ROWS(name, NT, RT) MMQ_ENTRY_OF(name, name, NT, RT)
#define MMQ_ENTRY(name, NT) MMQ_ENTRY_ROWS(name, NT, 1)
#define MMQ_ENTRIES(name) MMQ_ENTRY(name, 1) MMQ_ENTRY(name, 2) MMQ_ENTRY(name, 4) MMQ_ENTRY(name, 8)
// Q4_K: staged activations for token tiles of 8 and 16, with row tiles of 16, 32 and
// 64 rows; direct loads for 32 and 64 tokens.
MMQ_ENTRY(mmq_q4_k, 1) MMQ_ENTRY(mmq_q4_k, 2)
MMQ_ENTRY_OF(mmq_q4_k, mmq_q4_k_direct, 4, 1) MMQ_ENTRY_OF(mmq_q4_k, mmq_q4_k_direct, 8, 1)
// Q4_K for 32 and 64 tokens: a warp a token tile, 32 rows a CTA.
#define MMQ_MANY_ENTRY(NT, RT)                                                                                           \
    extern "C" __global__ void __launch_bounds__(WARP * NT) mmq_q4_k_many_##NT##_##RT(const MatvecHeldArgs kargs) { UNPACK_MatvecHeldArgs(kargs) \
        PDL_START                                                                                                        \
        MmqTile<RT> tl(w0, w1, w2, o0, o1, o2, r0, r1, r2, NT);                                                          \
        mmq_q4_k_many<NT, RT>(tl, a, nb, acc, tokens);                                                                   \
    }
MMQ_MANY_ENTRY(4, 2) MMQ_MANY_ENTRY(8, 2)
// The same tiles, a warp a row tile against two token tiles.
#define MMQ_PAIR_ENTRY(NT)                                                                                               \
    extern "C" __global__ void __launch_bounds__(WARP * NT) mmq_q4_k_pair_##NT##_2(const MatvecHeldArgs kargs) { UNPACK_MatvecHeldArgs(kargs) \
        PDL_START                                                                                                        \
        MmqTile<2> tl(w0, w1, w2, o0, o1, o2, r0, r1, r2, NT);                                                           \
        mmq_q4_k_pair<NT>(tl, a, nb, acc, tokens);                                                                       \
    }
MMQ_PAIR_ENTRY(4) MMQ_PAIR_ENTRY(8)
MMQ_ENTRY_ROWS(mmq_q4_k, 1, 2) MMQ_ENTRY_ROWS(mmq_q4_k, 1, 4)
MMQ_ENTRY_ROWS(mmq_q4_k, 2, 2) MMQ_ENTRY_ROWS(mmq_q4_k, 2, 4)
MMQ_ENTRIES(mmq_q8_0)
MMQ_ENTRIES(mmq_q4_1)

// A decode row's gated product made by its gate and up matrices' kernel and quantized
// for the down matrix (32-blocks: kind 0 Q8_0, 1 Q8_1), the gate and up rows never
// stored: a CTA of 32 warps owns a block of 32 rows, warp l computes gate row and then
// up row 32·blockIdx.x + l with the type's row function (the same sums as its other
// launches), and warp 0 quantizes act(gate)·up with quantize_q8_32's arithmetic. Grid
// (rows / 32), 1,024 threads. Q4_1 only: for Q8_0 it measured slower than the two
// launches it replaces, as did computing the gate and up rows together sharing the
// activations' loads (both tried in commit eb64b43).
#define GLU_ENTRY(name, WBYTES)                                                                         \
    extern "C" __global__ void __launch_bounds__(1024)                                                  \
        name##_glu(const MatvecGluArgs kargs) { UNPACK_MatvecGluArgs(kargs)       \
        __shared__ float g[WARP], u[WARP];                                                              \
        int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;                                       \
        long first = (long)blockIdx.x * WARP * nb * (WBYTES);                                           \
        PDL_PREFETCH(wg + first + warp * (long)nb * (WBYTES), (long)nb * (WBYTES));                     \
        PDL_PREFETCH(wu + first + warp * (long)nb * (WBYTES), (long)nb * (WBYTES));                     \
        PDL_START                                                                                       \
        name##_row<1>(wg + first, a, g, WARP, nb, warp, 0, 1);                                          \
        name##_row<1>(wu + first, a, u, WARP, nb, warp, 0, 1);                                          \
        __syncthreads();                                                                                \
        if (warp == 0)                                                                                  \
            q8_32_block(glu_value(g[lane], u[lane], act), out + (long)blockIdx.x * (kind == QUANT_Q8_1 ? 36 : 34), kind); \
    }
GLU_ENTRY(matvec_q4_1, 20)

// ---------------------------------------------------------------------------------
// Dequantization of single weights (embedding rows): weight k of a row of `cols`, in
// the device's layout (Q8_0's is its own, above).

__device__ float dequant_one(int type, const u8* row, int k, int cols) {
    switch (type) {
        case T_F32: return ldf(row + 4 * k);
        case T_F16: return ldh(row + 2 * k);
        case T_Q4_0: {
            const u8* b = row + (k / 32) * 18;
            int j = k % 32;
            int q = j < 16 ? (b[2 + j] & 15) : (b[2 + j - 16] >> 4);
            return (float)(q - 8) * ldh(b);
        }
        case T_Q4_1: {
            const u8* b = row + (k / 32) * 20;
            int j = k % 32;
            int q = j < 16 ? (b[4 + j] & 15) : (b[4 + j - 16] >> 4);
            return (float)q * ldh(b) + ldh(b + 2);
        }
        case T_Q5_0: {
            const u8* b = row + (k / 32) * 22;
            int j = k % 32;
            unsigned int qh = (unsigned int)b[2] | ((unsigned int)b[3] << 8) | ((unsigned int)b[4] << 16) | ((unsigned int)b[5] << 24);
            int nib = j < 16 ? (b[6 + j] & 15) : (b[6 + j - 16] >> 4);
            int q = nib | (((qh >> j) & 1) << 4);
            return (float)(q - 16) * ldh(b);
        }
        case T_Q8_0: return (float)((const i8*)row)[k] * q8_0_scale(row, cols / 32, k / 32);
        case T_Q4_K: {
            const u8* b = row + (k / 256) * 144;
            int kk = k % 256, g = kk / 32;
            int sc, m;
            scale_min_k4(g, b + 4, &sc, &m);
            u8 byte = b[16 + 32 * (kk / 64) + (kk % 32)];
            int code = ((kk / 32) % 2 == 0) ? (byte & 15) : (byte >> 4);
            return ldh(b) * (float)sc * (float)code - ldh(b + 2) * (float)m;
        }
        case T_Q6_K: {
            const u8* b = row + (k / 256) * 210;
            int kk = k % 256;
            int n = kk / 128, r = (kk % 128) / 32, l = kk % 32;
            u8 qlb = b[64 * n + 32 * (r % 2) + l];
            int low = r < 2 ? (qlb & 15) : (qlb >> 4);
            int high = (b[128 + 32 * n + l] >> (2 * r)) & 3;
            int q = (low | (high << 4)) - 32;
            return ldh(b + 208) * (float)((const i8*)(b + 192))[kk / 16] * (float)q;
        }
        case T_IQ2_S: {
            const u8* b = row + (k / 256) * 82;
            int kk = k % 256, g = kk / 32, l = (kk % 32) / 8, j = kk % 8;
            unsigned long long grid = iq2s_grid[b[2 + 4 * g + l] | (((int)b[66 + g] << (8 - 2 * l)) & 0x300)];
            float mag = (float)((grid >> (8 * j)) & 0xff);
            int s = (b[74 + g] >> (4 * (l / 2))) & 15;
            float v = ldh(b) * (0.5f + (float)s) * 0.25f * mag;
            return (b[34 + 4 * g + l] >> j) & 1 ? -v : v;
        }
    }
    return 0.0f;
}

// out[i] = dequantize(table row tokens[i]) · scale; grid (ceil(cols / 256), tokens).
extern "C" __global__ void embed(const EmbedArgs kargs) { UNPACK_EmbedArgs(kargs)
    PDL_START
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    int i = blockIdx.y;
    if (k >= cols) return;
    float v = dequant_one(ty, table + (long)tokens[i] * row_bytes, k, cols);
    out[(long)i * cols + k] = scaled ? v * scale : v;
}

// A weight matrix dequantized to f32 rows, for the batched products through cuBLAS;
// grid (rows, ceil(cols / 256)).
extern "C" __global__ void dequantize(const DequantizeArgs kargs) { UNPACK_DequantizeArgs(kargs)
    int k = blockIdx.y * blockDim.x + threadIdx.x;
    long r = blockIdx.x;
    if (k >= cols) return;
    out[r * cols + k] = dequant_one(ty, w + r * row_bytes, k, cols);
}

// ---------------------------------------------------------------------------------
// Row operations.

// The RMSNorm scale 1/sqrt(mean(x²) + eps) of the n values at xg, computed by the
// whole CTA (blockDim.x a multiple of 32): each thread's squares summed in
// f64, then the warps' sums in order, as the CPU engine sums them in f64. With n ≤
// blockDim.x every thread holds at most one value, so the sum (and the scale) is the
// same for any such CTA size.
__device__ float rms_finish(double s, int n, float eps) {
    __shared__ double part[32];
    for (int o = WARP / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    __syncthreads();  // part may still be read by a previous call
    if (threadIdx.x % WARP == 0) part[threadIdx.x / WARP] = s;
    __syncthreads();
    double total = 0.0;
    for (int i = 0; i < (int)(blockDim.x / WARP); i++) total += part[i];
    float mean = (float)(total / (double)n);
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
}

// Each thread's values are loaded R at a time before they are summed (in order), so
// that the loads are in flight together; the sum is the same for any R.
template <int R = 8>
__device__ float rms_scale(const float* xg, int n, float eps) {
    double s = 0.0;
    int step = blockDim.x;
    for (int i0 = threadIdx.x; i0 < n; i0 += R * step) {
        float v[R];
#pragma unroll
        for (int u = 0; u < R; u++) v[u] = i0 + u * step < n ? xg[i0 + u * step] : 0.0f;
#pragma unroll
        for (int u = 0; u < R; u++)
            if (i0 + u * step < n) s += (double)v[u] * (double)v[u];
    }
    return rms_finish(s, n, eps);
}


// RMSNorm of each group of n values (a row, or a head): one CTA of 256 threads per
// group. In place when x == out (each element is read by the thread that writes it,
// after the reduction).
__device__ void rms_norm_group(const float* x, const float* w, float* out, int n, float eps) {
    const float* xg = x + (long)blockIdx.x * n;
    float* og = out + (long)blockIdx.x * n;
    float scale = rms_scale(xg, n, eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) og[i] = normed(xg[i], scale, w[i]);
}

extern "C" __global__ void rms_norm(const RmsNormArgs kargs) { UNPACK_RmsNormArgs(kargs)
    PDL_START
    rms_norm_group(x, w, out, n, eps);
}

extern "C" __global__ void rms_norm_inplace(const RmsNormInplaceArgs kargs) { UNPACK_RmsNormInplaceArgs(kargs)
    PDL_START
    rms_norm_group(x, w, x, n, eps);
}

// x += rms_norm(o) · w per row of n (Gemma's post-norms and the residual add in one
// pass, the same two roundings as apart); grid (rows), 256 threads.
extern "C" __global__ void rms_norm_add(const RmsNormAddArgs kargs) { UNPACK_RmsNormAddArgs(kargs)
    if (PDL && threadIdx.x * 32 < n) l2_line(w + threadIdx.x * 32);
    PDL_START
    const float* og = o + (long)blockIdx.x * n;
    float* xg = x + (long)blockIdx.x * n;
    float scale = rms_scale(og, n, eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) xg[i] = __fadd_rn(xg[i], normed(og[i], scale, w[i]));
}

// One normalized value of rms_norm_quantize quantized: element i = j·N + thread of the
// row, in step j.
template <int N>
__device__ __forceinline__ void norm_quantize_at(float v, u8* out, int n, int j, int kind) {
    int i = j * N + threadIdx.x;
    if (kind == QUANT_Q8_K) {
        // Every group calls (the block synchronizes the CTA); those past the row write nothing.
        q8_k_block(v, out + ((long)blockIdx.x * (n / 256) + min(i, n - 1) / 256) * Q8K_BYTES, i < n);
    } else if (i - threadIdx.x % WARP < n) {  // whole warps: n is a multiple of 32
        q8_32_block(v, out + ((long)blockIdx.x * (n / 32) + i / 32) * (kind == QUANT_Q8_1 ? 36 : 34), kind);
    }
}

// A row's RMSNorm quantized for a matrix product, the normalized row never stored:
// kind 0 Q8_0, 1 Q8_1 (a warp per 32-block), 2 Q8_K (256 threads per 256-block, n a
// multiple of 256). N threads (a multiple of 256, up to 1,024); rows of up to 8·N
// values are read once, into registers, before the reduction. grid (rows).
template <int N>
__device__ void norm_quantize_row(const float* x, const float* w, u8* out, int n, float eps, int kind) {
    const int R = 8;
    const float* xg = x + (long)blockIdx.x * n;
    int t = threadIdx.x;
    if (n > N * R) {
        float scale = rms_scale(xg, n, eps);
        for (int j = 0; j * N < n; j++) {
            int i = j * N + t;
            norm_quantize_at<N>(i < n ? normed(xg[i], scale, w[i]) : 0.0f, out, n, j, kind);
        }
        return;
    }
    float xv[R], wv[R];
    double s = 0.0;
#pragma unroll
    for (int j = 0; j < R; j++) {
        int i = j * N + t;
        xv[j] = i < n ? xg[i] : 0.0f;
        wv[j] = i < n ? w[i] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < R; j++)
        if (j * N + t < n) s += (double)xv[j] * (double)xv[j];
    float scale = rms_finish(s, n, eps);
#pragma unroll
    for (int j = 0; j < R; j++)
        if (j * N < n) norm_quantize_at<N>(normed(xv[j], scale, wv[j]), out, n, j, kind);
}

// 256 threads; rows of up to 2,048 values are held in registers.
extern "C" __global__ void rms_norm_quantize(const RmsNormQuantizeArgs kargs) { UNPACK_RmsNormQuantizeArgs(kargs)
    if (PDL && threadIdx.x * 32 < n) l2_line(w + threadIdx.x * 32);
    PDL_START
    norm_quantize_row<256>(x, w, out, n, eps, kind);
}

// Longer rows: a CTA of 256 threads per 256 values, grid (rows, ceil(n / 256)). Every
// CTA of a row computes the row's scale (the same sums in the same order, so the same
// bits) and quantizes its 256 values (a Q8_K block, or eight 32-blocks), so the row's
// blocks are made in parallel rather than one after another. A thread's values of rows
// of up to SPLIT_HELD·256 are loaded together (faster than eight at a time with the
// CTA's own read again, commit 0fb21ed).
#define SPLIT_HELD 32
extern "C" __global__ void rms_norm_quantize_split(const RmsNormQuantizeArgs kargs) { UNPACK_RmsNormQuantizeArgs(kargs)
    if (PDL && threadIdx.x < 8 && blockIdx.y * 256 + threadIdx.x * 32 < n) l2_line(w + blockIdx.y * 256 + threadIdx.x * 32);
    PDL_START
    const float* xg = x + (long)blockIdx.x * n;
    int i = blockIdx.y * 256 + threadIdx.x;
    // The CTA's own value and weight asked for with the row's values, all in flight
    // together (one wait rather than three).
    float xi = i < n ? xg[i] : 0.0f, wi = i < n ? w[i] : 0.0f;
    float scale = rms_scale<SPLIT_HELD>(xg, n, eps);
    norm_quantize_at<256>(i < n ? normed(xi, scale, wi) : 0.0f, out, n, blockIdx.y, kind);
}

// RoPE on the first `dims` values of a head h: pairs (2i, 2i+1), or (i, i + dims/2)
// for NeoX; thread i < dims/2 rotates pair i. theta = pos · theta_scale^i by repeated
// multiplication, as ggml builds it.
__device__ __forceinline__ void rope_pair(float* h, unsigned int pos, int dims, float theta_scale, int neox) {
    int i = threadIdx.x;
    if (i >= dims / 2) return;
    float theta = (float)pos;
    for (int k = 0; k < i; k++) theta = __fmul_rn(theta, theta_scale);
    float s, c;
    sincosf(theta, &s, &c);
    int a = neox ? i : 2 * i, b = neox ? i + dims / 2 : 2 * i + 1;
    float x0 = h[a], x1 = h[b];
    h[a] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    h[b] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}

// grid (heads per row, rows), dims/2 threads.
extern "C" __global__ void rope(const RopeArgs kargs) { UNPACK_RopeArgs(kargs)
    PDL_START
    rope_pair(x + (long)blockIdx.y * width + blockIdx.x * head_dim, positions[blockIdx.y], dims, theta_scale, neox);
}

// Queries and keys made ready for attention in one launch: each head of q (n_q heads)
// and of k is RMS-normed where its norm weights are given (Gemma's QK-norm), rotated,
// and the queries scaled where q_scale ≠ 0 — each step the arithmetic of its own
// kernel. Where a cache is given (kc, one sequence whose rows are all of the batch's),
// the rotated keys and the values (n_k more CTAs) are stored in it, as kv_store does.
// grid (n_q + n_k [+ n_k], rows), head_dim rounded up to a warp threads (≤ 256).
extern "C" __global__ void qk_rope(const QkRopeArgs kargs) { UNPACK_QkRopeArgs(kargs)
    PDL_START
    int head = blockIdx.x, row = blockIdx.y, t = threadIdx.x;
    unsigned int pos = positions[row];
    if (head >= n_q + n_k) {
        int g = head - n_q - n_k;
        if (t < head_dim)
            vc[((long)g * slots + (long)(pos % (unsigned)slots)) * head_dim + t] =
                (u16)f2h(v[((long)row * n_k + g) * head_dim + t]);
        return;
    }
    bool is_q = head < n_q;
    float* h = is_q ? q + ((long)row * n_q + head) * head_dim : k + ((long)row * n_k + head - n_q) * head_dim;
    const float* w = is_q ? q_norm : k_norm;
    if (w) {
        float scale = rms_scale(h, head_dim, eps);
        if (t < head_dim) h[t] = normed(h[t], scale, w[t]);
        __syncthreads();
    }
    rope_pair(h, pos, dims, theta_scale, neox);
    if (is_q && q_scale != 0.0f) {
        __syncthreads();
        if (t < head_dim) h[t] = __fmul_rn(h[t], q_scale);
    }
    if (!is_q && kc) {
        __syncthreads();
        int g = head - n_q;
        if (t < head_dim) kc[((long)g * slots + (long)(pos % (unsigned)slots)) * head_dim + t] = (u16)f2h(h[t]);
    }
}

extern "C" __global__ void scale(const ScaleArgs kargs) { UNPACK_ScaleArgs(kargs)
    PDL_START
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = __fmul_rn(x[i], s);
}

extern "C" __global__ void add(const AddArgs kargs) { UNPACK_AddArgs(kargs)
    PDL_START
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = __fadd_rn(x[i], y[i]);
}

// e^x as the CPU engine's exp_approx computes it (Cephes' method, every step one
// IEEE-rounded multiply or add), so the activations below give the CPU's bits.
__device__ __forceinline__ float exp_approx(float x) {
    if (x > 88.37626f) return __int_as_float(0x7f800000);
    x = fmaxf(fminf(x, 88.37626f), -87.33654f);
    float n = rintf(__fmul_rn(x, 1.44269504088896341f));
    float r = __fsub_rn(__fsub_rn(x, __fmul_rn(n, 0.6933594f)), __fmul_rn(n, -2.1219444e-4f));
    float p = 1.9875691e-4f;
    p = __fadd_rn(__fmul_rn(p, r), 1.3981999e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 8.333452e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 4.1665796e-2f);
    p = __fadd_rn(__fmul_rn(p, r), 0.16666665f);
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    float e = __fadd_rn(__fadd_rn(__fmul_rn(p, __fmul_rn(r, r)), r), 1.0f);
    return __fmul_rn(e, __int_as_float(((int)n + 127) << 23));
}

// act(g) · u; act 0: SiLU x / (1 + e^-x), 1: GELU (tanh approximation) as
// x / (1 + e^(-2u)), u = sqrt(2/pi)·x·(1 + 0.044715·x²).
__device__ float glu_value(float g, float u, int act) {
    float a;
    if (act == GLU_SILU) {
        a = __fdiv_rn(g, __fadd_rn(1.0f, exp_approx(-g)));
    } else {
        float inner = __fmul_rn(__fmul_rn(0.7978846f, g), __fadd_rn(1.0f, __fmul_rn(__fmul_rn(0.044715f, g), g)));
        a = __fdiv_rn(g, __fadd_rn(1.0f, exp_approx(__fmul_rn(-2.0f, inner))));
    }
    return __fmul_rn(a, u);
}

// gate = act(gate) · up.
extern "C" __global__ void glu(const GluArgs kargs) { UNPACK_GluArgs(kargs)
    PDL_START
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) gate[i] = glu_value(gate[i], up[i], act);
}

// out row i = x row rows[i].
extern "C" __global__ void gather(const GatherArgs kargs) { UNPACK_GatherArgs(kargs)
    PDL_START
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    int i = blockIdx.y;
    if (k < width) out[(long)i * width + k] = x[(long)rows[i] * width + k];
}

// out row rows[i] = x row i (gather's inverse).
extern "C" __global__ void scatter(const ScatterArgs kargs) { UNPACK_ScatterArgs(kargs)
    PDL_START
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    int i = blockIdx.y;
    if (k < width) out[(long)rows[i] * width + k] = x[(long)i * width + k];
}

// x row i *= s[i].
extern "C" __global__ void scale_rows(const ScaleRowsArgs kargs) { UNPACK_ScaleRowsArgs(kargs)
    PDL_START
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    int i = blockIdx.y;
    if (k < width) x[(long)i * width + k] = __fmul_rn(x[(long)i * width + k], s[i]);
}

// x += b, b one row broadcast over all.
extern "C" __global__ void add_bias(const AddBiasArgs kargs) { UNPACK_AddBiasArgs(kargs)
    PDL_START
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = __fadd_rn(x[i], b[i % width]);
}

// x *= y, element by element.
extern "C" __global__ void mul(const MulArgs kargs) { UNPACK_MulArgs(kargs)
    PDL_START
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = __fmul_rn(x[i], y[i]);
}

// x = tanh(x).
extern "C" __global__ void tanh_inplace(const TanhArgs kargs) { UNPACK_TanhArgs(kargs)
    PDL_START
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = tanhf(x[i]);
}

// ---------------------------------------------------------------------------------
// KV cache and attention. A layer's cache is (kv_head, slot, head_dim) in f16; position
// p lives in slot p % slots (a ring for sliding-window layers).

// Stores n rows of keys and values (kv_dim = kv_heads · head_dim each) of rows row0..
// at their positions (read from `positions`, so that a replayed graph follows them);
// grid (kv_heads, n), head_dim threads.
__device__ __forceinline__ void store_kv(const float* k, const float* v, u16* kc, u16* vc, int row, const unsigned int* positions, int slots, int kv_dim, int head_dim) {
    int d = threadIdx.x, g = blockIdx.x;
    long src = (long)row * kv_dim + g * head_dim + d;
    long dst = ((long)g * slots + (long)(positions[row] % (unsigned)slots)) * head_dim + d;
    kc[dst] = (u16)f2h(k[src]);
    vc[dst] = (u16)f2h(v[src]);
}

extern "C" __global__ void kv_store(const KvStoreArgs kargs) { UNPACK_KvStoreArgs(kargs)
    PDL_START
    store_kv(k, v, kc, vc, row0 + blockIdx.y, positions, slots, kv_dim, head_dim);
}

// The same for the rows of several sequences, each with its own cache (`seqs`, a
// SeqKv each): grid (kv_heads, the most rows of a sequence, sequences).
extern "C" __global__ void kv_store_batch(const KvStoreBatchArgs kargs) { UNPACK_KvStoreBatchArgs(kargs)
    PDL_START
    const SeqKv& e = ((const SeqKv*)seqs)[blockIdx.z];
    if ((int)blockIdx.y >= e.rows) return;
    store_kv(k, v, e.kc, e.vc, e.row0 + blockIdx.y, positions, e.slots, kv_dim, head_dim);
}

// CHUNK (the engine's attention chunk) and MAX_HEAD_DIM come from the prelude.

// An attention CTA has key_lanes() threads per key of a chunk — 1, 2 or 4, the launch's
// choice: the least power of two with CHUNK · lanes ≥ head_dim (attention_threads in
// backend.rs) — the lanes of a key sharing its dot products with the queries, and
// thread d holding output element d. ATT_THREADS is the most.
#define MAX_KEY_LANES 4
#define ATT_THREADS (MAX_KEY_LANES * CHUNK)
static_assert(ATT_THREADS >= MAX_HEAD_DIM, "a thread per output element");

__device__ __forceinline__ int key_lanes() { return blockDim.x / CHUNK; }

// The maximum (MAX) or the sum of the chunk's CHUNK values of each of Q rows (every
// lane of key k holding value k), into every thread's v: the sum in the order of a
// halving tree (value k plus value k + o, o = 32, 16, …, 1). Ends with the CTA
// synchronized.
template <int Q, bool MAX>
__device__ __forceinline__ void chunk_reduce(float (&v)[Q]) {
    static_assert(CHUNK == 2 * WARP, "a chunk is two warps' values");
    __shared__ float vals[Q][CHUNK];
    __shared__ float total[Q];
    int t = threadIdx.x, lane = t % WARP, lanes = key_lanes();
    if (t % lanes == 0)
        for (int iq = 0; iq < Q; iq++) vals[iq][t / lanes] = v[iq];
    __syncthreads();
    if (t < WARP) {
        for (int iq = 0; iq < Q; iq++) {
            float x = MAX ? fmaxf(vals[iq][lane], vals[iq][lane + WARP]) : vals[iq][lane] + vals[iq][lane + WARP];
            for (int o = WARP / 2; o > 0; o >>= 1) {
                float y = __shfl_down_sync(0xffffffffu, x, o);
                x = MAX ? fmaxf(x, y) : x + y;
            }
            if (lane == 0) total[iq] = x;
        }
    }
    __syncthreads();
    for (int iq = 0; iq < Q; iq++) v[iq] = total[iq];
}

// Attention of query rows over their cached positions, split at absolute multiples of
// CHUNK: each chunk gives (max, Σexp, Σexp·v), and the chunks are merged in order into a
// running total. A CTA of CHUNK · key_lanes() threads takes Q consecutive query rows
// of one head: each key row is read once for all Q, and the Q queries' sums run side
// by side (independent chains), but every query's arithmetic is exactly what it is with Q = 1
// — the same operations in the same order — so a row's result does not depend on which
// other rows share its CTA, nor on whether its chunks are computed by one CTA or spread
// over several (attention_split). head_dim ≤ 256.

// The distance between value rows in shared memory, in u16: the row padded by 16 bytes,
// so that the threads of a phase storing 16 bytes each of different rows hit different
// banks (rows 2^k bytes apart all start in one bank).
#define SV_STRIDE(head_dim) ((head_dim) + 8)

// A CTA's query rows: their positions, the first position each sees (its window), and
// how many of the Q there are.
template <int Q>
struct QueryRows {
    int pos[Q], first[Q], n;
};

template <int Q>
__device__ __forceinline__ QueryRows<Q> query_rows(int pos0, int n, int window) {
    QueryRows<Q> r;
    r.n = n;
    for (int iq = 0; iq < Q; iq++) {
        r.pos[iq] = pos0 + min(iq, n - 1);
        r.first[iq] = window > 0 ? max(0, r.pos[iq] + 1 - window) : 0;
    }
    return r;
}

// The dot products of the Q queries (sq) with key row kr (when `active`), every lane of
// the key getting them: lane j of the key's L lanes sums, in order, the products of
// its 8-element groups g = j, j + L, … (elements in order within a group; elements d =
// j, j + L, … where head_dim is not a multiple of 8; at most eight groups, as L ≥
// head_dim / 64), and the lanes' sums are added as s0 + s1, or (s0 + s1) + (s2 + s3).
// The key's lanes read its row's consecutive 16-byte pieces together. Every thread of
// the warp calls it (shuffles).
template <int Q>
__device__ __forceinline__ void key_dot(const float (*sq)[MAX_HEAD_DIM], const u16* kr, int head_dim, bool active, float (&dot)[Q]) {
    int lanes = key_lanes(), j = threadIdx.x % lanes;
    for (int iq = 0; iq < Q; iq++) dot[iq] = 0.0f;
    if (active && head_dim % 8 == 0) {
        const int per = 8;
        const uint4* kr4 = (const uint4*)kr;
        int groups = head_dim / 8;
        uint4 w[per];
#pragma unroll
        for (int u = 0; u < per; u++)
            if (j + u * lanes < groups) w[u] = kr4[j + u * lanes];
#pragma unroll
        for (int u = 0; u < per; u++) {
            int g = j + u * lanes;
            if (g >= groups) break;
            unsigned int hw[4] = {w[u].x, w[u].y, w[u].z, w[u].w};
#pragma unroll
            for (int e = 0; e < 8; e++) {
                float kd = h2f((u16)(hw[e / 2] >> (16 * (e % 2))));
                for (int iq = 0; iq < Q; iq++) dot[iq] = __fadd_rn(dot[iq], __fmul_rn(sq[iq][8 * g + e], kd));
            }
        }
    } else if (active) {
        for (int d = j; d < head_dim; d += lanes) {
            float kd = h2f(kr[d]);
            for (int iq = 0; iq < Q; iq++) dot[iq] = __fadd_rn(dot[iq], __fmul_rn(sq[iq][d], kd));
        }
    }
    for (int o = 1; o < lanes; o <<= 1)
        for (int iq = 0; iq < Q; iq++) dot[iq] = __fadd_rn(dot[iq], __shfl_xor_sync(0xffffffffu, dot[iq], o));
}

// The chunk's value rows, CHUNK of head_dim (key row p of each key whose `active`),
// into shared memory rows SV_STRIDE(head_dim) apart: the key's lanes take its
// consecutive 16-byte pieces, so that the loads of all rows are in flight together.
__device__ __forceinline__ void load_values(u16* sv, const u16* vr, int head_dim, bool active) {
    if (!active) return;
    int lanes = key_lanes(), key = threadIdx.x / lanes, j = threadIdx.x % lanes;
    u16* row = sv + key * SV_STRIDE(head_dim);
    if (head_dim % 8 == 0) {
#pragma unroll 8
        for (int d8 = j; d8 < head_dim / 8; d8 += lanes) ((uint4*)row)[d8] = ((const uint4*)vr)[d8];
    } else {
        for (int d = j; d < head_dim; d += lanes) row[d] = vr[d];
    }
}

// One chunk's part of each query row: its max score m, Σexp (sum) and, for the
// thread's element d = threadIdx.x, Σexp·v (acc); `on` whether the row sees the chunk.
template <int Q>
struct ChunkPart {
    float m[Q], sum[Q], acc[Q];
    bool on[Q];
};

// The running total of each query row (per thread, as ChunkPart).
template <int Q>
struct Running {
    float max[Q], sum[Q], acc[Q];
};

template <int Q>
__device__ __forceinline__ void running_init(Running<Q>& r) {
    for (int iq = 0; iq < Q; iq++) {
        r.max[iq] = NEG_INF;
        r.sum[iq] = 0.0f;
        r.acc[iq] = 0.0f;
    }
}

// Chunk c of the rows `rows` (queries in sq) against the cached keys kh and values vh of
// their head group. Ends with the CTA synchronized.
template <int Q>
__device__ void chunk_part(const float (*sq)[MAX_HEAD_DIM], const u16* kh, const u16* vh, int slots, int head_dim, float scale,
                           const QueryRows<Q>& rows, int c, ChunkPart<Q>& out) {
    __shared__ float sp[Q][CHUNK];
    // The chunk's value rows: dynamic shared memory, so that a CTA holds what its head
    // needs rather than room for the largest head.
    extern __shared__ __align__(16) u16 sv[];
    const int vs = SV_STRIDE(head_dim);
    int t = threadIdx.x, lanes = key_lanes(), key = t / lanes;
    int lo[Q], hi[Q];
    int ulo = 0x7fffffff, uhi = -1;
    for (int iq = 0; iq < Q; iq++) {
        out.on[iq] = iq < rows.n && c >= rows.first[iq] / CHUNK && c <= rows.pos[iq] / CHUNK;
        lo[iq] = max(c * CHUNK, rows.first[iq]);
        hi[iq] = min(c * CHUNK + CHUNK - 1, rows.pos[iq]);
        if (out.on[iq]) {
            ulo = min(ulo, lo[iq]);
            uhi = max(uhi, hi[iq]);
        }
    }
    int p = c * CHUNK + key;
    bool active = p >= ulo && p <= uhi;
    long row = (long)(p % slots) * head_dim;
    // Read after the reductions below.
    load_values(sv, vh + row, head_dim, active);
    float dot[Q];
    key_dot<Q>(sq, kh + row, head_dim, active, dot);
    float s[Q];
    for (int iq = 0; iq < Q; iq++) s[iq] = out.on[iq] && p >= lo[iq] && p <= hi[iq] ? __fmul_rn(dot[iq], scale) : NEG_INF;
    for (int iq = 0; iq < Q; iq++) out.m[iq] = s[iq];
    chunk_reduce<Q, true>(out.m);
    for (int iq = 0; iq < Q; iq++) {
        float e = (out.on[iq] && p >= lo[iq] && p <= hi[iq]) ? expf(s[iq] - out.m[iq]) : 0.0f;
        if (t % lanes == 0) sp[iq][key] = e;
        out.sum[iq] = e;
    }
    chunk_reduce<Q, false>(out.sum);
    for (int iq = 0; iq < Q; iq++) out.acc[iq] = 0.0f;
    if (t < head_dim) {
#pragma unroll 4
        for (int pp = ulo; pp <= uhi; pp++) {
            float vd = h2f(sv[(pp - c * CHUNK) * vs + t]);
            for (int iq = 0; iq < Q; iq++)
                if (pp >= lo[iq] && pp <= hi[iq]) out.acc[iq] = __fmaf_rn(sp[iq][pp - c * CHUNK], vd, out.acc[iq]);
        }
    }
    __syncthreads();
}

// A chunk's part merged into the running totals (rows that do not see it unchanged).
template <int Q>
__device__ __forceinline__ void merge_part(Running<Q>& r, const ChunkPart<Q>& c, int head_dim) {
    float new_max[Q], a_old[Q], a_new[Q];
    for (int iq = 0; iq < Q; iq++) {
        new_max[iq] = fmaxf(r.max[iq], c.m[iq]);
        a_old[iq] = r.max[iq] == NEG_INF ? 0.0f : expf(r.max[iq] - new_max[iq]);
        a_new[iq] = expf(c.m[iq] - new_max[iq]);
    }
    if (threadIdx.x < head_dim)
        for (int iq = 0; iq < Q; iq++)
            if (c.on[iq]) r.acc[iq] = __fmaf_rn(r.acc[iq], a_old[iq], __fmul_rn(c.acc[iq], a_new[iq]));
    for (int iq = 0; iq < Q; iq++) {
        if (!c.on[iq]) continue;
        r.sum[iq] = __fmaf_rn(r.sum[iq], a_old[iq], __fmul_rn(c.sum[iq], a_new[iq]));
        r.max[iq] = new_max[iq];
    }
}

// The rows' results: row i0 + iq of head h into out (rows of width), or, with qout (Q =
// 1), quantized there (qkind 0 Q8_0, 1 Q8_1; head_dim a multiple of 32): each warp
// quantizes the 32 consecutive outputs it holds, exactly the values the f32 row would
// hold.
template <int Q>
__device__ void attend_out(const Running<Q>& r, int nq, float* out, long row, int h, int width, int head_dim, u8* qout, int qkind) {
    int t = threadIdx.x;
    if (qout) {
        int d0 = (t / WARP) * WARP;
        if (d0 >= head_dim) return;
        float inv = 1.0f / r.sum[0];
        int block = (h * head_dim + d0) / 32;
        q8_32_block(r.acc[0] * inv, qout + (row * (width / 32) + block) * (qkind == QUANT_Q8_1 ? 36 : 34), qkind);
        return;
    }
    if (t >= head_dim) return;
    for (int iq = 0; iq < nq; iq++) out[(row + iq) * width + h * head_dim + t] = r.acc[iq] * (1.0f / r.sum[iq]);
}

// Query rows row0.. (positions pos0, pos0 + 1, …), Q per CTA, every chunk in turn;
// grid (n_head, ceil(rows / Q)). Decode rows of one chunk run it with Q = 1
// (attention_split's one-CTA case); a batch's rows take attend_batch.
template <int Q>
__device__ void attend(const float* q, const u16* kc, const u16* vc, float* out, int row0, int pos0, int rows,
                       int slots, int window, int n_head, int group, int head_dim, float scale, u8* qout, int qkind) {
    __shared__ float sq[Q][MAX_HEAD_DIM];
    int h = blockIdx.x, i0 = blockIdx.y * Q;
    int width = n_head * head_dim;
    QueryRows<Q> qr = query_rows<Q>(pos0 + i0, min(Q, rows - i0), window);
    for (int iq = 0; iq < Q; iq++)
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) sq[iq][d] = q[(long)(row0 + i0 + min(iq, qr.n - 1)) * width + h * head_dim + d];
    __syncthreads();
    const u16* kh = kc + (long)(h / group) * slots * head_dim;
    const u16* vh = vc + (long)(h / group) * slots * head_dim;
    Running<Q> run;
    running_init(run);
    for (int c = qr.first[0] / CHUNK; c <= qr.pos[Q - 1] / CHUNK; c++) {
        ChunkPart<Q> part;
        chunk_part<Q>(sq, kh, vh, slots, head_dim, scale, qr, c, part);
        merge_part<Q>(run, part, head_dim);
    }
    attend_out<Q>(run, qr.n, out, row0 + i0, h, width, head_dim, qout, qkind);
}

// The cached keys and values of `chunks` chunks of positions, `every` chunks apart from
// position `from` on (up to pos), asked of L2 before the wait (positions come from the
// host, before the graph runs; the row the kernel before stores is among them, and L2
// holds what it stores): a key's lanes take its 128-byte lines in turn.
__device__ __forceinline__ void prefetch_cache(const u16* kh, const u16* vh, int from, int pos, int chunks, int every, int slots, int head_dim) {
    int lanes = key_lanes(), key = threadIdx.x / lanes, j = threadIdx.x % lanes;
    for (int k = 0; k < chunks; k++) {
        int p = from + k * every * CHUNK + key;
        if (p > pos) break;
        for (int o = 128 * j; o < head_dim * 2; o += 128 * lanes) {
            l2_line((const u8*)(kh + (long)(p % slots) * head_dim) + o);
            l2_line((const u8*)(vh + (long)(p % slots) * head_dim) + o);
        }
    }
}

// attend's arithmetic for a batch's rows (prefill), written as one loop rather than
// through chunk_part and merge_part: the same steps in the same order (key_dot; the
// chunk's max and Σexp by the halving tree chunk_reduce makes, through shared memory),
// so every row is bitwise what attend and attention_split give it (tests/gpu.rs: batch
// = token by token; parity --bitwise), but compiled to a different loop: with one thread
// per key it measured faster than attend<4> for prefill, while attend's form measured
// faster for decode rows (commit c84196c). grid (n_head, ceil(rows / Q)).
template <int Q>
__device__ void attend_batch(const float* q, const u16* kc, const u16* vc, float* out, int row0, int pos0, int rows,
                             int slots, int window, int n_head, int group, int head_dim, float scale) {
    __shared__ float sq[Q][MAX_HEAD_DIM];
    __shared__ float sp[Q][CHUNK];
    __shared__ float red[Q][CHUNK];
    __shared__ __align__(16) u16 sv[CHUNK * SV_STRIDE(MAX_HEAD_DIM)];
    const int vs = SV_STRIDE(head_dim);
    int h = blockIdx.x, t = threadIdx.x, i0 = blockIdx.y * Q;
    int lanes = key_lanes(), key = t / lanes;
    int nq = min(Q, rows - i0);
    int g = h / group;
    int width = n_head * head_dim;
    int first[Q], pos[Q];
    float acc[Q], run_max[Q], run_sum[Q];
    for (int iq = 0; iq < Q; iq++) {
        pos[iq] = pos0 + i0 + min(iq, nq - 1);
        first[iq] = window > 0 ? max(0, pos[iq] + 1 - window) : 0;
        run_max[iq] = NEG_INF;
        run_sum[iq] = 0.0f;
        acc[iq] = 0.0f;
        for (int d = t; d < head_dim; d += blockDim.x) sq[iq][d] = q[(long)(row0 + i0 + min(iq, nq - 1)) * width + h * head_dim + d];
    }
    __syncthreads();
    const u16* kh = kc + (long)g * slots * head_dim;
    const u16* vh = vc + (long)g * slots * head_dim;
    for (int c = first[0] / CHUNK; c <= pos[Q - 1] / CHUNK; c++) {
        int lo[Q], hi[Q];
        bool on[Q];
        int ulo = 0x7fffffff, uhi = -1;
        for (int iq = 0; iq < Q; iq++) {
            on[iq] = iq < nq && c >= first[iq] / CHUNK && c <= pos[iq] / CHUNK;
            lo[iq] = max(c * CHUNK, first[iq]);
            hi[iq] = min(c * CHUNK + CHUNK - 1, pos[iq]);
            if (on[iq]) {
                ulo = min(ulo, lo[iq]);
                uhi = max(uhi, hi[iq]);
            }
        }
        int p = c * CHUNK + key;
        bool active = p >= ulo && p <= uhi;
        long row = (long)(p % slots) * head_dim;
        load_values(sv, vh + row, head_dim, active);
        float dot[Q], s[Q];
        key_dot<Q>(sq, kh + row, head_dim, active, dot);
        for (int iq = 0; iq < Q; iq++) s[iq] = on[iq] && p >= lo[iq] && p <= hi[iq] ? __fmul_rn(dot[iq], scale) : NEG_INF;
        if (t % lanes == 0)
            for (int iq = 0; iq < Q; iq++) red[iq][key] = s[iq];
        __syncthreads();
        for (int o = CHUNK / 2; o > 0; o >>= 1) {
            if (t < o)
                for (int iq = 0; iq < Q; iq++) red[iq][t] = fmaxf(red[iq][t], red[iq][t + o]);
            __syncthreads();
        }
        float m[Q];
        for (int iq = 0; iq < Q; iq++) m[iq] = red[iq][0];
        __syncthreads();
        if (t % lanes == 0) {
            for (int iq = 0; iq < Q; iq++) {
                float e = (on[iq] && p >= lo[iq] && p <= hi[iq]) ? expf(s[iq] - m[iq]) : 0.0f;
                sp[iq][key] = e;
                red[iq][key] = e;
            }
        }
        __syncthreads();
        for (int o = CHUNK / 2; o > 0; o >>= 1) {
            if (t < o)
                for (int iq = 0; iq < Q; iq++) red[iq][t] += red[iq][t + o];
            __syncthreads();
        }
        // Each query's rescaling of its running total and of this chunk.
        float new_max[Q], a_old[Q], a_new[Q];
        for (int iq = 0; iq < Q; iq++) {
            new_max[iq] = fmaxf(run_max[iq], m[iq]);
            a_old[iq] = run_max[iq] == NEG_INF ? 0.0f : expf(run_max[iq] - new_max[iq]);
            a_new[iq] = expf(m[iq] - new_max[iq]);
        }
        if (t < head_dim) {
            float cacc[Q];
            for (int iq = 0; iq < Q; iq++) cacc[iq] = 0.0f;
#pragma unroll 4
            for (int pp = ulo; pp <= uhi; pp++) {
                float vd = h2f(sv[(pp - c * CHUNK) * vs + t]);
                for (int iq = 0; iq < Q; iq++)
                    if (pp >= lo[iq] && pp <= hi[iq]) cacc[iq] = __fmaf_rn(sp[iq][pp - c * CHUNK], vd, cacc[iq]);
            }
            for (int iq = 0; iq < Q; iq++)
                if (on[iq]) acc[iq] = __fmaf_rn(acc[iq], a_old[iq], __fmul_rn(cacc[iq], a_new[iq]));
        }
        for (int iq = 0; iq < Q; iq++) {
            if (!on[iq]) continue;
            run_sum[iq] = __fmaf_rn(run_sum[iq], a_old[iq], __fmul_rn(red[iq][0], a_new[iq]));
            run_max[iq] = new_max[iq];
        }
        __syncthreads();
    }
    if (t < head_dim)
        for (int iq = 0; iq < nq; iq++) out[(long)(row0 + i0 + iq) * width + h * head_dim + t] = acc[iq] * (1.0f / run_sum[iq]);
}

// Four query rows per CTA (prefill); grid (n_head, ceil(rows / 4)), CHUNK · key_lanes() threads.
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_4(const AttentionArgs kargs) { UNPACK_AttentionArgs(kargs)
    PDL_START
    attend_batch<4>(q, kc, vc, out, row0, (int)positions[row0], rows, slots, window, n_head, group, head_dim, scale);
}

// A float read past L1 (another CTA's result, published by its fence).
__device__ __forceinline__ float ld_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

// The most warps of a CTA that runs merge_parts (attention_merge's: a thread for each
// element of a head and one for Σexp; split_row's has at most ATT_THREADS), each taking
// two parts a lane when the rescaling factors are computed.
#define MERGE_WARPS (MAX_HEAD_DIM / WARP + 1)
static_assert(ATT_THREADS / WARP <= MERGE_WARPS, "split_row's CTA merges its parts");
#define MERGE_WARP_PARTS (2 * WARP)

// One chain of merge_part's: c ← c · a_old[i] + value_i · a_new[i] (each product and
// sum rounded as merge_part rounds them) for i < n, value_i = p[i · stride] when `on`,
// the values loaded B ahead of the B being merged. K chains side by side.
template <int B, int K>
__device__ __forceinline__ void merge_chains(float (&c)[K], const float* (&p)[K], const bool (&on)[K], long stride, int n, const float* a_old,
                                             const float* a_new) {
    float cur[K][B], next[K][B];
#pragma unroll
    for (int k = 0; k < K; k++)
#pragma unroll
        for (int u = 0; u < B; u++) cur[k][u] = on[k] && u < n ? ld_cg(p[k] + u * stride) : 0.0f;
    for (int b = 0; b < n; b += B) {
#pragma unroll
        for (int k = 0; k < K; k++)
#pragma unroll
            for (int u = 0; u < B; u++) next[k][u] = on[k] && b + B + u < n ? ld_cg(p[k] + (b + B + u) * stride) : 0.0f;
#pragma unroll
        for (int u = 0; u < B; u++) {
            if (b + u >= n) break;
#pragma unroll
            for (int k = 0; k < K; k++) c[k] = __fmaf_rn(c[k], a_old[b + u], __fmul_rn(cur[k][u], a_new[b + u]));
        }
#pragma unroll
        for (int k = 0; k < K; k++)
#pragma unroll
            for (int u = 0; u < B; u++) cur[k][u] = next[k][u];
    }
}

// The n chunk parts of head h of one decode row (as split_row writes them: per head,
// max_chunks parts of head_dim + 2 floats) merged into r, exactly as merge_part merges
// them one after another in chunk order. Only the chains that need the order run in
// order. The running maximum before each part is a prefix maximum, exact in any order,
// so the rescaling factors (merge_part's a_old and a_new) of up to MERGE_WARP_PARTS
// parts a warp are computed side by side; then Σexp and each element of the head are
// head_dim + 1 independent chains over the parts, element e = t taken by thread t (Σexp
// being element head_dim) and, with K = 2, also e = t + blockDim.x: blockDim.x ≥
// head_dim and K · blockDim.x > head_dim, in at most MERGE_WARPS warps.
template <int B, int K>
__device__ void merge_parts(Running<1>& r, const float* parts, int h, int n, int max_chunks, int head_dim) {
    __shared__ float a_old[MERGE_WARPS * MERGE_WARP_PARTS], a_new[MERGE_WARPS * MERGE_WARP_PARTS];
    __shared__ float warp_top[MERGE_WARPS], carry, sum;
    int t = threadIdx.x, lane = t % WARP, warp = t / WARP, warps = blockDim.x / WARP;
    int span = warps * MERGE_WARP_PARTS;
    long stride = head_dim + 2;
    const float* ph = parts + (long)h * max_chunks * stride;
    float c[K];
    const float* p[K];
    bool on[K];
    for (int k = 0; k < K; k++) {
        int e = t + k * blockDim.x;
        c[k] = 0.0f;
        on[k] = e <= head_dim;
        p[k] = ph + (e < head_dim ? 2 + e : 1);
    }
    if (t == 0) carry = NEG_INF;
    for (int w0 = 0; w0 < n; w0 += span) {
        int wn = min(span, n - w0);
        __syncthreads();
        int i0 = warp * MERGE_WARP_PARTS + 2 * lane, i1 = i0 + 1;
        float m0 = i0 < wn ? ld_cg(ph + (w0 + i0) * stride) : NEG_INF;
        float m1 = i1 < wn ? ld_cg(ph + (w0 + i1) * stride) : NEG_INF;
        float x = fmaxf(m0, m1);
        for (int o = 1; o < WARP; o <<= 1) {
            float y = __shfl_up_sync(0xffffffffu, x, o);
            if (lane >= o) x = fmaxf(x, y);
        }
        if (lane == WARP - 1) warp_top[warp] = x;
        __syncthreads();
        float before = carry;
        for (int w = 0; w < warp; w++) before = fmaxf(before, warp_top[w]);
        float prev = __shfl_up_sync(0xffffffffu, x, 1);
        float max0 = lane == 0 ? before : fmaxf(before, prev);
        float max1 = fmaxf(max0, m0), max2 = fmaxf(max1, m1);
        a_old[i0] = max0 == NEG_INF ? 0.0f : expf(max0 - max1);
        a_new[i0] = expf(m0 - max1);
        a_old[i1] = max1 == NEG_INF ? 0.0f : expf(max1 - max2);
        a_new[i1] = expf(m1 - max2);
        __syncthreads();
        if (t == 0)
            for (int w = 0; w < warps; w++) carry = fmaxf(carry, warp_top[w]);
        const float* pw[K];
        for (int k = 0; k < K; k++) pw[k] = p[k] + w0 * stride;
        merge_chains<B, K>(c, pw, on, stride, wn, a_old, a_new);
    }
    for (int k = 0; k < K; k++)
        if (t + k * (int)blockDim.x == head_dim) sum = c[k];
    __syncthreads();
    r.max[0] = carry;
    r.sum[0] = sum;
    r.acc[0] = t < head_dim ? c[0] : 0.0f;
}

// How many chunks a decode row's attention spans before attention_split spreads them
// over CTAs; up to this many, the head's first CTA runs them all (attend). One: two
// chunks in two CTAs and a merge measured faster than both in one CTA (commit d679ddd;
// to retune, time decode on each shape with the value raised).
#define SPLIT_FROM 1

// One decode row (row row0, at positions[row0]) with its chunks spread over the CTAs of
// its head: grid (n_head, S), CTA s taking the row's chunks s, s + S, … and writing each
// chunk's part (m, sum, then acc for every element: head_dim + 2 floats) to `parts`
// (per head, max_chunks parts). The last CTA of a head to finish — `tickets` (one per
// head, zero between launches) counts them — merges the parts in chunk order and
// writes the row as attend does. Every part is chunk_part's and the merge is
// merge_part's in the same order, so the row is attend's bit for bit, for any S.
// Rows spanning at most SPLIT_FROM chunks are computed by CTA 0 alone (attend).
// CHUNK · key_lanes() threads.
__device__ __forceinline__ void split_row(const float* q, const u16* kc, const u16* vc, float* out, int row0, const unsigned int* positions, int slots, int window, int n_head, int group, int head_dim, float scale, u8* qout, int qkind, float* parts, unsigned int* tickets, int max_chunks) {
    __shared__ float sq[1][MAX_HEAD_DIM];
    __shared__ bool last;
    int h = blockIdx.x, s = blockIdx.y, t = threadIdx.x, S = gridDim.y;
    int pos = (int)positions[row0];
    QueryRows<1> qr = query_rows<1>(pos, 1, window);
    int c0 = qr.first[0] / CHUNK, n = pos / CHUNK - c0 + 1;
    bool whole = n <= SPLIT_FROM;
    if (s >= (whole ? 1 : n)) return;
    const u16* kh = kc + (long)(h / group) * slots * head_dim;
    const u16* vh = vc + (long)(h / group) * slots * head_dim;
    if (PDL) {
        if (whole) prefetch_cache(kh, vh, qr.first[0], pos, SPLIT_FROM, 1, slots, head_dim);
        else prefetch_cache(kh, vh, (c0 + s) * CHUNK, pos, (n - s + S - 1) / S, S, slots, head_dim);
    }
    PDL_START
    if (whole) {
        attend<1>(q, kc, vc, out, row0, pos, 1, slots, window, n_head, group, head_dim, scale, qout, qkind);
        return;
    }
    int width = n_head * head_dim;
    for (int d = t; d < head_dim; d += blockDim.x) sq[0][d] = q[(long)row0 * width + h * head_dim + d];
    __syncthreads();
    long stride = head_dim + 2;
    float* mine = parts + (long)h * max_chunks * stride;
    for (int i = s; i < n; i += S) {
        ChunkPart<1> part;
        chunk_part<1>(sq, kh, vh, slots, head_dim, scale, qr, c0 + i, part);
        float* p = mine + i * stride;
        if (t == 0) {
            p[0] = part.m[0];
            p[1] = part.sum[0];
        }
        if (t < head_dim) p[2 + t] = part.acc[0];
    }
    __threadfence();
    __syncthreads();
    if (t == 0) last = atomicAdd(&tickets[h], 1u) == (unsigned int)min(S, n) - 1;
    __syncthreads();
    if (!last) return;
    if (t == 0) tickets[h] = 0;
    __threadfence();
    Running<1> run;
    merge_parts<8, 2>(run, parts, h, n, max_chunks, head_dim);
    attend_out<1>(run, 1, out, row0, h, width, head_dim, qout, qkind);
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) attention_split(const AttentionSplitArgs kargs) { UNPACK_AttentionSplitArgs(kargs)
    split_row(q, kc, vc, out, row0, positions, slots, window, n_head, group, head_dim, scale, qout, qkind, parts, tickets, max_chunks);
}

// The decode rows of several sequences in one launch, each with its own cache and
// scratch (`seqs`, a SeqKv each, its one row at row0): grid (n_head, S, sequences).
// Every row is attention_split's, bit for bit.
extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) attention_split_batch(const AttentionBatchArgs kargs) { UNPACK_AttentionBatchArgs(kargs)
    const SeqKv& e = ((const SeqKv*)seqs)[blockIdx.z];
    split_row(q, e.kc, e.vc, out, e.row0, positions, e.slots, window, n_head, group, head_dim, scale, 0, -1, e.parts, e.tickets, e.max_chunks);
}

// chunk_part for G query rows that see the same positions, lo..hi of chunk c (the
// heads of a KV head at one decode row), each row's arithmetic exactly chunk_part's:
// the rows' weights are kept key by key, so that the pass over the values reads them
// together and tests no row's span.
template <int G>
__device__ void group_chunk(const float (*sq)[MAX_HEAD_DIM], const u16* kh, const u16* vh, int slots, int head_dim, float scale, int lo,
                            int hi, int c, ChunkPart<G>& out) {
    __shared__ __align__(16) float sp[CHUNK][G];
    extern __shared__ __align__(16) u16 sv[];
    const int vs = SV_STRIDE(head_dim);
    int t = threadIdx.x, lanes = key_lanes(), key = t / lanes;
    int p = c * CHUNK + key;
    bool active = p >= lo && p <= hi;
    long row = (long)(p % slots) * head_dim;
    load_values(sv, vh + row, head_dim, active);
    float dot[G], s[G];
    key_dot<G>(sq, kh + row, head_dim, active, dot);
    for (int g = 0; g < G; g++) {
        s[g] = active ? __fmul_rn(dot[g], scale) : NEG_INF;
        out.m[g] = s[g];
        out.on[g] = true;
    }
    chunk_reduce<G, true>(out.m);
    for (int g = 0; g < G; g++) {
        float e = active ? expf(s[g] - out.m[g]) : 0.0f;
        if (t % lanes == 0) sp[key][g] = e;
        out.sum[g] = e;
    }
    chunk_reduce<G, false>(out.sum);
    for (int g = 0; g < G; g++) out.acc[g] = 0.0f;
    if (t < head_dim) {
#pragma unroll 4
        for (int pp = lo - c * CHUNK; pp <= hi - c * CHUNK; pp++) {
            float vd = h2f(sv[pp * vs + t]);
            for (int g = 0; g < G; g++) out.acc[g] = __fmaf_rn(sp[pp][g], vd, out.acc[g]);
        }
    }
    __syncthreads();
}

// A chunk part of G rows written where split_row writes row g's part i: its head's
// (h0 + g) parts, part i.
template <int G>
__device__ __forceinline__ void write_parts(const ChunkPart<G>& part, float* parts, int h0, int i, int max_chunks, int head_dim) {
    for (int g = 0; g < G; g++) {
        float* p = parts + ((long)(h0 + g) * max_chunks + i) * (head_dim + 2);
        if (threadIdx.x == 0) {
            p[0] = part.m[g];
            p[1] = part.sum[g];
        }
        if (threadIdx.x < head_dim) p[2 + threadIdx.x] = part.acc[g];
    }
}

// The chunk parts of one decode row (row row0, at positions[row0]) for the G query
// heads h0.. that share KV head blockIdx.x (grouped-query attention): grid (n_head / G,
// S) with S ≥ G. A shallow row (n chunks, n · G ≤ S) takes a CTA per (head, chunk); a
// deeper one a CTA per chunk for all G heads, CTA s taking chunks s, s + S, …, so that
// each chunk's keys and values are read once for the group. Either way every part is
// the one split_row computes, written where split_row writes it; attention_merge then
// merges each head's parts as split_row does, so each head's row is split_row's bit for
// bit. A row of one chunk is written here, by a CTA a head (the spread form's CTAs each
// take one chunk, so this and attention_merge's skipping such rows hold for SPLIT_FROM
// = 1 only).
static_assert(SPLIT_FROM == 1, "group_parts writes a row of one chunk whole");
template <int G>
__device__ __forceinline__ void group_parts(const float* q, const u16* kc, const u16* vc, float* out, int row0, const unsigned int* positions, int slots, int window, int n_head, int head_dim, float scale, u8* qout, int qkind, float* parts, int max_chunks) {
    __shared__ float sq[G][MAX_HEAD_DIM];
    int hk = blockIdx.x, h0 = hk * G, s = blockIdx.y, t = threadIdx.x, S = gridDim.y;
    int pos = (int)positions[row0];
    int first = window > 0 ? max(0, pos + 1 - window) : 0;
    int c0 = first / CHUNK, n = pos / CHUNK - c0 + 1;
    bool spread = n * G <= S, whole = spread && n <= SPLIT_FROM;
    if (s >= (spread ? n * G : min(S, n))) return;
    const u16* kh = kc + (long)hk * slots * head_dim;
    const u16* vh = vc + (long)hk * slots * head_dim;
    if (PDL) {
        if (spread) prefetch_cache(kh, vh, whole ? first : (c0 + s / G) * CHUNK, pos, 1, 1, slots, head_dim);
        else prefetch_cache(kh, vh, (c0 + s) * CHUNK, pos, (n - s + S - 1) / S, S, slots, head_dim);
    }
    PDL_START
    int width = n_head * head_dim;
    if (spread) {
        // One head's chunk, as split_row's CTA for it.
        int h = h0 + s % G, c = c0 + s / G;
        for (int d = t; d < head_dim; d += blockDim.x) sq[0][d] = q[(long)row0 * width + h * head_dim + d];
        __syncthreads();
        ChunkPart<1> part;
        group_chunk<1>(sq, kh, vh, slots, head_dim, scale, max(c * CHUNK, first), min(c * CHUNK + CHUNK - 1, pos), c, part);
        if (whole) {
            Running<1> run;
            running_init(run);
            merge_part<1>(run, part, head_dim);
            attend_out<1>(run, 1, out, row0, h, width, head_dim, qout, qkind);
        } else {
            write_parts<1>(part, parts, h, s / G, max_chunks, head_dim);
        }
        return;
    }
    for (int g = 0; g < G; g++)
        for (int d = t; d < head_dim; d += blockDim.x) sq[g][d] = q[(long)row0 * width + (h0 + g) * head_dim + d];
    __syncthreads();
    for (int i = s; i < n; i += S) {
        int c = c0 + i;
        ChunkPart<G> part;
        group_chunk<G>(sq, kh, vh, slots, head_dim, scale, max(c * CHUNK, first), min(c * CHUNK + CHUNK - 1, pos), c, part);
        write_parts<G>(part, parts, h0, i, max_chunks, head_dim);
    }
}

// The parts attention_group_G wrote for the decode row of head blockIdx.x merged in
// chunk order, as split_row merges them, and the row written as attend writes it; a
// row of at most SPLIT_FROM chunks, written whole there, is left alone. Grid (n_head),
// head_dim + 1 threads rounded up to whole warps.
__device__ __forceinline__ void merge_row(float* out, int row0, const unsigned int* positions, int window, int n_head, int head_dim, u8* qout, int qkind, const float* parts, int max_chunks) {
    int h = blockIdx.x, pos = (int)positions[row0];
    int first = window > 0 ? max(0, pos + 1 - window) : 0;
    int n = pos / CHUNK - first / CHUNK + 1;
    PDL_START
    if (n <= SPLIT_FROM) return;
    Running<1> run;
    merge_parts<32, 1>(run, parts, h, n, max_chunks, head_dim);
    attend_out<1>(run, 1, out, row0, h, n_head * head_dim, head_dim, qout, qkind);
}

extern "C" __global__ void attention_merge(const AttentionSplitArgs kargs) { UNPACK_AttentionSplitArgs(kargs)
    merge_row(out, row0, positions, window, n_head, head_dim, qout, qkind, parts, max_chunks);
}

// attention_merge for the decode row of every sequence of `seqs`: grid (n_head, 1,
// sequences).
extern "C" __global__ void attention_merge_batch(const AttentionBatchArgs kargs) { UNPACK_AttentionBatchArgs(kargs)
    const SeqKv& e = ((const SeqKv*)seqs)[blockIdx.z];
    merge_row(out, e.row0, positions, window, n_head, head_dim, 0, -1, e.parts, e.max_chunks);
}

#define ATTENTION_GROUP(G)                                                                                                   \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) attention_group_##G(const AttentionSplitArgs kargs) {       \
        UNPACK_AttentionSplitArgs(kargs) group_parts<G>(q, kc, vc, out, row0, positions, slots, window, n_head, head_dim,    \
                                                        scale, qout, qkind, parts, max_chunks);                              \
    }                                                                                                                        \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) attention_group_batch_##G(const AttentionBatchArgs kargs) { \
        UNPACK_AttentionBatchArgs(kargs) const SeqKv& e = ((const SeqKv*)seqs)[blockIdx.z];                                   \
        group_parts<G>(q, e.kc, e.vc, out, e.row0, positions, e.slots, window, n_head, head_dim, scale, 0, -1, e.parts,      \
                       e.max_chunks);                                                                                        \
    }
ATTENTION_GROUP(2)
ATTENTION_GROUP(3)
ATTENTION_GROUP(4)
