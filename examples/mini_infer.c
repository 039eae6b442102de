/* A toy "inference server" loop for the demo: tokenize, attention (matmul + softmax), MLP (matmul + gelu),
 * then write the result. Its flame graph should show those phases by their share of the work.
 * Usage: mini_infer [seconds] */
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define D 64
static float W[D][D], X[D][D], Y[D][D];
static int tokens[4096];

__attribute__((noinline)) void tokenize(const char *text, int n) {
    for (int r = 0; r < 8; r++)
        for (int i = 0; i < n; i++)
            tokens[i % 4096] = (tokens[i % 4096] * 31 + text[i % 64]) & 0xffff;
}

__attribute__((noinline)) void matmul(float a[D][D], float b[D][D], float c[D][D]) {
    for (int i = 0; i < D; i++)
        for (int j = 0; j < D; j++) {
            float s = 0;
            for (int k = 0; k < D; k++)
                s += a[i][k] * b[k][j];
            c[i][j] = s;
        }
}

__attribute__((noinline)) void softmax(float m[D][D]) {
    for (int i = 0; i < D; i++) {
        float mx = m[i][0], sum = 0;
        for (int j = 1; j < D; j++)
            mx = m[i][j] > mx ? m[i][j] : mx;
        for (int j = 0; j < D; j++)
            sum += (m[i][j] = expf(m[i][j] - mx));
        for (int j = 0; j < D; j++)
            m[i][j] /= sum;
    }
}

__attribute__((noinline)) void gelu(float m[D][D]) {
    for (int i = 0; i < D; i++)
        for (int j = 0; j < D; j++)
            m[i][j] = 0.5f * m[i][j] * (1.0f + tanhf(0.7978845608f * (m[i][j] + 0.044715f * m[i][j] * m[i][j] * m[i][j])));
}

__attribute__((noinline)) void attention(void) {
    matmul(X, W, Y);
    softmax(Y);
    matmul(Y, W, X);
}

__attribute__((noinline)) void mlp(void) {
    matmul(X, W, Y);
    gelu(Y);
    matmul(Y, W, X);
}

__attribute__((noinline)) void write_output(int fd) {
    for (int i = 0; i < 4; i++)
        if (write(fd, Y, sizeof Y) < 0)
            exit(1);
}

__attribute__((noinline)) void serve_request(int fd) {
    tokenize("the quick brown fox jumps over the lazy dog, again and again and again!!", 4096);
    for (int layer = 0; layer < 4; layer++) {
        attention();
        mlp();
    }
    write_output(fd);
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 5.0;
    int fd = open("/dev/null", O_WRONLY);
    for (int i = 0; i < D; i++)
        for (int j = 0; j < D; j++)
            W[i][j] = X[i][j] = (float)((i * 7 + j * 3) % 11) / 11.0f;
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        serve_request(fd);
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) / 1e9 < seconds);
    return 0;
}
