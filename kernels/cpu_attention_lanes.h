// Attention of many query rows that read one KV head (a shared-prefix group's members x query heads per KV head,
// or a block of a request's new tokens), with the rows in the lanes of 16-float vectors: blocks of up to 64 rows
// (4 vectors) against tiles of keys, as small register-blocked matrix products.
//
// Per block the queries are stored transposed, qt[d][lane], and so is the output accumulator, acc[d][lane]; a
// tile's scores come out as s[key][lane]. So the keys and values are read as rows, straight from the pool in
// float32 or from one converted float32 copy per tile and KV head, with no transposition; each key element is
// broadcast against the lanes of every row vector, and each row's softmax state (running max, sum) is a lane of a
// vector, updated with vector operations. Lanes past the block's rows hold zero queries and are never read back.
// Where the CPU has AVX-512 BF16, bfloat16 scores are dot products of bfloat16 pairs (vdpbf16ps: exact products,
// float32 sums) of the unscaled queries with the pool's keys in place, scaled after, and the values' products
// take the probabilities rounded to bfloat16 against each column's pair of values from one transposed copy per
// tile and KV head (transpose_values), two keys per vdpbf16ps; elsewhere keys and values are converted to float32.
#pragma once

#include "cpu_attention_amx.h"
#include "cpu_vec.h"

#include <algorithm>
#include <cstdint>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace radixserve_cpu {

constexpr int kLaneVectors = 4;                // row vectors per block at most
constexpr int kLaneRows = 16 * kLaneVectors;   // rows per block at most
#ifdef __AVX512F__
constexpr int kAccumulators = 16;  // 16-float accumulators a micro-kernel keeps in registers (32 zmm)
#else
constexpr int kAccumulators = 6;   // AVX2: 16 ymm registers, two per accumulator
#endif

// Keys (or value columns) per micro-kernel step for `kVectors` row vectors: a power of two, at most 8, within
// the register budget; divides the key tile and every head_dim (multiples of 16).
template <int kVectors>
constexpr int step_width() {
  int width = 8;
  while (width > 1 && width * kVectors > kAccumulators) width /= 2;
  return width;
}

// s[k][lanes] = keys[k] . qt[:, lanes] for kSteps keys; qt is [D][16 * kVectors].
template <int kVectors, int kSteps>
inline void lane_scores(const float* qt, const float* const* keys, int64_t D, float* s) {
  constexpr int W = 16 * kVectors;
  v16 acc[kSteps][kVectors] = {};
  const float* key[kSteps];
  for (int k = 0; k < kSteps; ++k) key[k] = keys[k];
  for (int64_t d = 0; d < D; ++d) {
    v16 q[kVectors];
    for (int j = 0; j < kVectors; ++j) q[j] = load16(qt + d * W + 16 * j), pin(q[j]);
    for (int k = 0; k < kSteps; ++k) {
      const float kd = key[k][d];
      for (int j = 0; j < kVectors; ++j) acc[k][j] += kd * q[j];
    }
  }
  for (int k = 0; k < kSteps; ++k)
    for (int j = 0; j < kVectors; ++j) store16(s + k * W + 16 * j, acc[k][j]);
}

#if defined(__AVX512BF16__)
constexpr bool kBf16Dots = true;

// s[k][lanes] = keys[k] . q[:, lanes] for kSteps bfloat16 keys; qp holds the queries as bfloat16 pairs,
// [D / 2][16 * kVectors][2].
template <int kVectors, int kSteps>
inline void lane_scores_bf16(const uint16_t* qp, const uint16_t* const* keys, int64_t D, float* s) {
  constexpr int W = 16 * kVectors;
  __m512 acc[kSteps][kVectors];
  for (int k = 0; k < kSteps; ++k)
    for (int j = 0; j < kVectors; ++j) acc[k][j] = _mm512_setzero_ps();
  const uint16_t* key[kSteps];
  for (int k = 0; k < kSteps; ++k) key[k] = keys[k];
  for (int64_t i = 0; i < D / 2; ++i) {
    __m512bh q[kVectors];
    for (int j = 0; j < kVectors; ++j) q[j] = (__m512bh)_mm512_loadu_si512(qp + (i * W + 16 * j) * 2);
    for (int k = 0; k < kSteps; ++k) {
      int32_t pair;
      std::memcpy(&pair, key[k] + 2 * i, sizeof(pair));
      const __m512bh kp = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < kVectors; ++j) acc[k][j] = _mm512_dpbf16_ps(acc[k][j], kp, q[j]);
    }
  }
  for (int k = 0; k < kSteps; ++k)
    for (int j = 0; j < kVectors; ++j) _mm512_storeu_ps(s + k * W + 16 * j, acc[k][j]);
}

// vt[d][0:32] = rows[k][d] for the 32 keys of a tile (bfloat16 bits; rows past the tile's keys point at zeros),
// D a multiple of 16. Per 16 columns: each key pair's two rows interleaved into 32-bit pairs, then a 16 x 16
// transpose of those pairs (32-bit unpacks, then 128-bit lane shuffles).
inline void transpose_values(const uint16_t* const* rows, int64_t D, uint16_t* vt) {
  const __m512i pairs = pair_index();
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    __m512i r[16], t[16];
    for (int p = 0; p < 16; ++p) {  // r[p] = (key 2p, key 2p + 1) at the columns d0 + 0..15
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[2 * p] + d0));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[2 * p + 1] + d0));
      r[p] = _mm512_permutexvar_epi16(pairs, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
    }
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    // r[4a + b], 128-bit lane L: column 4L + b of the pair rows 4a..4a + 3.
    for (int a = 0; a < 4; ++a) {
      r[4 * a] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
      r[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
      r[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
      r[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
    }
    for (int b = 0; b < 4; ++b) {
      t[b] = _mm512_shuffle_i32x4(r[b], r[4 + b], 0x88);
      t[4 + b] = _mm512_shuffle_i32x4(r[b], r[4 + b], 0xdd);
      t[8 + b] = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0x88);
      t[12 + b] = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0xdd);
    }
    uint16_t* out = vt + d0 * 32;
    for (int b = 0; b < 4; ++b) {
      _mm512_storeu_si512(out + b * 32, _mm512_shuffle_i32x4(t[b], t[8 + b], 0x88));
      _mm512_storeu_si512(out + (8 + b) * 32, _mm512_shuffle_i32x4(t[b], t[8 + b], 0xdd));
      _mm512_storeu_si512(out + (4 + b) * 32, _mm512_shuffle_i32x4(t[4 + b], t[12 + b], 0x88));
      _mm512_storeu_si512(out + (12 + b) * 32, _mm512_shuffle_i32x4(t[4 + b], t[12 + b], 0xdd));
    }
  }
}

// acc[d][lanes] += sum_k vt[d][k] * p[k][lanes] over the 32 keys of a tile, as vdpbf16ps of key pairs (exact
// products, float32 sums): pp the probabilities as bfloat16 key pairs ([16 pairs][16 * kVectors lanes][2]), each
// column's pair of values broadcast from vt (transpose_values), step_width columns at a time.
template <int kVectors>
inline void lane_values_bf16(const uint16_t* pp, const uint16_t* vt, int64_t D, float* acc) {
  constexpr int W = 16 * kVectors;
  constexpr int kSteps = step_width<kVectors>();
  for (int64_t d0 = 0; d0 < D; d0 += kSteps) {
    __m512 sum[kSteps][kVectors];
    for (int c = 0; c < kSteps; ++c)
      for (int j = 0; j < kVectors; ++j) sum[c][j] = _mm512_loadu_ps(acc + (d0 + c) * W + 16 * j);
    for (int p = 0; p < 16; ++p) {
      __m512bh pk[kVectors];
      for (int j = 0; j < kVectors; ++j) pk[j] = (__m512bh)_mm512_loadu_si512(pp + (p * W + 16 * j) * 2);
      for (int c = 0; c < kSteps; ++c) {
        int32_t pair;
        std::memcpy(&pair, vt + (d0 + c) * 32 + 2 * p, sizeof(pair));
        const __m512bh v = (__m512bh)_mm512_set1_epi32(pair);
        for (int j = 0; j < kVectors; ++j) sum[c][j] = _mm512_dpbf16_ps(sum[c][j], v, pk[j]);
      }
    }
    for (int c = 0; c < kSteps; ++c)
      for (int j = 0; j < kVectors; ++j) _mm512_storeu_ps(acc + (d0 + c) * W + 16 * j, sum[c][j]);
  }
}
#else
constexpr bool kBf16Dots = false;
#endif

// acc[d][lanes] = acc[d][lanes] * correction + sum_k values[k][d] * p[k][lanes] for the kSteps columns from d0.
template <int kVectors, int kSteps>
inline void lane_values(const float* p, const float* const* values, int64_t n, int64_t d0, const v16* correction,
                        float* acc) {
  constexpr int W = 16 * kVectors;
  v16 sum[kSteps][kVectors];
  for (int c = 0; c < kSteps; ++c)
    for (int j = 0; j < kVectors; ++j) sum[c][j] = load16(acc + (d0 + c) * W + 16 * j) * correction[j];
  for (int64_t k = 0; k < n; ++k) {
    v16 pk[kVectors];
    for (int j = 0; j < kVectors; ++j) pk[j] = load16(p + k * W + 16 * j), pin(pk[j]);
    const float* value = values[k] + d0;
    pin_address(value);
    for (int c = 0; c < kSteps; ++c) {
      const float vd = value[c];
      for (int j = 0; j < kVectors; ++j) sum[c][j] += vd * pk[j];
    }
  }
  for (int c = 0; c < kSteps; ++c)
    for (int j = 0; j < kVectors; ++j) store16(acc + (d0 + c) * W + 16 * j, sum[c][j]);
}

// The state of up to kLaneRows rows of one KV head over a sequence of key tiles (see the header).
class LaneBlock {
 public:
  // Takes `rows` rows: queries q[r * D ...] (already scaled), accumulators acc[r * D ...], running max and sum,
  // and positions (the key at position p is seen iff p <= position).
  void load(int64_t rows, int64_t D, const float* q, const float* acc, const float* max, const float* sum,
            const int64_t* positions) {
    load_state(rows, D, acc, max, sum, positions);
    const int64_t W = 16 * vectors_;
    qt_.assign(D * W, 0.0f);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < D; ++d) qt_[d * W + r] = q[r * D + d];
    score_scale_ = 1.0f;
  }

  // The same with unscaled bfloat16 queries (their bits), for keys read as bfloat16 (tile_bf16); the scores are
  // scaled by `scale`.
  void load_bf16(int64_t rows, int64_t D, const uint16_t* q, float scale, const float* acc, const float* max,
                 const float* sum, const int64_t* positions) {
    load_state(rows, D, acc, max, sum, positions);
    const int64_t W = 16 * vectors_;
    qp_.assign(D * W, 0);
    for (int64_t r = 0; r < rows; ++r)  // a pair of bfloat16s at a time
      for (int64_t i = 0; i < D / 2; ++i) std::memcpy(qp_.data() + (i * W + r) * 2, q + r * D + 2 * i, 4);
    score_scale_ = scale;
  }

  // Gives the state back, in the row layout of `load`.
  void store(float* acc, float* max, float* sum) const {
    const int64_t W = 16 * vectors_;
    for (int64_t r = 0; r < rows_; ++r) {
      for (int64_t d = 0; d < D_; ++d) acc[r * D_ + d] = acc_[d * W + r];
      max[r] = max_[r], sum[r] = sum_[r];
    }
  }

  // One tile of n (1..kTile) keys at positions pos0, pos0 + 1, ...; keys/values point at each key's D values of
  // this KV head, with entries up to the step width past n pointing at readable (zero) rows. Keys as float32
  // after `load`, as bfloat16 after `load_bf16`; with `key_tile` (bfloat16 keys copied contiguously, see
  // lane_scores_amx, and an AmxTiles in scope), the scores are computed on AMX tiles. With `value_tile` (bfloat16
  // keys; the tile's values transposed, see transpose_values; kTile 32) the values' products take the
  // probabilities as bfloat16 pairs (`values` unread), on AMX tiles with `key_tile`, else as vdpbf16ps.
  template <int kTile, typename Key>
  void tile(const Key* const* keys, const float* const* values, int64_t n, int64_t pos0,
            const uint16_t* key_tile = nullptr, const uint16_t* value_tile = nullptr) {
    switch (vectors_) {
      case 1: return tile_for<1, kTile>(keys, values, n, pos0, key_tile, value_tile);
      case 2: return tile_for<2, kTile>(keys, values, n, pos0, key_tile, value_tile);
      case 3: return tile_for<3, kTile>(keys, values, n, pos0, key_tile, value_tile);
      default: return tile_for<4, kTile>(keys, values, n, pos0, key_tile, value_tile);
    }
  }

 private:
  static constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  void load_state(int64_t rows, int64_t D, const float* acc, const float* max, const float* sum,
                  const int64_t* positions) {
    rows_ = rows, D_ = D;
    vectors_ = static_cast<int>((rows + 15) / 16);
    const int64_t W = 16 * vectors_;
    acc_.assign(D * W, 0.0f);
    max_.assign(W, kNegInf);
    sum_.assign(W, 0.0f);
    position_.assign(W, std::numeric_limits<float>::max());  // padding lanes: never masked
    min_position_ = std::numeric_limits<int64_t>::max();
    for (int64_t r = 0; r < rows; ++r) {
      // A row that has seen no key yet (max -inf) has a zero accumulator: nothing to copy.
      if (max[r] != kNegInf)
        for (int64_t d = 0; d < D; ++d) acc_[d * W + r] = acc[r * D + d];
      max_[r] = max[r], sum_[r] = sum[r];
      position_[r] = static_cast<float>(positions[r]);  // exact: positions are far below 2^24
      min_position_ = std::min(min_position_, positions[r]);
    }
  }

  template <int kVectors, int kTile, typename Key>
  void tile_for(const Key* const* keys, const float* const* values, int64_t n, int64_t pos0,
                const uint16_t* key_tile, const uint16_t* value_tile) {
    constexpr int W = 16 * kVectors;
    constexpr int kSteps = step_width<kVectors>();
    static_assert(kTile % kSteps == 0, "the key tile must be a multiple of the step width");
    float* s = scores_;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if constexpr (!std::is_same_v<Key, float>) {
      if (key_tile != nullptr) lane_scores_amx<kVectors>(qp_.data(), key_tile, D_, n, s);
    }
#endif
    for (int64_t k = 0; k < n && (key_tile == nullptr || std::is_same_v<Key, float>); k += kSteps) {
      if constexpr (std::is_same_v<Key, float>) {
        lane_scores<kVectors, kSteps>(qt_.data(), keys + k, D_, s + k * W);
      } else {
#if defined(__AVX512BF16__)
        lane_scores_bf16<kVectors, kSteps>(qp_.data(), keys + k, D_, s + k * W);
#endif
      }
    }
#if defined(__AVX512BF16__)
    if constexpr (!std::is_same_v<Key, float> && kTile == 32) {
      if (value_tile != nullptr) return softmax_values_bf16<kVectors>(n, pos0, value_tile, key_tile != nullptr);
    }
#endif
    // Scale, causal mask (only where some row does not see the whole tile) and the tile's max per lane.
    v16 position[kVectors], old_max[kVectors], new_max[kVectors], shift[kVectors], correction[kVectors];
    for (int j = 0; j < kVectors; ++j) {
      position[j] = load16(position_.data() + 16 * j);
      old_max[j] = new_max[j] = load16(max_.data() + 16 * j);
    }
    const v16 minus_inf = splat16(kNegInf);
    const bool masked = pos0 + n - 1 > min_position_;
    for (int64_t k = 0; k < n; ++k) {
      const v16 key_position = splat16(static_cast<float>(pos0 + k));
      for (int j = 0; j < kVectors; ++j) {
        v16 x = load16(s + k * W + 16 * j) * score_scale_;
        if (masked) x = key_position <= position[j] ? x : minus_inf;
        new_max[j] = x > new_max[j] ? x : new_max[j];
        store16(s + k * W + 16 * j, x);
      }
    }
    // p = exp(s - max) (masked scores give 0); a lane that has seen no key yet keeps max -inf and shifts by 0,
    // and its correction exp(-inf) = 0 starts its sum and accumulator from 0.
    for (int j = 0; j < kVectors; ++j) {
      shift[j] = new_max[j] == minus_inf ? splat16(0.0f) : new_max[j];
      correction[j] = exp16(old_max[j] - shift[j]);
      store16(max_.data() + 16 * j, new_max[j]);
    }
    v16 total[kVectors];
    for (int j = 0; j < kVectors; ++j) total[j] = load16(sum_.data() + 16 * j) * correction[j];
    for (int64_t k = 0; k < n; ++k) {
      for (int j = 0; j < kVectors; ++j) {
        const v16 p = exp16(load16(s + k * W + 16 * j) - shift[j]);
        store16(s + k * W + 16 * j, p);
        total[j] += p;
      }
    }
    for (int j = 0; j < kVectors; ++j) store16(sum_.data() + 16 * j, total[j]);
    for (int64_t d = 0; d < D_; d += kSteps)
      lane_values<kVectors, kSteps>(s, values, n, d, correction, acc_.data());
  }

#if defined(__AVX512BF16__)
  // The rest of a tile whose scores s[key][lane] (unscaled) are in scores_, with its bfloat16 values transposed
  // (vt, see transpose_values): causal mask, softmax in base 2 (exp2_16) and the values' products, on AMX tiles
  // (`on_tiles`, an AmxTiles of 8 tiles in scope) or as vdpbf16ps. A lane's reference max moves only when
  // the tile's max exceeds it by more than kMaxSlack (so the probabilities stay below e^kMaxSlack = 256, which
  // float32 sums and bfloat16 hold as well as numbers below 1): after the first tiles the accumulator is almost
  // never rescaled, where the running max of every lane made that a pass over it for most tiles. The
  // probabilities go straight to bfloat16 key pairs for the products; the sum takes them in float32.
  template <int kVectors>
  void softmax_values_bf16(int64_t n, int64_t pos0, const uint16_t* value_tile, bool on_tiles) {
    constexpr int W = 16 * kVectors;
    constexpr float kLog2e = 1.4426950408889634f, kMaxSlack = 5.545177444479562f;  // 8 ln 2
    float* s = scores_;
    const __m512 minus_inf = _mm512_set1_ps(kNegInf);
    __m512 position[kVectors], raw_max[kVectors];
    for (int j = 0; j < kVectors; ++j) {
      position[j] = _mm512_loadu_ps(position_.data() + 16 * j);
      raw_max[j] = minus_inf;
    }
    if (pos0 + n - 1 > min_position_) {  // some row does not see the whole tile
      for (int64_t k = 0; k < n; ++k) {
        const __m512 key_position = _mm512_set1_ps(static_cast<float>(pos0 + k));
        for (int j = 0; j < kVectors; ++j) {
          const __mmask16 hidden = _mm512_cmp_ps_mask(key_position, position[j], _CMP_GT_OQ);
          const __m512 x = _mm512_mask_mov_ps(_mm512_loadu_ps(s + k * W + 16 * j), hidden, minus_inf);
          _mm512_storeu_ps(s + k * W + 16 * j, x);
          raw_max[j] = _mm512_max_ps(raw_max[j], x);
        }
      }
    } else {
      for (int64_t k = 0; k < n; ++k)
        for (int j = 0; j < kVectors; ++j) raw_max[j] = _mm512_max_ps(raw_max[j], _mm512_loadu_ps(s + k * W + 16 * j));
    }
    const __m512 scale = _mm512_set1_ps(score_scale_), scale2 = _mm512_set1_ps(score_scale_ * kLog2e);
    const __m512 log2e = _mm512_set1_ps(kLog2e), one = _mm512_set1_ps(1.0f);
    __m512 shift2[kVectors], correction[kVectors];
    __mmask16 rescale = 0;
    for (int j = 0; j < kVectors; ++j) {
      const __m512 old_max = _mm512_loadu_ps(max_.data() + 16 * j);
      const __m512 tile_max = _mm512_mul_ps(raw_max[j], scale);
      // A lane that has seen no key (max -inf) takes the tile's max; its sum and accumulator are 0.
      const __mmask16 grow = _mm512_cmp_ps_mask(tile_max, _mm512_add_ps(old_max, _mm512_set1_ps(kMaxSlack)), _CMP_GT_OQ);
      const __m512 new_max = _mm512_mask_mov_ps(old_max, grow, tile_max);
      _mm512_storeu_ps(max_.data() + 16 * j, new_max);
      const __mmask16 moved = grow & _mm512_cmp_ps_mask(old_max, minus_inf, _CMP_NEQ_OQ);
      correction[j] = _mm512_mask_mov_ps(
          one, moved, exp2_16(_mm512_mul_ps(_mm512_sub_ps(old_max, new_max), log2e)));
      rescale |= moved;
      // Lanes still at -inf saw only masked keys: their scores are -inf, shifted by 0.
      const __mmask16 seen = _mm512_cmp_ps_mask(new_max, minus_inf, _CMP_NEQ_OQ);
      shift2[j] = _mm512_maskz_mul_ps(seen, new_max, log2e);
    }
    if (rescale) {
      for (int64_t d = 0; d < D_; ++d)
        for (int j = 0; j < kVectors; ++j)
          _mm512_storeu_ps(acc_.data() + d * W + 16 * j,
                           _mm512_mul_ps(_mm512_loadu_ps(acc_.data() + d * W + 16 * j), correction[j]));
    }
    __m512 total[kVectors];
    for (int j = 0; j < kVectors; ++j) total[j] = _mm512_mul_ps(_mm512_loadu_ps(sum_.data() + 16 * j), correction[j]);
    alignas(64) uint16_t pp[16 * W * 2];  // [key pair][lane][2]
    const __m512i pairs = pair_index();
    const __m512 zero = _mm512_setzero_ps();
    for (int p = 0; p < 16; ++p) {
      for (int j = 0; j < kVectors; ++j) {
        const __m512 a = 2 * p < n ? exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(s + 2 * p * W + 16 * j), scale2, shift2[j]))
                                   : zero;
        const __m512 b = 2 * p + 1 < n
                             ? exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(s + (2 * p + 1) * W + 16 * j), scale2, shift2[j]))
                             : zero;
        total[j] = _mm512_add_ps(total[j], _mm512_add_ps(a, b));
        const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));  // a in the low half
        _mm512_store_si512(pp + (p * W + 16 * j) * 2, _mm512_permutexvar_epi16(pairs, both));
      }
    }
    for (int j = 0; j < kVectors; ++j) _mm512_storeu_ps(sum_.data() + 16 * j, total[j]);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (on_tiles) return lane_values_amx<kVectors>(pp, value_tile, D_, acc_.data());
#endif
    (void)on_tiles;
    lane_values_bf16<kVectors>(pp, value_tile, D_, acc_.data());
  }
#endif

  int64_t rows_ = 0, D_ = 0, min_position_ = 0;
  int vectors_ = 1;
  float score_scale_ = 1.0f;
  std::vector<float> qt_, acc_, max_, sum_, position_;
  std::vector<uint16_t> qp_;
  alignas(64) float scores_[64 * kLaneRows];  // [key][lane] of one tile (up to 64 keys)
};

}  // namespace radixserve_cpu
