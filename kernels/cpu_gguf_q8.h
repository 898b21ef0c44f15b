// Q8_0 / Q4_0 / Q4_1 weights against int8 activations, as llama.cpp multiplies them (kernels/cpu_gguf_linear.cpp's
// `activation_bits` 8): each input row is rounded per block of 32 to int8 (xq = round(x / dx), dx = max|x| / 127, the
// Q8_1 layout: the block's scale and the sum of its values), and each (weight block, activation block) pair is one
// integer dot product of 32 byte pairs, scaled once:
//
//     Q4_1  w = d * q + m     sum(w * x) = d * dx * (q . xq) + m * (dx * sum xq)
//     Q4_0  w = d * (q - 8)   sum(w * x) = d * dx * (q . xq - 8 * sum xq)
//     Q8_0  w = d * q         sum(w * x) = d * dx * ((q + 128) . xq - 128 * sum xq)     (VNNI)
//                                        = d * dx * (|q| . sign(q) xq)                   (AVX2)
//
// The dot products run on AVX-512 VNNI's `vpdpbusd` (unsigned bytes times signed bytes, four pairs to an int32 lane)
// on 256-bit vectors, one block each; without VNNI, AVX2's `vpmaddubsw` + `vpmaddwd` make the same lanes. There Q8_0's
// signed weights go in as |q| with their signs moved onto the activations (|q| <= 128, |xq| <= 127: a pair of
// products stays below 2^15, so `vpmaddubsw` never saturates); `vpdpbusd` does not saturate, so with VNNI they go in
// shifted to unsigned, the shift's term taken off exactly in the integer lanes. The integer part of every block is
// exact; the float sums are float32, lane by lane over the blocks. Rounding the activations moves a product by a few
// tenths of a percent of its scale, so this is a different function from the float32 product of the dequantized
// weights: the runner uses it only when asked (`--gguf-activations int8`, model_runner/cpu/gguf_linear.py).
#pragma once

#include <ATen/Parallel.h>

#include "cpu_vec.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace q8 {

constexpr int kBlock = 32;

// One block of 32 activations rounded to int8.
struct alignas(32) ActivationBlock {
  int8_t q[kBlock];
  int32_t lane_sum[8];  // q[4l] + ... + q[4l + 3]: the four values that meet in int32 lane l of a dot product
  float dx;             // x ~ dx * q
  float dx_sum;         // dx * sum(q)
};

inline void quantize(const float* x, ActivationBlock& out) {
  int32_t sums[kBlock / 16];
  out.dx = radixserve_cpu::round_to_levels(x, kBlock, 127, out.q, sums);
  const int32_t sum = sums[0] + sums[1];
  for (int l = 0; l < 8; ++l) out.lane_sum[l] = out.q[4 * l] + out.q[4 * l + 1] + out.q[4 * l + 2] + out.q[4 * l + 3];
  out.dx_sum = out.dx * static_cast<float>(sum);
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _cvtsh_ss(bits);
}

// ggml's type ids (gguf.GGMLQuantizationType)
enum Type : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

template <int64_t T>
struct Block;  // bytes, scale, offset (the float term's weight, Q4_1 only) and the values of one weight block

template <>
struct Block<kQ8_0> {
  static constexpr int64_t kBytes = 34;
  static constexpr bool kOffset = false;
  static const uint8_t* values(const uint8_t* b) { return b + 2; }
  static float offset(const uint8_t*) { return 0.0f; }
};

template <>
struct Block<kQ4_0> {
  static constexpr int64_t kBytes = 18;
  static constexpr bool kOffset = false;
  static const uint8_t* values(const uint8_t* b) { return b + 2; }
  static float offset(const uint8_t*) { return 0.0f; }
};

template <>
struct Block<kQ4_1> {
  static constexpr int64_t kBytes = 20;
  static constexpr bool kOffset = true;
  static const uint8_t* values(const uint8_t* b) { return b + 4; }
  static float offset(const uint8_t* b) { return half_at(b + 2); }
};

#if defined(__AVX2__)
#if defined(__AVX512F__)
constexpr int kTileRows = 4;  // 32 vector registers: 4 x 4 accumulators, 4 weight blocks and temporaries
#else
constexpr int kTileRows = 2;  // 16 vector registers
#endif

// The 32 nibbles of a Q4 block as bytes in value order (byte j holds value j in its low half, value j + 16 in its
// high half).
template <int64_t T>
inline __m256i weight_bytes(const uint8_t* block) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(Block<T>::values(block)));
  const __m128i low = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low), _mm_and_si128(q, low));
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

// The int32 lanes of (weight bytes . xq) + start.
inline __m256i dot_lanes(__m256i start, __m256i weight, __m256i xq) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(start, weight, xq);
#else
  const __m256i pairs = _mm256_maddubs_epi16(weight, xq);
  return _mm256_add_epi32(start, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[m, n0 .. n0 + NB) for MB input rows from m0. With `ahead` (the first pass over a tile), the same blocks of the
// next tile's rows are prefetched into L2 as this tile's are read, so that the weight stream from memory runs a tile
// ahead of the dot products: at a few rows a decode step's weights come from memory, and without it one thread's
// stream stalls on each row's next line.
template <int64_t T, int NB, int MB>
inline void tile(const uint8_t* w, int64_t row_bytes, const ActivationBlock* xq, int64_t blocks, const float* bias,
                 int64_t N, int64_t n0, int64_t m0, float* y, const uint8_t* ahead) {
  __m256 acc[NB][MB];
  float offset_sum[NB][MB] = {};
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < MB; ++m) acc[n][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    // Q8_0's signed values: with VNNI, shifted to unsigned (q + 128, the 128 * sum xq taken off in `start`);
    // with AVX2 (whose vpmaddubsw would saturate on those) as |q|, their signs moved onto the activations (`raw`).
    __m256i raw[NB], weight[NB];
    float d[NB], offset[NB];
    if (ahead != nullptr)
#pragma GCC unroll 4
      for (int n = 0; n < NB; ++n) __builtin_prefetch(ahead + n * row_bytes + b * Block<T>::kBytes, 0, 2);
#pragma GCC unroll 4
    for (int n = 0; n < NB; ++n) {
      const uint8_t* block = w + (n0 + n) * row_bytes + b * Block<T>::kBytes;
      raw[n] = T == kQ8_0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(Block<T>::values(block)))
                          : _mm256_setzero_si256();
      if constexpr (T != kQ8_0)
        weight[n] = weight_bytes<T>(block);
      else if constexpr (kVnni)
        weight[n] = _mm256_xor_si256(raw[n], _mm256_set1_epi8(static_cast<char>(0x80)));
      else
        weight[n] = _mm256_sign_epi8(raw[n], raw[n]);
      d[n] = half_at(block);
      offset[n] = Block<T>::offset(block);
    }
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
      const ActivationBlock& a = xq[(m0 + m) * blocks + b];
      const __m256i x = _mm256_load_si256(reinterpret_cast<const __m256i*>(a.q));
      // the weights' shift to unsigned, lane by lane: Q4_0's - 8 * sum xq, Q8_0's - 128 * sum xq (VNNI)
      constexpr int shift = T == kQ4_0 ? 3 : (T == kQ8_0 && kVnni ? 7 : 0);
      __m256i start = _mm256_setzero_si256();
      if constexpr (shift != 0)
        start = _mm256_sub_epi32(start, _mm256_slli_epi32(
            _mm256_load_si256(reinterpret_cast<const __m256i*>(a.lane_sum)), shift));
#pragma GCC unroll 4
      for (int n = 0; n < NB; ++n) {
        const __m256i xs = T == kQ8_0 && !kVnni ? _mm256_sign_epi8(x, raw[n]) : x;
        const __m256i dot = dot_lanes(start, weight[n], xs);
        acc[n][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d[n] * a.dx), acc[n][m]);
        if constexpr (Block<T>::kOffset) offset_sum[n][m] += offset[n] * a.dx_sum;
      }
    }
  }
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < MB; ++m)
      y[(m0 + m) * N + n0 + n] = lane_sum(acc[n][m]) + offset_sum[n][m] + (bias ? bias[n0 + n] : 0.0f);
}
#else  // no AVX2: the same sums, value by value
constexpr int kTileRows = 1;

template <int64_t T>
inline int32_t weight_value(const uint8_t* block, int i) {
  const uint8_t* v = Block<T>::values(block);
  if constexpr (T == kQ8_0) return static_cast<int8_t>(v[i]);
  const int32_t q = i < 16 ? (v[i] & 0x0F) : (v[i - 16] >> 4);
  return T == kQ4_0 ? q - 8 : q;
}

template <int64_t T, int NB, int MB>
inline void tile(const uint8_t* w, int64_t row_bytes, const ActivationBlock* xq, int64_t blocks, const float* bias,
                 int64_t N, int64_t n0, int64_t m0, float* y, const uint8_t*) {
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < MB; ++m) {
      float sum = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = w + (n0 + n) * row_bytes + b * Block<T>::kBytes;
        const ActivationBlock& a = xq[(m0 + m) * blocks + b];
        int32_t dot = 0;
        for (int i = 0; i < kBlock; ++i) dot += weight_value<T>(block, i) * a.q[i];
        sum += half_at(block) * a.dx * static_cast<float>(dot) + Block<T>::offset(block) * a.dx_sum;
      }
      y[(m0 + m) * N + n0 + n] = sum + (bias ? bias[n0 + n] : 0.0f);
    }
}
#endif

constexpr int kPassRows = 4;  // input rows that share one pass over a tile's weight blocks
// How far ahead of the tile being multiplied its thread prefetches, in tiles (here and in cpu_gguf_linear.cpp's
// kernels). At one row the embedded model's LM head (49152 Q8_0 rows of 576, 30 MB) took 4.5 ms on one thread without
// prefetching, 2.0 ms one tile ahead and 1.1-1.3 ms two to four tiles ahead.
constexpr int64_t kAheadTiles = 2;

template <int64_t T, int NB, int R>
inline void rest_rows(int rows, const uint8_t* w, int64_t row_bytes, const ActivationBlock* xq, int64_t blocks,
                      const float* bias, int64_t N, int64_t n0, int64_t m0, float* y, const uint8_t* ahead) {
  if constexpr (R >= 1) {
    if (rows == R) return tile<T, NB, R>(w, row_bytes, xq, blocks, bias, N, n0, m0, y, ahead);
    rest_rows<T, NB, R - 1>(rows, w, row_bytes, xq, blocks, bias, N, n0, m0, y, ahead);
  }
}

// `ahead`: the next tile's first weight row (prefetched during the first pass), or null.
template <int64_t T, int NB>
inline void all_rows(const uint8_t* w, int64_t row_bytes, const ActivationBlock* xq, int64_t blocks,
                     const float* bias, int64_t M, int64_t N, int64_t n0, float* y, const uint8_t* ahead) {
  int64_t m0 = 0;
  for (; m0 + kPassRows <= M; m0 += kPassRows, ahead = nullptr)
    tile<T, NB, kPassRows>(w, row_bytes, xq, blocks, bias, N, n0, m0, y, ahead);
  if (m0 < M)
    rest_rows<T, NB, kPassRows - 1>(static_cast<int>(M - m0), w, row_bytes, xq, blocks, bias, N, n0, m0, y, ahead);
}

// y [M, N] = x [M, K] @ W^T (+ bias), W in blocks of type T, x rounded to int8 per block of 32. The tiles of weight
// rows are split over the threads.
template <int64_t T>
void linear(const uint8_t* w, int64_t row_bytes, const float* x, const float* bias, int64_t M, int64_t N, int64_t K,
            float* y) {
  const int64_t blocks = K / kBlock;
  std::vector<ActivationBlock> xq(M * blocks);  // row m's block b at m * blocks + b
  for (int64_t i = 0; i < M * blocks; ++i) quantize(x + i * kBlock, xq[i]);
  const int64_t tiles = N / kTileRows;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t later = t + kAheadTiles;
      const uint8_t* ahead = later < end ? w + later * kTileRows * row_bytes : nullptr;
      all_rows<T, kTileRows>(w, row_bytes, xq.data(), blocks, bias, M, N, t * kTileRows, y, ahead);
    }
  });
  for (int64_t n = tiles * kTileRows; n < N; ++n)
    all_rows<T, 1>(w, row_bytes, xq.data(), blocks, bias, M, N, n, y, nullptr);
}

}  // namespace q8
