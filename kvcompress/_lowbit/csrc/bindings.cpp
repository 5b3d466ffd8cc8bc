// A few-row CPU drop-in for mx.quantized_matmul(x, w, scales, biases, transpose=False) (affine).
#include <nanobind/nanobind.h>
#include <nanobind/stl/variant.h>

#include "op.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_lowbit_qmm, m) {
  m.doc() = "CPU kernels for MLX: few-row quantized_matmul (either transpose), float32 row softmaxes";
  m.def("qmm", &lowbit::qmm_few_rows, "x"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a = 64, "bits"_a = 4,
        nb::kw_only(), "transpose"_a = false, "stream"_a = nb::none(),
        "quantized_matmul(x, w, scales, biases, transpose, group_size, bits) for few rows of x");
  m.def("softmax", &lowbit::softmax_last, "x"_a, nb::kw_only(), "normalize"_a = true, "stream"_a = nb::none(),
        "softmax(x, axis=-1) for float32 x on the CPU (vectorised exp); normalize=False: exp(x - max x)");
  m.def("owner_softmax", &lowbit::owner_softmax, "x"_a, "v"_a, nb::kw_only(), "shift"_a = 0, "stream"_a = nb::none(),
        "softmax of x [..., g, rep, T] per head h over the columns j with head(v[..., j]) == h");
  m.def("has_avx2", &lowbit::has_avx2);
}
