// Few-row affine quantized matmul kernels:
//   transpose=False: out[b,m,n] = sum_k x[b,m,k] * (s[b,k,n/g] * q[b,k,n] + z[b,k,n/g])   (w [K, N*bits/32])
//   transpose=True:  out[b,m,n] = sum_k x[b,m,k] * (s[b,n,k/g] * q[b,n,k] + z[b,n,k/g])   (w [N, K*bits/32])
// Pure C++ (no MLX headers) so it can be compiled twice (baseline x86-64 and AVX2+FMA) without ODR hazards.
#pragma once
#include <cstdint>

namespace lowbit {

enum DT : int { F32 = 0, F16 = 1, BF16 = 2 };

struct Args {
  int M, K, N, bits, group, transpose;
  int x_dt, s_dt, out_dt;
  int64_t batch;
  const void* x; const int64_t* x_off; int64_t x_sm, x_sk;      // element offsets / strides
  const uint32_t* w; const int64_t* w_off; int64_t w_sk, w_sj;  // w row stride, word stride
  const void* s; const int64_t* s_off; int64_t s_sk, s_sg;      // scales row stride, group stride
  const void* b; const int64_t* b_off; int64_t b_sk, b_sg;      // biases [K, N/group]
  void* out;                                                   // contiguous [batch, M, N]
  float* scratch_x; float* scratch_o;                          // [K*4], [4*N] floats
};

namespace base { void run(const Args& a); }
namespace avx2 { void run(const Args& a); }

// out[r, :] = softmax(x[r, :]) (normalize=false: e^(x[r, :] - max x[r, :])) for `rows` contiguous
// float32 rows of `n` (softmax_impl.inc)
namespace base { void softmax_rows(const float* x, float* out, int64_t rows, int64_t n, bool normalize); }
namespace avx2 { void softmax_rows(const float* x, float* out, int64_t rows, int64_t n, bool normalize); }

// rows r0 .. r1 - 1 of x [P, g, rep, n]: row (p, h, i) = the softmax over the columns j with
// head(v[p, j]) == h, 0 elsewhere (head(v) = v >> shift for v >= 0; v < 0: no head's)
namespace base { void owner_softmax_rows(const float* x, const int32_t* v, float* out, int64_t r0, int64_t r1, int64_t g, int64_t rep, int64_t n, int shift); }
namespace avx2 { void owner_softmax_rows(const float* x, const int32_t* v, float* out, int64_t r0, int64_t r1, int64_t g, int64_t rep, int64_t n, int shift); }

}  // namespace lowbit
