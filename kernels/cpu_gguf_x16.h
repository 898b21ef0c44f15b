// Q4_0 / Q4_1 / Q8_0 weights re-laid 16 rows at a time ("interleaved"), against activations rounded to 16-bit (or
// int8) integers per block of 32 (kernels/cpu_gguf_linear.cpp's type ids + `kFlag16`, or + `kFlag8`).
//
// GGUF stores a weight row after row, block after block. Multiplying those blocks in registers converts every value to
// float32 for one multiply-add with one activation: at one input row the embedded model's projections then take about
// as many instructions as values, and a decode step is bound by them, not by the bytes it reads. Here the same bytes
// are regrouped so that one 512-bit integer multiply-add (`vpdpwssd`: 32 pairs of 16-bit values into 16 int32 lanes)
// serves 16 weight rows at once, lane c holding row c:
//
//   one tile-block = rows 16g .. 16g + 15, values 32b .. 32b + 31 of each (the same bytes as their 16 blocks):
//     Q4_0 / Q4_1  256 bytes of nibbles, four chunks of 64: the 16-bit word w of chunk L holds in bits 4s .. 4s + 3
//                  the value of row w / 2 at k = 2 (L + 4s) + w % 2; then d [16] (float16), then m [16] (Q4_1)
//     Q8_0         512 bytes, 16 chunks of 32: byte w of chunk p is row w / 2's value at k = 2p + w % 2; then d [16]
//
// so a chunk's words, masked and shifted (or sign-extended), are the weights of two consecutive k for the 16 rows, and
// the matching activations are one 32-bit pair broadcast to every lane. A group of 16 rows is K / 32 tile-blocks, in
// the bytes the 16 rows took before. The int8 layout (`vpdpbusd`: four byte pairs a lane) holds four consecutive k a
// lane instead: Q4's chunk L has quad L in its bytes' low nibbles and quad L + 4 in their high ones (byte 4c + j: row
// c, k = 4 quad + j); Q8_0's 8 chunks of 64 bytes hold quad p each, stored + 128 (unsigned, as `vpdpbusd` multiplies
// its weights; the 128 * sum(xq) this adds is taken off in integers).
//
// The activations are rounded per block of 32 to 16-bit integers (xq = round(x / dx), dx = max|x| / 32767; or, for
// `--gguf-activations int8`, to int8, dx = max|x| / 127, the layout then holding four consecutive k per lane for
// `vpdpbusd`), so each block's integer part is exact and the result is the product of the dequantized weight with the
// rounded activations x~ = dx * xq:
//
//     Q4_1  sum(w * x~) = d * dx * (q . xq) + m * dx * sum(xq)     Q4_0  = d * dx * (q . xq - 8 * sum(xq))
//     Q8_0  sum(w * x~) = d * dx * (q . xq)
//
// (the offset meets the rounded sum, not the exact one: Q4_1's offset centres the weights, and with the exact sum the
// rounding's error met the uncentred q instead, twice as large). Rounding to 16 bits moves an activation by at most
// 1/65534 of its block's largest: far below float16 weights' own rounding, and below bfloat16's 1/512 of the value
// itself. tests/ops checks every path against a float64 product of gguf-py's dequantization of the original blocks.
#pragma once

#include <ATen/Parallel.h>

#include "cpu_vec.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

namespace x16 {

constexpr int kBlock = 32;
constexpr int kRows = 16;         // weight rows in a group: one int32 lane each
constexpr int64_t kFlag16 = 256;  // the interleaved layouts' type ids: the GGML type's + kFlag16 (16-bit activations)
constexpr int64_t kFlag8 = 512;   // or + kFlag8 (int8 activations)
// Input rows that share one pass over a group's tile-blocks. At a decode step's 16 rows the first pass streams the
// weights from memory and the others reread them from cache: passes of 8 rows took the embedded model's int8-activation
// linears at 16 rows from 6.1-6.2 s to 4.8-5.4 s over the 16-streams workload (benchmarks/cpu_profile.py --workload
// streams16), where passes of 4 rows read the weights twice as often; with the weights in cache both ran alike.
constexpr int kPassRows = 8;
constexpr int64_t kChunkRows = 64;  // input rows per sweep over a thread's groups (their activations stay in L2)
// How far ahead of the tile-block being multiplied the first pass over it prefetches its thread's weights: a group's
// tile-blocks follow one another, so this is further along the same stream. At one row the embedded model's Q8_0 LM
// head (30 MB) streamed at 29 GB/s without, 32 GB/s at 8 KB ahead on every pass (24-27 GB/s at 2 KB or 16-32 KB) and
// 40 GB/s at 8 KB ahead on a chunk's first pass only, on two threads.
constexpr int64_t kAheadBytes = 8192;

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr bool kVectorized = true;
#else
constexpr bool kVectorized = false;
#endif

enum Type : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

// The tile-block's layout by type: bytes of values, where the block's source values start in a GGUF block, whether it
// carries m, and the bytes of one GGUF block.
template <int64_t T>
struct Layout;
template <>
struct Layout<kQ4_0> {
  static constexpr int64_t kValueBytes = 256, kSourceValues = 2, kBlockBytes = 18;
  static constexpr bool kOffset = false;
};
template <>
struct Layout<kQ4_1> {
  static constexpr int64_t kValueBytes = 256, kSourceValues = 4, kBlockBytes = 20;
  static constexpr bool kOffset = true;
};
template <>
struct Layout<kQ8_0> {
  static constexpr int64_t kValueBytes = 512, kSourceValues = 2, kBlockBytes = 34;
  static constexpr bool kOffset = false;
};
template <int64_t T>
constexpr int64_t tile_bytes() { return kRows * Layout<T>::kBlockBytes; }

// Value k of GGUF block `src` (without the scale), as the integer q the format stores (Q4: 0..15, Q8_0: -128..127).
template <int64_t T>
inline int32_t source_value(const uint8_t* src, int k) {
  const uint8_t* v = src + Layout<T>::kSourceValues;
  if constexpr (T == kQ8_0) return static_cast<int8_t>(v[k]);
  return k < 16 ? (v[k] & 0x0F) : (v[k - 16] >> 4);
}

// Where value k of row c sits in a tile-block of activation width A (see the file comment): its byte, and for the
// nibble types the shift of its nibble in that byte.
template <int64_t T, int A>
inline int64_t value_byte(int c, int k, int& shift) {
  if constexpr (A == 16) {
    const int p = k >> 1, word = 2 * c + (k & 1);
    shift = 0;
    if constexpr (T == kQ8_0) return 32 * p + word;
    const int s = p >> 2;  // the nibble's place in its 16-bit word (little-endian bytes)
    shift = 4 * (s & 1);
    return 64 * (p & 3) + 2 * word + (s >> 1);
  } else {
    const int p = k >> 2, lane_byte = 4 * c + (k & 3);
    shift = 0;
    if constexpr (T == kQ8_0) return 64 * p + lane_byte;
    shift = 4 * (p >> 2);
    return 64 * (p & 3) + lane_byte;
  }
}

// Value k of row c in a tile-block.
template <int64_t T, int A>
inline int32_t tile_value(const uint8_t* tile, int c, int k) {
  int shift;
  const uint8_t byte = tile[value_byte<T, A>(c, k, shift)];
  if constexpr (T != kQ8_0) return (byte >> shift) & 0x0F;
  return A == 8 ? static_cast<int32_t>(byte) - 128 : static_cast<int8_t>(byte);
}

// Re-lays N (a multiple of kRows) rows of GGUF blocks into tile-blocks for activations of A bits (same bytes, same
// size).
template <int64_t T, int A>
void interleave(const uint8_t* src, int64_t row_bytes, int64_t N, uint8_t* dst) {
  const int64_t blocks = row_bytes / Layout<T>::kBlockBytes;
  at::parallel_for(0, N / kRows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* tile = dst + g * kRows * row_bytes + b * tile_bytes<T>();
        std::memset(tile, 0, tile_bytes<T>());
        for (int c = 0; c < kRows; ++c) {
          const uint8_t* block = src + (g * kRows + c) * row_bytes + b * Layout<T>::kBlockBytes;
          for (int k = 0; k < kBlock; ++k) {
            int shift;
            uint8_t& byte = tile[value_byte<T, A>(c, k, shift)];
            const int32_t q = source_value<T>(block, k);
            if constexpr (T == kQ8_0)
              byte = static_cast<uint8_t>(A == 8 ? q + 128 : q);  // int8 activations: unsigned for vpdpbusd
            else
              byte |= static_cast<uint8_t>(q << shift);
          }
          std::memcpy(tile + Layout<T>::kValueBytes + 2 * c, block, 2);  // d
          if constexpr (Layout<T>::kOffset) std::memcpy(tile + Layout<T>::kValueBytes + 32 + 2 * c, block + 2, 2);
        }
      }
  });
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _cvtsh_ss(bits);
}

// Row c's (scale, offset) in a tile-block: w = scale * q + offset.
template <int64_t T>
inline void scale_offset(const uint8_t* tile, int c, float& d, float& m) {
  d = half_at(tile + Layout<T>::kValueBytes + 2 * c);
  m = Layout<T>::kOffset ? half_at(tile + Layout<T>::kValueBytes + 32 + 2 * c) : (T == kQ4_0 ? -8.0f * d : 0.0f);
}

// The float32 values [N, K] of interleaved groups.
template <int64_t T, int A>
void dequantize(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, float* out) {
  const int64_t blocks = K / kBlock;
  at::parallel_for(0, N / kRows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* tile = w + g * kRows * row_bytes + b * tile_bytes<T>();
        for (int c = 0; c < kRows; ++c) {
          float d, m;
          scale_offset<T>(tile, c, d, m);
          for (int k = 0; k < kBlock; ++k)
            out[(g * kRows + c) * K + b * kBlock + k] = d * static_cast<float>(tile_value<T, A>(tile, c, k)) + m;
        }
      }
  });
}

// One block of 32 activations rounded to A-bit integers.
template <int A>
struct alignas(64) Activations {
  using Int = std::conditional_t<A == 16, int16_t, int8_t>;
  static constexpr int kLevels = A == 16 ? 32767 : 127;  // values in [-kLevels, kLevels]
  Int q[kBlock];  // 16 bits: pair p (values 2p, 2p + 1) is 32-bit word p; 8 bits: quad p (4p .. 4p + 3) is word p
  float dx;       // x ~ dx * q
  float sum;      // dx * sum(q): the rounded block's sum, which the offset meets
  int32_t qsum;   // sum(q)
};

template <int A>
inline void quantize(const float* x, Activations<A>& out) {
  int32_t sums[kBlock / 16];
  out.dx = radixserve_cpu::round_to_levels(x, kBlock, Activations<A>::kLevels, out.q, sums);
  out.qsum = sums[0] + sums[1];
  out.sum = out.dx * static_cast<float>(out.qsum);
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// The 32-bit word p of a's values (a pair of 16-bit values, or four int8 ones), in every lane.
template <int A>
inline __m512i broadcast_word(const Activations<A>& a, int p) {
  int32_t word;
  std::memcpy(&word, a.q + (A == 16 ? 2 : 4) * p, sizeof(word));
  return _mm512_set1_epi32(word);
}

// dot + one step of weight words against activation words: 16-bit pairs (`vpdpwssd`) or unsigned weight bytes
// against signed activation bytes (`vpdpbusd`).
template <int A>
inline __m512i dot_step(__m512i dot, __m512i weights, __m512i activations) {
  if constexpr (A == 16) return _mm512_dpwssd_epi32(dot, weights, activations);
  return _mm512_dpbusd_epi32(dot, weights, activations);
}

// y[m0 .. m0 + MB, n0 .. n0 + 16) from the group's tile-blocks at `group`. A row's integer sums run in CH independent
// chains (summed at the block's end), so that fewer than four rows still keep several dot products in flight: one
// chain of dependent ones per block is bound by their latency. `ahead`: prefetch the thread's weights kAheadBytes on.
template <int64_t T, int A, int MB>
inline void pass(const uint8_t* group, int64_t blocks, const Activations<A>* xq, const float* bias, int64_t N,
                 int64_t n0, int64_t m0, float* y, bool ahead) {
  constexpr int CH = MB >= 4 ? 1 : (MB == 1 ? 4 : 2);
  __m512 acc[MB];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i low4 = A == 16 ? _mm512_set1_epi16(0x0F) : _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* tile = group + b * tile_bytes<T>();
    if (ahead)
#pragma GCC unroll 8
      for (int64_t line = 0; line < tile_bytes<T>(); line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(tile + kAheadBytes + line), _MM_HINT_T0);
    const Activations<A>* a[MB];
    __m512i dot[MB][CH];
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      a[m] = xq + (m0 + m) * blocks + b;
#pragma GCC unroll 4
      for (int c = 0; c < CH; ++c) dot[m][c] = _mm512_setzero_si512();
    }
    if constexpr (T == kQ8_0 && A == 16) {  // 16 chunks of 32 bytes: the values of pair p, sign-extended
#pragma GCC unroll 16
      for (int p = 0; p < 16; ++p) {
        const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * p)));
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) dot[m][p % CH] = dot_step<A>(dot[m][p % CH], w, broadcast_word(*a[m], p));
      }
    } else if constexpr (T == kQ8_0) {  // 8 chunks of 64 bytes: the values of quad p, + 128
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        const __m512i w = _mm512_loadu_si512(tile + 64 * p);
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) dot[m][p % CH] = dot_step<A>(dot[m][p % CH], w, broadcast_word(*a[m], p));
      }
    } else if constexpr (A == 16) {  // 4 chunks of 64 bytes: nibble s of word lanes is pair L + 4s
#pragma GCC unroll 4
      for (int L = 0; L < 4; ++L) {
        const __m512i raw = _mm512_loadu_si512(tile + 64 * L);
#pragma GCC unroll 4
        for (int s = 0; s < 4; ++s) {
          const __m512i w = s == 3 ? _mm512_srli_epi16(raw, 12)
                                   : _mm512_and_si512(s == 0 ? raw : _mm512_srli_epi16(raw, 4 * s), low4);
#pragma GCC unroll 8
          for (int m = 0; m < MB; ++m)
            dot[m][L % CH] = dot_step<A>(dot[m][L % CH], w, broadcast_word(*a[m], L + 4 * s));
        }
      }
    } else {  // 4 chunks of 64 bytes: low nibbles quad L, high nibbles quad L + 4
#pragma GCC unroll 4
      for (int L = 0; L < 4; ++L) {
        const __m512i raw = _mm512_loadu_si512(tile + 64 * L);
        const __m512i low = _mm512_and_si512(raw, low4), high = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) {
          dot[m][L % CH] = dot_step<A>(dot[m][L % CH], low, broadcast_word(*a[m], L));
          dot[m][L % CH] = dot_step<A>(dot[m][L % CH], high, broadcast_word(*a[m], L + 4));
        }
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
#pragma GCC unroll 4
      for (int c = 1; c < CH; ++c) dot[m][0] = _mm512_add_epi32(dot[m][0], dot[m][c]);
      if constexpr (T == kQ8_0 && A == 8)  // the weights' + 128, exactly: 128 * sum(q) in every lane
        dot[m][0] = _mm512_sub_epi32(dot[m][0], _mm512_set1_epi32(128 * a[m]->qsum));
    }
    const uint8_t* scales = tile + Layout<T>::kValueBytes;  // d [16], then m [16]
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
    __m512 offset = _mm512_setzero_ps();
    if constexpr (Layout<T>::kOffset)
      offset = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 32)));
    else if constexpr (T == kQ4_0)
      offset = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][0]), _mm512_mul_ps(d, _mm512_set1_ps(a[m]->dx)), acc[m]);
      if constexpr (T != kQ8_0) acc[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(a[m]->sum), acc[m]);
    }
  }
  const __m512 bias_v = bias != nullptr ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(y + (m0 + m) * N + n0, _mm512_add_ps(acc[m], bias_v));
}
#else  // the same sums, value by value
template <int64_t T, int A, int MB>
inline void pass(const uint8_t* group, int64_t blocks, const Activations<A>* xq, const float* bias, int64_t N,
                 int64_t n0, int64_t m0, float* y, bool) {
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < kRows; ++c) {
      float acc = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* tile = group + b * tile_bytes<T>();
        const Activations<A>& a = xq[(m0 + m) * blocks + b];
        int32_t dot = 0;
        for (int k = 0; k < kBlock; ++k) dot += tile_value<T, A>(tile, c, k) * a.q[k];
        float d, off;
        scale_offset<T>(tile, c, d, off);
        acc += static_cast<float>(dot) * (d * a.dx) + off * a.sum;
      }
      y[(m0 + m) * N + n0 + c] = acc + (bias != nullptr ? bias[n0 + c] : 0.0f);
    }
}
#endif

template <int64_t T, int A, int R>
inline void rest_pass(int rows, const uint8_t* group, int64_t blocks, const Activations<A>* xq, const float* bias,
                      int64_t N, int64_t n0, int64_t m0, float* y, bool ahead) {
  if constexpr (R >= 1) {
    if (rows == R) return pass<T, A, R>(group, blocks, xq, bias, N, n0, m0, y, ahead);
    rest_pass<T, A, R - 1>(rows, group, blocks, xq, bias, N, n0, m0, y, ahead);
  }
}

// y [M, N] = x [M, K] @ W^T (+ bias), W interleaved for A-bit activations (N a multiple of kRows). The groups are split
// over the threads; each thread sweeps its groups once per kChunkRows input rows.
template <int64_t T, int A>
void linear(const uint8_t* w, int64_t row_bytes, const float* x, const float* bias, int64_t M, int64_t N, int64_t K,
            float* y) {
  const int64_t blocks = K / kBlock;
  // row m's block b at m * blocks + b; left uninitialized, as quantize writes every field
  const std::unique_ptr<Activations<A>[]> xq(new Activations<A>[M * blocks]);
  at::parallel_for(0, M * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) quantize<A>(x + i * kBlock, xq[i]);
  });
  at::parallel_for(0, N / kRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c0 = 0; c0 < M; c0 += kChunkRows) {
      const int64_t c1 = std::min(M, c0 + kChunkRows);
      for (int64_t g = begin; g < end; ++g) {
        const uint8_t* group = w + g * kRows * row_bytes;
        int64_t m0 = c0;
        for (; m0 + kPassRows <= c1; m0 += kPassRows)
          pass<T, A, kPassRows>(group, blocks, xq.get(), bias, N, g * kRows, m0, y, m0 == c0);
        if (m0 < c1)
          rest_pass<T, A, kPassRows - 1>(static_cast<int>(c1 - m0), group, blocks, xq.get(), bias, N, g * kRows, m0,
                                         y, m0 == c0);
      }
    }
  });
}

}  // namespace x16
