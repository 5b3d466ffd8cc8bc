#include "op.h"

#include <memory>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "kernel.h"
#include "mlx/backend/cpu/encoder.h"

namespace lowbit {

bool has_avx2() {
  static const bool ok = [] {
    if (const char* e = std::getenv("KVCOMPRESS_LOWBIT_NO_AVX2"); e && *e && *e != '0') return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return ok;
}

static int dt_code(mx::Dtype d) {
  if (d == mx::float32) return F32;
  if (d == mx::float16) return F16;
  if (d == mx::bfloat16) return BF16;
  throw std::invalid_argument("[qmm_few_rows] only float32/float16/bfloat16 are supported");
}

mx::array qmm_few_rows(const mx::array& x, const mx::array& w, const mx::array& scales,
                       const mx::array& biases, int group_size, int bits, bool transpose, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu)
    return mx::quantized_matmul(x, w, scales, biases, transpose, group_size, bits, "affine", s);
  auto fail = [&](const std::string& m) { throw std::invalid_argument("[qmm_few_rows] " + m); };
  if (bits != 2 && bits != 4 && bits != 8) fail("bits must be 2, 4 or 8");
  if (group_size != 32 && group_size != 64 && group_size != 128) fail("group_size must be 32, 64 or 128");
  if (w.dtype() != mx::uint32) fail("w must be uint32");
  if (w.ndim() < 2 || scales.ndim() < 2 || x.ndim() < 1) fail("w/scales need >= 2 dims");
  if (scales.shape() != biases.shape()) fail("scales and biases must have the same shape");
  if (scales.dtype() != biases.dtype()) fail("scales and biases must have the same dtype");
  if (!std::equal(w.shape().begin(), w.shape().end() - 1, scales.shape().begin()) || w.ndim() != scales.ndim())
    fail("w and scales batch/row shapes differ");
  int packed = w.shape(-1) * 32 / bits;  // entries per row of w
  int K = transpose ? packed : w.shape(-2), N = transpose ? w.shape(-2) : packed;
  if (scales.shape(-1) * group_size != packed) fail("w and scales shapes incompatible with group_size/bits");
  if (x.shape(-1) != K)
    fail(transpose ? "last dim of x must equal the entries of a row of w (transpose=True)"
                   : "last dim of x must equal w.shape(-2) (transpose=False)");
  auto dtype = mx::promote_types(x.dtype(), scales.dtype());
  dt_code(dtype); dt_code(x.dtype()); dt_code(scales.dtype());
  std::vector<mx::array> inputs = {x, w, scales, biases};
  if (x.ndim() > 2 && w.ndim() > 2) {  // broadcast the batch dims, like mx::quantized_matmul
    mx::Shape xb(x.shape().begin(), x.shape().end() - 2), wb(w.shape().begin(), w.shape().end() - 2);
    auto bs = mx::broadcast_shapes(xb, wb);
    for (auto& a : inputs) {
      mx::Shape sh = bs;
      sh.push_back(a.shape(-2));
      sh.push_back(a.shape(-1));
      if (sh != a.shape()) a = mx::broadcast_to(a, sh, stream);
    }
  }
  auto out_shape = inputs[0].shape();
  out_shape.back() = N;
  return mx::array(std::move(out_shape), dtype, std::make_shared<LowbitQmm>(stream, group_size, bits, transpose),
                   std::move(inputs));
}

// element offsets of each batch entry (leading dims of `a` over the output's batch shape)
static std::vector<int64_t> batch_offsets(const mx::array& a, const mx::array& out, int64_t batch) {
  std::vector<int64_t> off(batch, 0);
  int nb = (int)out.ndim() - 2;
  if ((int)a.ndim() != (int)out.ndim() || nb <= 0) return off;  // 2-D operand: shared by every batch
  for (int64_t i = 0; i < batch; i++) {
    int64_t r = i, o = 0;
    for (int d = nb - 1; d >= 0; d--) {
      o += (r % out.shape(d)) * a.strides()[d];
      r /= out.shape(d);
    }
    off[i] = o;
  }
  return off;
}

void LowbitQmm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& x = inputs[0];
  auto& w = inputs[1];
  auto& s = inputs[2];
  auto& b = inputs[3];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(x);
  enc.set_input_array(w);
  enc.set_input_array(s);
  enc.set_input_array(b);
  enc.set_output_array(out);

  Args a{};
  a.transpose = transpose_ ? 1 : 0;
  a.K = transpose_ ? w.shape(-1) * 32 / bits_ : w.shape(-2);
  a.N = out.shape(-1);
  a.M = x.ndim() > 1 ? x.shape(-2) : 1;
  a.bits = bits_;
  a.group = group_size_;
  a.x_dt = dt_code(x.dtype());
  a.s_dt = dt_code(s.dtype());
  a.out_dt = dt_code(out.dtype());
  a.batch = out.size() / ((int64_t)a.M * a.N);
  if (out.size() == 0) return;
  auto st = [](const mx::array& v, int back) -> int64_t { return v.ndim() >= back ? v.strides()[v.ndim() - back] : 0; };
  a.x_sk = st(x, 1);
  a.x_sm = st(x, 2);
  a.w_sj = st(w, 1);
  a.w_sk = st(w, 2);
  a.s_sg = st(s, 1);
  a.s_sk = st(s, 2);
  a.b_sg = st(b, 1);
  a.b_sk = st(b, 2);
  // x with ndim==2 and batched w: mx.quantized_matmul uses batch 0 of w (out is 2-D) -> offsets 0
  auto xo = std::make_shared<std::vector<int64_t>>(batch_offsets(x, out, a.batch));
  auto wo = std::make_shared<std::vector<int64_t>>(batch_offsets(w, out, a.batch));
  auto so = std::make_shared<std::vector<int64_t>>(batch_offsets(s, out, a.batch));
  auto bo = std::make_shared<std::vector<int64_t>>(batch_offsets(b, out, a.batch));
  // data pointers include each array's own offset
  a.x = x.data<void>();
  a.w = w.data<uint32_t>();
  a.s = s.data<void>();
  a.b = b.data<void>();
  a.out = out.data<void>();
  enc.dispatch([a, xo, wo, so, bo]() mutable {
    std::vector<float> sx((size_t)a.K * 4), so_((size_t)a.N * 4);  // 4 rows of x, 4 rows of output
    a.x_off = xo->data();
    a.w_off = wo->data();
    a.s_off = so->data();
    a.b_off = bo->data();
    a.scratch_x = sx.data();
    a.scratch_o = so_.data();
    if (has_avx2()) avx2::run(a);
    else base::run(a);
  });
}

void LowbitQmm::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[qmm_few_rows] no GPU implementation");
}

bool LowbitQmm::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const LowbitQmm&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && transpose_ == o.transpose_;
}

std::vector<mx::Shape> LowbitQmm::output_shapes(const std::vector<mx::array>& inputs) {
  auto sh = inputs[0].shape();
  sh.back() = transpose_ ? inputs[1].shape(-2) : inputs[1].shape(-1) * 32 / bits_;
  return {sh};
}

mx::array softmax_last(const mx::array& x, bool normalize, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu || x.dtype() != mx::float32 || x.ndim() == 0) {
    if (normalize) return mx::softmax(x, std::vector<int>{-1}, false, s);
    return mx::exp(mx::subtract(x, mx::max(x, -1, true, s), s), s);
  }
  auto xc = mx::contiguous(x, false, stream);
  return mx::array(xc.shape(), mx::float32, std::make_shared<RowSoftmax>(stream, normalize), {xc});
}

//: elements from which the rows are split over threads (below, one thread: no start-up cost)
constexpr int64_t SOFTMAX_THREADS_FROM = 1 << 17;

// run(r0, r1) over `rows` rows of `n` elements: on this thread, or split over up to 8 threads
// for large inputs
template <class Run>
static void split_rows(int64_t rows, int64_t n, const Run& run) {
  int64_t parts = 1;
  if (rows * n >= SOFTMAX_THREADS_FROM)
    parts = std::min<int64_t>({rows, (int64_t)std::max(1u, std::thread::hardware_concurrency()), 8});
  if (parts <= 1) return run(0, rows);
  std::vector<std::thread> workers;
  for (int64_t p = 1; p < parts; p++) workers.emplace_back(run, rows * p / parts, rows * (p + 1) / parts);
  run(0, rows / parts);
  for (auto& w : workers) w.join();
}

// rows are read before they are written (max, then e^(x - max) in place): the logits' buffer
// serves as the output when nothing else holds it, so a softmax allocates nothing
static void reuse_or_allocate(const mx::array& x, mx::array& out) {
  if (x.is_donatable() && x.flags().row_contiguous && x.nbytes() == out.nbytes()) out.copy_shared_buffer(x);
  else out.set_data(mx::allocator::malloc(out.nbytes()));
}

void RowSoftmax::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& x = inputs[0];
  reuse_or_allocate(x, out);
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(x);
  enc.set_output_array(out);
  int64_t n = x.shape(-1);
  if (out.size() == 0 || n == 0) return;
  int64_t rows = x.size() / n;
  const float* xp = x.data<float>();
  float* op = out.data<float>();
  bool norm = normalize_;
  enc.dispatch([xp, op, rows, n, norm]() {
    auto run = [&](int64_t r0, int64_t r1) {
      if (has_avx2()) avx2::softmax_rows(xp + r0 * n, op + r0 * n, r1 - r0, n, norm);
      else base::softmax_rows(xp + r0 * n, op + r0 * n, r1 - r0, n, norm);
    };
    split_rows(rows, n, run);
  });
}

void RowSoftmax::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[softmax_last] no GPU implementation");
}

static mx::array heads_of(const mx::array& v, int shift, mx::Stream s) {
  auto h = mx::right_shift(v, mx::array(shift, mx::int32), s);
  return mx::where(mx::greater_equal(v, mx::array(0, mx::int32), s), h, mx::array(-1, mx::int32), s);
}

mx::array owner_softmax(const mx::array& x, const mx::array& v, int shift, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  auto fail = [](const std::string& m) { throw std::invalid_argument("[owner_softmax] " + m); };
  if (x.ndim() < 3) fail("x must be [..., g, rep, T]");
  if (v.ndim() != x.ndim() - 2 || !std::equal(v.shape().begin(), v.shape().end() - 1, x.shape().begin()) ||
      v.shape(-1) != x.shape(-1))
    fail("v must be [..., T] with x's leading dims and T");
  if (v.dtype() != mx::int32) fail("v must be int32");
  if (shift < 0 || shift > 30) fail("shift must be in 0 .. 30");
  if (stream.device != mx::Device::cpu || x.dtype() != mx::float32) {
    int g = x.shape(-3);
    auto sh = v.shape();
    sh.insert(sh.end() - 1, {1, 1});
    auto h = mx::reshape(heads_of(v, shift, stream), sh, stream);  // [..., 1, 1, T]
    auto own = mx::equal(h, mx::reshape(mx::arange(g, mx::int32, stream), {g, 1, 1}, stream), stream);
    auto xm = mx::where(own, x, mx::array(-INFINITY, x.dtype()), stream);
    return mx::softmax(xm, std::vector<int>{-1}, true, stream);
  }
  auto xc = mx::contiguous(x, false, stream);
  auto vc = mx::contiguous(v, false, stream);
  return mx::array(xc.shape(), mx::float32, std::make_shared<OwnerSoftmax>(stream, shift), {xc, vc});
}

void OwnerSoftmax::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& x = inputs[0];
  auto& v = inputs[1];
  reuse_or_allocate(x, out);
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(x);
  enc.set_input_array(v);
  enc.set_output_array(out);
  int64_t n = x.shape(-1), g = x.shape(-3), rep = x.shape(-2);
  if (out.size() == 0 || n == 0) return;
  int64_t rows = x.size() / n;
  const float* xp = x.data<float>();
  const int32_t* vp = v.data<int32_t>();
  float* op = out.data<float>();
  int shift = shift_;
  enc.dispatch([xp, vp, op, rows, n, g, rep, shift]() {
    auto run = [&](int64_t r0, int64_t r1) {
      if (has_avx2()) avx2::owner_softmax_rows(xp, vp, op, r0, r1, g, rep, n, shift);
      else base::owner_softmax_rows(xp, vp, op, r0, r1, g, rep, n, shift);
    };
    split_rows(rows, n, run);
  });
}

void OwnerSoftmax::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[owner_softmax] no GPU implementation");
}

}  // namespace lowbit
