// compiled with -mavx2 -mfma; only called after a runtime CPU check
#include "kernel.h"
#include <cmath>
#include <cstring>
#include <vector>
namespace lowbit { namespace avx2 {
#include "kernel_impl.inc"
#include "softmax_impl.inc"
} }
