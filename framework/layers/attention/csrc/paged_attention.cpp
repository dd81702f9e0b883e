// Causal attention on the CPU, read straight from the paged KV pool.
//
// Each request's new tokens (one in a decode step, a prompt's worth in a
// prefill, both in a mixed step) attend to its cached tokens and to the new
// tokens before them; the request's tokens are found through req_to_token.
// The pool keeps each token's keys (and values) for all heads in one row.
//
// * A request with one new token (decode) is bound by reading its rows once:
//   it walks them in place, each row's heads at once, for the scores, then
//   again for the values, eight rows at a time (each output block is read and
//   written once per eight rows), with the rows ahead prefetched. Several decode tokens
//   of one request at consecutive positions (a verify step of speculative decoding gives
//   its tokens so) walk its rows together: each row is fetched once, and each token's
//   sums are the ones it gets alone, operation for operation.
// * A request with several new tokens (prefill, extend) reads each row many
//   times: it is split by key/value head, and the head's keys and values are
//   first copied into two contiguous blocks that stay in the core's caches
//   while every query of the head's group reads them. With head_dim a multiple
//   of 16, the keys are copied transposed and eight queries at a time go through
//   two register-tiled products (scores against 16 keys at a time, then the
//   weighted values), so that every loaded key and value serves eight queries
//   (sixteen sums in flight: twice as many as four queries, which left the
//   multiply-adds waiting on one another; 20-27% less prefill attention).
//
// Otherwise scores take four keys (or heads) at a time, each with its own
// accumulator, so that their multiply-adds overlap instead of waiting on one
// another. Work
// items run on torch's own thread pool (at::parallel_for), so the kernel
// shares the cores the way the model's other operators do.
//
// Two per-layer variants (Variant): a sliding window W, under which the query at
// position p sees only the keys at p - W + 1 .. p, and soft-capping, under which each
// score s becomes cap * tanh(s / cap) before the softmax. A window shortens the work
// rather than masking it: keys before a request's first window are neither copied nor
// read, a decode token walks only its last W rows, and a tile of queries starts its
// products at the key tile of its first query's window. Without them the bounds are
// the causal ones and the capping pass is skipped, one test per query row.
//
// The pool may hold float32 or bfloat16 (then the queries and the output are bfloat16
// too): bfloat16 rows are widened to float32 as they are read, and everything is
// computed in float32; the output is rounded to bfloat16 at the end.
//
// It may also hold 8-bit codes (Pool), whatever q's dtype: FP8 E4M3 with one float32
// scale per KV head, or int8 with one float16 scale per slot and KV head (x = code *
// scale, framework/mem_cache/kv_quant.py). Codes are read at a quarter of float32's
// bytes and widened to float32: times their scale into the blocks the extend paths copy;
// for a decode token, which reads rows in place, in registers as its products read them
// (FP8 through F16C, as its value times 2^-8), each dot product of a query head with a
// key row then multiplied by the row's scale for that head's KV head (and the 2^8), and
// each attention weight by the value row's, rather than every code by its scale
// (code_load8, row_factors).
//
// Built at first use by framework/layers/attention/native_build.py; registered
// as torch.ops.framework_cpu.paged_attention (and .write_kv, which stores a step's new
// keys and values in the pool).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec.h"

namespace {

using framework_cpu::bf16;
using framework_cpu::float8;
using framework_cpu::fp8;
using framework_cpu::load8;
using framework_cpu::round_to;
using framework_cpu::splat8;
using framework_cpu::store8;
using framework_cpu::sum8;
using framework_cpu::to_float;

// Rows this far ahead are prefetched while copying: a request's tokens sit anywhere in
// the pool, so the hardware prefetcher cannot follow them.
constexpr int64_t kPrefetchDistance = 4;

// Asks for the cache lines of `count` elements from p (one request per 64-byte line).
template <typename T>
inline void prefetch(const T* p, int64_t count) {
  for (int64_t i = 0; i < count; i += 64 / static_cast<int64_t>(sizeof(T)))
    __builtin_prefetch(p + i, 0, 1);
}

// How a pool's rows become values: as they are (the model's dtype), or 8-bit codes times
// one scale per KV head (FP8: [kv_heads] float32) or per slot and KV head (int8: [slots,
// kv_heads] float16). Each gives a row's scale (1 for Unscaled) and prefetches it.
struct Unscaled {
  static constexpr bool kScaled = false;
  float operator()(int64_t /*slot*/, int64_t /*head*/) const { return 1.f; }
  void prefetch(int64_t /*slot*/) const {}
};

struct HeadScales {
  static constexpr bool kScaled = true;
  const float* scales;
  float operator()(int64_t /*slot*/, int64_t head) const { return scales[head]; }
  void prefetch(int64_t /*slot*/) const {}  // a few floats, read by every row
};

struct SlotScales {
  static constexpr bool kScaled = true;
  const c10::Half* scales;
  int64_t kv_heads;
  float operator()(int64_t slot, int64_t head) const {
    return static_cast<float>(scales[slot * kv_heads + head]);
  }
  // A slot's scales sit apart from its codes, one more line to ask for per row.
  void prefetch(int64_t slot) const { __builtin_prefetch(scales + slot * kv_heads, 0, 1); }
};

// One layer's pool as the kernel reads it: rows of T [slots, kv_heads, dim], and scales.
template <typename T, typename S>
struct Pool {
  const T* k;
  const T* v;
  S k_scales;
  S v_scales;
};

// Asks for a pool row and its scales.
template <typename T, typename S>
inline void prefetch_row(const T* buffer, const S& scales, int64_t slot, int64_t row) {
  prefetch(buffer + slot * row, row);
  scales.prefetch(slot);
}

// Copies `dim` elements to float32: values as they are, codes times their scale.
inline void copy_row(const float* __restrict from, int64_t dim, float /*scale: 1*/,
                     float* __restrict to) {
  std::memcpy(to, from, dim * sizeof(float));
}

inline void copy_row(const bf16* __restrict from, int64_t dim, float /*scale: 1*/,
                     float* __restrict to) {
  for (int64_t d = 0; d < dim; ++d) to[d] = to_float(from[d]);
}

template <typename Code>
inline void copy_row(const Code* __restrict from, int64_t dim, float scale,
                     float* __restrict to) {
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8) store8(to + d, load8(from + d) * splat8(scale));
  for (; d < dim; ++d) to[d] = to_float(from[d]) * scale;
}

// Pool elements as the decode paths multiply them, read in place: values as they are,
// int8 codes as the integer, FP8 codes as their value times 2^-8 (widen_fp8: three
// instructions where load8's exact construction takes fifteen). A row's code scale, times
// kCodeUnit<T> (the 2^8), is applied once to each dot product rather than to each code.
template <typename T>
inline float8 code_load8(const T* p) {
  return load8(p);
}

template <>
inline float8 code_load8(const fp8* p) {
  return framework_cpu::widen_fp8(reinterpret_cast<const int8_t*>(p));
}

template <typename T>
inline float code_value(T x) {
  return to_float(x);
}

template <>
inline float code_value(fp8 x) {
  return to_float(x) * 0x1p-8f;
}

template <typename T>
constexpr float kCodeUnit = 1.f;
template <>
constexpr float kCodeUnit<fp8> = 256.f;

// factor[g] = base * the row's scale for KV head g (times kCodeUnit): what a decode
// token's products with pool row `slot` are multiplied by, per KV head.
template <typename T, typename S>
inline void row_factors(const S& scales, int64_t slot, int64_t kv_heads, float base,
                        float* factor) {
  for (int64_t g = 0; g < kv_heads; ++g) factor[g] = base * (kCodeUnit<T> * scales(slot, g));
}

// Copies head `head`'s [dim] slice of each token's pool row into out [len, dim].
template <typename T, typename S>
void gather_head(const T* __restrict buffer, const S& scales, const int64_t* __restrict slots,
                 int64_t len, int64_t row, int64_t head, int64_t dim, float* __restrict out) {
  for (int64_t t = 0; t < len; ++t) {
    if (t + kPrefetchDistance < len) {
      prefetch(buffer + slots[t + kPrefetchDistance] * row + head * dim, dim);
      scales.prefetch(slots[t + kPrefetchDistance]);
    }
    copy_row(buffer + slots[t] * row + head * dim, dim, scales(slots[t], head), out + t * dim);
  }
}

// s[j] = scale * (q . k_j) for keys j < n of k [n, dim]. Four keys at a time, each with
// its own accumulator, so that their multiply-adds overlap instead of waiting on one
// another.
template <typename T>
void scores(const float* __restrict q, const T* __restrict k, int64_t n, int64_t dim,
            float scale, float* __restrict s) {
  if (dim % 8 != 0) {
    for (int64_t j = 0; j < n; ++j) {
      float acc = 0.f;
      for (int64_t d = 0; d < dim; ++d) acc += q[d] * code_value(k[j * dim + d]);
      s[j] = acc * scale;
    }
    return;
  }
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const T* k0 = k + j * dim;
    float8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int64_t d = 0; d < dim; d += 8) {
      const float8 qd = load8(q + d);
      a0 += qd * code_load8(k0 + d);
      a1 += qd * code_load8(k0 + dim + d);
      a2 += qd * code_load8(k0 + 2 * dim + d);
      a3 += qd * code_load8(k0 + 3 * dim + d);
    }
    s[j] = sum8(a0) * scale;
    s[j + 1] = sum8(a1) * scale;
    s[j + 2] = sum8(a2) * scale;
    s[j + 3] = sum8(a3) * scale;
  }
  for (; j < n; ++j) {
    float8 acc = {};
    for (int64_t d = 0; d < dim; d += 8) acc += load8(q + d) * code_load8(k + j * dim + d);
    s[j] = sum8(acc) * scale;
  }
}

// In place: s [n] becomes cap * tanh(s / cap), scores bounded to (-cap, cap).
void soft_cap(float* __restrict s, int64_t n, float cap) {
  const float inv = 1.f / cap;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) s[j] = cap * std::tanh(s[j] * inv);
}

// In place: s [n] becomes softmax(s).
void softmax(float* __restrict s, int64_t n) {
  float top = s[0];  // subtracted first, so that exp() cannot overflow
  for (int64_t j = 1; j < n; ++j) top = std::max(top, s[j]);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - top);
    total += s[j];
  }
  const float inv = 1.f / total;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) s[j] *= inv;
}

// out [dim] = sum over j < n of w[j] * v_j, v [n, dim]; four partial sums per column
// block, for the same reason as in scores().
void weighted_sum(const float* __restrict w, const float* __restrict v, int64_t n,
                  int64_t dim, float* __restrict out) {
  if (dim % 8 != 0) {
    std::fill(out, out + dim, 0.f);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < dim; ++d) out[d] += w[j] * v[j * dim + d];
    return;
  }
  for (int64_t d = 0; d < dim; d += 8) {
    float8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      const float* vj = v + j * dim + d;
      a0 += splat8(w[j]) * load8(vj);
      a1 += splat8(w[j + 1]) * load8(vj + dim);
      a2 += splat8(w[j + 2]) * load8(vj + 2 * dim);
      a3 += splat8(w[j + 3]) * load8(vj + 3 * dim);
    }
    for (; j < n; ++j) a0 += splat8(w[j]) * load8(v + j * dim + d);
    store8(out + d, (a0 + a1) + (a2 + a3));
  }
}

struct Shapes {
  int64_t heads, kv_heads, dim, context;
  // [heads]: where query head h's key/value head starts in a pool row, (h / group) * dim;
  // looked up rather than divided per pool row, where an integer division costs as much
  // as a small head's multiply-adds (the default model's 4 heads of 32, bfloat16, one
  // thread on the Zen 4 EPYC: six decode tokens of a request over 250 rows 47 -> 43 us,
  // one token over 500 rows 25.8 -> 23.6 us).
  const int64_t* kv_at;
  // [heads]: query head h's key/value head, h / group (looked up for the same reason).
  const int64_t* kv_of;
};

// A layer's variant of causal attention: window (0: none) and cap (0: none).
struct Variant {
  int64_t window;
  float cap;
};

// The first key (position) the query at position p sees.
inline int64_t first_key(int64_t p, const Variant& var) {
  return var.window > 0 ? std::max<int64_t>(0, p - var.window + 1) : 0;
}

// In place: the scores s [n] of one query become its weights.
inline void weights(float* s, int64_t n, const Variant& var) {
  if (var.cap > 0.f) soft_cap(s, n, var.cap);
  softmax(s, n);
}

// s[h * len] = c_h * (q_h . k_g), g = h / group, for every query head h of one pool row k
// (read in place: code_load8): c_h = factor[g] (row_factors) for codes, `scale` for values.
template <bool kScaled, typename T>
void row_scores(const Shapes& sh, const float* __restrict q, const T* __restrict k,
                float scale, const float* __restrict factor, int64_t len,
                float* __restrict s) {
  const int64_t dim = sh.dim;
  auto times = [&](int64_t h) {
    if constexpr (kScaled) {
      return factor[sh.kv_of[h]];
    } else {
      return scale;
    }
  };
  if (dim % 8 != 0) {
    for (int64_t h = 0; h < sh.heads; ++h) scores(q + h * dim, k + sh.kv_at[h], 1, dim,
                                                  times(h), s + h * len);
    return;
  }
  int64_t h0 = 0;
  for (; h0 + 4 <= sh.heads; h0 += 4) {
    const float* q0 = q + h0 * dim;
    const T* k0 = k + sh.kv_at[h0];
    const T* k1 = k + sh.kv_at[h0 + 1];
    const T* k2 = k + sh.kv_at[h0 + 2];
    const T* k3 = k + sh.kv_at[h0 + 3];
    float8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int64_t d = 0; d < dim; d += 8) {
      a0 += load8(q0 + d) * code_load8(k0 + d);
      a1 += load8(q0 + dim + d) * code_load8(k1 + d);
      a2 += load8(q0 + 2 * dim + d) * code_load8(k2 + d);
      a3 += load8(q0 + 3 * dim + d) * code_load8(k3 + d);
    }
    s[h0 * len] = sum8(a0) * times(h0);
    s[(h0 + 1) * len] = sum8(a1) * times(h0 + 1);
    s[(h0 + 2) * len] = sum8(a2) * times(h0 + 2);
    s[(h0 + 3) * len] = sum8(a3) * times(h0 + 3);
  }
  for (; h0 < sh.heads; ++h0) scores(q + h0 * dim, k + sh.kv_at[h0], 1, dim, times(h0),
                                     s + h0 * len);
}

// Pool rows taken together by the value pass of a decode token.
constexpr int64_t kValueBlock = 8;
// How far ahead the scores pass of a decode token prefetches its key rows: a little
// further than the copies of the extend path, as each row costs it less work.
constexpr int64_t kDecodePrefetchRows = 6;

// out_h += sum over j < n of w[h * len + j] * v_j,g, g = h / group, for every query head h,
// for the n <= kValueBlock pool rows v_j (read in place: code_load8); with codes, each
// weight times the row's factor for g (factor [n, kv_heads], from row_factors; nullptr:
// values). Each output block is loaded and stored once per n rows rather than once per row.
template <typename T>
void block_values(const Shapes& sh, const float* __restrict w,
                  const T* const* __restrict v, const float* __restrict factor, int64_t n,
                  int64_t len, float* __restrict out) {
  const int64_t dim = sh.dim;
  float scaled[kValueBlock];
  for (int64_t h = 0; h < sh.heads; ++h) {
    const float* wh = w + h * len;
    if (factor != nullptr) {
      for (int64_t j = 0; j < n; ++j) scaled[j] = wh[j] * factor[j * sh.kv_heads + sh.kv_of[h]];
      wh = scaled;
    }
    const int64_t at = sh.kv_at[h];
    float* oh = out + h * dim;
    if (dim % 8 != 0) {
      for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < dim; ++d) oh[d] += wh[j] * code_value(v[j][at + d]);
      continue;
    }
    for (int64_t d = 0; d < dim; d += 8) {
      float8 a0 = load8(oh + d), a1 = {};
      int64_t j = 0;
      for (; j + 2 <= n; j += 2) {
        a0 += splat8(wh[j]) * code_load8(v[j] + at + d);
        a1 += splat8(wh[j + 1]) * code_load8(v[j + 1] + at + d);
      }
      if (j < n) a0 += splat8(wh[j]) * code_load8(v[j] + at + d);
      store8(oh + d, a0 + a1);
    }
  }
}

// One decode token: q, out [heads, dim]; the request's len tokens at `slots`. Rows are
// read in place, each row's heads at once; with codes, each row's factors (row_factors)
// scale its products.
template <typename T, typename S>
void decode_one(const Shapes& sh, const Variant& var, const float* q, const Pool<T, S>& pool,
                const int64_t* slots, int64_t len, float scale, float* out,
                std::vector<float>& scratch) {
  const int64_t row = sh.kv_heads * sh.dim, kv = sh.kv_heads;
  // The token, at position len - 1, reads only the rows of its window.
  const int64_t skipped = first_key(len - 1, var);
  slots += skipped;
  len -= skipped;
  // [heads, len] scores, then the factors of a key row and of kValueBlock value rows.
  scratch.resize(static_cast<size_t>(sh.heads * len + (kValueBlock + 1) * kv));
  float* s = scratch.data();
  float* k_factor = s + sh.heads * len;
  float* v_factor = k_factor + kv;
  // Each pass starts by asking for its first rows, so that it does not begin on a miss
  // per row until its prefetches ahead take over.
  for (int64_t t = 0; t < std::min(kDecodePrefetchRows, len); ++t)
    prefetch_row(pool.k, pool.k_scales, slots[t], row);
  for (int64_t t = 0; t < len; ++t) {
    if (t + kDecodePrefetchRows < len)
      prefetch_row(pool.k, pool.k_scales, slots[t + kDecodePrefetchRows], row);
    if constexpr (S::kScaled) row_factors<T>(pool.k_scales, slots[t], kv, scale, k_factor);
    row_scores<S::kScaled>(sh, q, pool.k + slots[t] * row, scale, k_factor, len, s + t);
  }
  for (int64_t t = 0; t < std::min(kValueBlock, len); ++t)
    prefetch_row(pool.v, pool.v_scales, slots[t], row);
  for (int64_t h = 0; h < sh.heads; ++h) weights(s + h * len, len, var);
  std::fill(out, out + sh.heads * sh.dim, 0.f);
  const T* rows[kValueBlock];
  for (int64_t t0 = 0; t0 < len; t0 += kValueBlock) {
    const int64_t n = std::min(kValueBlock, len - t0);
    for (int64_t j = 0; j < n; ++j) {
      rows[j] = pool.v + slots[t0 + j] * row;
      if constexpr (S::kScaled)
        row_factors<T>(pool.v_scales, slots[t0 + j], kv, 1.f, v_factor + j * kv);
      if (t0 + j + kValueBlock < len)
        prefetch_row(pool.v, pool.v_scales, slots[t0 + j + kValueBlock], row);
    }
    block_values(sh, s + t0, rows, S::kScaled ? v_factor : nullptr, n, len, out);
  }
}

// Pool row `row` of `width` elements as decode_one's products read it (code_load8: codes
// without their scales), widened to float32 into `to` once for the tokens of a group;
// float32 rows as they are.
template <typename T>
inline const float* widen_row(const T* row, int64_t width, float* to) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else if constexpr (std::is_same_v<T, fp8>) {
    int64_t d = 0;
    for (; d + 8 <= width; d += 8) store8(to + d, code_load8(row + d));
    for (; d < width; ++d) to[d] = code_value(row[d]);
    return to;
  } else {  // a loop the compiler vectorizes at the machine's width
    for (int64_t d = 0; d < width; ++d) to[d] = code_value(row[d]);
    return to;
  }
}

// `count` decode tokens of one request at consecutive positions (a verify step's): token
// i sees the first len + i tokens; q, out [count, heads, dim]. Each token's scores,
// weights and sums are decode_one's, operation for operation (the same rows, or rows
// widened to the floats decode_one's products read, with the same factors), so each
// token's output is what it gets alone, bit for bit; but every pool row is fetched, and
// its factors computed, once for all of them (and widened once, but for code keys). No
// sliding window (decode_one skips a different number of rows per token).
template <typename T, typename S>
void decode_group(const Shapes& sh, const Variant& var, const float* q, const Pool<T, S>& pool,
                  const int64_t* slots, int64_t len, int64_t count, float scale, float* out,
                  std::vector<float>& scratch) {
  const int64_t row = sh.kv_heads * sh.dim, kv = sh.kv_heads, last = len + count - 1;
  // Token i's [heads, len + i] scores at s + sh.heads * (i * len + i * (i - 1) / 2), then
  // the factors of one key row and of kValueBlock value rows, then one widened key row
  // and kValueBlock widened value rows.
  const int64_t scores_size = sh.heads * (count * len + count * (count - 1) / 2);
  scratch.resize(static_cast<size_t>(scores_size + (kValueBlock + 1) * (kv + row)));
  float* s = scratch.data();
  float* k_factor = s + scores_size;
  float* v_factor = k_factor + kv;
  float* wide = v_factor + kValueBlock * kv;
  auto scores_of = [&](int64_t i) { return s + sh.heads * (i * len + i * (i - 1) / 2); };
  for (int64_t t = 0; t < std::min(kDecodePrefetchRows, last); ++t)
    prefetch_row(pool.k, pool.k_scales, slots[t], row);
  for (int64_t t = 0; t < last; ++t) {
    if (t + kDecodePrefetchRows < last)
      prefetch_row(pool.k, pool.k_scales, slots[t + kDecodePrefetchRows], row);
    // Codes: the key row read in place, as decode_one reads it (scores of the same floats
    // read from a widened row came out in other last bits with float32 queries: the two
    // instantiations compile to other orders of operations); values: widened once.
    const auto k = [&] {
      if constexpr (S::kScaled) {
        row_factors<T>(pool.k_scales, slots[t], kv, scale, k_factor);
        return pool.k + slots[t] * row;
      } else {
        return widen_row(pool.k + slots[t] * row, row, wide);
      }
    }();
    for (int64_t i = std::max<int64_t>(0, t + 1 - len); i < count; ++i)
      row_scores<S::kScaled>(sh, q + i * sh.heads * sh.dim, k, scale, k_factor, len + i,
                             scores_of(i) + t);
  }
  for (int64_t t = 0; t < std::min(kValueBlock, last); ++t)
    prefetch_row(pool.v, pool.v_scales, slots[t], row);
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t h = 0; h < sh.heads; ++h) weights(scores_of(i) + h * (len + i), len + i, var);
    std::fill(out + i * sh.heads * sh.dim, out + (i + 1) * sh.heads * sh.dim, 0.f);
  }
  const float* rows[kValueBlock];
  float* values = wide + row;
  for (int64_t t0 = 0; t0 < last; t0 += kValueBlock) {
    const int64_t n = std::min(kValueBlock, last - t0);
    for (int64_t j = 0; j < n; ++j) {
      rows[j] = widen_row(pool.v + slots[t0 + j] * row, row, values + j * row);
      if constexpr (S::kScaled)
        row_factors<T>(pool.v_scales, slots[t0 + j], kv, 1.f, v_factor + j * kv);
      if (t0 + j + kValueBlock < last)
        prefetch_row(pool.v, pool.v_scales, slots[t0 + j + kValueBlock], row);
    }
    for (int64_t i = std::max<int64_t>(0, t0 + 1 - len); i < count; ++i)
      block_values(sh, scores_of(i) + t0, rows, S::kScaled ? v_factor : nullptr,
                   std::min(n, len + i - t0), len + i, out + i * sh.heads * sh.dim);
  }
}

// Queries of one head, and keys, taken together by the tiled extend path.
constexpr int64_t kQueryTile = 8;
constexpr int64_t kKeyTile = 16;

// Copies head `head`'s [dim] slice of each token's pool row into the columns of
// out [dim, ld] (keys transposed: a key tile's values of one feature are contiguous);
// columns len..ld are zeroed. dim: a multiple of 8.
template <typename T, typename S>
void gather_head_transposed(const T* __restrict buffer, const S& scales,
                            const int64_t* __restrict slots, int64_t len, int64_t row,
                            int64_t head, int64_t dim, int64_t ld, float* __restrict out) {
  for (int64_t t = 0; t < len; ++t) {
    if (t + kPrefetchDistance < len) {
      prefetch(buffer + slots[t + kPrefetchDistance] * row + head * dim, dim);
      scales.prefetch(slots[t + kPrefetchDistance]);
    }
    const T* src = buffer + slots[t] * row + head * dim;
    const float8 scale = splat8(scales(slots[t], head));
    for (int64_t d = 0; d < dim; d += 8) {
      const float8 x = load8(src + d) * scale;
      for (int64_t i = 0; i < 8; ++i) out[(d + i) * ld + t] = x[i];
    }
  }
  for (int64_t d = 0; d < dim; ++d) std::fill(out + d * ld + len, out + (d + 1) * ld, 0.f);
}

// s[r * ld + j] = scale * (q_r . k_j) for the kQueryTile queries q_r and keys j < cols
// (a multiple of kKeyTile), keys_t [dim, ld]. Each feature of a key tile is loaded once
// for all the queries, and every sum stays in its own register: no horizontal sums.
void tile_scores(const float* const* __restrict q, const float* __restrict keys_t, int64_t ld,
                 int64_t cols, int64_t dim, float scale, float* __restrict s) {
  for (int64_t j = 0; j < cols; j += kKeyTile) {
    float8 acc[kQueryTile][2] = {};
    for (int64_t d = 0; d < dim; ++d) {
      const float8 k0 = load8(keys_t + d * ld + j), k1 = load8(keys_t + d * ld + j + 8);
#pragma GCC unroll 16
      for (int64_t r = 0; r < kQueryTile; ++r) {
        const float8 b = splat8(q[r][d]);
        acc[r][0] += b * k0;
        acc[r][1] += b * k1;
      }
    }
    const float8 f = splat8(scale);
#pragma GCC unroll 16
    for (int64_t r = 0; r < kQueryTile; ++r) {
      store8(s + r * ld + j, acc[r][0] * f);
      store8(s + r * ld + j + 8, acc[r][1] * f);
    }
  }
}

// out_r [dim] = sum over j < n of p[r * ld + j] * v_j for the kQueryTile rows of weights p,
// values v [n, dim], dim a multiple of 16: each value row is loaded once for all rows.
void tile_values(const float* __restrict p, int64_t ld, const float* __restrict v, int64_t n,
                 int64_t dim, float* const* __restrict out) {
  for (int64_t d = 0; d < dim; d += 16) {
    float8 acc[kQueryTile][2] = {};
    for (int64_t j = 0; j < n; ++j) {
      const float8 v0 = load8(v + j * dim + d), v1 = load8(v + j * dim + d + 8);
#pragma GCC unroll 16
      for (int64_t r = 0; r < kQueryTile; ++r) {
        const float8 b = splat8(p[r * ld + j]);
        acc[r][0] += b * v0;
        acc[r][1] += b * v1;
      }
    }
#pragma GCC unroll 16
    for (int64_t r = 0; r < kQueryTile; ++r) {
      store8(out[r] + d, acc[r][0]);
      store8(out[r] + d + 8, acc[r][1]);
    }
  }
}

// Every new token of one request, for the query heads of key/value head g, dim a multiple
// of 16: kQueryTile queries of a head at a time against the head's keys (transposed) and
// values, as two small matrix products around each query's softmax. A tile computes the
// scores from the key tile holding its first query's first key up to its last query's
// position; each query's softmax takes only what it sees, and its other weights are
// zero. Missing queries of a last, partial tile read zeros and write to scratch. Keys
// are copied from the first one the request's first new token sees (`start`) and
// indexed from there.
template <typename T, typename S>
void extend_tiled(const Shapes& sh, const Variant& var, const float* q, const Pool<T, S>& pool,
                  const int64_t* slots, int64_t seq_len, int64_t num_new, int64_t g,
                  float scale, float* out, std::vector<float>& scratch) {
  const int64_t dim = sh.dim, group = sh.heads / sh.kv_heads, row = sh.kv_heads * dim;
  const int64_t prefix = seq_len - num_new;
  const int64_t start = first_key(prefix, var);
  const int64_t len = seq_len - start;  // keys copied
  const int64_t ld = (len + kKeyTile - 1) / kKeyTile * kKeyTile;
  scratch.resize(static_cast<size_t>(dim * ld + len * dim + kQueryTile * ld + 2 * dim));
  float* keys_t = scratch.data();
  float* values = keys_t + dim * ld;
  float* s = values + len * dim;
  float* zeros = s + kQueryTile * ld;
  float* spill = zeros + dim;
  std::fill(zeros, zeros + dim, 0.f);
  gather_head_transposed(pool.k, pool.k_scales, slots + start, len, row, g, dim, ld, keys_t);
  gather_head(pool.v, pool.v_scales, slots + start, len, row, g, dim, values);
  const float* q_rows[kQueryTile];
  float* out_rows[kQueryTile];
  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    for (int64_t i0 = 0; i0 < num_new; i0 += kQueryTile) {
      const int64_t tile = std::min(kQueryTile, num_new - i0);
      for (int64_t r = 0; r < kQueryTile; ++r) {
        const int64_t at = ((i0 + r) * sh.heads + h) * dim;
        q_rows[r] = r < tile ? q + at : zeros;
        out_rows[r] = r < tile ? out + at : spill;
      }
      const int64_t seen = prefix + i0 + tile - start;  // past the tile's last query's key
      // The products start at a key tile's boundary, so that they stay within ld.
      const int64_t from = (first_key(prefix + i0, var) - start) / kKeyTile * kKeyTile;
      const int64_t cols = (seen + kKeyTile - 1) / kKeyTile * kKeyTile - from;
      tile_scores(q_rows, keys_t + from, ld, cols, dim, scale, s);
      for (int64_t r = 0; r < kQueryTile; ++r) {
        // The row's keys, as columns of s: lo .. end - 1.
        float* sr = s + r * ld;
        const int64_t p = prefix + i0 + r;
        const int64_t end = r < tile ? p + 1 - start - from : 0;
        const int64_t lo = r < tile ? first_key(p, var) - start - from : 0;
        if (end > 0) weights(sr + lo, end - lo, var);
        std::fill(sr, sr + lo, 0.f);
        std::fill(sr + end, sr + seen - from, 0.f);
      }
      tile_values(s, ld, values + from * dim, seen - from, dim, out_rows);
    }
  }
}

// Every new token of one request, for the query heads of key/value head g: any dim, one
// query at a time. Keys are copied from the first one the request's first new token
// sees (`start`) and indexed from there.
template <typename T, typename S>
void extend_one(const Shapes& sh, const Variant& var, const float* q, const Pool<T, S>& pool,
                const int64_t* slots, int64_t seq_len, int64_t num_new, int64_t g,
                float scale, float* out, std::vector<float>& scratch) {
  const int64_t dim = sh.dim, group = sh.heads / sh.kv_heads, row = sh.kv_heads * dim;
  const int64_t prefix = seq_len - num_new;
  const int64_t start = first_key(prefix, var);
  const int64_t len = seq_len - start;  // keys copied
  scratch.resize(static_cast<size_t>(2 * len * dim + len));
  float* keys = scratch.data();
  float* values = keys + len * dim;
  float* s = values + len * dim;
  gather_head(pool.k, pool.k_scales, slots + start, len, row, g, dim, keys);
  gather_head(pool.v, pool.v_scales, slots + start, len, row, g, dim, values);
  for (int64_t i = 0; i < num_new; ++i) {
    // Causal: the token's window up to itself, keys lo .. lo + visible - 1.
    const int64_t lo = first_key(prefix + i, var) - start;
    const int64_t visible = prefix + i + 1 - start - lo;
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      const int64_t at = (i * sh.heads + h) * dim;
      scores(q + at, keys + lo * dim, visible, dim, scale, s);
      weights(s, visible, var);
      weighted_sum(s, values + lo * dim, visible, dim, out + at);
    }
  }
}

void check_inputs(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                  const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                  const at::Tensor& seq_lens, const at::Tensor& extend_seq_lens,
                  int64_t window, double cap) {
  TORCH_CHECK(window >= 0 && cap >= 0,
              "paged_attention: window and cap must be >= 0 (0: none), got ", window, " and ",
              cap);
  TORCH_CHECK(q.dim() == 3 && k_buffer.dim() == 3 && v_buffer.dim() == 3,
              "paged_attention: q and the KV buffers must be 3-dimensional");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_attention: float32 or bfloat16 only (q), got ", q.scalar_type());
  const auto stored = k_buffer.scalar_type();
  TORCH_CHECK(v_buffer.scalar_type() == stored &&
                  (stored == q.scalar_type() || stored == at::kFloat8_e4m3fn ||
                   stored == at::kChar),
              "paged_attention: the KV buffers alike, in q's dtype or as 8-bit codes "
              "(float8_e4m3fn, int8), got ", stored, " and ", v_buffer.scalar_type(),
              " for q in ", q.scalar_type());
  for (const at::Tensor* t : {&req_to_token, &req_pool_indices, &seq_lens, &extend_seq_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong, "paged_attention: int64 indices only");
  for (const at::Tensor* t : {&q, &k_buffer, &v_buffer, &req_to_token, &req_pool_indices,
                              &seq_lens, &extend_seq_lens})
    TORCH_CHECK(t->is_contiguous(), "paged_attention: contiguous tensors only");
  TORCH_CHECK(k_buffer.size(2) == q.size(2) && v_buffer.sizes() == k_buffer.sizes(),
              "paged_attention: the KV buffers do not match q's head_dim");
  TORCH_CHECK(q.size(1) % k_buffer.size(1) == 0,
              "paged_attention: heads must be a multiple of kv_heads");
  const int64_t batch = req_pool_indices.numel();
  TORCH_CHECK(seq_lens.numel() == batch && extend_seq_lens.numel() == batch,
              "paged_attention: one seq_len and extend_seq_len per request");
  const int64_t* idx = req_pool_indices.const_data_ptr<int64_t>();
  const int64_t* lens = seq_lens.const_data_ptr<int64_t>();
  const int64_t* news = extend_seq_lens.const_data_ptr<int64_t>();
  int64_t tokens = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(news[b] >= 1 && news[b] <= lens[b] && lens[b] <= req_to_token.size(1) &&
                    idx[b] >= 0 && idx[b] < req_to_token.size(0),
                "paged_attention: request ", b, " has ", news[b], " new of ", lens[b],
                " tokens or req_pool_index ", idx[b], ": out of range");
    tokens += news[b];
  }
  TORCH_CHECK(tokens == q.size(0), "paged_attention: ", q.size(0),
              " query rows for ", tokens, " new tokens");
}

// 8-bit codes come with both scales, FP8's [kv_heads] float32, int8's [slots, kv_heads]
// float16; a pool in the model's dtype with none.
void check_scales(const at::Tensor& k_buffer, const std::optional<at::Tensor>& k_scale,
                  const std::optional<at::Tensor>& v_scale) {
  const bool fp8_codes = k_buffer.scalar_type() == at::kFloat8_e4m3fn;
  const bool int8_codes = k_buffer.scalar_type() == at::kChar;
  if (!fp8_codes && !int8_codes) {
    TORCH_CHECK(!k_scale.has_value() && !v_scale.has_value(),
                "paged_attention: scales are for 8-bit KV codes only");
    return;
  }
  TORCH_CHECK(k_scale.has_value() && v_scale.has_value(),
              "paged_attention: 8-bit KV codes need k_scale and v_scale");
  const int64_t slots = k_buffer.size(0), heads = k_buffer.size(1);
  for (const at::Tensor* t : {&*k_scale, &*v_scale}) {
    if (fp8_codes) {
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == heads &&
                      t->is_contiguous(),
                  "paged_attention: FP8 codes take contiguous float32 scales [kv_heads] ([",
                  heads, "]), got ", t->scalar_type(), " ", t->sizes());
    } else {
      TORCH_CHECK(t->scalar_type() == at::kHalf && t->dim() == 2 && t->size(0) == slots &&
                      t->size(1) == heads && t->is_contiguous(),
                  "paged_attention: int8 codes take contiguous float16 scales [slots, "
                  "kv_heads] ([", slots, ", ", heads, "]), got ", t->scalar_type(), " ",
                  t->sizes());
    }
  }
}

// The batch's requests: req_to_token [requests, context] (table) and, per request, its
// row there, its tokens and its new tokens.
struct Requests {
  const int64_t* table;
  const int64_t* idx;
  const int64_t* lens;
  const int64_t* news;
  int64_t batch;
};

// The kernel over a pool of T (q and out in float32, [tokens, heads, dim]).
template <typename T, typename S>
void attend(const Shapes& sh, const Variant& var, const float* qp, const Pool<T, S>& pool,
            const Requests& reqs, float s, float* op) {
  const int64_t batch = reqs.batch;
  const int64_t *idx = reqs.idx, *lens = reqs.lens, *news = reqs.news;
  std::vector<int64_t> first(static_cast<size_t>(batch));  // each request's first q row
  for (int64_t b = 0, row = 0; b < batch; row += news[b++]) first[b] = row;
  const int64_t row_floats = sh.heads * sh.dim;
  // Work items: (request, -n) for n decode tokens of one request row at consecutive
  // positions (a verify step's, given as requests of one new token each; n = 1: a plain
  // decode token), (request, g) for each key/value head of a request with several new
  // tokens.
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t b = 0; b < batch; ++b) {
    if (news[b] == 1) {
      int64_t n = 1;
      while (var.window == 0 && b + n < batch && news[b + n] == 1 && idx[b + n] == idx[b] &&
             lens[b + n] == lens[b] + n)
        ++n;
      items.emplace_back(b, -n);
      b += n - 1;
    } else {
      for (int64_t g = 0; g < sh.kv_heads; ++g) items.emplace_back(b, g);
    }
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t item = begin; item < end; ++item) {
      const auto [b, g] = items[item];
      const int64_t* slots = reqs.table + idx[b] * sh.context;
      const float* q_rows = qp + first[b] * row_floats;
      float* out_rows = op + first[b] * row_floats;
      if (g == -1) {
        decode_one(sh, var, q_rows, pool, slots, lens[b], s, out_rows, scratch);
      } else if (g < 0) {
        decode_group(sh, var, q_rows, pool, slots, lens[b], -g, s, out_rows, scratch);
      } else if (sh.dim % 16 == 0) {
        extend_tiled(sh, var, q_rows, pool, slots, lens[b], news[b], g, s, out_rows, scratch);
      } else {
        extend_one(sh, var, q_rows, pool, slots, lens[b], news[b], g, s, out_rows, scratch);
      }
    }
  });
}

// The kernel over `pool` for q in float32 or bfloat16; returns [tokens, heads, dim] in
// q's dtype.
template <typename T, typename S>
at::Tensor attend_q(const at::Tensor& q, const Shapes& sh, const Variant& var,
                    const Pool<T, S>& pool, const Requests& reqs, float s) {
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.scalar_type() == at::kFloat) {
    attend(sh, var, q.const_data_ptr<float>(), pool, reqs, s, out.mutable_data_ptr<float>());
    return out;
  }
  // bfloat16: the queries widened once, the output computed in float32 and rounded.
  const int64_t count = q.numel();
  std::vector<float> qf(static_cast<size_t>(count)), of(static_cast<size_t>(count));
  const bf16* qb = q.const_data_ptr<bf16>();
  for (int64_t i = 0; i < count; ++i) qf[i] = to_float(qb[i]);
  attend(sh, var, qf.data(), pool, reqs, s, of.data());
  bf16* ob = out.mutable_data_ptr<bf16>();
  for (int64_t i = 0; i < count; ++i) ob[i] = round_to<bf16>(of[i]);
  return out;
}

// q: [tokens, heads, dim], the batch's new tokens packed request after request;
// k_buffer, v_buffer: [pool_slots, kv_heads, dim], the new tokens' keys and values
// already written, in q's dtype or as 8-bit codes (FP8 E4M3 or int8) with k_scale and
// v_scale (FP8: [kv_heads] float32, int8: [pool_slots, kv_heads] float16);
// req_to_token: [requests, context]; req_pool_indices, seq_lens, extend_seq_lens:
// [batch], int64; window: the sliding window (0: none); cap: the scores' soft cap
// (0: none). Returns [tokens, heads, dim] in q's dtype.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_buffer,
                           const at::Tensor& v_buffer, const at::Tensor& req_to_token,
                           const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                           const at::Tensor& extend_seq_lens, double scale, int64_t window,
                           double cap, const std::optional<at::Tensor>& k_scale,
                           const std::optional<at::Tensor>& v_scale) {
  check_inputs(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
               extend_seq_lens, window, cap);
  check_scales(k_buffer, k_scale, v_scale);
  const int64_t heads = q.size(1), kv_heads = k_buffer.size(1), dim = q.size(2);
  std::vector<int64_t> kv_at(static_cast<size_t>(heads)), kv_of(static_cast<size_t>(heads));
  for (int64_t h = 0; h < heads; ++h) {
    kv_of[h] = h / (heads / kv_heads);
    kv_at[h] = kv_of[h] * dim;
  }
  const Shapes sh{heads, kv_heads, dim, req_to_token.size(1), kv_at.data(), kv_of.data()};
  const Variant var{window, static_cast<float>(cap)};
  const Requests reqs{req_to_token.const_data_ptr<int64_t>(),
                      req_pool_indices.const_data_ptr<int64_t>(),
                      seq_lens.const_data_ptr<int64_t>(),
                      extend_seq_lens.const_data_ptr<int64_t>(), req_pool_indices.numel()};
  const float s = static_cast<float>(scale);
  switch (k_buffer.scalar_type()) {
    case at::kFloat8_e4m3fn: {
      const Pool<fp8, HeadScales> pool{k_buffer.const_data_ptr<fp8>(),
                                       v_buffer.const_data_ptr<fp8>(),
                                       {k_scale->const_data_ptr<float>()},
                                       {v_scale->const_data_ptr<float>()}};
      return attend_q(q, sh, var, pool, reqs, s);
    }
    case at::kChar: {
      const Pool<int8_t, SlotScales> pool{k_buffer.const_data_ptr<int8_t>(),
                                          v_buffer.const_data_ptr<int8_t>(),
                                          {k_scale->const_data_ptr<c10::Half>(), sh.kv_heads},
                                          {v_scale->const_data_ptr<c10::Half>(), sh.kv_heads}};
      return attend_q(q, sh, var, pool, reqs, s);
    }
    case at::kFloat: {
      const Pool<float, Unscaled> pool{k_buffer.const_data_ptr<float>(),
                                       v_buffer.const_data_ptr<float>(), {}, {}};
      return attend_q(q, sh, var, pool, reqs, s);
    }
    default: {  // bfloat16, as q (check_inputs)
      const Pool<bf16, Unscaled> pool{k_buffer.const_data_ptr<bf16>(),
                                      v_buffer.const_data_ptr<bf16>(), {}, {}};
      return attend_q(q, sh, var, pool, reqs, s);
    }
  }
}

// k_buffer[loc[i]] = k[i] and v_buffer[loc[i]] = v[i] for the n new tokens: k and v are
// [n, kv_heads * dim] rows with contiguous features (column slices of qkv will do).
// One pass of row copies in parallel, where two indexed assignments in torch each
// walk the rows on one thread.
void write_kv(at::Tensor& k_buffer, at::Tensor& v_buffer, const at::Tensor& loc,
              const at::Tensor& k, const at::Tensor& v) {
  const auto dtype = k_buffer.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) &&
                  v_buffer.scalar_type() == dtype && k.scalar_type() == dtype &&
                  v.scalar_type() == dtype,
              "write_kv: float32 or bfloat16 only, the buffers and the new rows alike");
  TORCH_CHECK(k_buffer.is_contiguous() && v_buffer.is_contiguous() &&
                  v_buffer.sizes() == k_buffer.sizes() && k_buffer.dim() == 3,
              "write_kv: the KV buffers must be contiguous [slots, kv_heads, dim] alike");
  TORCH_CHECK(loc.scalar_type() == at::kLong && loc.dim() == 1 && loc.is_contiguous(),
              "write_kv: loc must be contiguous int64 [n]");
  const int64_t n = loc.numel(), width = k_buffer.size(1) * k_buffer.size(2);
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == n && t->size(1) == width && t->stride(1) == 1,
                "write_kv: k and v must be [", n, ", ", width, "] with contiguous features");
  const int64_t* slots = loc.const_data_ptr<int64_t>();
  const int64_t pool = k_buffer.size(0);
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < pool, "write_kv: slot ", slots[i],
                " is outside the pool of ", pool);
  // Bytes: the rows are copied as they are, whatever the dtype.
  const int64_t size = k_buffer.element_size(), row_bytes = width * size;
  char* kb = static_cast<char*>(k_buffer.mutable_data_ptr());
  char* vb = static_cast<char*>(v_buffer.mutable_data_ptr());
  const char* kp = static_cast<const char*>(k.const_data_ptr());
  const char* vp = static_cast<const char*>(v.const_data_ptr());
  const int64_t k_stride = k.stride(0) * size, v_stride = v.stride(0) * size;
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(kb + slots[i] * row_bytes, kp + i * k_stride, row_bytes);
      std::memcpy(vb + slots[i] * row_bytes, vp + i * v_stride, row_bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY(framework_cpu, m) {
  m.def("write_kv(Tensor(a!) k_buffer, Tensor(b!) v_buffer, Tensor loc, Tensor k, Tensor v) -> ()");
  m.impl("write_kv", c10::DispatchKey::CPU, &write_kv);
  m.def(
      "paged_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, "
      "Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, float scale, "
      "int window=0, float cap=0., Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
}
