#include "kernel.h"
#include <cmath>
#include <cstring>
#include <vector>
#define LOWBIT_LUT 1
namespace lowbit { namespace base {
#include "kernel_impl.inc"
#include "softmax_impl.inc"
} }
