// Attention of a few query rows that read one KV head (a decode token's query heads per KV head): per row, dot
// products with each key and weighted sums of the values, on 16-float vectors (cpu_vec.h); the keys and values
// are read as rows ([key][head_dim], at `offset` in each key's row). Many rows: cpu_attention_lanes.h.
#pragma once

#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

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

// out[i][0:D] += sum_k p[i][k] * v[k][0:D] for `rows` (1..4) rows, D a multiple of 16 up to 256.
template <int kRows>
inline void values_block(const float* p, int64_t p_stride, const float* const* v, int64_t offset, int64_t n,
                         int64_t D, float* out, int64_t out_stride) {
  for (int64_t c = 0; c < D; c += 64) {
    const int chunks = static_cast<int>(std::min<int64_t>(64, D - c) / 16);
    v16 acc[kRows][4];
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < chunks; ++j) acc[i][j] = load16(out + i * out_stride + c + 16 * j);
    for (int64_t k = 0; k < n; ++k) {
      v16 vk[4];
      for (int j = 0; j < chunks; ++j) vk[j] = load16(v[k] + offset + c + 16 * j);
      for (int i = 0; i < kRows; ++i) {
        const float pk = p[i * p_stride + k];
        for (int j = 0; j < chunks; ++j) acc[i][j] += pk * vk[j];
      }
    }
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < chunks; ++j) store16(out + i * out_stride + c + 16 * j, acc[i][j]);
  }
}

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
  if (max != kNegInf && new_max != max) {
    const float correction = std::exp(max - new_max);
    sum *= correction;
    for (int64_t d = 0; d < D; ++d) acc[d] *= correction;
  }
  max = new_max;
  for (int64_t k = 0; k < tile; ++k) s[k] -= new_max;
  exp_inplace(s, tile);
  float tile_sum = 0.0f;
  for (int64_t k = 0; k < tile; ++k) tile_sum += s[k];
  sum += tile_sum;
}

}  // namespace radixserve_cpu
