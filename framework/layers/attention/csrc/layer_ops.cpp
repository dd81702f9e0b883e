// Fused element-wise layers on the CPU: RMS norm (with the residual add) and SiLU-and-mul.
//
// In torch each of these is several passes over the activations (a square, a mean, an
// rsqrt, two products; a SiLU, then a product), each one a kernel launch and a trip
// through memory for a prefill's thousands of rows. Here each row is read once and
// written once, rows in parallel on torch's own threads.
//
// Numerics follow the Hugging Face layers: the norm takes its mean of squares in float32
// and multiplies by the weight last; SiLU is x / (1 + exp(-x)). Sums run in another
// order than torch's, so results agree to float rounding, not bit for bit.
//
// Built with paged_attention.cpp into one library (native_build.py); registered as
// torch.ops.framework_cpu.rms_norm, .add_rms_norm and .silu_and_mul.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

// Rows per work item: enough to amortise scheduling, few enough to split a decode batch.
constexpr int64_t kRowGrain = 16;

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": float32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": contiguous [rows, features] only");
}

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
                  weight.is_contiguous() && weight.size(0) == x.size(1),
              "rms_norm: a float32 weight of ", x.size(1), " features is needed");
}

// out = x / sqrt(mean(x^2) + eps) * weight, for one row of n features.
inline void normalize_row(const float* __restrict x, const float* __restrict weight, int64_t n,
                          float eps, float* __restrict out) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) squares += x[i] * x[i];
  const float scale = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * scale);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.size(1);
  const float* xp = x.const_data_ptr<float>();
  const float* wp = weight.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      normalize_row(xp + r * n, wp, n, static_cast<float>(eps), op + r * n);
  });
  return out;
}

// (norm(x + residual), x + residual): the pre-norm block's step into its next half.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  check_rows(residual, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes(), "add_rms_norm: x and residual differ in shape");
  at::Tensor out = at::empty_like(x);
  at::Tensor summed = at::empty_like(x);
  const int64_t n = x.size(1);
  const float* xp = x.const_data_ptr<float>();
  const float* rp = residual.const_data_ptr<float>();
  const float* wp = weight.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  float* sp = summed.mutable_data_ptr<float>();
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* s = sp + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) s[i] = xp[r * n + i] + rp[r * n + i];
      normalize_row(s, wp, n, static_cast<float>(eps), op + r * n);
    }
  });
  return {out, summed};
}

// [rows, 2d] laid out [gate | up] -> [rows, d] = silu(gate) * up.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: an even number of features is needed");
  const int64_t rows = gate_up.size(0), d = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, d}, gate_up.options());
  const float* in = gate_up.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = in + r * 2 * d;
      const float* up = gate + d;
      float* o = op + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(framework_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
}
