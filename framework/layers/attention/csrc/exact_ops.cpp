// CPU kernels whose results must be exactly torch's: the rotary embedding, bit for bit
// the "rotate half" form's, and the greedy argmax, torch's choice of index included.
//
// Rotary: each head's two halves (x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin), with the
// products rounded before the sum, as torch's separate multiply and add kernels round
// them (in bfloat16, each product and the sum rounded to bfloat16, as torch's bfloat16
// kernels round their float32 results). That is why this file is built without
// -ffast-math and with
// -ffp-contract=off (native_build.py): a fused multiply-add would round once and
// change the last bit (and -ffast-math would also drop the NaN checks of the argmax). In
// torch the same rotation is six kernels per tensor over
// the whole batch; here it is one pass, reading the rows where they are (a column
// slice of the fused qkv projection) and writing a new contiguous tensor.
//
// Argmax: the index of each row's largest value, the first one among equals, or of its
// first NaN, as torch.max(dim) picks it; in two vector passes over the row (its maximum,
// then where that is), where torch's reduction with an index runs far slower.
//
// Registered as torch.ops.framework_cpu.rotary and .argmax_rows.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "vec.h"

namespace {

constexpr int64_t kRowGrain = 16;

using framework_cpu::bf16;
using framework_cpu::round_to;
using framework_cpu::to_float;

// Rows [begin, end) of the rotation: x [rows, width] (row stride `stride`), cos and sin
// [rows, half], out [rows, width] contiguous. Each product and each sum is rounded to T.
template <typename T>
void rotate_rows(const T* xp, int64_t stride, const T* cp, const T* sp, int64_t width,
                 int64_t head_dim, T* op, int64_t begin, int64_t end) {
  const int64_t half = head_dim / 2;
  for (int64_t r = begin; r < end; ++r) {
    const T* c = cp + r * half;
    const T* s = sp + r * half;
    for (int64_t head = 0; head < width; head += head_dim) {
      const T* x1 = xp + r * stride + head;
      const T* x2 = x1 + half;
      T* o1 = op + r * width + head;
      T* o2 = o1 + half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = to_float(x1[i]), b = to_float(x2[i]);
        const float cv = to_float(c[i]), sv = to_float(s[i]);
        const float first = to_float(round_to<T>(a * cv)), second = to_float(round_to<T>(b * sv));
        o1[i] = round_to<T>(first - second);
        const float third = to_float(round_to<T>(b * cv)), fourth = to_float(round_to<T>(a * sv));
        o2[i] = round_to<T>(third + fourth);
      }
    }
  }
}

// x: [rows, heads * head_dim] with unit column stride (its rows may be further apart);
// cos, sin: [rows, head_dim / 2], of x's dtype (float32 or bfloat16). Returns the rotated
// rows, contiguous.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                  int64_t head_dim) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary: float32 or bfloat16 only, cos and sin in x's dtype");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rotary: x must be [rows, features] with "
              "contiguous features");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && x.size(1) % head_dim == 0,
              "rotary: features must be whole heads of an even head_dim");
  const int64_t rows = x.size(0), width = x.size(1), half = head_dim / 2;
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == rows && t->size(1) == half && t->is_contiguous(),
                "rotary: cos and sin must be contiguous [rows, head_dim / 2]");
  at::Tensor out = at::empty({rows, width}, x.options());
  const int64_t stride = x.stride(0);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    if (x.scalar_type() == at::kFloat) {
      rotate_rows(x.const_data_ptr<float>(), stride, cos.const_data_ptr<float>(),
                  sin.const_data_ptr<float>(), width, head_dim, out.mutable_data_ptr<float>(),
                  begin, end);
    } else {
      rotate_rows(x.const_data_ptr<bf16>(), stride, cos.const_data_ptr<bf16>(),
                  sin.const_data_ptr<bf16>(), width, head_dim, out.mutable_data_ptr<bf16>(),
                  begin, end);
    }
  });
  return out;
}

using framework_cpu::float8;
typedef int int8v __attribute__((vector_size(32)));

// The index of row x [n]'s maximum as torch.max(dim) gives it: the first NaN if there is
// one, else the first position of the largest value.
int64_t argmax_row(const float* __restrict x, int64_t n) {
  int64_t i = 0;
  float top = x[0];
  bool nan = false;
  if (n >= 8) {
    float8 best, v;
    std::memcpy(&best, x, sizeof(best));
    int8v unordered = best != best;
    for (i = 8; i + 8 <= n; i += 8) {
      std::memcpy(&v, x + i, sizeof(v));
      best = v > best ? v : best;
      unordered |= v != v;
    }
    for (int k = 0; k < 8; ++k) {
      top = best[k] > top ? best[k] : top;
      nan |= unordered[k] != 0;
    }
  }
  for (; i < n; ++i) {
    top = x[i] > top ? x[i] : top;
    nan |= x[i] != x[i];
  }
  for (int64_t j = 0; j < n; ++j)
    if (nan ? x[j] != x[j] : x[j] == top) return j;
  return 0;  // not reached
}

// x: [rows, n], float32, contiguous, n >= 1. Returns int64 [rows].
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() &&
                  x.size(1) >= 1,
              "argmax_rows: contiguous float32 [rows, n >= 1] only");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.const_data_ptr<float>();
  int64_t* op = out.mutable_data_ptr<int64_t>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * n, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(framework_cpu, m) {
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, int head_dim) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.impl("rotary", c10::DispatchKey::CPU, &rotary);
  m.impl("argmax_rows", c10::DispatchKey::CPU, &argmax_rows);
}
