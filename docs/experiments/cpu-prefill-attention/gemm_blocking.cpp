// The tiled flash attention's two GEMMs at its shapes (Q·Kᵀ: 64x128 by 128x64, P·V: 64x64 by 64x128, the six
// heads of a GQA group in turn over one K/V tile), with register blocks of RM rows x RN vectors of 16 floats.
// Every block computes each element of C as the same chain of FMAs over K, as ggml's simd_gemm does.
// c++ -O3 -march=native gemm_blocking.cpp -o /tmp/gemm_blocking && /tmp/gemm_blocking
#include <immintrin.h>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <vector>

static double now() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec*1e-9;
}

// C[RM x 16*RN] += A[RM x K] * B[K x 16*RN] (row strides K and N)
template <int RM, int RN>
static inline void block(float * __restrict C, const float * __restrict A, const float * __restrict B, int K, int N) {
    __m512 acc[RM][RN];
    for (int i = 0; i < RM; i++) {
        for (int r = 0; r < RN; r++) {
            acc[i][r] = _mm512_loadu_ps(C + i*N + r*16);
        }
    }
    for (int kk = 0; kk < K; kk++) {
        __m512 b[RN];
        for (int r = 0; r < RN; r++) {
            b[r] = _mm512_loadu_ps(B + kk*N + r*16);
        }
        for (int i = 0; i < RM; i++) {
            const __m512 a = _mm512_set1_ps(A[i*K + kk]);
            for (int r = 0; r < RN; r++) {
                acc[i][r] = _mm512_fmadd_ps(b[r], a, acc[i][r]);
            }
        }
    }
    for (int i = 0; i < RM; i++) {
        for (int r = 0; r < RN; r++) {
            _mm512_storeu_ps(C + i*N + r*16, acc[i][r]);
        }
    }
}

// rows in blocks of RM, then of 4, then one at a time
template <int RM, int RN>
static void gemm(float * C, const float * A, const float * B, int M, int K, int N) {
    int ii = 0;
    for (; ii + RM <= M; ii += RM) {
        for (int jj = 0; jj < N; jj += 16*RN) block<RM, RN>(C + ii*N + jj, A + ii*K, B + jj, K, N);
    }
    for (; ii + 4 <= M; ii += 4) {
        for (int jj = 0; jj < N; jj += 16*RN) block<4, RN>(C + ii*N + jj, A + ii*K, B + jj, K, N);
    }
    for (; ii < M; ii++) {
        for (int jj = 0; jj < N; jj += 16*RN) block<1, RN>(C + ii*N + jj, A + ii*K, B + jj, K, N);
    }
}

template <int RM, int RN>
static void run() {
    const int heads = 6, rounds = 3000;
    std::vector<float> Q(heads*64*128, 0.01f), Kt(128*64, 0.02f), KQ(64*64), V(64*128, 0.03f), O(heads*64*128);
    double t_kq = 0.0, t_pv = 0.0;
    for (int n = 0; n < rounds; n++) {
        for (int g = 0; g < heads; g++) {
            const double t0 = now();
            memset(KQ.data(), 0, KQ.size()*sizeof(float));
            gemm<RM, RN>(KQ.data(), Q.data() + g*64*128, Kt.data(), 64, 128, 64);
            const double t1 = now();
            gemm<RM, RN>(O.data() + g*64*128, KQ.data(), V.data(), 64, 64, 128);
            t_pv += now() - t1;
            t_kq += t1 - t0;
        }
    }
    const double flop = rounds*heads*2.0*64*128*64;
    printf("%2dx%d: Q·Kt %.1f GFLOPS, P·V %.1f GFLOPS (%g)\n", RM, RN, flop/t_kq/1e9, flop/t_pv/1e9, O[5]);
}

int main() {
    for (int round = 0; round < 3; round++) {
        run<4, 4>();
        run<6, 4>();
        run<7, 4>();
        run<12, 2>();
        run<14, 2>();
    }
    return 0;
}
