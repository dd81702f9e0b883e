// What the CPU kernels share: eight-float vectors, bfloat16 read as float32 and rounded
// back to it as torch does, and how the weight walks prefetch.
//
// A bfloat16 is the top half of a float32, so reading one is a shift; writing one rounds
// to nearest, ties to even, and keeps a NaN a NaN (c10's round_to_nearest_even), tested
// on the bits so that -ffast-math cannot drop the test. The kernels compute in float32
// and round once where torch's bfloat16 operator rounds its result.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

namespace framework_cpu {

using bf16 = c10::BFloat16;

// The locality hint of a weight walk's prefetches (__builtin_prefetch's third argument):
// 1, into the outer caches. A decode step's weights come from memory; with the
// non-temporal hint (0) an Intel server core kept only as many lines in flight as its
// first-level cache tracks, and a float32 walk through 320 MB of weights ran at 4.4 GB/s
// against 13 GB/s with this hint (one thread, Xeon with AVX-512; 4-bit and int8 walks
// 1.3-1.6x faster likewise).
constexpr int kWeightPrefetchLocality = 1;

// Eight floats: one AVX register, or two NEON ones; the compiler picks the instructions.
typedef float float8 __attribute__((vector_size(32)));
typedef uint32_t uint8v __attribute__((vector_size(32)));
typedef uint16_t uint16x8 __attribute__((vector_size(16)));

inline float8 load8(const float* p) {
  float8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float8 load8(const bf16* p) {
  uint16x8 raw;
  std::memcpy(&raw, p, sizeof(raw));
  const uint8v wide = __builtin_convertvector(raw, uint8v) << 16;  // one widening move
  float8 v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

inline void store8(float* p, float8 v) { std::memcpy(p, &v, sizeof(v)); }

inline float8 splat8(float x) { return float8{x, x, x, x, x, x, x, x}; }

inline float sum8(float8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

inline float to_float(float x) { return x; }

inline float to_float(bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// x rounded to T (float: itself).
template <typename T>
T round_to(float x);

template <>
inline float round_to<float>(float x) {
  return x;
}

template <>
inline bf16 round_to<bf16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  const uint16_t rounded = static_cast<uint16_t>((bits + ((bits >> 16) & 1u) + 0x7fffu) >> 16);
  return bf16(nan ? static_cast<uint16_t>(0x7fc0) : rounded, bf16::from_bits());
}

// 8-bit KV codes, read as float32 without their scale (the kernel applies it): int8 as
// the integer, FP8 E4M3 as its value. E4M3 is a sign, 4 exponent bits (bias 7) and 3
// mantissa bits; a normal code's exponent and mantissa are moved into float32's fields
// with the bias raised by 120. A subnormal (exponent 0: m * 2^-9) is made as
// 2^-6 * (1 + m / 8) - 2^-6, an exact difference, so that no float32 subnormal is formed
// and denormals-are-zero cannot change it. The NaN codes (0x7f, 0xff) are not told apart.
using fp8 = c10::Float8_e4m3fn;
typedef int8_t int8x8 __attribute__((vector_size(8)));
typedef uint8_t uint8x8 __attribute__((vector_size(8)));

// With AVX2, by intrinsics: GCC turns the portable conversion of an 8-bit vector into
// scalar code (one byte at a time), a third of their speed.
inline float8 load8(const int8_t* p) {
#if defined(__AVX2__) && defined(__F16C__)
  const __m256 v = _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  float8 out;
  std::memcpy(&out, &v, sizeof(out));
  return out;
#else
  int8x8 raw;
  std::memcpy(&raw, p, sizeof(raw));
  return __builtin_convertvector(raw, float8);
#endif
}

inline float8 load8(const fp8* p) {
  uint8x8 raw;
  std::memcpy(&raw, p, sizeof(raw));
  const uint8v b = __builtin_convertvector(raw, uint8v);
  const uint8v fields = (b & 0x7fu) << 20;  // exponent and mantissa, at float32's
  const uint8v normal = fields + (120u << 23);
  const uint8v tiny = fields + (121u << 23);  // 2^-6 * (1 + m / 8), exponent field 0
  float8 n, t;
  std::memcpy(&n, &normal, sizeof(n));
  std::memcpy(&t, &tiny, sizeof(t));
  t -= splat8(0x1p-6f);
  uint8v nb, tb;
  std::memcpy(&nb, &n, sizeof(nb));
  std::memcpy(&tb, &t, sizeof(tb));
  const uint8v subnormal = reinterpret_cast<uint8v>((b & 0x78u) == 0u);  // all ones, or 0
  const uint8v bits = ((tb & subnormal) | (nb & ~subnormal)) | ((b & 0x80u) << 24);
  float8 v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

inline float to_float(int8_t x) { return static_cast<float>(x); }

inline float to_float(fp8 x) { return static_cast<float>(x); }  // c10's: exact

// Eight E4M3 codes (bytes) as floats times 2^-8, the caller's scale carrying the 2^8: the
// byte's sign moved to bit 15 of a float16 and its exponent and mantissa to bits 7-13 make
// a float16 equal to the value times 2^-8 (subnormals included), which F16C widens (a
// float16's exponent bias is 8 more than E4M3's). Sign extension fills bits 8-15 with the
// sign: after the shift bit 15 holds it and bit 14 must be cleared. Three instructions
// where load8's exact float32 construction takes fifteen; no float32 subnormal is formed
// (the smallest code gives 2^-17). The NaN codes read as +-480 * 2^-8.
#if defined(__AVX2__) && defined(__F16C__)
inline float8 widen_fp8(const int8_t* p) {
  const __m128i wide = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i bits = _mm_and_si128(_mm_slli_epi16(wide, 7), _mm_set1_epi16(~0x4000));
  const __m256 v = _mm256_cvtph_ps(bits);
  float8 out;
  std::memcpy(&out, &v, sizeof(out));
  return out;
}
#else
inline float8 widen_fp8(const int8_t* p) {
  int8x8 codes;
  std::memcpy(&codes, p, sizeof(codes));
  typedef int16_t int16x8 __attribute__((vector_size(16)));
  const int16x8 bits = (__builtin_convertvector(codes, int16x8) << 7) &
                       static_cast<int16_t>(~0x4000);
  float8 out;
  for (int i = 0; i < 8; ++i)
    out[i] = static_cast<float>(c10::Half(static_cast<uint16_t>(bits[i]), c10::Half::from_bits()));
  return out;
}
#endif

}  // namespace framework_cpu
