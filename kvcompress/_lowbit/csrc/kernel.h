// Few-row affine quantized matmul kernel (transpose=False): out[b,m,n] = sum_k x[b,m,k] * (s[b,k,n/g] * q[b,k,n] + z[b,k,n/g])
// Pure C++ (no MLX headers) so it can be compiled twice (baseline x86-64 and AVX2+FMA) without ODR hazards.
#pragma once
#include <cstdint>

namespace lowbit {

enum DT : int { F32 = 0, F16 = 1, BF16 = 2 };

struct Args {
  int M, K, N, bits, group;
  int x_dt, s_dt, out_dt;
  int64_t batch;
  const void* x; const int64_t* x_off; int64_t x_sm, x_sk;      // element offsets / strides
  const uint32_t* w; const int64_t* w_off; int64_t w_sk, w_sj;  // w [K, N*bits/32]
  const void* s; const int64_t* s_off; int64_t s_sk, s_sg;      // scales [K, N/group]
  const void* b; const int64_t* b_off; int64_t b_sk, b_sg;      // biases [K, N/group]
  void* out;                                                   // contiguous [batch, M, N]
  float* scratch_x; float* scratch_o;                          // [K*4], [4*N] floats
};

namespace base { void run(const Args& a); }
namespace avx2 { void run(const Args& a); }

}  // namespace lowbit
