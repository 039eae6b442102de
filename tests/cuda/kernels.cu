// Small CUDA program for the GPU-symbol and launch-tracing tests. Its launch pattern is fixed and relied on:
// `scale` 3x <<<4,256>>>, `add` once <<<dim3(2,3,1), dim3(32,4,1), 128>>>, one 4096-byte copy host->device,
// one device->host, one cudaDeviceSynchronize (plus three cudaMalloc). Host code goes main -> run_steps ->
// launch_scale / launch_add (noipa: never inlined or cloned; built with frame pointers) so stack tests can expect
// that chain. demo::fill<int> is compiled (a namespaced template name) but never launched. Without a GPU every
// call returns an error code; the program ignores them and exits 0.
#include <cstdio>
#include <cuda_runtime.h>

#define N 1024

// Inlined into both kernels, so the line tables mix two source regions per function.
__device__ __forceinline__ float mix(float a, float b, int i) {
    float t = a * 0.5f + b;
    if (i & 1) {
        t = t * t - a;
    }
    return t;
}

__global__ void scale(float *x, float k, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float acc = x[i];
        for (int j = 0; j < 8; j++) {
            acc = mix(acc, k, j + i);
        }
        x[i] = acc * k;
    }
}

__global__ void add(const float *a, const float *b, float *out, int n) {
    extern __shared__ float tile[];
    int t = threadIdx.y * blockDim.x + threadIdx.x;
    int i = (blockIdx.y * gridDim.x + blockIdx.x) * (blockDim.x * blockDim.y) + t;
    tile[t % 32] = i < n ? a[i] : 0.0f;
    __syncthreads();
    if (i < n) {
        out[i] = mix(tile[t % 32], b[i], t);
    }
}

namespace demo {
template <typename T>
__global__ void fill(T *x, T v, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}
template __global__ void fill<int>(int *, int, int);
}  // namespace demo

__attribute__((noipa)) void launch_scale(float *x) {
    scale<<<4, 256>>>(x, 2.0f, N);
}

__attribute__((noipa)) void launch_add(const float *a, const float *b, float *out) {
    add<<<dim3(2, 3, 1), dim3(32, 4, 1), 128>>>(a, b, out, N);
}

__attribute__((noipa)) int run_steps(void) {
    static float host[N];
    float *dx = nullptr, *dy = nullptr, *dz = nullptr;
    cudaError_t rc = cudaMalloc(&dx, sizeof(host));
    cudaMalloc(&dy, sizeof(host));
    cudaMalloc(&dz, sizeof(host));
    for (int i = 0; i < 3; i++) {
        launch_scale(dx);
    }
    launch_add(dx, dy, dz);
    cudaMemcpy(dx, host, sizeof(host), cudaMemcpyHostToDevice);
    cudaMemcpy(host, dz, sizeof(host), cudaMemcpyDeviceToHost);
    cudaDeviceSynchronize();
    return (int)rc;
}

int main(void) {
    int rc = run_steps();
    printf("kernels: first cuda status %d\n", rc);
    return 0;
}
