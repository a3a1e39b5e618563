// The tile GEMMs of gemm_blocking.cpp with A packed so that a block's RM broadcast rows are contiguous (Ap[k*RM+i]),
// each element's FMA chain in the same order; 'base' is simd_gemm's layout. Not taken: packing made both GEMMs slower.
// c++ -O3 -march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 gemm_packed_a.cpp -o /tmp/gemm_packed_a && /tmp/gemm_packed_a
#include <immintrin.h>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <vector>
static double now(){timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
// baseline: as simd_gemm
template <int RM, int RN>
static inline void block(float * __restrict C, const float * __restrict A, const float * __restrict B, int K, int N) {
    __m512 acc[RM][RN];
    for (int i = 0; i < RM; i++) for (int r = 0; r < RN; r++) acc[i][r] = _mm512_loadu_ps(C + i*N + r*16);
    for (int kk = 0; kk < K; kk++) {
        __m512 b[RN];
        for (int r = 0; r < RN; r++) b[r] = _mm512_loadu_ps(B + kk*N + r*16);
        for (int i = 0; i < RM; i++) { const __m512 a = _mm512_set1_ps(A[i*K + kk]);
            for (int r = 0; r < RN; r++) acc[i][r] = _mm512_fmadd_ps(b[r], a, acc[i][r]); }
    }
    for (int i = 0; i < RM; i++) for (int r = 0; r < RN; r++) _mm512_storeu_ps(C + i*N + r*16, acc[i][r]);
}
// packed A: Ap[kk*RM + i]
template <int RM, int RN>
static inline void blockp(float * __restrict C, const float * __restrict Ap, const float * __restrict B, int K, int N) {
    __m512 acc[RM][RN];
    for (int i = 0; i < RM; i++) for (int r = 0; r < RN; r++) acc[i][r] = _mm512_loadu_ps(C + i*N + r*16);
    for (int kk = 0; kk < K; kk++) {
        __m512 b[RN];
        for (int r = 0; r < RN; r++) b[r] = _mm512_loadu_ps(B + kk*N + r*16);
        for (int i = 0; i < RM; i++) { const __m512 a = _mm512_set1_ps(Ap[kk*RM + i]);
            for (int r = 0; r < RN; r++) acc[i][r] = _mm512_fmadd_ps(b[r], a, acc[i][r]); }
    }
    for (int i = 0; i < RM; i++) for (int r = 0; r < RN; r++) _mm512_storeu_ps(C + i*N + r*16, acc[i][r]);
}
template <int RM, int RN, int MODE>
static void gemm(float * C, const float * A, const float * B, int M, int K, int N, float * Ap) {
    int ii = 0;
    for (; ii + RM <= M; ii += RM) {
        if (MODE == 0) { for (int jj = 0; jj < N; jj += 16*RN) block<RM, RN>(C + ii*N + jj, A + ii*K, B + jj, K, N); }
        else {
            for (int kk = 0; kk < K; kk++) for (int i = 0; i < RM; i++) Ap[kk*RM+i] = A[(ii+i)*K+kk];
            for (int jj = 0; jj < N; jj += 16*RN) blockp<RM, RN>(C + ii*N + jj, Ap, B + jj, K, N);
        }
    }
    for (; ii + 4 <= M; ii += 4) for (int jj = 0; jj < N; jj += 16*RN) block<4, RN>(C + ii*N + jj, A + ii*K, B + jj, K, N);
    for (; ii < M; ii++) for (int jj = 0; jj < N; jj += 16*RN) block<1, RN>(C + ii*N + jj, A + ii*K, B + jj, K, N);
}
template <int RM, int RN, int MODE>
static void run(const char*name) {
    const int heads = 6, rounds = 3000;
    std::vector<float> Q(heads*64*128, 0.01f), Kt(128*64, 0.02f), KQ(64*64), V(64*128, 0.03f), O(heads*64*128), Ap(128*16);
    double t_kq = 0.0, t_pv = 0.0;
    for (int n = 0; n < rounds; n++) for (int g = 0; g < heads; g++) {
        const double t0 = now();
        memset(KQ.data(), 0, KQ.size()*sizeof(float));
        gemm<RM, RN, MODE>(KQ.data(), Q.data() + g*64*128, Kt.data(), 64, 128, 64, Ap.data());
        const double t1 = now();
        gemm<RM, RN, MODE>(O.data() + g*64*128, KQ.data(), V.data(), 64, 64, 128, Ap.data());
        t_pv += now() - t1; t_kq += t1 - t0;
    }
    const double flop = rounds*heads*2.0*64*128*64;
    printf("%s %2dx%d: Q·Kt %.1f, P·V %.1f GFLOPS (%g)\n", name, RM, RN, flop/t_kq/1e9, flop/t_pv/1e9, O[5]);
}
int main(){ for(int r=0;r<3;r++){ run<6,4,0>("base"); run<6,4,1>("packA"); run<12,2,1>("packA"); run<6,4,0>("base2");} }
