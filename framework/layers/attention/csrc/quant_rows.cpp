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
//  * 4-bit: a byte holds input features 2j (low nibble) and 2j + 1 (high), so eight
//    bytes widen to 32-bit lanes and give the even features (mask) and the odd ones
//    (shift): x's float32 copy is put in that order, as linear_rows does for bfloat16;
//  * FP8 E4M3: the byte's sign to bit 15 of a float16 and its exponent and mantissa to
//    bits 7-13 make a float16 equal to the value times 2^-8 (subnormals included), which
//    the F16C instruction widens; the caller's scales carry the 2^8.
//
// 4-bit and int8 weights multiply int16 activations in the cpu backend (int4_rows_a16,
// int8_rows_a16, notes at the kernel), FP8 ones float32 activations (fp8_rows). 4-bit
// and int8 weights can also multiply int8 activations (int4_rows_a8 and
// int8_rows_a8, the cpu_a8 backend): each row of x is rounded per group (the 4-bit
// weight's groups; next to int8 weights, blocks of up to 128 features; scale: the group's
// largest |x| / 127) and the sums run in integers: SSSE3's maddubs multiplies sixteen
// unsigned codes by sixteen activation bytes and adds neighbouring products into int16
// lanes (an int8 weight gives it its magnitude and passes its sign to the activation), so
// widening a code costs a mask or a shift and nothing goes through float until a group
// ends. Per sixteen bytes of 4-bit codes, seven vector operations (mask, shift, mask, two
// maddubs, two adds) against the float kernel's twenty-four (twenty to widen, four
// multiply-adds): about 2.4x its rate at one row on an AVX2 Zen core (int8: 1.7x). With
// VNNI, dpbusd takes the products into int32 lanes at once (dot_products). The
// result is the product of the dequantized weight and the dequantized activations, to
// float rounding.
//
// Built with the other kernels into one library (native_build.py); registered as
// torch.ops.framework_cpu.int8_rows_a8, int8_rows_a16, int4_rows, int4_rows_a8,
// int4_rows_a16, fp8_rows and fp8_bfloat16.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace {

using framework_cpu::float8;
using framework_cpu::load8;
using framework_cpu::sum8;
using framework_cpu::widen_fp8;

typedef int8_t int8x8 __attribute__((vector_size(8)));
typedef uint8_t uint8x8 __attribute__((vector_size(8)));
typedef int16_t int16x8 __attribute__((vector_size(16)));
typedef int32_t int32x8 __attribute__((vector_size(32)));
typedef uint8_t uint8x16 __attribute__((vector_size(16)));
typedef int8_t int8x16 __attribute__((vector_size(16)));
typedef int32_t int32x4 __attribute__((vector_size(16)));
typedef float float4 __attribute__((vector_size(16)));

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

// Sixteen 4-bit codes (eight bytes): the low nibbles, then the high ones, as floats.
inline void widen_nibbles(const uint8_t* p, float8& low, float8& high) {
  const __m256i wide = _mm256_cvtepu8_epi32(load_bytes8(p));
  low = to_float8(_mm256_cvtepi32_ps(_mm256_and_si256(wide, _mm256_set1_epi32(0xf))));
  high = to_float8(_mm256_cvtepi32_ps(_mm256_srli_epi32(wide, 4)));
}
#else
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
// One byte a code (FP8 E4M3, whose scales carry 2^8), widened by Widen.
template <float8 (*Widen)(const int8_t*)>
struct ByteCodes {
  static constexpr int64_t kBytesPerStep = kStep;
  static constexpr bool kPairs = false;  // x in its own order
  const int8_t* codes;
  int64_t row_bytes;
  const float* scales;  // [N, groups]: one group (per channel), or block-wise FP8's blocks
  const float* zeros = nullptr;
  void load16(int64_t n, int64_t k, float8& a, float8& b) const {
    const int8_t* p = codes + n * row_bytes + k;
    a = Widen(p);
    b = Widen(p + 8);
  }
};
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
      // kPrefetchBlocks blocks ahead.
      const char* next = ahead + (k / kStep) * F * Codes::kBytesPerStep;
      for (int64_t b = 0; b < F * Codes::kBytesPerStep; b += 64)
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

// Whether the products summed in integers (the int8 and int16 activation kernels) take
// four features for every count of rows: with AVX-512's 32 vector registers the M x 4
// int32 sums stay in registers, and each activation vector loaded serves four features
// (one Zen 4 thread, int8_rows_a16 on 2048 x 1024: 16 rows 0.63 ms against 0.85 with
// fewer features for more rows, 64 rows 2.6 against 3.3; int8_rows_a8 3.2 against 4.3).
// The float kernels keep fewer (two float sums a step each; not faster with four).
#if defined(__AVX512F__)
constexpr bool kWideIntegerTiles = true;
#else
constexpr bool kWideIntegerTiles = false;
#endif

// Output features [n0, n0 + count) of M rows: `features(std::integral_constant<int, F>{},
// n)` for F features from n, F at a time (fewer for more rows, to keep the sums in
// registers, but with kWide: four), the last count % F one at a time.
template <int M, bool kWide = false, typename Features>
void in_feature_blocks(int64_t n0, int64_t count, const Features& features) {
  constexpr int F = kWide || M == 1 ? 4 : (M == 2 ? 2 : 1);
  int64_t n = n0;
  for (; n + F <= n0 + count; n += F) features(std::integral_constant<int, F>{}, n);
  for (; n < n0 + count; ++n) features(std::integral_constant<int, 1>{}, n);
}

// All N outputs of all rows, kBlock features at a time split over torch's threads: each
// block's weight rows are read from memory once, by the first kMaxRows rows of x, and
// stay in the cache for the next ones. `block(std::integral_constant<int, M>{}, r, n0,
// count)` computes rows [r, r + M) of features [n0, n0 + count).
template <typename Block>
void over_blocks(int64_t rows, int64_t n_size, const Block& block) {
  const int64_t blocks = (n_size + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 64 / kBlock, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBlock, count = std::min(kBlock, n_size - n0);
      for (int64_t r = 0; r < rows; r += kMaxRows) {
        switch (std::min(kMaxRows, rows - r)) {
          case 1: block(std::integral_constant<int, 1>{}, r, n0, count); break;
          case 2: block(std::integral_constant<int, 2>{}, r, n0, count); break;
          case 3: block(std::integral_constant<int, 3>{}, r, n0, count); break;
          default: block(std::integral_constant<int, 4>{}, r, n0, count);
        }
      }
    }
  });
}

template <typename Codes>
void product(const float* x, const float* group_sums, int64_t rows, int64_t k_size,
             int64_t group, const Codes& w, int64_t n_size, float* y) {
  const int64_t groups = k_size / group;
  over_blocks(rows, n_size, [&](auto m, int64_t r, int64_t n0, int64_t count) {
    constexpr int M = decltype(m)::value;
    const float* xr = x + r * k_size;
    const float* sums = group_sums + r * groups;
    float* yr = y + r * n_size;
    in_feature_blocks<M>(n0, count, [&](auto f, int64_t n) {
      features<Codes, M, decltype(f)::value>(xr, sums, k_size, group, w, n, yr, n_size);
    });
  });
}

// ---- Weights times int8 activations (module notes) ----

// x's int8 codes lie in [-127, 127], so that maddubs' sum of two products fits its int16
// lanes: at most 2 * 15 * 127 next to 4-bit codes, 2 * 128 * 127 = 32,512 next to an int8
// weight's magnitude. int16 codes (int4_rows_a16) lie in [-32767, 32767].
template <typename Code>
constexpr float kActivationLevels = static_cast<float>(std::numeric_limits<Code>::max());
// Features of x that share a scale next to int8 weights (whose scale is per output
// feature): the largest of these that divides K.
constexpr int64_t kA8Int8Blocks[] = {128, 64, 32, 16};

// Rows of x [rows, K] rounded to Code (int8 or int16) per group of `group` features; with
// `pairs`, in the 4-bit kernels' order (per step of 32, the even features then the odd
// ones). Per row and group, the scale (largest |x| / the code's largest value; 0 for a
// group of zeros) and the scale times the sum of the group's codes (for the zero terms).
template <typename Code>
void quantize_activations(const float* x, int64_t rows, int64_t k_size, int64_t group,
                          bool pairs, Code* codes, float* scales, float* code_sums) {
  constexpr float levels = kActivationLevels<Code>;
  const int64_t groups = k_size / group;
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const float* in = x + m * k_size + g * group;
      Code* out = codes + m * k_size + g * group;
      float largest = 0.f;
      for (int64_t k = 0; k < group; ++k) largest = std::max(largest, std::fabs(in[k]));
      const float inverse = largest > 0.f ? levels / largest : 0.f;
      int64_t sum = 0;
      for (int64_t k = 0; k < group; ++k) {
        // In pairs order, position k of a step of 32 holds feature 2k (k < 16) or 2k - 31.
        const int64_t step = k - k % 32, j = k % 32;
        const int64_t from = pairs ? step + (j < 16 ? 2 * j : 2 * j - 31) : k;
        out[k] = static_cast<Code>(std::clamp(std::nearbyint(in[from] * inverse), -levels, levels));
        sum += out[k];
      }
      const float scale = largest / levels;
      scales[m * groups + g] = scale;
      code_sums[m * groups + g] = scale * static_cast<float>(sum);
    }
}

// Sixteen codes times sixteen activation bytes, neighbouring products added: int16 lanes.
// maddubs takes one unsigned operand: unsigned codes (4-bit) go to it as they are, signed
// ones (int8 weights) give it their magnitudes and pass their signs to the activations.
template <bool Signed, typename Codes>
inline int16x8 pair_products(Codes codes, const int8_t* x) {
#if defined(__SSSE3__)
  const __m128i c = reinterpret_cast<__m128i>(codes);
  const __m128i activations = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  if constexpr (Signed)
    return reinterpret_cast<int16x8>(
        _mm_maddubs_epi16(_mm_abs_epi8(c), _mm_sign_epi8(activations, c)));
  else
    return reinterpret_cast<int16x8>(_mm_maddubs_epi16(c, activations));
#else
  int16x8 out;
  for (int i = 0; i < 8; ++i)
    out[i] = static_cast<int16_t>(codes[2 * i] * x[2 * i] + codes[2 * i + 1] * x[2 * i + 1]);
  return out;
#endif
}

// int16 lanes added in neighbouring pairs into int32 ones.
inline int32x4 widen_pairs(int16x8 v) {
#if defined(__SSSE3__)
  return reinterpret_cast<int32x4>(_mm_madd_epi16(reinterpret_cast<__m128i>(v), _mm_set1_epi16(1)));
#else
  int32x4 out;
  for (int i = 0; i < 4; ++i) out[i] = v[2 * i] + v[2 * i + 1];
  return out;
#endif
}

// With VNNI (AVX512-VNNI on 128-bit vectors, or AVX-VNNI) one instruction multiplies
// sixteen unsigned bytes by sixteen signed ones and adds each four neighbouring products
// into an int32 lane: no int16 stage, so nothing to widen between steps.
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define FRAMEWORK_CPU_VNNI 1
constexpr bool kDotBytes = true;
#else
constexpr bool kDotBytes = false;
#endif

#if defined(FRAMEWORK_CPU_VNNI)
// acc plus sixteen codes times sixteen activation bytes, four neighbouring products to a
// lane (signed codes pass their signs to the activations, as in pair_products).
template <bool Signed, typename Codes>
inline int32x4 dot_products(int32x4 acc, Codes codes, const int8_t* x) {
  const __m128i c = reinterpret_cast<__m128i>(codes);
  __m128i activations = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  __m128i magnitudes = c;
  if constexpr (Signed) {
    magnitudes = _mm_abs_epi8(c);
    activations = _mm_sign_epi8(activations, c);
  }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return reinterpret_cast<int32x4>(
      _mm_dpbusd_epi32(reinterpret_cast<__m128i>(acc), magnitudes, activations));
#else
  return reinterpret_cast<int32x4>(
      _mm_dpbusd_avx_epi32(reinterpret_cast<__m128i>(acc), magnitudes, activations));
#endif
}
#endif

// The weight formats the int8-activation kernel reads: a step of codes per feature (sixteen
// bytes), their products with a row's activation codes, and the scale and zero term of a
// feature's group.
struct Int4ByA8 {
  // Codes per step: the bytes' low nibbles multiply x's sixteen even features of the step,
  // the high nibbles its odd ones (x's codes are put in that order).
  static constexpr int64_t kStep = 32;
  // Steps summed in int16 lanes before widening: a step adds at most 4 * 15 * 127 = 7,620
  // to a lane, four steps 30,480, below 2^15.
  static constexpr int64_t kInt16Steps = 4;
  static constexpr bool kPairs = true;
  struct Step {
    uint8x16 low, high;
  };
  Int4Codes w;
  int64_t groups;
  int64_t stride() const { return w.row_bytes; }
  const uint8_t* bytes(int64_t n, int64_t k) const { return w.codes + n * w.row_bytes + k / 2; }
  Step load(int64_t n, int64_t k) const {
    uint8x16 b;
    std::memcpy(&b, bytes(n, k), sizeof(b));
    return {b & 0xf, b >> 4};
  }
  static int16x8 products(const Step& step, const int8_t* x) {
    return pair_products<false>(step.low, x) + pair_products<false>(step.high, x + kStep / 2);
  }
#if defined(FRAMEWORK_CPU_VNNI)
  static int32x4 dot(int32x4 acc, const Step& step, const int8_t* x) {
    return dot_products<false>(dot_products<false>(acc, step.low, x), step.high, x + kStep / 2);
  }
#endif
  float scale(int64_t n, int64_t g) const { return w.scales[n * groups + g]; }
  float zero(int64_t n, int64_t g) const { return w.zeros[n * groups + g]; }
};

struct Int8ByA8 {
  static constexpr int64_t kStep = 16;
  // A step's pair sums reach 2 * 128 * 127 = 32,512: widened after every step.
  static constexpr int64_t kInt16Steps = 1;
  static constexpr bool kPairs = false;
  using Step = int8x16;
  const int8_t* codes;
  int64_t row_bytes;
  const float* scales;  // [N]: one per output feature, whatever the activations' groups
  int64_t stride() const { return row_bytes; }
  const int8_t* bytes(int64_t n, int64_t k) const { return codes + n * row_bytes + k; }
  Step load(int64_t n, int64_t k) const {
    Step b;
    std::memcpy(&b, bytes(n, k), sizeof(b));
    return b;
  }
  static int16x8 products(const Step& step, const int8_t* x) {
    return pair_products<true>(step, x);
  }
#if defined(FRAMEWORK_CPU_VNNI)
  static int32x4 dot(int32x4 acc, const Step& step, const int8_t* x) {
    return dot_products<true>(acc, step, x);
  }
#endif
  float scale(int64_t n, int64_t) const { return scales[n]; }
  float zero(int64_t, int64_t) const { return 0.f; }
};

// The steps of [k0, k1) of a walk through F features' codes, kStep weights (kStepBytes
// bytes of each feature's codes) a step: each step asks for the codes kPrefetchBlocks
// blocks of features ahead (`ahead`: where those blocks' codes start), then hands each
// feature's `load(f, k)` and every row to `body(m, f, loaded, k)`.
template <int M, int F, int64_t kStep, int64_t kStepBytes, typename Load, typename Body>
__attribute__((always_inline)) inline void walk_steps(const char* ahead, int64_t k0,
                                                      int64_t k1, Load&& load, Body&& body) {
  for (int64_t k = k0; k < k1; k += kStep) {
    const char* next = ahead + (k / kStep) * F * kStepBytes;
    for (int64_t b = 0; b < F * kStepBytes; b += 64)
      __builtin_prefetch(next + b, 0, framework_cpu::kWeightPrefetchLocality);
#pragma GCC unroll 4
    for (int f = 0; f < F; ++f) {
      const auto loaded = load(f, k);
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) body(m, f, loaded, k);
    }
  }
}

// y[m][n] for output features [n0, n0 + F) of the M rows of x's codes: per group, int32
// sums of codes times codes (without VNNI, in int16 for Weights::kInt16Steps steps at a
// time), then scaled by both scales into float totals; the zero terms from x's scaled code
// sums.
template <typename Weights, int M, int F>
void features_a8(const int8_t* __restrict x, const float* __restrict x_scales,
                 const float* __restrict x_sums, int64_t k_size, int64_t group,
                 const Weights& w, int64_t n0, float* __restrict y, int64_t n_size) {
  constexpr int64_t kStep = Weights::kStep, kRun = Weights::kInt16Steps * kStep;
  // Sixteen bytes of each feature's codes per step, the features' rows one after another.
  constexpr int64_t kStepBytes = 16;
  const int64_t groups = k_size / group;
  float4 total[M][F] = {};
  float zero_total[M][F] = {};
  const char* ahead =
      reinterpret_cast<const char*>(w.bytes(n0, 0)) + kPrefetchBlocks * F * w.stride();
  // The steps of [k0, k1), each feature's codes and every row's activation codes handed
  // to `body(m, f, step, x_codes)`.
  const auto over_steps = [&](int64_t k0, int64_t k1, auto&& body) {
    walk_steps<M, F, kStep, kStepBytes>(
        ahead, k0, k1, [&](int f, int64_t k) { return w.load(n0 + f, k); },
        [&](int m, int f, const typename Weights::Step& step, int64_t k) {
          body(m, f, step, x + m * k_size + k);
        });
  };
  using Step = typename Weights::Step;
  for (int64_t g = 0; g < groups; ++g) {
    int32x4 acc[M][F] = {};
    for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += kRun) {
      const int64_t k1 = std::min(k0 + kRun, (g + 1) * group);
      if constexpr (kDotBytes) {
        over_steps(k0, k1, [&](int m, int f, const Step& step, const int8_t* codes) {
          acc[m][f] = Weights::dot(acc[m][f], step, codes);
        });
      } else {
        int16x8 sums[M][F] = {};
        over_steps(k0, k1, [&](int m, int f, const Step& step, const int8_t* codes) {
          sums[m][f] += Weights::products(step, codes);
        });
        for (int m = 0; m < M; ++m)
          for (int f = 0; f < F; ++f) acc[m][f] += widen_pairs(sums[m][f]);
      }
    }
    for (int f = 0; f < F; ++f) {
      const float scale = w.scale(n0 + f, g), zero = w.zero(n0 + f, g);
      for (int m = 0; m < M; ++m) {
        const float both = scale * x_scales[m * groups + g];
        total[m][f] += __builtin_convertvector(acc[m][f], float4) * both;
        zero_total[m][f] += zero * x_sums[m * groups + g];
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int f = 0; f < F; ++f) {
      const float4 t = total[m][f];
      y[m * n_size + n0 + f] = ((t[0] + t[2]) + (t[1] + t[3])) - zero_total[m][f];
    }
}

// All rows of x [rows, K] float32 times a weight, x rounded to int8 per row and group of
// `group` features.
template <typename Weights>
at::Tensor rows_a8(const at::Tensor& x, const Weights& w, int64_t n_size, int64_t group) {
  const int64_t rows = x.size(0), k_size = x.size(1), groups = k_size / group;
  std::vector<int8_t> codes(static_cast<size_t>(rows * k_size));
  std::vector<float> x_scales(static_cast<size_t>(rows * groups));
  std::vector<float> x_sums(static_cast<size_t>(rows * groups));
  quantize_activations<int8_t>(x.const_data_ptr<float>(), rows, k_size, group,
                               Weights::kPairs, codes.data(), x_scales.data(), x_sums.data());
  at::Tensor out = at::empty({rows, n_size}, x.options());
  float* y = out.mutable_data_ptr<float>();
  over_blocks(rows, n_size, [&](auto m, int64_t r, int64_t n0, int64_t count) {
    constexpr int M = decltype(m)::value;
    in_feature_blocks<M, kWideIntegerTiles>(n0, count, [&](auto f, int64_t n) {
      features_a8<Weights, M, decltype(f)::value>(
          codes.data() + r * k_size, x_scales.data() + r * groups, x_sums.data() + r * groups,
          k_size, group, w, n, y + r * n_size, n_size);
    });
  });
  return out;
}

// ---- 4-bit and int8 weights times int16 activations (int4_rows_a16, int8_rows_a16: the
// cpu backend's) ----
//
// x rounded to int16 per group (its largest |x| / 32767: 2^-16 of that value at most,
// against 2^-24 of each value in float32; next to int8 weights, blocks of up to 128
// features) and the codes widened to int16 lanes (4-bit: one byte to a lane and its two
// nibbles by a mask and a shift; int8: sixteen bytes sign-extended at once), multiplied by
// pmaddwd (VNNI: dpwssd), which adds each two neighbouring products into an int32 lane.
// Per 32 4-bit codes five vector operations where the float kernel spends twenty-four;
// per 16 int8 codes two where it spends six; nothing goes through float until a group
// ends. On a Zen 4 thread, 2048 x 1024 int8: one row 0.05 ms against the float kernel's
// 0.09, eight rows 0.32 against 0.61.

typedef int16_t int16x16 __attribute__((vector_size(32)));

// A step's 32 codes (sixteen bytes) as int16 lanes: the low nibbles (x's sixteen even
// features of the step), then the high ones (its odd features).
struct Int4Words {
  int16x16 low, high;
};

inline Int4Words int4_words(const uint8_t* p) {
#if defined(__AVX2__)
  const __m256i wide = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {reinterpret_cast<int16x16>(_mm256_and_si256(wide, _mm256_set1_epi16(0xf))),
          reinterpret_cast<int16x16>(_mm256_srli_epi16(wide, 4))};
#else
  uint8x16 bytes;
  std::memcpy(&bytes, p, sizeof(bytes));
  const int16x16 wide = __builtin_convertvector(bytes, int16x16);
  return {wide & 0xf, wide >> 4};
#endif
}

// acc plus sixteen code lanes times sixteen activation lanes, neighbouring products added.
inline int32x8 madd_words(int32x8 acc, int16x16 codes, const int16_t* x) {
#if defined(__AVX2__)
  const __m256i c = reinterpret_cast<__m256i>(codes);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return reinterpret_cast<int32x8>(_mm256_dpwssd_epi32(reinterpret_cast<__m256i>(acc), c, v));
#elif defined(__AVXVNNI__)
  return reinterpret_cast<int32x8>(_mm256_dpwssd_avx_epi32(reinterpret_cast<__m256i>(acc), c, v));
#else
  return acc + reinterpret_cast<int32x8>(_mm256_madd_epi16(c, v));
#endif
#else
  for (int i = 0; i < 8; ++i) acc[i] += codes[2 * i] * x[2 * i] + codes[2 * i + 1] * x[2 * i + 1];
  return acc;
#endif
}

// The two weights that multiply int16 activations: how a step's codes become int16 lanes
// and meet x's, each row's scale per group and its zero term.
// 4-bit codes, a step of 32 features (sixteen bytes; x in pairs order): a step adds at
// most 2 * 2 * 15 * 32767 to a lane, so 512 steps (1.0e9) stay below 2^31 before the
// sums go to float.
struct Int4ByA16 {
  static constexpr int64_t kStep = 32;
  static constexpr int64_t kStepBytes = kStep / 2;
  static constexpr int64_t kRunSteps = 512;
  static constexpr bool kPairs = true;
  static constexpr bool kWeightGroups = true;  // the scales and zeros per group
  using Words = Int4Words;
  const Int4Codes& w;
  const uint8_t* row(int64_t n) const { return w.codes + n * w.row_bytes; }
  int64_t row_bytes() const { return w.row_bytes; }
  static Words words(const uint8_t* p, int64_t k) { return int4_words(p + k / 2); }
  static int32x8 madd(int32x8 acc, const Words& words, const int16_t* x) {
    return madd_words(madd_words(acc, words.low, x), words.high, x + 16);
  }
  float scale(int64_t n, int64_t g, int64_t groups) const { return w.scales[n * groups + g]; }
  float zero(int64_t n, int64_t g, int64_t groups) const { return w.zeros[n * groups + g]; }
};

// int8 codes, a step of 16 features (sixteen bytes sign-extended to int16 lanes; x in its
// own order), one scale per output feature: a step adds at most 2 * 127 * 32767 to a
// lane, so 256 steps (2.1e9) stay below 2^31.
struct Int8ByA16 {
  static constexpr int64_t kStep = 16;
  static constexpr int64_t kStepBytes = kStep;
  static constexpr int64_t kRunSteps = 256;
  static constexpr bool kPairs = false;
  static constexpr bool kWeightGroups = false;
  using Words = int16x16;
  const int8_t* codes;
  int64_t k_size;
  const float* scales;  // [N]
  const uint8_t* row(int64_t n) const {
    return reinterpret_cast<const uint8_t*>(codes + n * k_size);
  }
  int64_t row_bytes() const { return k_size; }
  static Words words(const uint8_t* p, int64_t k) {
#if defined(__AVX2__)
    return reinterpret_cast<int16x16>(
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k))));
#else
    int8x16 bytes;
    std::memcpy(&bytes, p + k, sizeof(bytes));
    return __builtin_convertvector(bytes, int16x16);
#endif
  }
  static int32x8 madd(int32x8 acc, const Words& words, const int16_t* x) {
    return madd_words(acc, words, x);
  }
  float scale(int64_t n, int64_t, int64_t) const { return scales[n]; }
  float zero(int64_t, int64_t, int64_t) const { return 0.f; }
};

// y[m][n] for output features [n0, n0 + F) of the M rows of x's int16 codes (in the
// weight's order), over `groups` groups of x's scales: per group, int32 sums of codes
// times codes, scaled into float totals by x's scale (and a 4-bit weight's scale of the
// group); the zero terms from x's scaled code sums; an int8 weight's scale at the end.
template <int M, int F, typename Codes>
void features_a16(const int16_t* __restrict x, const float* __restrict x_scales,
                  const float* __restrict x_sums, int64_t k_size, int64_t group,
                  const Codes& w, int64_t groups, int64_t n0, float* __restrict y,
                  int64_t n_size) {
  constexpr int64_t kRun = Codes::kRunSteps * Codes::kStep;
  float8 total[M][F] = {};
  float zero_total[M][F] = {};
  const uint8_t* rows = w.row(n0);
  const int64_t row_bytes = w.row_bytes();
  const char* ahead = reinterpret_cast<const char*>(rows) + kPrefetchBlocks * F * row_bytes;
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += kRun) {
      const int64_t k1 = std::min(k0 + kRun, (g + 1) * group);
      int32x8 acc[M][F] = {};
      walk_steps<M, F, Codes::kStep, Codes::kStepBytes>(
          ahead, k0, k1, [&](int f, int64_t k) { return Codes::words(rows + f * row_bytes, k); },
          [&](int m, int f, const typename Codes::Words& words, int64_t k) {
            acc[m][f] = Codes::madd(acc[m][f], words, x + m * k_size + k);
          });
      for (int f = 0; f < F; ++f) {
        const float scale = Codes::kWeightGroups ? w.scale(n0 + f, g, groups) : 1.f;
        for (int m = 0; m < M; ++m)
          total[m][f] += __builtin_convertvector(acc[m][f], float8) *
                         framework_cpu::splat8(scale * x_scales[m * groups + g]);
      }
    }
    if constexpr (Codes::kWeightGroups)
      for (int f = 0; f < F; ++f)
        for (int m = 0; m < M; ++m)
          zero_total[m][f] += w.zero(n0 + f, g, groups) * x_sums[m * groups + g];
  }
  for (int m = 0; m < M; ++m)
    for (int f = 0; f < F; ++f) {
      const float scale = Codes::kWeightGroups ? 1.f : w.scale(n0 + f, 0, groups);
      y[m * n_size + n0 + f] = sum8(total[m][f]) * scale - zero_total[m][f];
    }
}

// x [rows, K] rounded to int16 per group of K / groups features, times the weight w.
template <typename Codes>
at::Tensor rows_a16(const at::Tensor& x, const Codes& w, int64_t n_size, int64_t groups) {
  const int64_t rows = x.size(0), k_size = x.size(1), group = k_size / groups;
  std::vector<int16_t> codes(static_cast<size_t>(rows * k_size));
  std::vector<float> x_scales(static_cast<size_t>(rows * groups));
  std::vector<float> x_sums(static_cast<size_t>(rows * groups));
  quantize_activations<int16_t>(x.const_data_ptr<float>(), rows, k_size, group,
                                Codes::kPairs, codes.data(), x_scales.data(), x_sums.data());
  at::Tensor out = at::empty({rows, n_size}, x.options());
  float* y = out.mutable_data_ptr<float>();
  over_blocks(rows, n_size, [&](auto m, int64_t r, int64_t n0, int64_t count) {
    constexpr int M = decltype(m)::value;
    in_feature_blocks<M, kWideIntegerTiles>(n0, count, [&](auto f, int64_t n) {
      features_a16<M, decltype(f)::value>(codes.data() + r * k_size,
                                          x_scales.data() + r * groups,
                                          x_sums.data() + r * groups, k_size, group, w,
                                          groups, n, y + r * n_size, n_size);
    });
  });
  return out;
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

// x [rows, K] float32, codes [N, K] int8 (E4M3 bits), scales [N, groups] float32
// (groups of K / groups features, a multiple of kStep: one per channel, or FP8's blocks).
template <typename Codes>
at::Tensor byte_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const char* name) {
  check_x(x, name);
  const int64_t k_size = x.size(1);
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.is_contiguous() &&
                  codes.size(1) == k_size,
              name, ": codes must be contiguous int8 [N, ", k_size, "]");
  const int64_t n_size = codes.size(0);
  TORCH_CHECK(n_size > 0 && scales.numel() % n_size == 0, name, ": scales must be [N, groups]");
  const int64_t groups = scales.numel() / n_size;
  TORCH_CHECK(groups > 0 && k_size % groups == 0 && (k_size / groups) % kStep == 0,
              name, ": groups must split K into runs of a multiple of ", kStep, " features");
  check_scales(scales, n_size, groups, name);
  const Codes w{codes.const_data_ptr<int8_t>(), k_size, scales.const_data_ptr<float>()};
  return rows_product(x, w, n_size, k_size / groups);
}

at::Tensor fp8_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  return byte_rows<Fp8Codes>(x, codes, scales, "fp8_rows");
}

// The checked 4-bit operands of int4_rows and int4_rows_a8: x [rows, K] float32; nibbles
// [N, K / 2] uint8 (feature 2j in byte j's low nibble); scales and zeros [N, groups]
// float32 (w = q * scale - zero), groups of K / groups features, a multiple of `step`.
Int4Codes int4_codes(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales,
                     const at::Tensor& zeros, int64_t step, const char* name) {
  check_x(x, name);
  const int64_t k_size = x.size(1);
  TORCH_CHECK(nibbles.scalar_type() == at::kByte && nibbles.dim() == 2 &&
                  nibbles.is_contiguous() && nibbles.size(1) * 2 == k_size,
              name, ": nibbles must be contiguous uint8 [N, ", k_size / 2, "]");
  const int64_t n_size = nibbles.size(0);
  TORCH_CHECK(n_size > 0 && scales.numel() % n_size == 0, name, ": scales must be [N, groups]");
  const int64_t groups = scales.numel() / n_size;
  TORCH_CHECK(groups > 0 && k_size % groups == 0 && (k_size / groups) % step == 0,
              name, ": groups must split K into runs of a multiple of ", step, " features");
  check_scales(scales, n_size, groups, name);
  check_scales(zeros, n_size, groups, name);
  return Int4Codes{nibbles.const_data_ptr<uint8_t>(), nibbles.size(1),
                   scales.const_data_ptr<float>(), zeros.const_data_ptr<float>()};
}

at::Tensor int4_rows(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales,
                     const at::Tensor& zeros) {
  const Int4Codes w = int4_codes(x, nibbles, scales, zeros, kStep, "int4_rows");
  return rows_product(x, w, nibbles.size(0), x.size(1) / (scales.numel() / nibbles.size(0)));
}

// x [rows, K] float32, rounded to int8 per row and group; nibbles, scales and zeros as
// int4_rows', groups a multiple of 32 features.
at::Tensor int4_rows_a8(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales,
                        const at::Tensor& zeros) {
  const Int4Codes w = int4_codes(x, nibbles, scales, zeros, Int4ByA8::kStep, "int4_rows_a8");
  const int64_t n_size = nibbles.size(0), groups = scales.numel() / n_size;
  return rows_a8(x, Int4ByA8{w, groups}, n_size, x.size(1) / groups);
}

// x [rows, K] float32, rounded to int16 per row and group; nibbles, scales and zeros as
// int4_rows', groups a multiple of 32 features.
at::Tensor int4_rows_a16(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scales,
                         const at::Tensor& zeros) {
  const Int4Codes w = int4_codes(x, nibbles, scales, zeros, Int4ByA16::kStep, "int4_rows_a16");
  return rows_a16(x, Int4ByA16{w}, nibbles.size(0), scales.numel() / nibbles.size(0));
}

// The checked operands of int8_rows_a8 and int8_rows_a16: x [rows, K] float32, codes
// [N, K] int8, scales [N] float32. Returns the features of x that share a scale: the
// largest of kA8Int8Blocks that divides K.
int64_t int8_activation_block(const at::Tensor& x, const at::Tensor& codes,
                              const at::Tensor& scales, const char* name) {
  check_x(x, name);
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.is_contiguous() &&
                  codes.size(1) == x.size(1),
              name, ": codes must be contiguous int8 [N, ", x.size(1), "]");
  check_scales(scales, codes.size(0), 1, name);
  return *std::find_if(std::begin(kA8Int8Blocks), std::end(kA8Int8Blocks),
                       [&](int64_t b) { return x.size(1) % b == 0; });
}

// x [rows, K] float32, rounded to int8 per row and block of the largest of kA8Int8Blocks
// that divides K; codes [N, K] int8, scales [N] float32.
at::Tensor int8_rows_a8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  const int64_t block = int8_activation_block(x, codes, scales, "int8_rows_a8");
  const Int8ByA8 w{codes.const_data_ptr<int8_t>(), x.size(1), scales.const_data_ptr<float>()};
  return rows_a8(x, w, codes.size(0), block);
}

// int8_rows_a8's operands, x rounded to int16 per row and block instead (the cpu
// backend's int8 products: 2^-16 of a block's largest |x| at most).
at::Tensor int8_rows_a16(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  const int64_t block = int8_activation_block(x, codes, scales, "int8_rows_a16");
  const Int8ByA16 w{codes.const_data_ptr<int8_t>(), x.size(1), scales.const_data_ptr<float>()};
  return rows_a16(x, w, codes.size(0), x.size(1) / block);
}

// E4M3 bytes [N, K] (int8 view) as bfloat16 [N, K], each the byte's value times 2^-8 (as
// fp8_rows reads it; the caller's scales carry the 2^8). Exact: the float16 that
// widen_fp8 makes has at most 4 significant bits, so its float32's upper half is the
// same number. Feeds torch's bfloat16 GEMM with the weight of a product of many rows.
at::Tensor fp8_bfloat16(const at::Tensor& codes) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous() &&
                  codes.numel() % 8 == 0,
              "fp8_bfloat16: codes must be contiguous int8, a multiple of 8 elements");
  at::Tensor out = at::empty(codes.sizes(), codes.options().dtype(at::kBFloat16));
  const int8_t* from = codes.const_data_ptr<int8_t>();
  uint16_t* to = reinterpret_cast<uint16_t*>(out.mutable_data_ptr<at::BFloat16>());
  constexpr int64_t kGrain = 1 << 16;
  at::parallel_for(0, codes.numel() / 8, kGrain / 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float8 widened = widen_fp8(from + 8 * i);
      framework_cpu::uint8v bits;
      std::memcpy(&bits, &widened, sizeof(bits));
      const framework_cpu::uint16x8 upper =
          __builtin_convertvector(bits >> 16, framework_cpu::uint16x8);
      std::memcpy(to + 8 * i, &upper, sizeof(upper));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(framework_cpu, m) {
  m.def("fp8_rows(Tensor x, Tensor codes, Tensor scales) -> Tensor");
  m.def("int4_rows(Tensor x, Tensor nibbles, Tensor scales, Tensor zeros) -> Tensor");
  m.def("int4_rows_a8(Tensor x, Tensor nibbles, Tensor scales, Tensor zeros) -> Tensor");
  m.def("int4_rows_a16(Tensor x, Tensor nibbles, Tensor scales, Tensor zeros) -> Tensor");
  m.def("int8_rows_a8(Tensor x, Tensor codes, Tensor scales) -> Tensor");
  m.def("int8_rows_a16(Tensor x, Tensor codes, Tensor scales) -> Tensor");
  m.def("fp8_bfloat16(Tensor codes) -> Tensor");
  m.impl("fp8_rows", c10::DispatchKey::CPU, &fp8_rows);
  m.impl("int4_rows", c10::DispatchKey::CPU, &int4_rows);
  m.impl("int4_rows_a8", c10::DispatchKey::CPU, &int4_rows_a8);
  m.impl("int4_rows_a16", c10::DispatchKey::CPU, &int4_rows_a16);
  m.impl("int8_rows_a8", c10::DispatchKey::CPU, &int8_rows_a8);
  m.impl("int8_rows_a16", c10::DispatchKey::CPU, &int8_rows_a16);
  m.impl("fp8_bfloat16", c10::DispatchKey::CPU, &fp8_bfloat16);
}
