// GGUF's K-quants (Q4_K, Q5_K, Q6_K) kept in llama.cpp's super-blocks and multiplied in integers, as llama.cpp does:
// the activations are quantized per block of 256 (one float scale each), and each super-block's integer values meet
// them in integer dot products, the sub-block scales applied to the integer sums. Two widths of activations:
//
//   int8   llama.cpp's Q8_K: `vpdpbusd` (AVX-512 VNNI or AVX-VNNI) where the CPU has it, `vpmaddubsw` + `vpmaddwd`
//          (AVX-512 BW, AVX2) otherwise. The int8 rounding (about 0.4% of a typical output) changes greedy tokens.
//   int16  14-bit activations (64 times finer) in `vpmaddwd`: the rounding stays below float32 noise of the model, so
//          greedy tokens are those of the float product of the dequantized weights (what the runtime uses).
//
// A plain loop runs without AVX2. Included once, by cpu_gguf_linear.cpp; the instruction set is the one the library
// was built for (-march=native, the build's cache key holds the CPU's flags), so the path is fixed per machine.
//
// A super-block holds 256 values of one weight row, in sub-blocks with integer scales:
//
//     Q4_K  144 bytes: d, dmin (float16), 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of
//           nibbles                                                      w = d * sc * q - dmin * m,  q in 0..15
//     Q5_K  176 bytes: as Q4_K, with 32 bytes of fifth bits before the nibbles                       q in 0..31
//     Q6_K  210 bytes: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales for sub-blocks of 16, d
//                                                                         w = d * sc * (q - 32),     q in 0..63
//
// Every format is first unpacked into one shape (`Unpacked`): the 256 q as unsigned bytes in the order of the values,
// and per 16 values an integer scale and an integer offset weight, so one dot product serves the three formats:
//
//     sum_i w_i x_i = dx * (d * sum_t scale_t * (q . xq)_t  -  dmin * sum_t offset_t * (sum of xq)_t)
//
// with xq = round(x / dx) the integer activations of the super-block, t over its 16 groups of 16 values (Q4_K and
// Q5_K: scale_t = sc, offset_t = m of the 32-value sub-block; Q6_K: scale_t = sc, offset_t = 32 sc, dmin = d). The
// integer sums are exact, so against the float64 product of the dequantized weight with the dequantized activations
// the kernel differs by float32 rounding only.

#pragma once

#include <c10/util/Half.h>
#include "cpu_vec.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kquants {

constexpr int kSuper = 256;        // values per super-block
constexpr int kGroups = 16;        // groups of 16 values per super-block, each with one scale and offset
constexpr int kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;  // ggml's type ids

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

inline int64_t super_block_bytes(int64_t type) {
  switch (type) {
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 0;
  }
}

// One super-block of a weight row in the shape every format is multiplied in.
struct Unpacked {
  alignas(64) uint8_t q[kSuper];
  alignas(64) int32_t lane_scale[kSuper / 4];  // scale_t for each 4-byte lane of q (lane l: group l / 4)
  alignas(64) int32_t offset[kGroups];
  int32_t scale[kGroups];
  int32_t zero;  // the q that means 0 (Q6_K: 32), for the dequantization
  float d, dmin;
};

// Q4_K / Q5_K's 12 bytes: 6-bit scale and min for each of the 8 sub-blocks of 32 (the top 2 bits of sub-blocks 4-7
// stored in the high bits of bytes 0-7).
inline void scales_and_mins(const uint8_t* s, int* sc, int* m) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    m[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
    m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

inline void set_group(Unpacked& u, int t, int scale, int offset) {
  u.scale[t] = scale;
  u.offset[t] = offset;
  for (int l = 0; l < 4; ++l) u.lane_scale[t * 4 + l] = scale;
}

#if defined(__AVX2__)
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void store32(uint8_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
// Bits [shift, shift + width) of every byte.
inline __m256i byte_bits(__m256i v, int shift, int mask) {
  return _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi8(static_cast<char>(mask)));
}
#endif

// Q4_K (FIFTH_BIT false) and Q5_K: bytes 32j..32j+31 of the nibbles hold sub-block 2j in their low halves and 2j + 1
// in their high halves; Q5_K's bit 4 of value i of sub-block s is bit s of byte i of its 32 fifth-bit bytes.
template <bool FIFTH_BIT>
inline void unpack_q45(const uint8_t* block, Unpacked& u) {
  u.d = half_to_float(block);
  u.dmin = half_to_float(block + 2);
  u.zero = 0;
  int sc[8], m[8];
  scales_and_mins(block + 4, sc, m);
  for (int t = 0; t < kGroups; ++t) set_group(u, t, sc[t / 2], m[t / 2]);
  const uint8_t* high = block + 16;
  const uint8_t* nibbles = block + (FIFTH_BIT ? 48 : 16);
#if defined(__AVX2__)
  [[maybe_unused]] const __m256i h = FIFTH_BIT ? load32(high) : _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    const __m256i v = load32(nibbles + 32 * j);
    __m256i lo = _mm256_and_si256(v, _mm256_set1_epi8(0x0F)), hi = byte_bits(v, 4, 0x0F);
    if constexpr (FIFTH_BIT) {
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(byte_bits(h, 2 * j, 1), 4));
      hi = _mm256_or_si256(hi, _mm256_slli_epi16(byte_bits(h, 2 * j + 1, 1), 4));
    }
    store32(u.q + 64 * j, lo);
    store32(u.q + 64 * j + 32, hi);
  }
#else
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < 32; ++i) {
      const uint8_t v = nibbles[32 * j + i];
      u.q[64 * j + i] = (v & 0x0F) | (FIFTH_BIT ? ((high[i] >> (2 * j)) & 1) << 4 : 0);
      u.q[64 * j + 32 + i] = (v >> 4) | (FIFTH_BIT ? ((high[i] >> (2 * j + 1)) & 1) << 4 : 0);
    }
#endif
}

// Q6_K: in half h of the super-block (values 128h ...), value 32g + i takes its low 4 bits from byte 64h + 32(g & 1) + i
// of the low nibbles (low half for g < 2, high half otherwise) and its top 2 bits from bits 2g, 2g + 1 of byte
// 32h + i of the high pairs.
inline void unpack_q6(const uint8_t* block, Unpacked& u) {
  const uint8_t *low = block, *high = block + 128;
  const auto* scales = reinterpret_cast<const int8_t*>(block + 192);
  u.d = u.dmin = half_to_float(block + 208);
  u.zero = 32;
  for (int t = 0; t < kGroups; ++t) set_group(u, t, scales[t], 32 * scales[t]);
  for (int half = 0; half < 2; ++half) {
#if defined(__AVX2__)
    const __m256i h = load32(high + 32 * half);
    for (int g = 0; g < 4; ++g) {
      const __m256i l = byte_bits(load32(low + 64 * half + 32 * (g & 1)), 4 * (g >> 1), 0x0F);
      store32(u.q + 128 * half + 32 * g, _mm256_or_si256(l, _mm256_slli_epi16(byte_bits(h, 2 * g, 3), 4)));
    }
#else
    for (int g = 0; g < 4; ++g)
      for (int i = 0; i < 32; ++i)
        u.q[128 * half + 32 * g + i] = ((low[64 * half + 32 * (g & 1) + i] >> (4 * (g >> 1))) & 0x0F) |
                                       (((high[32 * half + i] >> (2 * g)) & 3) << 4);
#endif
  }
}

#if defined(__AVX2__)
inline int32_t hsum(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i s2 = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
}
#endif

template <typename Int>
inline int64_t scaled_dot_scalar(const Unpacked& w, const Int* xq) {
  int64_t total = 0;
  for (int t = 0; t < kGroups; ++t) {
    int32_t dot = 0;
    for (int i = 16 * t; i < 16 * t + 16; ++i) dot += static_cast<int32_t>(w.q[i]) * xq[i];
    total += static_cast<int64_t>(w.scale[t]) * dot;
  }
  return total;
}

inline void unpack(int64_t type, const uint8_t* block, Unpacked& u) {
  if (type == kQ4_K) return unpack_q45<false>(block, u);
  if (type == kQ5_K) return unpack_q45<true>(block, u);
  unpack_q6(block, u);
}

// One row's activations of a super-block, quantized per block of 256 to Int (int8: llama.cpp's Q8_K; int16: 64
// times finer, 14 bits): xq = round(x / dx), dx = max |x| / kLevels, and the sum of xq over each group of 16.
template <typename Int>
struct QuantizedBlock {
  static constexpr int kLevels = sizeof(Int) == 1 ? 127 : 8191;
  alignas(64) Int q[kSuper];
  alignas(64) int32_t group_sum[kGroups];
  float dx;
};

template <typename Int>
inline void quantize_activations(const float* x, QuantizedBlock<Int>& out) {
  out.dx = radixserve_cpu::round_to_levels(x, kSuper, QuantizedBlock<Int>::kLevels, out.q, out.group_sum);
}

// sum_t scale_t * (q . xq)_t over the super-block, int8 activations: exact in int32 (|q| <= 63, |xq| <= 127,
// |scale| <= 128: a lane's sum stays below 2^24).
inline int64_t scaled_dot(const Unpacked& w, const QuantizedBlock<int8_t>& x) {
#if defined(__AVX512BW__)
  __m512i acc = _mm512_setzero_si512();
  for (int c = 0; c < kSuper / 64; ++c) {
    const __m512i q = _mm512_load_si512(w.q + 64 * c), xq = _mm512_load_si512(x.q + 64 * c);
#if defined(__AVX512VNNI__)
    const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xq);
#else
    const __m512i dot = _mm512_madd_epi16(_mm512_maddubs_epi16(q, xq), _mm512_set1_epi16(1));
#endif
    acc = _mm512_add_epi32(acc, _mm512_mullo_epi32(dot, _mm512_load_si512(w.lane_scale + 16 * c)));
  }
  return _mm512_reduce_add_epi32(acc);
#elif defined(__AVX2__)
  __m256i acc = _mm256_setzero_si256();
  for (int c = 0; c < kSuper / 32; ++c) {
    const __m256i q = _mm256_load_si256(reinterpret_cast<const __m256i*>(w.q + 32 * c));
    const __m256i xq = _mm256_load_si256(reinterpret_cast<const __m256i*>(x.q + 32 * c));
#if defined(__AVXVNNI__)
    const __m256i dot = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), q, xq);
#else
    const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xq), _mm256_set1_epi16(1));
#endif
    acc = _mm256_add_epi32(
        acc, _mm256_mullo_epi32(dot, _mm256_load_si256(reinterpret_cast<const __m256i*>(w.lane_scale + 8 * c))));
  }
  return hsum(acc);
#else
  return scaled_dot_scalar(w, x.q);
#endif
}

// The same with int16 activations, in 16-bit multiply-adds (`vpmaddwd`, two values per int32 lane). Each lane is
// exact in int32 (it adds 2 |q| |xq| |scale| <= 2 * 63 * 8191 * 128 < 2^27 per step, over at most 16 steps); the
// lanes are added in int64, since the super-block's total can pass 2^31.
inline int64_t scaled_dot(const Unpacked& w, const QuantizedBlock<int16_t>& x) {
#if defined(__AVX512BW__)
  __m512i acc = _mm512_setzero_si512();
  for (int c = 0; c < kSuper / 32; ++c) {  // 32 values: lanes 0-7 group 2c, lanes 8-15 group 2c + 1
    const __m512i q = _mm512_cvtepu8_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(w.q + 32 * c)));
    const __m512i dot = _mm512_madd_epi16(q, _mm512_load_si512(x.q + 32 * c));
    const __m512i scale = _mm512_inserti64x4(_mm512_set1_epi32(w.scale[2 * c]), _mm256_set1_epi32(w.scale[2 * c + 1]),
                                             1);
    acc = _mm512_add_epi32(acc, _mm512_mullo_epi32(dot, scale));
  }
  return _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc)),
                                                  _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc, 1))));
#elif defined(__AVX2__)
  __m256i acc = _mm256_setzero_si256();
  for (int t = 0; t < kGroups; ++t) {  // 16 values: one group
    const __m256i q = _mm256_cvtepu8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(w.q + 16 * t)));
    const __m256i dot = _mm256_madd_epi16(q, _mm256_load_si256(reinterpret_cast<const __m256i*>(x.q + 16 * t)));
    acc = _mm256_add_epi32(acc, _mm256_mullo_epi32(dot, _mm256_set1_epi32(w.scale[t])));
  }
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
  int64_t total = 0;
  for (const int32_t lane : lanes) total += lane;
  return total;
#else
  return scaled_dot_scalar(w, x.q);
#endif
}

// The super-block's share of one output: dx * (d * sum scale (q . xq) - dmin * sum offset (sum xq)). The offsets'
// sum is taken in 64 bits (Q6_K's offsets reach 32 * 128, int16 group sums 16 * 16383).
template <typename Int>
inline float block_dot(const Unpacked& w, const QuantizedBlock<Int>& x) {
  int64_t offsets = 0;
  for (int t = 0; t < kGroups; ++t) offsets += static_cast<int64_t>(w.offset[t]) * x.group_sum[t];
  return x.dx * (w.d * static_cast<float>(scaled_dot(w, x)) - w.dmin * static_cast<float>(offsets));
}

// The 256 float32 values, as gguf-py computes them: (d * sc) * (q - zero) - (dmin * m).
inline void dequantize(const Unpacked& u, float* out) {
  for (int t = 0; t < kGroups; ++t) {
    const float scale = u.d * static_cast<float>(u.scale[t]);
    const float offset = u.zero ? 0.0f : u.dmin * static_cast<float>(u.offset[t]);
    for (int i = 16 * t; i < 16 * t + 16; ++i)
      out[i] = scale * static_cast<float>(static_cast<int32_t>(u.q[i]) - u.zero) - offset;
  }
}

}  // namespace kquants
