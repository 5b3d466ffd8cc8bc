#pragma once
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace lowbit {

// Drop-in for mx::quantized_matmul(x, w, scales, biases, transpose, group_size, bits, "affine")
// on the CPU: unpacks each tile of codes once for up to 4 rows of x.
mx::array qmm_few_rows(const mx::array& x, const mx::array& w, const mx::array& scales,
                       const mx::array& biases, int group_size, int bits, bool transpose = false,
                       mx::StreamOrDevice s = {});

bool has_avx2();

// softmax(x, axis=-1) for float32 x on the CPU: one pass of vectorised exp per row (MLX's CPU
// exp is scalar), rows split over threads when there are many.
// normalize=false: e^(x - max x) per row, unnormalised.
mx::array softmax_last(const mx::array& x, bool normalize = true, mx::StreamOrDevice s = {});

class RowSoftmax : public mx::UnaryPrimitive {
 public:
  RowSoftmax(mx::Stream stream, bool normalize) : mx::UnaryPrimitive(stream), normalize_(normalize) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "RowSoftmax"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return normalize_ == static_cast<const RowSoftmax&>(other).normalize_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  bool normalize_;
};

// The softmax of each query head over its own KV head's slots of a head-group row: x float32
// [..., g, rep, T] (the row's g KV heads, rep query heads each), v int32 [..., T] (the leading
// dims as x's); row (.., h, i) = softmax over the columns j with head(v[.., j]) == h, 0 elsewhere,
// head(v) = v >> shift for v >= 0 (v < 0: an empty slot, no head's).
mx::array owner_softmax(const mx::array& x, const mx::array& v, int shift = 0, mx::StreamOrDevice s = {});

class OwnerSoftmax : public mx::UnaryPrimitive {
 public:
  OwnerSoftmax(mx::Stream stream, int shift) : mx::UnaryPrimitive(stream), shift_(shift) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "OwnerSoftmax"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return shift_ == static_cast<const OwnerSoftmax&>(other).shift_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  int shift_;
};

class LowbitQmm : public mx::UnaryPrimitive {
 public:
  LowbitQmm(mx::Stream stream, int group_size, int bits, bool transpose = false)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits), transpose_(transpose) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "LowbitQmm"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int group_size_, bits_;
  bool transpose_;
};

}  // namespace lowbit
