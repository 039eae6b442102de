/* aiflame: the host-side macros CUDA's runtime headers expect from crt/host_defines.h, for a plain C compiler
 * on hosts whose CUDA headers (pip's nvidia-cuda-runtime without nvidia-cuda-crt) lack crt/. Host code only. */
#ifndef AIFLAME_CRT_HOST_DEFINES_H
#define AIFLAME_CRT_HOST_DEFINES_H
#define __host__
#define __device__
#define __global__
#define __shared__
#define __constant__
#define __managed__
#define __device_builtin__
#define __device_builtin_texture_type__
#define __device_builtin_surface_type__
#define __cudart_builtin__
#define __forceinline__ __inline__ __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __align__(n) __attribute__((aligned(n)))
#define __builtin_align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define __location__(a) __annotate__(a)
#define __annotate__(a) __attribute__((a))
#define __thread__ __thread
#define __import__
#define __export__
#define __cdecl
#define __specialization_static
#define CUDARTAPI
#define CUDARTAPI_CDECL
#endif
