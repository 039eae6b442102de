// A two-layer MLP training step (forward, backward, SGD) on the GPU, as a shared library that train.py drives
// through ctypes. It is the workload of the AI flame graph example (make.sh): real kernels, compiled by nvcc into
// real SASS with line tables, launched from real host code. Without a GPU every CUDA call returns an error
// (cudaErrorInsufficientDriver) and the library ignores it: the launches are still made, which is what the
// profiler's uprobes see. Host helpers are noipa so each launch keeps its own frame in the launch stack.
#include <cuda_runtime.h>

#define TILE 16

// C[M,N] = op(A)[M,K] * op(B)[K,N]; ta/tb transpose A or B (row-major storage).
__global__ void matmul_tiled(const float *A, const float *B, float *C, int M, int N, int K, int ta, int tb) {
    __shared__ float as[TILE][TILE];
    __shared__ float bs[TILE][TILE];
    int row = blockIdx.y * TILE + threadIdx.y;
    int col = blockIdx.x * TILE + threadIdx.x;
    float acc = 0.0f;
    for (int t = 0; t < (K + TILE - 1) / TILE; t++) {
        int ak = t * TILE + threadIdx.x;
        int bk = t * TILE + threadIdx.y;
        as[threadIdx.y][threadIdx.x] = (row < M && ak < K) ? (ta ? A[ak * M + row] : A[row * K + ak]) : 0.0f;
        bs[threadIdx.y][threadIdx.x] = (col < N && bk < K) ? (tb ? B[col * K + bk] : B[bk * N + col]) : 0.0f;
        __syncthreads();
        for (int k = 0; k < TILE; k++) {
            acc += as[threadIdx.y][k] * bs[k][threadIdx.x];
        }
        __syncthreads();
    }
    if (row < M && col < N) {
        C[row * N + col] = acc;
    }
}

__global__ void bias_relu(float *x, const float *bias, int rows, int cols) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * cols) {
        float v = x[i] + bias[i % cols];
        x[i] = v > 0.0f ? v : 0.0f;
    }
}

// One thread per row: numerically stable softmax, cross-entropy loss, and dL/dlogits in place.
__global__ void softmax_xent(float *logits, const int *labels, float *loss, int rows, int cols) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) {
        return;
    }
    float *z = logits + r * cols;
    float m = z[0];
    for (int j = 1; j < cols; j++) {
        m = fmaxf(m, z[j]);
    }
    float s = 0.0f;
    for (int j = 0; j < cols; j++) {
        z[j] = __expf(z[j] - m);
        s += z[j];
    }
    int y = labels[r];
    for (int j = 0; j < cols; j++) {
        z[j] = z[j] / s - (j == y ? 1.0f : 0.0f);
    }
    atomicAdd(loss, -__logf(z[y] + 1.0f + 1e-12f) / rows);
}

__global__ void relu_backward(float *grad, const float *act, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && act[i] <= 0.0f) {
        grad[i] = 0.0f;
    }
}

__global__ void sgd_update(float *w, const float *g, float lr, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        w[i] -= lr * g[i];
    }
}

static int B_, D_, H_, O_;
static float *x_, *w1_, *b1_, *h_, *w2_, *logits_, *dh_, *dw1_, *dw2_, *loss_;
static int *labels_;

static dim3 tiles(int m, int n) { return dim3((n + TILE - 1) / TILE, (m + TILE - 1) / TILE); }
static int blocks(int n) { return (n + 255) / 256; }

__attribute__((noipa)) static void matmul(const float *a, const float *b, float *c, int m, int n, int k, int ta,
                                          int tb) {
    matmul_tiled<<<tiles(m, n), dim3(TILE, TILE)>>>(a, b, c, m, n, k, ta, tb);
}

extern "C" {

int mlp_init(int batch, int in, int hidden, int out) {
    B_ = batch, D_ = in, H_ = hidden, O_ = out;
    cudaError_t rc = cudaMalloc(&x_, sizeof(float) * B_ * D_);
    cudaMalloc(&w1_, sizeof(float) * D_ * H_);
    cudaMalloc(&b1_, sizeof(float) * H_);
    cudaMalloc(&h_, sizeof(float) * B_ * H_);
    cudaMalloc(&w2_, sizeof(float) * H_ * O_);
    cudaMalloc(&logits_, sizeof(float) * B_ * O_);
    cudaMalloc(&dh_, sizeof(float) * B_ * H_);
    cudaMalloc(&dw1_, sizeof(float) * D_ * H_);
    cudaMalloc(&dw2_, sizeof(float) * H_ * O_);
    cudaMalloc(&loss_, sizeof(float));
    cudaMalloc(&labels_, sizeof(int) * B_);
    return (int)rc;
}

int mlp_upload(const float *x, const int *labels) {
    cudaError_t rc = cudaMemcpy(x_, x, sizeof(float) * B_ * D_, cudaMemcpyHostToDevice);
    cudaMemcpy(labels_, labels, sizeof(int) * B_, cudaMemcpyHostToDevice);
    return (int)rc;
}

__attribute__((noipa)) void mlp_forward(void) {
    cudaMemsetAsync(loss_, 0, sizeof(float));
    matmul(x_, w1_, h_, B_, H_, D_, 0, 0);
    bias_relu<<<blocks(B_ * H_), 256>>>(h_, b1_, B_, H_);
    matmul(h_, w2_, logits_, B_, O_, H_, 0, 0);
    softmax_xent<<<blocks(B_), 256>>>(logits_, labels_, loss_, B_, O_);
}

__attribute__((noipa)) void mlp_backward(void) {
    matmul(logits_, w2_, dh_, B_, H_, O_, 0, 1);    // dh = dlogits * W2^T
    relu_backward<<<blocks(B_ * H_), 256>>>(dh_, h_, B_ * H_);
    matmul(h_, logits_, dw2_, H_, O_, B_, 1, 0);    // dW2 = h^T * dlogits
    matmul(x_, dh_, dw1_, D_, H_, B_, 1, 0);        // dW1 = x^T * dh
}

__attribute__((noipa)) void mlp_sgd(float lr) {
    sgd_update<<<blocks(D_ * H_), 256>>>(w1_, dw1_, lr, D_ * H_);
    sgd_update<<<blocks(H_ * O_), 256>>>(w2_, dw2_, lr, H_ * O_);
}

float mlp_loss(void) {
    float loss = 0.0f;
    cudaMemcpy(&loss, loss_, sizeof(float), cudaMemcpyDeviceToHost);
    cudaDeviceSynchronize();
    return loss;
}

}  // extern "C"
