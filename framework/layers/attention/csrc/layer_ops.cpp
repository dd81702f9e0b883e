// Fused element-wise layers on the CPU: RMS norm (with the residual add) and SiLU-and-mul,
// in float32 and bfloat16.
//
// In torch each of these is several passes over the activations (a square, a mean, an
// rsqrt, two products; a SiLU, then a product), each one a kernel launch and a trip
// through memory for a prefill's thousands of rows, and for a decode step's one row a
// few microseconds of dispatch each. Here each row is read once and written once, rows
// in parallel on torch's own threads.
//
// Numerics follow the Hugging Face layers: the norm takes its mean of squares in float32
// and multiplies by the weight last; SiLU is x / (1 + exp(-x)). Sums run in another
// order than torch's, so results agree to float rounding, not bit for bit. In bfloat16
// every step computes in float32 and rounds where torch's bfloat16 operators round
// their results: the residual sum, the normalized row before the weight, the product
// with the weight; the SiLU, then its product with the up projection.
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

#include "vec.h"

namespace {

using framework_cpu::bf16;
using framework_cpu::round_to;
using framework_cpu::to_float;

// Rows per work item: enough to amortise scheduling, few enough to split a decode batch.
constexpr int64_t kRowGrain = 16;

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": float32 or bfloat16 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": contiguous [rows, features] only");
}

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 &&
                  weight.is_contiguous() && weight.size(0) == x.size(1),
              "rms_norm: a weight of ", x.size(1), " features in the input's dtype is needed");
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

// The same in bfloat16, as Hugging Face's layer rounds it: the normalized row is rounded
// before the product with the weight, and the product again.
inline void normalize_row(const bf16* __restrict x, const bf16* __restrict weight, int64_t n,
                          float eps, bf16* __restrict out) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) squares += to_float(x[i]) * to_float(x[i]);
  const float scale = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i)
    out[i] = round_to<bf16>(to_float(weight[i]) *
                            to_float(round_to<bf16>(to_float(x[i]) * scale)));
}

template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t n = x.size(1);
  const T* xp = x.const_data_ptr<T>();
  const T* wp = weight.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      normalize_row(xp + r * n, wp, n, static_cast<float>(eps), op + r * n);
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows<float>(x, weight, eps, out);
  } else {
    rms_norm_rows<bf16>(x, weight, eps, out);
  }
  return out;
}

template <typename T>
void add_rms_norm_rows(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                       double eps, at::Tensor& out, at::Tensor& summed) {
  const int64_t n = x.size(1);
  const T* xp = x.const_data_ptr<T>();
  const T* rp = residual.const_data_ptr<T>();
  const T* wp = weight.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  T* sp = summed.mutable_data_ptr<T>();
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* s = sp + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i)
        s[i] = round_to<T>(to_float(xp[r * n + i]) + to_float(rp[r * n + i]));
      normalize_row(s, wp, n, static_cast<float>(eps), op + r * n);
    }
  });
}

// (norm(x + residual), x + residual): the pre-norm block's step into its next half.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  check_rows(residual, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: x and residual differ in shape or dtype");
  at::Tensor out = at::empty_like(x);
  at::Tensor summed = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) {
    add_rms_norm_rows<float>(x, residual, weight, eps, out, summed);
  } else {
    add_rms_norm_rows<bf16>(x, residual, weight, eps, out, summed);
  }
  return {out, summed};
}

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

// [rows, 2d] laid out [gate | up] -> [rows, d] = silu(gate) * up.
template <typename T>
void silu_and_mul_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), d = gate_up.size(1) / 2;
  const T* in = gate_up.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in + r * 2 * d;
      const T* up = gate + d;
      T* o = op + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) {
        // In bfloat16 the SiLU is rounded before the product, as torch's two operators do.
        const float activated = to_float(round_to<T>(silu(to_float(gate[i]))));
        o[i] = round_to<T>(activated * to_float(up[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: an even number of features is needed");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_and_mul_rows<float>(gate_up, out);
  } else {
    silu_and_mul_rows<bf16>(gate_up, out);
  }
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
