extern "C" __global__ void scale(float *x, float a) { x[threadIdx.x] *= a; }
