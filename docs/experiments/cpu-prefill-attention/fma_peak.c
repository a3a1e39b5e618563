// One core's F32 FMA peak with AVX-512: 16 independent chains of vfmadd on zmm registers.
// cc -O2 -march=native fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak   (two at once: /tmp/fma_peak & /tmp/fma_peak)
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec*1e-9;
}

int main(void) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) {
        acc[i] = _mm512_set1_ps(i*0.001f);
    }
    const __m512 b = _mm512_set1_ps(0.999f);
    const __m512 c = _mm512_set1_ps(0.0001f);
    const long n = 100000000;
    const double t0 = now();
    for (long k = 0; k < n; k++) {
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            acc[i] = _mm512_fmadd_ps(acc[i], b, c);
        }
    }
    const double t = now() - t0;
    float sum = 0.0f;
    for (int i = 0; i < 16; i++) {
        sum += _mm512_reduce_add_ps(acc[i]);
    }
    printf("zmm FMA: %.1f GFLOPS on one core (%g)\n", n*16.0*32/t/1e9, sum);
    return 0;
}
