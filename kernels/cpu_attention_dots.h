// Attention of a few query rows that read one KV head (a decode token's query heads per KV head): per row, dot
// products with each key and weighted sums of the values, on 16-float vectors (cpu_vec.h); the keys and values
// are read as rows ([key][head_dim], at `offset` in each key's row). Where the CPU has AVX-512 BF16, bfloat16 keys
// and values are read in place: the scores as bfloat16 pair products, the probabilities rounded to bfloat16
// against pairs of value rows, both summed in float32. Many rows: cpu_attention_lanes.h.
#pragma once

#include "cpu_vec.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace radixserve_cpu {

// The sum of x's 16 lanes, as a tree.
inline float reduce16(v16 x) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  const v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// scores[i][k] = q_i . key_k for `rows` (1..4) query rows and n keys stored as rows ([k][stride]); for few rows,
// (many rows attend as lanes, cpu_attention_lanes.h).
template <int kRows>
inline void scores_dots(const float* q, int64_t q_stride, const float* const* keys, int64_t offset, int64_t n,
                        int64_t D, float* s, int64_t s_stride) {
  for (int64_t k = 0; k < n; ++k) {
    const float* key = keys[k] + offset;
    v16 acc[kRows] = {};
    for (int64_t d = 0; d < D; d += 16) {
      const v16 kd = load16(key + d);
      for (int i = 0; i < kRows; ++i) acc[i] += load16(q + i * q_stride + d) * kd;
    }
    for (int i = 0; i < kRows; ++i) s[i * s_stride + k] = reduce16(acc[i]);
  }
}

// Runs f(std::integral_constant<int, chunks>{}, c) over the columns of a row of D (a multiple of 16), 64 at a time:
// `chunks` 16-float vectors from column c. The count is a compile-time constant so that a micro-kernel's
// accumulator arrays stay in registers (with a run-time count GCC keeps them on the stack).
template <typename F>
inline void for_column_chunks(int64_t D, F&& f) {
  for (int64_t c = 0; c < D; c += 64) {
    switch (std::min<int64_t>(64, D - c) / 16) {
      case 4: f(std::integral_constant<int, 4>{}, c); break;
      case 3: f(std::integral_constant<int, 3>{}, c); break;
      case 2: f(std::integral_constant<int, 2>{}, c); break;
      default: f(std::integral_constant<int, 1>{}, c); break;
    }
  }
}

// out[i][0:D] += sum_k p[i][k] * v[k][0:D] for `rows` (1..4) rows, D a multiple of 16 up to 256.
template <int kRows>
inline void values_block(const float* p, int64_t p_stride, const float* const* v, int64_t offset, int64_t n,
                         int64_t D, float* out, int64_t out_stride) {
  for_column_chunks(D, [&](auto chunks_constant, int64_t c) {
    constexpr int kChunks = decltype(chunks_constant)::value;
    v16 acc[kRows][kChunks];
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < kChunks; ++j) acc[i][j] = load16(out + i * out_stride + c + 16 * j);
    for (int64_t k = 0; k < n; ++k) {
      v16 vk[kChunks];
      for (int j = 0; j < kChunks; ++j) vk[j] = load16(v[k] + offset + c + 16 * j), pin(vk[j]);
      for (int i = 0; i < kRows; ++i) {
        const float pk = p[i * p_stride + k];
        for (int j = 0; j < kChunks; ++j) acc[i][j] += pk * vk[j];
      }
    }
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < kChunks; ++j) store16(out + i * out_stride + c + 16 * j, acc[i][j]);
  });
}

#if defined(__AVX512F__)
// Lane k of the result: the sum of acc[k]'s 16 lanes (halves, then quarters, then within 128-bit lanes, which
// leaves acc[4i + L] at 4L + i; a permutation puts it back).
inline __m512 reduce16x16(const __m512* acc) {
  __m512 half[8], quarter[4];
  for (int i = 0; i < 8; ++i)
    half[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                            _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xee));
  for (int i = 0; i < 4; ++i)
    quarter[i] = _mm512_add_ps(_mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], 0x88),
                               _mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], 0xdd));
  const __m512 u0 =
      _mm512_add_ps(_mm512_unpacklo_ps(quarter[0], quarter[1]), _mm512_unpackhi_ps(quarter[0], quarter[1]));
  const __m512 u1 =
      _mm512_add_ps(_mm512_unpacklo_ps(quarter[2], quarter[3]), _mm512_unpackhi_ps(quarter[2], quarter[3]));
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(u0, u1, 0x44), _mm512_shuffle_ps(u0, u1, 0xee));
  return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), sums);
}

// 16 values of a key or value row as float32 lanes: float32 and bfloat16 as cpu_vec.h's load16 reads them, float16
// through F16C.
inline __m512 load_f32(const float* p) { return __m512(load16(p)); }
inline __m512 load_f32(const c10::BFloat16* p) { return __m512(load16(p)); }
inline __m512 load_f32(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Lane k (0..7) of the result: the sum of acc[k]'s 16 lanes, by the tree of reduce16x16 (halves, quarters, then
// within 128-bit lanes).
inline __m256 reduce8x16(const __m512* acc) {
  __m512 half[4], quarter[2];
  for (int i = 0; i < 4; ++i)
    half[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                            _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xee));
  for (int i = 0; i < 2; ++i)  // 128-bit lane j of quarter[i]: four partial sums of acc[4i + j]
    quarter[i] = _mm512_add_ps(_mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], 0x88),
                               _mm512_shuffle_f32x4(half[2 * i], half[2 * i + 1], 0xdd));
  const __m512 u = _mm512_add_ps(_mm512_unpacklo_ps(quarter[0], quarter[1]),
                                 _mm512_unpackhi_ps(quarter[0], quarter[1]));
  const __m512 sums = _mm512_add_ps(u, _mm512_shuffle_ps(u, u, 0x4e));  // lane j: acc[j] at 0, acc[4 + j] at 1
  return _mm512_castps512_ps256(
      _mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 13, 9, 5, 1, 12, 8, 4, 0), sums));
}

// s[i][k] = q_i . keys[k][offset : offset + D] for kRows (1..3) float32 query rows and n keys of any pool dtype,
// 8 keys at a time: each key's row is loaded (and converted) once for all the rows, its products summed along D in
// a vector per (row, key) and the 8 keys' sums reduced together. The key pointers up to the next multiple of 8
// past n read zeros. A row's bits do not depend on kRows.
template <int kRows, typename T>
inline void scores_rows(const float* q, int64_t q_stride, const T* const* keys, int64_t offset, int64_t n,
                        int64_t D, float* s, int64_t s_stride) {
  for (int64_t k0 = 0; k0 < n; k0 += 8) {
    __m512 acc[kRows][8];
    for (int i = 0; i < kRows; ++i)
      for (int k = 0; k < 8; ++k) acc[i][k] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      __m512 qd[kRows];
      for (int i = 0; i < kRows; ++i) qd[i] = _mm512_loadu_ps(q + i * q_stride + d), pin(qd[i]);
      for (int k = 0; k < 8; ++k) {
        const __m512 kd = load_f32(keys[k0 + k] + offset + d);
        for (int i = 0; i < kRows; ++i) acc[i][k] = _mm512_fmadd_ps(kd, qd[i], acc[i][k]);
      }
    }
    for (int i = 0; i < kRows; ++i) _mm256_storeu_ps(s + i * s_stride + k0, reduce8x16(acc[i]));
  }
}

// out[i][0:D] += sum_k p[i][k] * v[k][0:D] for kRows (1..4) rows and n value rows of any pool dtype, each value
// row loaded (and converted) once for all the rows; D a multiple of 16. A row's bits do not depend on kRows.
// `between(k)` runs before key k's products (the caller's prefetches).
template <int kRows, typename T, typename F>
inline void values_rows(const float* p, int64_t p_stride, const T* const* v, int64_t offset, int64_t n, int64_t D,
                        float* out, int64_t out_stride, F&& between) {
  for_column_chunks(D, [&](auto chunks_constant, int64_t c) {
    constexpr int kChunks = decltype(chunks_constant)::value;
    __m512 acc[kRows][kChunks];
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < kChunks; ++j) acc[i][j] = _mm512_loadu_ps(out + i * out_stride + c + 16 * j);
    for (int64_t k = 0; k < n; ++k) {
      if (c == 0) between(k);
      __m512 vk[kChunks];
      for (int j = 0; j < kChunks; ++j) vk[j] = load_f32(v[k] + offset + c + 16 * j), pin(vk[j]);
      for (int i = 0; i < kRows; ++i) {
        const __m512 pk = _mm512_set1_ps(p[i * p_stride + k]);
        for (int j = 0; j < kChunks; ++j) acc[i][j] = _mm512_fmadd_ps(pk, vk[j], acc[i][j]);
      }
    }
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < kChunks; ++j) _mm512_storeu_ps(out + i * out_stride + c + 16 * j, acc[i][j]);
  });
}
#endif

#if defined(__AVX512BF16__)

// s[k] = scale * (q . keys[k] + offset) for n keys, as bfloat16 pair products (exact) summed in float32; the key
// pointers up to the next multiple of 16 past n read zeros.
inline void scores_bf16(const uint16_t* q, const uint16_t* const* keys, int64_t offset, int64_t n, int64_t D,
                        float scale, float* s) {
  for (int64_t k0 = 0; k0 < n; k0 += 16) {
    __m512 acc[16];
    for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) {
      const __mmask32 mask = D - d >= 32 ? 0xFFFFFFFFu : 0xFFFFu;
      const __m512bh qd = (__m512bh)_mm512_maskz_loadu_epi16(mask, q + d);
      for (int k = 0; k < 16; ++k)
        acc[k] = _mm512_dpbf16_ps(acc[k], (__m512bh)_mm512_maskz_loadu_epi16(mask, keys[k0 + k] + offset + d), qd);
    }
    _mm512_storeu_ps(s + k0, _mm512_mul_ps(reduce16x16(acc), _mm512_set1_ps(scale)));
  }
}

// out[i][0:D] += sum_k p[i][k] * v[k][0:D] for `rows` (1..4) rows, with p as bfloat16 bits (p[i * p_stride + k])
// and the values as bfloat16 rows, key pairs at once (the two rows interleaved; the row past an odd n reads zeros
// and its p is 0); D a multiple of 16.
// `between(k)` runs before the products of keys k and k + 1 (the caller's prefetches, for both).
template <int kRows, typename F>
inline void values_bf16(const uint16_t* p, int64_t p_stride, const uint16_t* const* v, int64_t offset, int64_t n,
                        int64_t D, float* out, int64_t out_stride, F&& between) {
  const __m512i pairs = pair_index();
  for_column_chunks(D, [&](auto chunks_constant, int64_t c) {
    constexpr int kChunks = decltype(chunks_constant)::value;
    __m512 acc[kRows][kChunks];
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < kChunks; ++j) acc[i][j] = _mm512_loadu_ps(out + i * out_stride + c + 16 * j);
    for (int64_t k = 0; k < n; k += 2) {
      if (c == 0) between(k);
      __m512bh vp[kChunks];
      for (int j = 0; j < kChunks; ++j) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v[k] + offset + c + 16 * j));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v[k + 1] + offset + c + 16 * j));
        vp[j] = (__m512bh)_mm512_permutexvar_epi16(pairs, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
      }
      for (int i = 0; i < kRows; ++i) {
        int32_t pair;
        std::memcpy(&pair, p + i * p_stride + k, sizeof(pair));
        const __m512bh pk = (__m512bh)_mm512_set1_epi32(pair);
        for (int j = 0; j < kChunks; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], vp[j], pk);
      }
    }
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < kChunks; ++j) _mm512_storeu_ps(out + i * out_stride + c + 16 * j, acc[i][j]);
  });
}
#endif

// A row's running max moves to `new_max`: its sum and accumulator acc[0:D], summed under the old max, are rescaled
// (nothing to rescale while nothing was summed, max still -inf).
inline void move_max(float& max, float new_max, float& sum, float* acc, int64_t D) {
  if (max != -std::numeric_limits<float>::infinity() && new_max != max) {
    const float correction = std::exp(max - new_max);
    sum *= correction;
    for (int64_t d = 0; d < D; ++d) acc[d] *= correction;
  }
  max = new_max;
}

#if defined(__AVX512F__)
// The scores of a 32-key tile in two vectors, -inf past the `last_visible` key of the n in the tile, with the row's
// running max moved over them (move_max); false (and nothing moved) where no key of the tile is visible.
inline bool tile_max32(const float* s, int64_t n, int64_t last_visible, float& max, float& sum, float* acc, int64_t D,
                       __m512& lo, __m512& hi) {
  const int64_t visible = std::min(n, std::max<int64_t>(0, last_visible + 1));
  if (visible == 0) return false;
  const uint32_t keep = visible >= 32 ? 0xFFFFFFFFu : (1u << visible) - 1;
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  lo = _mm512_mask_loadu_ps(minus_inf, static_cast<__mmask16>(keep), s);
  hi = _mm512_mask_loadu_ps(minus_inf, static_cast<__mmask16>(keep >> 16), s + 16);
  move_max(max, std::max(max, _mm512_reduce_max_ps(_mm512_max_ps(lo, hi))), sum, acc, D);
  return true;
}

// softmax_row for a tile of 32 keys in two vectors: the probabilities (exp16, as softmax_row) replace the scores in
// s[0:32], 0 past the `last_visible` key of the n in the tile.
inline void softmax_row32(float* s, int64_t n, int64_t last_visible, float& max, float& sum, float* acc, int64_t D) {
  __m512 lo, hi;
  if (!tile_max32(s, n, last_visible, max, sum, acc, D, lo, hi)) {
    std::memset(s, 0, 32 * sizeof(float));
    return;
  }
  const v16 p_lo = exp16(v16(lo) - max), p_hi = exp16(v16(hi) - max);
  sum += _mm512_reduce_add_ps(_mm512_add_ps(__m512(p_lo), __m512(p_hi)));
  store16(s, p_lo);
  store16(s + 16, p_hi);
}
#endif

#if defined(__AVX512BF16__)
// softmax_row for a tile of 32 keys in two vectors, the scores' exponentials in base 2 (exp2_16), the
// probabilities written to p[0:32] rounded to bfloat16 (0 past the last visible key).
inline void softmax_row32_bf16(const float* s, int64_t n, int64_t last_visible, float& max, float& sum, float* acc,
                               int64_t D, uint16_t* p) {
  constexpr float kLog2e = 1.4426950408889634f;
  __m512 lo, hi;
  if (!tile_max32(s, n, last_visible, max, sum, acc, D, lo, hi)) {
    std::memset(p, 0, 32 * sizeof(uint16_t));
    return;
  }
  const __m512 log2e = _mm512_set1_ps(kLog2e), shift = _mm512_set1_ps(max * kLog2e);
  const __m512 p_lo = exp2_16(_mm512_fmsub_ps(lo, log2e, shift));
  const __m512 p_hi = exp2_16(_mm512_fmsub_ps(hi, log2e, shift));
  sum += _mm512_reduce_add_ps(_mm512_add_ps(p_lo, p_hi));
  const __m512bh bits = _mm512_cvtne2ps_pbh(p_hi, p_lo);  // p_lo in the low half
  std::memcpy(p, &bits, 32 * sizeof(uint16_t));
}
#endif


// One row's scores of a tile of `tile` keys, s[0:tile], become probabilities (0 past the `last_visible` key of
// the n in the tile) under the row's running max; its sum and accumulator acc[0:D] are rescaled when the max grows.
inline void softmax_row(float* s, int64_t tile, int64_t n, int64_t last_visible, float& max, float& sum, float* acc,
                        int64_t D) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t visible = std::min(n, std::max<int64_t>(0, last_visible + 1));
  for (int64_t k = visible; k < tile; ++k) s[k] = kNegInf;
  if (visible == 0) {
    for (int64_t k = 0; k < tile; ++k) s[k] = 0.0f;
    return;
  }
  float tile_max = kNegInf;
  for (int64_t k = 0; k < visible; ++k) tile_max = std::max(tile_max, s[k]);
  const float new_max = std::max(max, tile_max);
  move_max(max, new_max, sum, acc, D);
  for (int64_t k = 0; k < tile; ++k) s[k] -= new_max;
  exp_inplace(s, tile);
  float tile_sum = 0.0f;
  for (int64_t k = 0; k < tile; ++k) tile_sum += s[k];
  sum += tile_sum;
}

}  // namespace radixserve_cpu
