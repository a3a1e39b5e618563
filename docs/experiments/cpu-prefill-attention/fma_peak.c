// One core's F32 FMA peak: independent chains of vfmadd, 16 on zmm registers with AVX-512, 12 on ymm
// registers with AVX2 (16 ymm registers: 12 chains and the two operands, no spills).
// cc -O2 -march=native fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak   (two at once: /tmp/fma_peak & /tmp/fma_peak)
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#if defined(__AVX512F__)
#define CHAINS 16
#define LANES 16
#define VEC __m512
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define STORE _mm512_storeu_ps
#define NAME "zmm"
#else
#define CHAINS 12
#define LANES 8
#define VEC __m256
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define STORE _mm256_storeu_ps
#define NAME "ymm"
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec*1e-9;
}

int main(void) {
    VEC acc[CHAINS];
    for (int i = 0; i < CHAINS; i++) {
        acc[i] = SET1(i*0.001f);
    }
    const VEC b = SET1(0.999f);
    const VEC c = SET1(0.0001f);
    const long n = 100000000;
    const double t0 = now();
    for (long k = 0; k < n; k++) {
#pragma GCC unroll 16
        for (int i = 0; i < CHAINS; i++) {
            acc[i] = FMA(acc[i], b, c);
        }
    }
    const double t = now() - t0;
    float sum = 0.0f;
    for (int i = 0; i < CHAINS; i++) {
        float lanes[LANES];
        STORE(lanes, acc[i]);
        for (int j = 0; j < LANES; j++) {
            sum += lanes[j];
        }
    }
    printf("%s FMA: %.1f GFLOPS on one core (%g)\n", NAME, n*(double)CHAINS*LANES*2/t/1e9, sum);
    return 0;
}
