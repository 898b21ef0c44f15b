// Scores of bfloat16 keys against a block of query rows on AMX tiles, where the CPU has AMX-BF16: the transposed
// scores s[key][lane] of 16 keys x 16 lanes are one tile product, keys (A: 16 keys x 32 bfloat16) times the
// queries' pairs (B: 16 pairs x 16 lanes x 2, the layout LaneBlock keeps for vdpbf16ps), summed in float32 over
// head_dim in steps of 32 (TDPBF16PS: exact products, float32 sums). The values too: the transposed accumulator
// acc[d][lane] of 16 columns x 16 lanes gains the tile product of the values transposed (A: 16 columns x 32 keys,
// a copy per key tile and KV head) and the probabilities rounded to bfloat16 as key pairs (B: 16 pairs x 16 lanes
// x 2), so each 32 keys of a 64-wide head are 4 tile products per 16 rows instead of 2,048 float32 FMAs.
#pragma once

#include "cpu_vec.h"

#include <cstdint>
#include <cstdlib>
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
// (the attention uses 3: scores, keys, queries; for the values, accumulator, values, probabilities; the linear
// kernel 8). The configuration is per thread and other kernels (oneDNN's) set their own, so it is loaded per use.
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

// s[k][lanes] = keys[k] . q[:, lanes] for the n (rounded up to 16) keys of `keys` ([16 * ceil(n / 16)][D]
// bfloat16 bits, contiguous; rows past n any finite values), qp the queries' pairs [D / 2][16 * kVectors][2];
// D a multiple of 32. Needs an AmxTiles in scope.
template <int kVectors>
inline void lane_scores_amx(const uint16_t* qp, const uint16_t* keys, int64_t D, int64_t n, float* s) {
  constexpr int W = 16 * kVectors;
  for (int64_t k0 = 0; k0 < n; k0 += 16) {
    for (int j = 0; j < kVectors; ++j) {
      _tile_zero(0);
      for (int64_t d0 = 0; d0 < D; d0 += 32) {
        _tile_loadd(1, keys + k0 * D + d0, D * 2);
        _tile_loadd(2, qp + ((d0 / 2) * W + 16 * j) * 2, W * 4);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, s + k0 * W + 16 * j, W * 4);
    }
  }
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

// acc[d][lanes] += sum_k vt[d][k] * p[k][lanes] over the 32 keys of a tile: p its probabilities s[k][lane]
// (float32, W = 16 * kVectors lanes; keys from n on count as 0) rounded to bfloat16 pairs, vt from
// transpose_values. Needs an AmxTiles in scope.
template <int kVectors>
inline void lane_values_amx(const float* s, int64_t n, const uint16_t* vt, int64_t D, float* acc) {
  constexpr int W = 16 * kVectors;
  alignas(64) uint16_t pp[16 * W * 2];  // [key pair][lane][2]
  const __m512i pairs = pair_index();
  for (int p = 0; p < 16; ++p)
    for (int j = 0; j < kVectors; ++j) {
      const __m512 a = 2 * p < n ? _mm512_loadu_ps(s + 2 * p * W + 16 * j) : _mm512_setzero_ps();
      const __m512 b = 2 * p + 1 < n ? _mm512_loadu_ps(s + (2 * p + 1) * W + 16 * j) : _mm512_setzero_ps();
      const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));  // a in the low half
      _mm512_store_si512(pp + (p * W + 16 * j) * 2, _mm512_permutexvar_epi16(pairs, both));
    }
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    _tile_loadd(1, vt + d0 * 32, 64);
    for (int j = 0; j < kVectors; ++j) {
      _tile_loadd(0, acc + d0 * W + 16 * j, W * 4);
      _tile_loadd(2, pp + 16 * j * 2, W * 4);
      _tile_dpbf16ps(0, 1, 2);
      _tile_stored(0, acc + d0 * W + 16 * j, W * 4);
    }
  }
}

constexpr bool kAmx = true;

#else

constexpr bool kAmx = false;
inline bool amx_ready() { return false; }
struct AmxTiles {};

#endif

// RADIXSERVE_CPU_AMX=0 keeps the AVX-512 BF16 dot products (read at every call, so tests compare both paths).
inline bool amx_enabled() {
  const char* value = std::getenv("RADIXSERVE_CPU_AMX");
  return value == nullptr || std::strcmp(value, "0") != 0;
}

}  // namespace radixserve_cpu
