// decode-ceiling: the fastest a decode step of a given launch structure can run on this
// GPU, whatever its matrix kernels do. Each matrix product of the step is replaced by a
// kernel that only streams its weight bytes (no arithmetic), each other kernel of the
// step by one CTA norming a row (the memory pattern of an RMS norm), and the whole step
// is recorded in a CUDA graph and replayed, as astra records its decode steps.
//
// Build and run on a GPU machine (scripts/gpu-check does):
//   nvcc -O3 -arch=native -o decode-ceiling scripts/decode-ceiling.cu && ./decode-ceiling
//   ./decode-ceiling LAYERS OTHERS OUTPUT_BYTES BYTES...   (another shape)
// BYTES are one layer's product launches in order, each followed by its share of the
// layer's OTHERS other kernels (the first launch takes the remainder). The default is
// the 8B shape (`astra synth --like llama3-8b --type q4_k`) as astra's CUDA engine
// launches it: QKV, attention output, gate and up, down; six other kernels a layer
// (norm + quantize, QK-RoPE, attention, quantize, norm + quantize, GLU + quantize).
//
// The kernels alone compile under NVRTC too (the host part is left out there), so that
// the test suite compiles them wherever it compiles astra's own.
#define ROW 4096

// A row of ROW values normed in place by the first 256 threads of a CTA: every load in
// flight together, the sum of squares reduced over the 256.
__device__ __forceinline__ void norm_row(float* __restrict__ x) {
    float v[ROW / 256], s = 0.0f;
#pragma unroll
    for (int j = 0; j < ROW / 256; j++) v[j] = x[threadIdx.x + 256 * j];
#pragma unroll
    for (int j = 0; j < ROW / 256; j++) s += v[j] * v[j];
    for (int o = 16; o; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
    __shared__ float part[8];
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = s;
    asm volatile("bar.sync 1, 256;" ::: "memory");
    s = 0.0f;
    for (int j = 0; j < 8; j++) s += part[j];
    float r = rsqrtf(s / ROW + 1e-6f);
#pragma unroll
    for (int j = 0; j < ROW / 256; j++) x[threadIdx.x + 256 * j] = v[j] * r + 1.0f;
}

// Streams n16 16-byte words of w, four loads in flight a thread. With `early`, the
// first four are asked for before the wait on the kernel before (weights do not depend
// on it). With `ticket`, the CTA that finishes last also norms x: another kernel's work
// folded into this one's end.
extern "C" __global__ void stream(const uint4* __restrict__ w, long n16, unsigned* sink, int early, unsigned* ticket, float* x) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x, step = (long)gridDim.x * blockDim.x;
    unsigned acc = 0;
    uint4 pre[4];
    int ahead = 0;
    if (early) {
#pragma unroll
        for (int u = 0; u < 4; u++)
            if (i + u * step < n16) pre[u] = __ldg(w + i + u * step), ahead = u + 1;
    }
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
#pragma unroll
    for (int u = 0; u < 4; u++)
        if (u < ahead) acc ^= pre[u].x ^ pre[u].y ^ pre[u].z ^ pre[u].w;
    for (i += ahead * step; i + 3 * step < n16; i += 4 * step) {
        uint4 a = __ldg(w + i), b = __ldg(w + i + step), c = __ldg(w + i + 2 * step), d = __ldg(w + i + 3 * step);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n16; i += step) {
        uint4 a = __ldg(w + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    // Never true for the bytes main writes (every byte 1); keeps the loads.
    if (acc == 0x12345678u) sink[0] = acc;
    if (ticket) {
        __shared__ bool last;
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            last = atomicAdd(ticket, 1u) == gridDim.x - 1;
        }
        __syncthreads();
        if (last) {
            __threadfence();
            if (threadIdx.x < 256) norm_row(x);
            if (threadIdx.x == 0) *ticket = 0;
        }
    }
}

// Another kernel of the step: one CTA of 256 norming x, letting the next kernel be
// scheduled before (`first`) or after its wait.
extern "C" __global__ void other(float* __restrict__ x, int first) {
    if (first) asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (!first) asm volatile("griddepcontrol.launch_dependents;");
    norm_row(x);
}

#ifndef __CUDACC_RTC__
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <vector>

// A whole argument as a number, or exit 2.
static long number(const char* arg) {
    char* end;
    long v = strtol(arg, &end, 10);
    if (*arg == '\0' || *end != '\0') {
        fprintf(stderr, "not a number: %s\n", arg);
        exit(2);
    }
    return v;
}

#define CHECK(x)                                                                              \
    do {                                                                                      \
        cudaError_t e = (x);                                                                  \
        if (e != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e));        \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

static void launch(cudaStream_t s, const void* f, dim3 grid, dim3 block, void** args, bool dependent) {
    cudaLaunchConfig_t c = {};
    c.gridDim = grid, c.blockDim = block, c.stream = s;
    cudaLaunchAttribute a;
    a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    a.val.programmaticStreamSerializationAllowed = 1;
    c.attrs = &a, c.numAttrs = dependent ? 1 : 0;
    CHECK(cudaLaunchKernelExC(&c, f, args));
}

struct Variant {
    const char* name;
    bool one;        // one kernel for every byte of the step
    bool others;     // the step's other kernels launched too
    bool dependent;  // programmatic dependent launches
    bool early;      // products ask for their first weights before the wait
    int first;       // other kernels let the next be scheduled before their wait
    bool tickets;    // the other kernel after each product but the first folded into it
};

int main(int argc, char** argv) {
    int layers = 32, others = 6;
    long output = 128256L * 128 * 34;  // Q8_0 output matrix
    std::vector<long> layer = {6144L * 2304, 4096L * 2304, 28672L * 2304, 4096L * 8064};
    if (argc > 1) {
        if (argc < 5) {
            fprintf(stderr, "usage: %s [LAYERS OTHERS OUTPUT_BYTES BYTES...]\n", argv[0]);
            return 2;
        }
        long n = number(argv[1]), o = number(argv[2]);
        output = number(argv[3]);
        layer.clear();
        for (int i = 4; i < argc; i++) layer.push_back(number(argv[i]));
        if (n < 1 || n > 1000 || o < 0 || o > 1000 || output < 0) {
            fprintf(stderr, "LAYERS must be 1..1000, OTHERS 0..1000, OUTPUT_BYTES not negative\n");
            return 2;
        }
        layers = (int)n, others = (int)o;
        for (long b : layer)
            if (b < 16) {
                fprintf(stderr, "each launch streams at least 16 bytes\n");
                return 2;
            }
    }
    // The launches of a step: bytes, and how many other kernels follow.
    std::vector<long> bytes;
    std::vector<int> after;
    int share = others / (int)layer.size(), first_share = others - share * ((int)layer.size() - 1);
    for (int l = 0; l < layers; l++)
        for (size_t k = 0; k < layer.size(); k++) bytes.push_back(layer[k]), after.push_back(k == 0 ? first_share : share);
    if (output > 0) bytes.push_back(output), after.push_back(0);
    long total = 0;
    std::vector<long> offset;
    for (long b : bytes) offset.push_back(total), total += (b + 255) / 256 * 256;

    int sms, mem_khz, bus_bits;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CHECK(cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, 0));
    CHECK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, 0));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    char* w;
    unsigned *sink, *ticket;
    float* x;
    CHECK(cudaMalloc(&w, total));
    CHECK(cudaMemset(w, 1, total));
    CHECK(cudaMalloc(&sink, 4));
    CHECK(cudaMalloc(&ticket, 4));
    CHECK(cudaMemset(ticket, 0, 4));
    CHECK(cudaMalloc(&x, ROW * 4));
    CHECK(cudaMemset(x, 0, ROW * 4));
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    printf("%s, %d SMs; a step: %zu product launches, %.3f GB of weights\n", prop.name, sms, bytes.size(), total / 1e9);
    printf("(the memory clock and bus the driver reports give %.2f TB/s; the first line below is what one stream reaches)\n",
           2.0 * mem_khz * 1e3 * bus_bits / 8 / 1e12);

    Variant variants[] = {
        {"one kernel streaming every byte", true, false, false, false, 0, false},
        {"a kernel a product", false, false, false, false, 0, false},
        {"a kernel a product, dependent launches", false, false, true, false, 0, false},
        {"  and first weights asked before the wait", false, false, true, true, 0, false},
        {"+ the other kernels, dependent launches", false, true, true, false, 0, false},
        {"  and first weights asked before the wait", false, true, true, true, 0, false},
        {"  and the others scheduling the next first", false, true, true, true, 1, false},
        {"  and an other folded into each product but the first", false, true, true, true, 0, true},
    };
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    double one_step = 0;
    for (const Variant& v : variants) {
        cudaGraph_t g;
        cudaGraphExec_t exec;
        CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        dim3 grid(sms * 4), block(512);
        if (v.one) {
            long n16 = total / 16;
            const uint4* p = (const uint4*)w;
            int early = 0;
            unsigned* none = nullptr;
            void* args[] = {&p, &n16, &sink, &early, &none, &x};
            launch(s, (const void*)stream, grid, block, args, false);
        } else {
            for (size_t k = 0; k < bytes.size(); k++) {
                long n16 = bytes[k] / 16;
                const uint4* p = (const uint4*)(w + offset[k]);
                int early = v.early, n = v.others ? after[k] : 0;
                bool fold = v.tickets && n > 0 && k % layer.size() != 0;
                unsigned* t = fold ? ticket : nullptr;
                void* args[] = {&p, &n16, &sink, &early, &t, &x};
                launch(s, (const void*)stream, grid, block, args, v.dependent);
                int first = v.first;
                void* oargs[] = {&x, &first};
                for (int j = fold ? 1 : 0; j < n; j++) launch(s, (const void*)other, dim3(1), dim3(256), oargs, v.dependent);
            }
        }
        CHECK(cudaStreamEndCapture(s, &g));
        CHECK(cudaGraphInstantiate(&exec, g, 0));
        for (int r = 0; r < 5; r++) CHECK(cudaGraphLaunch(exec, s));
        CHECK(cudaStreamSynchronize(s));
        const int reps = 50;
        CHECK(cudaEventRecord(a, s));
        for (int r = 0; r < reps; r++) CHECK(cudaGraphLaunch(exec, s));
        CHECK(cudaEventRecord(b, s));
        CHECK(cudaStreamSynchronize(s));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, a, b));
        double step = ms / reps;
        if (v.one) one_step = step;
        printf("%-56s %7.3f ms a step, %7.1f steps/s, %5.2f TB/s, %3.0f%% of one stream's\n", v.name, step, 1e3 / step,
               total / (step * 1e-3) / 1e12, 100 * one_step / step);
        CHECK(cudaGraphExecDestroy(exec));
        CHECK(cudaGraphDestroy(g));
    }
    return 0;
}
#endif
