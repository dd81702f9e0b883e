// Rotary position embeddings on the CPU, bit for bit those of the "rotate half" form.
//
// Each head's two halves (x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin), with the
// products rounded before the sum, as torch's separate multiply and add kernels round
// them. That is why this file is built without -ffast-math and with
// -ffp-contract=off (native_build.py): a fused multiply-add would round once and
// change the last bit. In torch the same rotation is six kernels per tensor over
// the whole batch; here it is one pass, reading the rows where they are (a column
// slice of the fused qkv projection) and writing a new contiguous tensor.
//
// Registered as torch.ops.framework_cpu.rotary.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>

namespace {

constexpr int64_t kRowGrain = 16;

// x: [rows, heads * head_dim] with unit column stride (its rows may be further apart);
// cos, sin: [rows, head_dim / 2]. Returns the rotated rows, contiguous.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                  int64_t head_dim) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "rotary: float32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rotary: x must be [rows, features] with "
              "contiguous features");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && x.size(1) % head_dim == 0,
              "rotary: features must be whole heads of an even head_dim");
  const int64_t rows = x.size(0), width = x.size(1), half = head_dim / 2;
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == rows && t->size(1) == half && t->is_contiguous(),
                "rotary: cos and sin must be contiguous [rows, head_dim / 2]");
  at::Tensor out = at::empty({rows, width}, x.options());
  const float* xp = x.const_data_ptr<float>();
  const float* cp = cos.const_data_ptr<float>();
  const float* sp = sin.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + r * half;
      const float* s = sp + r * half;
      for (int64_t head = 0; head < width; head += head_dim) {
        const float* x1 = xp + r * stride + head;
        const float* x2 = x1 + half;
        float* o1 = op + r * width + head;
        float* o2 = o1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float first = x1[i] * c[i], second = x2[i] * s[i];
          o1[i] = first - second;
          const float third = x2[i] * c[i], fourth = x1[i] * s[i];
          o2[i] = third + fourth;
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(framework_cpu, m) {
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, int head_dim) -> Tensor");
  m.impl("rotary", c10::DispatchKey::CPU, &rotary);
}
