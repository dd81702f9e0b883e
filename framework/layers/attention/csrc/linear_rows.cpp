// y = x W^T + b for a few rows of x (a decode step of a few requests), float32 or bfloat16.
//
// With one to four rows, a product is a walk through the weight: every weight element is
// used once per row, so the time is that of reading the weight. A GEMM library's call
// costs more than that on the small layers of a decode step (oneDNN's on a packed
// weight took 40-50 us for a 256 x 256 weight that this reads in under 10), and torch's
// bfloat16 product converts on every call. Here a few output features at a time take
// their weight rows in one pass, every row of x against each, in float32 accumulators
// that are summed at the end; a bfloat16 weight is widened as it is read (two elements
// to a 32-bit lane: a shift and a mask), so it is read at half the bytes. Sums run in
// another order than a GEMM's, so results agree with F.linear to float rounding, not
// bit for bit. Output features are split over torch's threads.
//
// More rows go four at a time, each block another walk through the weight: on a CPU
// without bfloat16 instructions (no AVX512-BF16 or AMX) torch's bfloat16 GEMM is slower
// than this at every row count, so bfloat16 products of any size come here there.
//
// Built with paged_attention.cpp into one library (native_build.py); registered as
// torch.ops.framework_cpu.linear_rows.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "vec.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define FRAMEWORK_WIDE_ROWS 1
#endif

namespace {

using framework_cpu::bf16;
using framework_cpu::float8;
using framework_cpu::load8;
using framework_cpu::round_to;
using framework_cpu::sum8;
using framework_cpu::to_float;

// Rows of x per walk through the weight: the sums of a block stay in registers.
constexpr int64_t kBlockRows = 4;
// Weight elements taken per step along K: two vectors, each with its own accumulator.
constexpr int64_t kStep = 16;
// How many blocks of features ahead the weight is prefetched: a decode step's weights do
// not stay in the cache from one step to the next, and the hardware prefetcher alone
// kept the product at about 60% of the memory's rate.
constexpr int64_t kPrefetchBlocks = 2;

// Weights k..k+16 of a row as two vectors, in the order of x's float32 copy (load_x):
// a float32 row as it is, the first eight then the next; a bfloat16 row as its even
// elements, then its odd ones: each 32-bit lane holds two, so a shift and a mask widen
// them (a dot product does not mind the order of its terms).
inline void load16(const float* w, float8& a, float8& b) {
  a = load8(w);
  b = load8(w + 8);
}

inline void load16(const bf16* w, float8& a, float8& b) {
  framework_cpu::uint8v pairs;
  std::memcpy(&pairs, w, sizeof(pairs));
  const framework_cpu::uint8v even = pairs << 16, odd = pairs & 0xffff0000u;
  std::memcpy(&a, &even, sizeof(a));
  std::memcpy(&b, &odd, sizeof(b));
}

// The M rows of x [rows, K] (row stride `stride`) in float32, in the order the weight's
// loads of `step` elements give for T (0: as stored): a bfloat16 step as its even
// elements, then its odd ones.
template <typename T>
void load_x(const T* x, int64_t stride, int64_t rows, int64_t k_size, int64_t step,
            float* out) {
  for (int64_t m = 0; m < rows; ++m) {
    const T* row = x + m * stride;
    float* to = out + m * k_size;
    if (std::is_same_v<T, bf16> && step > 0) {
      for (int64_t k = 0; k < k_size; k += step)
        for (int64_t j = 0; j < step / 2; ++j) {
          to[k + j] = to_float(row[k + 2 * j]);
          to[k + step / 2 + j] = to_float(row[k + 2 * j + 1]);
        }
    } else {
      for (int64_t k = 0; k < k_size; ++k) to[k] = to_float(row[k]);
    }
  }
}

// y[m][n] for output features [n0, n0 + F) of the M rows of x (float32 [M, K] in
// load16's order, K a multiple of 16), weight W [N, K] of type T. Two accumulators per
// output, so that consecutive multiply-adds do not wait on one another.
template <typename T, int M, int F>
void features(const float* __restrict x, int64_t k_size, const T* __restrict w, int64_t n0,
              float* __restrict y, int64_t n_size) {
  float8 acc[M][F][2] = {};
  // The features' rows are contiguous, and so are those of the blocks after them: each
  // step asks for as many bytes, kPrefetchBlocks blocks ahead, as it reads (prefetching
  // past the weight's end is harmless: a prefetch never faults), into the outer caches
  // (vec.h: kWeightPrefetchLocality).
  constexpr int64_t step_bytes = F * kStep * static_cast<int64_t>(sizeof(T));
  const char* ahead = reinterpret_cast<const char*>(w + (n0 + kPrefetchBlocks * F) * k_size);
  for (int64_t k = 0; k < k_size; k += kStep) {
    const char* next = ahead + (k / kStep) * step_bytes;
    for (int64_t b = 0; b < step_bytes; b += 64)
      __builtin_prefetch(next + b, 0, framework_cpu::kWeightPrefetchLocality);
    float8 xa[M], xb[M];
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      xa[m] = load8(x + m * k_size + k);
      xb[m] = load8(x + m * k_size + k + 8);
    }
#pragma GCC unroll 4
    for (int f = 0; f < F; ++f) {
      float8 wa, wb;
      load16(w + (n0 + f) * k_size + k, wa, wb);
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        acc[m][f][0] += xa[m] * wa;
        acc[m][f][1] += xb[m] * wb;
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int f = 0; f < F; ++f) y[m * n_size + n0 + f] = sum8(acc[m][f][0] + acc[m][f][1]);
}

// All N outputs: F features at a time (fewer for more rows, to keep the sums in
// registers), split over torch's threads; the last N % F one at a time.
template <typename T, int M>
void product(const float* x, int64_t k_size, const T* w, int64_t n_size, float* y) {
  constexpr int F = M == 1 ? 4 : (M == 2 ? 2 : 1);
  const int64_t blocks = n_size / F;
  at::parallel_for(0, blocks, 64 / F, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) features<T, M, F>(x, k_size, w, b * F, y, n_size);
  });
  for (int64_t n = blocks * F; n < n_size; ++n) features<T, M, 1>(x, k_size, w, n, y, n_size);
}

// Any K: one sum per output, in order (the rare shape whose features are not a multiple
// of 16).
template <typename T>
void product_any(const float* x, int64_t rows, int64_t k_size, const T* w, int64_t n_size,
                 float* y) {
  at::parallel_for(0, n_size, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m = 0; m < rows; ++m) {
        float acc = 0.f;
        for (int64_t k = 0; k < k_size; ++k) acc += x[m * k_size + k] * to_float(w[n * k_size + k]);
        y[m * n_size + n] = acc;
      }
  });
}

#ifdef FRAMEWORK_WIDE_ROWS
// With AVX-512, a step takes 32 weight elements and a walk up to eight rows; the sums of
// a block of outputs (rows x features, at most 16) are added up together at the end
// (reduce16), since one reduction per output would cost more than a 128-wide product's
// multiply-adds.
constexpr int64_t kWideRows = 8;
constexpr int64_t kWideStep = 32;

// Weights k..k+32 of a row as two vectors, in load_x's order for kWideStep.
inline void load32(const float* w, __m512& a, __m512& b) {
  a = _mm512_loadu_ps(w);
  b = _mm512_loadu_ps(w + 16);
}

inline void load32(const bf16* w, __m512& a, __m512& b) {
  const __m512i pairs = _mm512_loadu_si512(w);
  a = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
  b = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(0xffff0000u)));
}

// How a step of the weight meets a row of x. Widened: the weight widened to float32 as
// two vectors, against x's float32 copy in load32's order, by two multiply-adds.
template <typename T>
struct Widened {
  using Weight = T;
  using X = float;
  struct Step {
    __m512 a, b;
  };
  static Step load(const T* w) {
    Step s;
    load32(w, s.a, s.b);
    return s;
  }
  static __m512 madd(__m512 acc, const float* xm, const Step& s) {
    acc = _mm512_fmadd_ps(_mm512_load_ps(xm), s.a, acc);
    return _mm512_fmadd_ps(_mm512_load_ps(xm + 16), s.b, acc);
  }
  static void copy_x(const T* x, int64_t stride, int64_t rows, int64_t k_size, float* out) {
    load_x(x, stride, rows, k_size, kWideStep, out);
  }
};

#ifdef __AVX512BF16__
// Bf16Dot: a bfloat16 weight against bfloat16 x as they are, by AVX512-BF16's dot
// product: one instruction multiplies 32 pairs exactly and adds each two neighbours'
// products into a float32 lane (denormals read as zero), where the widening walk spends
// two shifts and two multiply-adds. On the Zen 4 EPYC measured it halves the time of a
// walk of six to eight rows and takes a fifth off one row's (the default model's
// products: 73 -> 60 us for one row, 335 -> 188 us for six); on the Intel Xeon measured
// it ran at a quarter of the multiply-add rate, so it is AMD's default only.
struct Bf16Dot {
  using Weight = bf16;
  using X = bf16;
  using Step = __m512bh;
  static Step load(const bf16* w) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(w)); }
  static __m512 madd(__m512 acc, const bf16* xm, Step s) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(_mm512_load_si512(xm)), s);
  }
  static void copy_x(const bf16* x, int64_t stride, int64_t rows, int64_t k_size, bf16* out) {
    for (int64_t m = 0; m < rows; ++m) std::memcpy(out + m * k_size, x + m * stride, k_size * 2);
  }
};

// Whether bfloat16 products take Bf16Dot unless the caller says (an AMD CPU: see Bf16Dot).
bool bf16_dot_by_default() {
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
}
#endif

// Two vectors' 16 lanes each halved into 8 partial sums, side by side in one vector: the
// sum of the 128-bit quarters (halve_quarters) or of the lanes within them (halve_lanes)
// that `Low` and `High` pick (0x44 and 0xEE: the first and last pairs; 0x88 and 0xDD: the
// even and odd ones).
template <int Low, int High>
__attribute__((always_inline)) inline __m512 halve_quarters(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, Low), _mm512_shuffle_f32x4(a, b, High));
}

template <int Low, int High>
__attribute__((always_inline)) inline __m512 halve_lanes(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, Low), _mm512_shuffle_ps(a, b, High));
}

// The 16 sums of each of 16 vectors at once, into one vector: four rounds, each adding two
// halves of every pair of vectors, so that a round halves both the vectors and the
// lanes each sum still spans (15 additions and 30 shuffles, against 16 reductions of
// eight instructions each). Sum i lands in lane reduced_lane(i). The vectors come as
// values, so that they stay in registers.
__attribute__((always_inline)) inline __m512 reduce16(
    __m512 v0, __m512 v1, __m512 v2, __m512 v3, __m512 v4, __m512 v5, __m512 v6, __m512 v7,
    __m512 v8, __m512 v9, __m512 v10, __m512 v11, __m512 v12, __m512 v13, __m512 v14,
    __m512 v15) {
  const __m512 r0 = halve_quarters<0x44, 0xEE>(v0, v1), r1 = halve_quarters<0x44, 0xEE>(v2, v3),
               r2 = halve_quarters<0x44, 0xEE>(v4, v5), r3 = halve_quarters<0x44, 0xEE>(v6, v7),
               r4 = halve_quarters<0x44, 0xEE>(v8, v9), r5 = halve_quarters<0x44, 0xEE>(v10, v11),
               r6 = halve_quarters<0x44, 0xEE>(v12, v13),
               r7 = halve_quarters<0x44, 0xEE>(v14, v15);
  const __m512 s0 = halve_quarters<0x88, 0xDD>(r0, r1), s1 = halve_quarters<0x88, 0xDD>(r2, r3),
               s2 = halve_quarters<0x88, 0xDD>(r4, r5), s3 = halve_quarters<0x88, 0xDD>(r6, r7);
  const __m512 t0 = halve_lanes<0x44, 0xEE>(s0, s1), t1 = halve_lanes<0x44, 0xEE>(s2, s3);
  return halve_lanes<0x88, 0xDD>(t0, t1);
}

constexpr int reduced_lane(int i) { return (i % 4) * 4 + i / 4; }

// y[m][n] for output features [n0, n0 + F) of the M rows of x ([M, K] as Walk copies it,
// K a multiple of 32), weight W [N, K]. Each output's sum runs in one order whatever M
// and F: a verify step's logits are a plain step's to the bit.
template <typename Walk, int M, int F>
void wide_features(const typename Walk::X* __restrict x, int64_t k_size,
                   const typename Walk::Weight* __restrict w, int64_t n0, float* __restrict y,
                   int64_t n_size) {
  using T = typename Walk::Weight;
  static_assert(M * F <= 16);
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  constexpr int64_t step_bytes = F * kWideStep * static_cast<int64_t>(sizeof(T));
  const char* ahead = reinterpret_cast<const char*>(w + (n0 + kPrefetchBlocks * F) * k_size);
  for (int64_t k = 0; k < k_size; k += kWideStep) {
    const char* next = ahead + (k / kWideStep) * step_bytes;
    for (int64_t b = 0; b < step_bytes; b += 64)
      __builtin_prefetch(next + b, 0, framework_cpu::kWeightPrefetchLocality);
#pragma GCC unroll 16
    for (int f = 0; f < F; ++f) {
      const auto step = Walk::load(w + (n0 + f) * k_size + k);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m)
        acc[m * F + f] = Walk::madd(acc[m * F + f], x + m * k_size + k, step);
    }
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, reduce16(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6],
                                 acc[7], acc[8], acc[9], acc[10], acc[11], acc[12], acc[13],
                                 acc[14], acc[15]));
  for (int m = 0; m < M; ++m)
    for (int f = 0; f < F; ++f) y[m * n_size + n0 + f] = sums[reduced_lane(m * F + f)];
}

// All N outputs of M rows: F = 16 / M features at a time, split over torch's threads; the
// last N % F one at a time.
template <typename Walk, int M>
void wide_product(const typename Walk::X* x, int64_t k_size, const typename Walk::Weight* w,
                  int64_t n_size, float* y) {
  constexpr int F = 16 / M;
  const int64_t blocks = n_size / F;
  at::parallel_for(0, blocks, std::max(1, 64 / F), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      wide_features<Walk, M, F>(x, k_size, w, b * F, y, n_size);
  });
  for (int64_t n = blocks * F; n < n_size; ++n)
    wide_features<Walk, M, 1>(x, k_size, w, n, y, n_size);
}

// yf [rows, N] float32 = x W^T for K a multiple of kWideStep: x copied once as the walk
// reads it, then walks of up to kWideRows rows.
template <typename Walk, typename T = typename Walk::Weight>
void wide_rows(const T* x, int64_t x_stride, int64_t rows, int64_t k_size, const T* w,
               int64_t n_size, float* yf) {
  using X = typename Walk::X;
  // Aligned to a cache line, so that no vector of x straddles two (K is a multiple of 32).
  std::vector<__m512> xv(static_cast<size_t>(rows * k_size * sizeof(X) / 64));
  X* xc = reinterpret_cast<X*>(xv.data());
  Walk::copy_x(x, x_stride, rows, k_size, xc);
  for (int64_t r0 = 0; r0 < rows; r0 += kWideRows) {
    const X* xb = xc + r0 * k_size;
    float* yb = yf + r0 * n_size;
    switch (std::min(kWideRows, rows - r0)) {
      case 1: wide_product<Walk, 1>(xb, k_size, w, n_size, yb); break;
      case 2: wide_product<Walk, 2>(xb, k_size, w, n_size, yb); break;
      case 3: wide_product<Walk, 3>(xb, k_size, w, n_size, yb); break;
      case 4: wide_product<Walk, 4>(xb, k_size, w, n_size, yb); break;
      case 5: wide_product<Walk, 5>(xb, k_size, w, n_size, yb); break;
      case 6: wide_product<Walk, 6>(xb, k_size, w, n_size, yb); break;
      case 7: wide_product<Walk, 7>(xb, k_size, w, n_size, yb); break;
      default: wide_product<Walk, 8>(xb, k_size, w, n_size, yb); break;
    }
  }
}
#endif

// yf [rows, N] float32 = x W^T: x widened to float32 once, then walks of kBlockRows rows.
template <typename T>
void widened_rows(const T* x, int64_t x_stride, int64_t rows, int64_t k_size, const T* w,
                  int64_t n_size, float* yf) {
  const bool in_steps = k_size % kStep == 0;
  std::vector<float> xf(static_cast<size_t>(rows * k_size));
  load_x(x, x_stride, rows, k_size, in_steps ? kStep : 0, xf.data());
  for (int64_t r0 = 0; r0 < rows; r0 += kBlockRows) {
    const int64_t block = std::min(kBlockRows, rows - r0);
    const float* xb = xf.data() + r0 * k_size;
    float* yb = yf + r0 * n_size;
    if (!in_steps) {
      product_any(xb, block, k_size, w, n_size, yb);
    } else if (block == 1) {
      product<T, 1>(xb, k_size, w, n_size, yb);
    } else if (block == 2) {
      product<T, 2>(xb, k_size, w, n_size, yb);
    } else if (block == 3) {
      product<T, 3>(xb, k_size, w, n_size, yb);
    } else {
      product<T, 4>(xb, k_size, w, n_size, yb);
    }
  }
}

template <typename T>
at::Tensor linear_rows_typed(const at::Tensor& x, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias, bool dot) {
  const int64_t rows = x.size(0), k_size = x.size(1), n_size = weight.size(0);
  // The products in float32, then bias and rounding.
  std::vector<float> yf(static_cast<size_t>(rows * n_size));
  const T* xp = x.const_data_ptr<T>();
  const T* wp = weight.const_data_ptr<T>();
#ifdef FRAMEWORK_WIDE_ROWS
  if (k_size % kWideStep != 0) {
    widened_rows(xp, x.stride(0), rows, k_size, wp, n_size, yf.data());
#ifdef __AVX512BF16__
  } else if constexpr (std::is_same_v<T, bf16>) {
    if (dot)
      wide_rows<Bf16Dot>(xp, x.stride(0), rows, k_size, wp, n_size, yf.data());
    else
      wide_rows<Widened<T>>(xp, x.stride(0), rows, k_size, wp, n_size, yf.data());
#endif
  } else {
    wide_rows<Widened<T>>(xp, x.stride(0), rows, k_size, wp, n_size, yf.data());
  }
#else
  widened_rows(xp, x.stride(0), rows, k_size, wp, n_size, yf.data());
#endif
  at::Tensor out = at::empty({rows, n_size}, x.options());
  T* op = out.mutable_data_ptr<T>();
  const T* bp = bias ? bias->const_data_ptr<T>() : nullptr;
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t n = 0; n < n_size; ++n) {
      const float value = yf[m * n_size + n] + (bp ? to_float(bp[n]) : 0.f);
      op[m * n_size + n] = round_to<T>(value);
    }
  return out;
}

// x: [rows, K] with contiguous features; weight: [N, K] contiguous; bias: [N] or
// None; all of one dtype, float32 or bfloat16. Returns [rows, N] in that dtype.
// bf16_dot: whether bfloat16 products (K a multiple of 32) take AVX512-BF16's dot
// product (Bf16Dot) rather than the widening walk; None: the CPU's default.
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, std::optional<bool> bf16_dot) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "linear_rows: float32 or bfloat16 only");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.stride(1) == 1,
              "linear_rows: x must be [rows, K] with contiguous features");
  TORCH_CHECK(weight.scalar_type() == dtype && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.size(1) == x.size(1),
              "linear_rows: weight must be contiguous [N, ", x.size(1), "] of x's dtype");
  if (bias)
    TORCH_CHECK(bias->scalar_type() == dtype && bias->dim() == 1 && bias->is_contiguous() &&
                    bias->size(0) == weight.size(0),
                "linear_rows: bias must be contiguous [", weight.size(0), "] of x's dtype");
#ifdef __AVX512BF16__
  const bool dot = bf16_dot.value_or(bf16_dot_by_default());
#else
  TORCH_CHECK(!bf16_dot.value_or(false), "linear_rows: bf16_dot needs a CPU with AVX512-BF16");
  const bool dot = false;
#endif
  TORCH_CHECK(!(dot && bf16_dot && dtype != at::kBFloat16),
              "linear_rows: bf16_dot is for bfloat16 products");
  if (dtype == at::kFloat) return linear_rows_typed<float>(x, weight, bias, false);
  return linear_rows_typed<bf16>(x, weight, bias, dot);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(framework_cpu, m) {
  m.def("linear_rows(Tensor x, Tensor weight, Tensor? bias, bool? bf16_dot=None) -> Tensor");
  m.impl("linear_rows", c10::DispatchKey::CPU, &linear_rows);
}
