// Launches at a steady rate, far above what launch records with stacks can keep up with, for the launch budget
// tests: `hot` about 70 % of the time through main -> loop -> deep x8 -> launch_hot, `cold` otherwise through
// launch_cold, in a pseudo-random order. Prints how many of each it launched: {"hot": N, "cold": M}. Without a GPU
// every launch fails at once (cudaErrorInsufficientDriver) but is made, so the probes see each one.
//   launch_loop SECONDS RATE   (or run_loop() of the -shared build, from Python)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <cuda_runtime.h>

__global__ void hot(float *x) { x[threadIdx.x] += 1.0f; }
__global__ void cold(float *x) { x[threadIdx.x] *= 2.0f; }

__attribute__((noinline)) void launch_hot(float *x) { hot<<<1, 32>>>(x); }
__attribute__((noinline)) void launch_cold(float *x) { cold<<<1, 32>>>(x); }

__attribute__((noinline)) bool deep(int d, unsigned *rng, float *x) {
    if (d > 0) {
        bool r = deep(d - 1, rng, x);
        asm volatile("" ::: "memory");  // not a tail call: every level stays on the stack
        return r;
    }
    *rng = *rng * 1103515245u + 12345u;
    bool is_hot = (*rng >> 16) % 10 < 7;
    if (is_hot) launch_hot(x); else launch_cold(x);
    return is_hot;
}

// The loop itself, also called from Python through ctypes (bench/launch_rate.py --python: the library build).
extern "C" int run_loop(double seconds, long rate, long *n_hot, long *n_cold) {
    unsigned rng = 1;
    long n = 0;
    *n_hot = *n_cold = 0;
    auto t0 = std::chrono::steady_clock::now();
    for (;;) {
        double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (el >= seconds) break;
        for (; n < el * rate; n++) {
            if (deep(8, &rng, nullptr)) (*n_hot)++; else (*n_cold)++;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return 0;
}

// One launch through the same deep stack, for a caller that paces itself (bench/launch_steps.py: Python work
// between launches, as a training step's dispatch is). Returns 1 for hot, 0 for cold.
extern "C" int launch_one(void) {
    static unsigned rng = 1;
    return deep(8, &rng, nullptr) ? 1 : 0;
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 2;
    long rate = argc > 2 ? atol(argv[2]) : 10000;
    long n_hot = 0, n_cold = 0;
    run_loop(seconds, rate, &n_hot, &n_cold);
    printf("{\"hot\": %ld, \"cold\": %ld}\n", n_hot, n_cold);
    return 0;
}
