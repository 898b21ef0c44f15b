// Scores of bfloat16 keys against a block of query rows on AMX tiles, where the CPU has AMX-BF16: the transposed
// scores s[key][lane] of 16 keys x 16 lanes are one tile product, keys (A: 16 keys x 32 bfloat16) times the
// queries' pairs (B: 16 pairs x 16 lanes x 2, the layout LaneBlock keeps for vdpbf16ps), summed in float32 over
// head_dim in steps of 32 (TDPBF16PS: exact products, float32 sums). The values stay on AVX-512 in float32.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace radixserve_cpu {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

// Whether this process may use the tile registers: Linux grants the tile state on request (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA); where it refuses, the callers keep the AVX-512 path.
inline bool amx_ready() {
  static const bool ready = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ready;
}

// The tile configuration of this thread while it lives: tiles 0 (scores), 1 (keys), 2 (queries), each 16 rows of
// 64 bytes. The configuration is per thread and other kernels (oneDNN's) set their own, so it is loaded per use.
class AmxTiles {
 public:
  AmxTiles() {
    struct {
      uint8_t palette, start_row, reserved[14];
      uint16_t colsb[16];
      uint8_t rows[16];
    } config;
    std::memset(&config, 0, sizeof(config));
    config.palette = 1;
    for (int t = 0; t < 3; ++t) config.colsb[t] = 64, config.rows[t] = 16;
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
