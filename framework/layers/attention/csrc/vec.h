// What the CPU kernels share: eight-float vectors, and bfloat16 read as float32 and
// rounded back to it as torch does.
//
// A bfloat16 is the top half of a float32, so reading one is a shift; writing one rounds
// to nearest, ties to even, and keeps a NaN a NaN (c10's round_to_nearest_even), tested
// on the bits so that -ffast-math cannot drop the test. The kernels compute in float32
// and round once where torch's bfloat16 operator rounds its result.

#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace framework_cpu {

using bf16 = c10::BFloat16;

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

}  // namespace framework_cpu
