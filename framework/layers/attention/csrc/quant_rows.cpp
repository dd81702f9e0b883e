// y = x W^T for some rows of x (a decode step of some requests), W held quantized:
// int8 or FP8 E4M3 bytes with one scale per output feature, or 4-bit codes (two to a
// byte) with a scale and a zero term per group of input features.
//
// As in linear_rows.cpp, a product of a few rows is a walk through the weight, bound by
// reading it; here the weight is read in its quantized bytes (a quarter or an eighth of
// float32's) and widened to float32 in registers, never in memory. Rows go four at a
// time through a block of output features while its weight rows are in the cache. The sums
// run over codes: for each output feature and group, sum_k x_k q_k in float32
// accumulators, then scale * sum - zero * sum_k x_k (the zero term from the group's sum
// of x, computed once per call). Results agree with a float32 product on the
// dequantized weight to float rounding.
//
// Widening, eight codes at a time:
//  * int8: sign-extend to 32 bits, convert to float;
//  * 4-bit: a byte holds input features 2j (low nibble) and 2j + 1 (high), so eight
//    bytes widen to 32-bit lanes and give the even features (mask) and the odd ones
//    (shift): x's float32 copy is put in that order, as linear_rows does for bfloat16;
//  * FP8 E4M3: the byte's sign to bit 15 of a float16 and its exponent and mantissa to
//    bits 7-13 make a float16 equal to the value times 2^-8 (subnormals included), which
//    the F16C instruction widens; the caller's scales carry the 2^8.
//
// Built with the other kernels into one library (native_build.py); registered as
// torch.ops.framework_cpu.int8_rows, int4_rows and fp8_rows.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace {

using framework_cpu::float8;
using framework_cpu::load8;
using framework_cpu::sum8;

typedef int8_t int8x8 __attribute__((vector_size(8)));
typedef uint8_t uint8x8 __attribute__((vector_size(8)));
typedef int16_t int16x8 __attribute__((vector_size(16)));
typedef int32_t int32x8 __attribute__((vector_size(32)));

// Rows of x multiplied together: their sums stay in registers.
constexpr int64_t kMaxRows = 4;
// Output features per block: the weight rows every block of rows multiplies in turn.
constexpr int64_t kBlock = 4;
// Input features taken per step: sixteen codes, two vectors of eight.
constexpr int64_t kStep = 16;
// Blocks of features prefetched ahead (see linear_rows.cpp: the weights of a decode step
// are not in the cache, and the hardware prefetcher alone falls short of the memory's rate).
constexpr int64_t kPrefetchBlocks = 2;

// Widening with AVX2 intrinsics where the machine has them: GCC turns the portable
// conversions of 8-bit vectors below into scalar code (one byte at a time), a third of the
// intrinsics' speed.
#if defined(__AVX2__) && defined(__F16C__)
inline float8 to_float8(__m256 v) {
  float8 out;
  std::memcpy(&out, &v, sizeof(out));
  return out;
}

inline __m128i load_bytes8(const void* p) {
  return _mm_loadl_epi64(static_cast<const __m128i*>(p));
}

// Eight int8 codes as floats.
inline float8 widen_int8(const int8_t* p) {
  return to_float8(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load_bytes8(p))));
}

// Eight E4M3 codes as floats times 2^-8 (module notes). Sign extension fills bits 8-15
// with the sign: after the shift bit 15 holds it and bit 14 must be cleared.
inline float8 widen_fp8(const int8_t* p) {
  const __m128i wide = _mm_cvtepi8_epi16(load_bytes8(p));
  const __m128i bits = _mm_and_si128(_mm_slli_epi16(wide, 7), _mm_set1_epi16(~0x4000));
  return to_float8(_mm256_cvtph_ps(bits));
}

// Sixteen 4-bit codes (eight bytes): the low nibbles, then the high ones, as floats.
inline void widen_nibbles(const uint8_t* p, float8& low, float8& high) {
  const __m256i wide = _mm256_cvtepu8_epi32(load_bytes8(p));
  low = to_float8(_mm256_cvtepi32_ps(_mm256_and_si256(wide, _mm256_set1_epi32(0xf))));
  high = to_float8(_mm256_cvtepi32_ps(_mm256_srli_epi32(wide, 4)));
}
#else
inline float8 widen_int8(const int8_t* p) {
  int8x8 codes;
  std::memcpy(&codes, p, sizeof(codes));
  return __builtin_convertvector(__builtin_convertvector(codes, int32x8), float8);
}

inline float8 widen_fp8(const int8_t* p) {
  int8x8 codes;
  std::memcpy(&codes, p, sizeof(codes));
  const int16x8 bits = (__builtin_convertvector(codes, int16x8) << 7) &
                       static_cast<int16_t>(~0x4000);
  float8 out;
  for (int i = 0; i < 8; ++i)
    out[i] = static_cast<float>(c10::Half(static_cast<uint16_t>(bits[i]), c10::Half::from_bits()));
  return out;
}

inline void widen_nibbles(const uint8_t* p, float8& low, float8& high) {
  uint8x8 bytes;
  std::memcpy(&bytes, p, sizeof(bytes));
  const int32x8 wide = __builtin_convertvector(bytes, int32x8);
  low = __builtin_convertvector(wide & 0xf, float8);
  high = __builtin_convertvector(wide >> 4, float8);
}
#endif

// The weight formats: how sixteen codes of a feature's row are read (two vectors, in the
// order of x's copy), and each feature's scale and zero term per group.
// One byte a code (int8, or FP8 E4M3 whose scales carry 2^8), widened by Widen.
template <float8 (*Widen)(const int8_t*)>
struct ByteCodes {
  static constexpr int64_t kBytesPerStep = kStep;
  static constexpr bool kPairs = false;  // x in its own order
  const int8_t* codes;
  int64_t row_bytes;
  const float* scales;  // [N]
  const float* zeros = nullptr;
  void load16(int64_t n, int64_t k, float8& a, float8& b) const {
    const int8_t* p = codes + n * row_bytes + k;
    a = Widen(p);
    b = Widen(p + 8);
  }
};
using Int8Codes = ByteCodes<widen_int8>;
using Fp8Codes = ByteCodes<widen_fp8>;

struct Int4Codes {
  static constexpr int64_t kBytesPerStep = kStep / 2;
  static constexpr bool kPairs = true;  // x's even features, then its odd ones, per step
  const uint8_t* codes;
  int64_t row_bytes;
  const float* scales;  // [N, groups]
  const float* zeros;   // [N, groups]: zero point times scale
  void load16(int64_t n, int64_t k, float8& a, float8& b) const {
    widen_nibbles(codes + n * row_bytes + k / 2, a, b);
  }
};

// Rows of x [rows, K] as float32 (copied), in the order the codes are read, and each
// row's sum over each group of `group` features.
void load_x(const float* x, int64_t rows, int64_t k_size, bool pairs, int64_t group,
            float* out, float* group_sums) {
  const int64_t groups = k_size / group;
  for (int64_t m = 0; m < rows; ++m) {
    const float* row = x + m * k_size;
    float* to = out + m * k_size;
    if (pairs) {
      for (int64_t k = 0; k < k_size; k += kStep)
        for (int64_t j = 0; j < kStep / 2; ++j) {
          to[k + j] = row[k + 2 * j];
          to[k + kStep / 2 + j] = row[k + 2 * j + 1];
        }
    } else {
      std::memcpy(to, row, sizeof(float) * k_size);
    }
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) sum += row[k];
      group_sums[m * groups + g] = sum;
    }
  }
}

// y[m][n] for output features [n0, n0 + F) of the M rows of x. Per group, two
// accumulators per output (consecutive multiply-adds do not wait on one another), added
// into a vector total at the group's scale; the zero terms are summed apart, and each
// total is reduced to one float at the end.
template <typename Codes, int M, int F>
void features(const float* __restrict x, const float* __restrict group_sums, int64_t k_size,
              int64_t group, const Codes& w, int64_t n0, float* __restrict y, int64_t n_size) {
  const int64_t groups = k_size / group;
  float8 total[M][F] = {};
  float zero_total[M][F] = {};
  const char* base = reinterpret_cast<const char*>(w.codes);
  const char* ahead = base + (n0 + kPrefetchBlocks * F) * w.row_bytes;
  for (int64_t g = 0; g < groups; ++g) {
    float8 acc[M][F][2] = {};
    for (int64_t k = g * group; k < (g + 1) * group; k += kStep) {
      // The features' rows are contiguous, as are the blocks' after them: one step's bytes,
      // kPrefetchBlocks blocks ahead, non-temporal (a weight is read once a step).
      const char* next = ahead + (k / kStep) * F * Codes::kBytesPerStep;
      for (int64_t b = 0; b < F * Codes::kBytesPerStep; b += 64) __builtin_prefetch(next + b, 0, 0);
      float8 xa[M], xb[M];
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        xa[m] = load8(x + m * k_size + k);
        xb[m] = load8(x + m * k_size + k + 8);
      }
#pragma GCC unroll 4
      for (int f = 0; f < F; ++f) {
        float8 wa, wb;
        w.load16(n0 + f, k, wa, wb);
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) {
          acc[m][f][0] += xa[m] * wa;
          acc[m][f][1] += xb[m] * wb;
        }
      }
    }
    for (int f = 0; f < F; ++f) {
      const float8 scale = framework_cpu::splat8(w.scales[(n0 + f) * groups + g]);
      const float zero = w.zeros ? w.zeros[(n0 + f) * groups + g] : 0.f;
      for (int m = 0; m < M; ++m) {
        total[m][f] += (acc[m][f][0] + acc[m][f][1]) * scale;
        zero_total[m][f] += zero * group_sums[m * groups + g];
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int f = 0; f < F; ++f) y[m * n_size + n0 + f] = sum8(total[m][f]) - zero_total[m][f];
}

// Output features [n0, n0 + count) of the M rows of x: F at a time (fewer for more
// rows, to keep the sums in registers), the last count % F one at a time.
template <typename Codes, int M>
void rows_block(const float* x, const float* group_sums, int64_t k_size, int64_t group,
                const Codes& w, int64_t n0, int64_t count, float* y, int64_t n_size) {
  constexpr int F = M == 1 ? 4 : (M == 2 ? 2 : 1);
  int64_t n = n0;
  for (; n + F <= n0 + count; n += F)
    features<Codes, M, F>(x, group_sums, k_size, group, w, n, y, n_size);
  for (; n < n0 + count; ++n) features<Codes, M, 1>(x, group_sums, k_size, group, w, n, y, n_size);
}

// All N outputs of all rows, kBlock features at a time split over torch's threads: each
// block's weight rows are read from memory once, by the first kMaxRows rows of x, and
// stay in the cache for the next ones.
template <typename Codes>
void product(const float* x, const float* group_sums, int64_t rows, int64_t k_size,
             int64_t group, const Codes& w, int64_t n_size, float* y) {
  const int64_t groups = k_size / group;
  const int64_t blocks = (n_size + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 64 / kBlock, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBlock, count = std::min(kBlock, n_size - n0);
      for (int64_t r = 0; r < rows; r += kMaxRows) {
        const float* xr = x + r * k_size;
        const float* sums = group_sums + r * groups;
        float* yr = y + r * n_size;
        switch (std::min(kMaxRows, rows - r)) {
          case 1: rows_block<Codes, 1>(xr, sums, k_size, group, w, n0, count, yr, n_size); break;
          case 2: rows_block<Codes, 2>(xr, sums, k_size, group, w, n0, count, yr, n_size); break;
          case 3: rows_block<Codes, 3>(xr, sums, k_size, group, w, n0, count, yr, n_size); break;
          default: rows_block<Codes, 4>(xr, sums, k_size, group, w, n0, count, yr, n_size);
        }
      }
    }
  });
}

template <typename Codes>
at::Tensor rows_product(const at::Tensor& x, const Codes& w, int64_t n_size, int64_t group) {
  const int64_t rows = x.size(0), k_size = x.size(1);
  std::vector<float> xf(static_cast<size_t>(rows * k_size));
  std::vector<float> sums(static_cast<size_t>(rows * (k_size / group)));
  load_x(x.const_data_ptr<float>(), rows, k_size, Codes::kPairs, group, xf.data(), sums.data());
  at::Tensor out = at::empty({rows, n_size}, x.options());
  product(xf.data(), sums.data(), rows, k_size, group, w, n_size, out.mutable_data_ptr<float>());
  return out;
}

void check_x(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(0) >= 1 &&
                  x.is_contiguous(),
              name, ": x must be contiguous float32 [rows, K]");
  TORCH_CHECK(x.size(1) % kStep == 0, name, ": K must be a multiple of ", kStep);
}

void check_scales(const at::Tensor& scales, int64_t n_size, int64_t groups, const char* name) {
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == n_size * groups,
              name, ": scales must be contiguous float32 with ", n_size * groups, " elements");
}

// x [rows, K] float32, codes [N, K] int8 (int8 or E4M3 bits), scales [N] float32.
template <typename Codes>
at::Tensor byte_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const char* name) {
  check_x(x, name);
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.is_contiguous() &&
                  codes.size(1) == x.size(1),
              name, ": codes must be contiguous int8 [N, ", x.size(1), "]");
  const int64_t n_size = codes.size(0);
  check_scales(scales, n_size, 1, name);
  const Codes w{codes.const_data_ptr<int8_t>(), codes.size(1), scales.const_data_ptr<float>()};
  return rows_product(x, w, n_size, x.size(1));
}

at::Tensor int8_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  return byte_rows<Int8Codes>(x, codes, scales, "int8_rows");
}

at::Tensor fp8_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  return byte_rows<Fp8Codes>(x, codes, scales, "fp8_rows");
}

// x [rows, K] float32; nibbles [N, K / 2] uint8 (feature 2j in byte j's low nibble);
// scales and zeros [N, groups] float32 (w = q * scale - zero), groups of K / groups
// features, a multiple of 16.
at::Tensor int4_rows(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales,
                     const at::Tensor& zeros) {
  check_x(x, "int4_rows");
  const int64_t k_size = x.size(1);
  TORCH_CHECK(nibbles.scalar_type() == at::kByte && nibbles.dim() == 2 &&
                  nibbles.is_contiguous() && nibbles.size(1) * 2 == k_size,
              "int4_rows: nibbles must be contiguous uint8 [N, ", k_size / 2, "]");
  const int64_t n_size = nibbles.size(0);
  TORCH_CHECK(n_size > 0 && scales.numel() % n_size == 0, "int4_rows: scales must be [N, groups]");
  const int64_t groups = scales.numel() / n_size;
  TORCH_CHECK(groups > 0 && k_size % groups == 0 && (k_size / groups) % kStep == 0,
              "int4_rows: groups must split K into runs of a multiple of ", kStep, " features");
  check_scales(scales, n_size, groups, "int4_rows");
  check_scales(zeros, n_size, groups, "int4_rows");
  const Int4Codes w{nibbles.const_data_ptr<uint8_t>(), nibbles.size(1),
                    scales.const_data_ptr<float>(), zeros.const_data_ptr<float>()};
  return rows_product(x, w, n_size, k_size / groups);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(framework_cpu, m) {
  m.def("int8_rows(Tensor x, Tensor codes, Tensor scales) -> Tensor");
  m.def("fp8_rows(Tensor x, Tensor codes, Tensor scales) -> Tensor");
  m.def("int4_rows(Tensor x, Tensor nibbles, Tensor scales, Tensor zeros) -> Tensor");
  m.impl("int8_rows", c10::DispatchKey::CPU, &int8_rows);
  m.impl("fp8_rows", c10::DispatchKey::CPU, &fp8_rows);
  m.impl("int4_rows", c10::DispatchKey::CPU, &int4_rows);
}
