// Scores of bfloat16 keys against a block of query rows on AMX tiles, where the CPU has AMX-BF16: the transposed
// scores s[key][lane] of 16 keys x 16 lanes are one tile product, keys (A: 16 keys x 32 bfloat16) times the
// queries' pairs (B: 16 pairs x 16 lanes x 2, the layout LaneBlock keeps for vdpbf16ps), summed in float32 over
// head_dim in steps of 32 (TDPBF16PS: exact products, float32 sums). The values too: the transposed accumulator
// acc[d][lane] of 16 columns x 16 lanes gains the tile product of the values transposed (A: 16 columns x 32 keys,
// a copy per key tile and KV head, transpose_values in cpu_attention_lanes.h) and the probabilities rounded to
// bfloat16 as key pairs (B: 16 pairs x 16 lanes x 2), so each 32 keys of a 64-wide head are 4 tile products per 16
// rows instead of 1,024 vdpbf16ps (lane_values_bf16).
#pragma once

#include "cpu_vec.h"

#include <cstdint>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace radixserve_cpu {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

// Whether this process may use the tile registers: Linux grants the tile state on request (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA); where it refuses, the callers keep the AVX-512 path.
inline bool amx_ready() {
  static const bool ready = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ready;
}

// The tile configuration of this thread while it lives: the first `num_tiles` tiles of 16 rows of 64 bytes each
// (the attention and the linear kernel use all 8: four accumulators and two of each operand, see tile_step_2x2).
// The configuration is per thread and other kernels (oneDNN's) set their own, so it is loaded per use.
class AmxTiles {
 public:
  explicit AmxTiles(int num_tiles = 3) {
    struct {
      uint8_t palette, start_row, reserved[14];
      uint16_t colsb[16];
      uint8_t rows[16];
    } config;
    std::memset(&config, 0, sizeof(config));
    config.palette = 1;
    for (int t = 0; t < num_tiles; ++t) config.colsb[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
  }
  ~AmxTiles() { _tile_release(); }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
};

// One step of a 2 x 2 block of tile products: C(a, b) += A(a) x B(b) for the blocks present (a1: a second A
// block, b1: a second B block), the accumulators in tiles 0-3 (C(a, b) in tile 2a + b), A in 4-5, B in 6-7. The
// products write distinct tiles, so they overlap in the pipeline instead of waiting on each other's result.
template <bool kA1, bool kB1>
inline void tile_step_2x2(const void* a0, const void* a1, int64_t a_stride, const void* b0, const void* b1,
                          int64_t b_stride) {
  _tile_loadd(4, a0, a_stride);
  _tile_loadd(6, b0, b_stride);
  if constexpr (kB1) _tile_loadd(7, b1, b_stride);
  if constexpr (kA1) _tile_loadd(5, a1, a_stride);
  _tile_dpbf16ps(0, 4, 6);
  if constexpr (kB1) _tile_dpbf16ps(1, 4, 7);
  if constexpr (kA1) _tile_dpbf16ps(2, 5, 6);
  if constexpr (kA1 && kB1) _tile_dpbf16ps(3, 5, 7);
}

// The accumulator tiles of a 2 x 2 block from zero.
template <bool kA1, bool kB1>
inline void tile_zero_2x2() {
  _tile_zero(0);
  if constexpr (kB1) _tile_zero(1);
  if constexpr (kA1) _tile_zero(2);
  if constexpr (kA1 && kB1) _tile_zero(3);
}

// Stores (kStore) or loads the accumulator tiles of a 2 x 2 block, C(a, b) at c + a * a_step + b * b_step.
template <bool kStore, bool kA1, bool kB1>
inline void tile_move_2x2(float* c, int64_t a_step, int64_t b_step, int64_t stride) {
  if constexpr (kStore) {
    _tile_stored(0, c, stride);
    if constexpr (kB1) _tile_stored(1, c + b_step, stride);
    if constexpr (kA1) _tile_stored(2, c + a_step, stride);
    if constexpr (kA1 && kB1) _tile_stored(3, c + a_step + b_step, stride);
  } else {
    _tile_loadd(0, c, stride);
    if constexpr (kB1) _tile_loadd(1, c + b_step, stride);
    if constexpr (kA1) _tile_loadd(2, c + a_step, stride);
    if constexpr (kA1 && kB1) _tile_loadd(3, c + a_step + b_step, stride);
  }
}

// s[k][lanes] for up to 32 keys (two key blocks a) and two vectors of lanes (b) from j: see lane_scores_amx.
template <int kVectors, bool kA1, bool kB1>
inline void lane_scores_2x2(const uint16_t* qp, const uint16_t* keys, int64_t D, int j, float* s) {
  constexpr int W = 16 * kVectors;
  tile_zero_2x2<kA1, kB1>();
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    const uint16_t* b = qp + ((d0 / 2) * W + 16 * j) * 2;
    tile_step_2x2<kA1, kB1>(keys + d0, keys + 16 * D + d0, D * 2, b, b + 32, W * 4);
  }
  tile_move_2x2<true, kA1, kB1>(s + 16 * j, 16 * W, 16, W * 4);
}

// s[k][lanes] = keys[k] . q[:, lanes] for the n (1..32, rounded up to 16) keys of `keys` ([16 * ceil(n / 16)][D]
// bfloat16 bits, contiguous; rows past n any finite values), qp the queries' pairs [D / 2][16 * kVectors][2];
// D a multiple of 32. Needs an AmxTiles of 8 tiles in scope.
template <int kVectors>
inline void lane_scores_amx(const uint16_t* qp, const uint16_t* keys, int64_t D, int64_t n, float* s) {
  for (int j = 0; j < kVectors; j += 2) {
    const bool b1 = j + 1 < kVectors;
    if (n > 16 && b1) lane_scores_2x2<kVectors, true, true>(qp, keys, D, j, s);
    else if (n > 16) lane_scores_2x2<kVectors, true, false>(qp, keys, D, j, s);
    else if (b1) lane_scores_2x2<kVectors, false, true>(qp, keys, D, j, s);
    else lane_scores_2x2<kVectors, false, false>(qp, keys, D, j, s);
  }
}

// acc[d][lanes] += sum_k vt[d][k] * p[k][lanes] over the 32 keys of a tile: pp the probabilities as bfloat16 key
// pairs ([16 pairs][16 * kVectors lanes][2]), vt from transpose_values. Needs an AmxTiles of 8 tiles in scope.
template <int kVectors>
inline void lane_values_amx(const uint16_t* pp, const uint16_t* vt, int64_t D, float* acc) {
  constexpr int W = 16 * kVectors;
  // acc[d0 + 16a][16(j + b) ...]: two column blocks (a) by two lane vectors (b) at a time.
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    for (int j = 0; j < kVectors; j += 2) {
      float* c = acc + d0 * W + 16 * j;
      const uint16_t* b = pp + 16 * j * 2;
      if (j + 1 < kVectors) {
        tile_move_2x2<false, true, true>(c, 16 * W, 16, W * 4);
        tile_step_2x2<true, true>(vt + d0 * 32, vt + (d0 + 16) * 32, 64, b, b + 32, W * 4);
        tile_move_2x2<true, true, true>(c, 16 * W, 16, W * 4);
      } else {
        tile_move_2x2<false, true, false>(c, 16 * W, 16, W * 4);
        tile_step_2x2<true, false>(vt + d0 * 32, vt + (d0 + 16) * 32, 64, b, b + 32, W * 4);
        tile_move_2x2<true, true, false>(c, 16 * W, 16, W * 4);
      }
    }
  }
}

constexpr bool kAmx = true;
constexpr int kAttentionTiles = 8;

#else

constexpr bool kAmx = false;
constexpr int kAttentionTiles = 8;
inline bool amx_ready() { return false; }
struct AmxTiles {
  explicit AmxTiles(int = 3) {}
};

#endif

}  // namespace radixserve_cpu
