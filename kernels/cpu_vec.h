// Helpers shared by the CPU kernels (cpu_attention*.{cpp,h}, cpu_elementwise.cpp, the GGUF blocks' cpu_gguf_*.h).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace radixserve_cpu {

// 16 floats as one value: GCC lowers it to one AVX-512 register, two AVX2 registers or scalar code, whatever the
// CPU the library is built for.
typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

inline void store16(float* p, v16 x) { std::memcpy(p, &x, sizeof(x)); }

inline v16 splat16(float x) { return v16{} + x; }

// Keeps the vector x (v16, __m512, __m512bh) in a register from here on: one loaded once and used by several FMAs
// is otherwise folded into each of them as a memory operand, so a micro-kernel's loads outnumber its FMAs (one
// 512-bit load a cycle on Zen 4). Without AVX-512 a v16 spans two registers and stays as it is.
template <typename V>
inline void pin(V& x) {
#ifdef __AVX512F__
  asm("" : "+v"(x));
#else
  (void)x;
#endif
}

// Keeps the pointer x in one general register, so that its few neighbouring elements are read at constant
// displacements from it: otherwise the compiler may hold each element's address (row pointer plus a column offset) in
// a register of its own through a loop, and the registers it runs out of spill into vector registers a micro-kernel
// needs for its operands (which then go to the stack).
template <typename T>
inline void pin_address(T*& x) {
  asm("" : "+r"(x));
}

typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

// 16 elements of a float32 or bfloat16 array as float32 lanes, and back. The bfloat16 store rounds to nearest even,
// as c10::BFloat16's constructor does, but in vector registers (the scalar conversion with its NaN branch does not
// vectorize: the elementwise kernels spent most of their time in it): one VCVTNEPS2BF16 with AVX-512 BF16, else the
// integer form of the same rounding. A NaN stays a NaN (its payload may differ from c10's 0x7FC0) and, with the
// instruction, a float32 subnormal rounds to zero.
inline v16 load16(const c10::BFloat16* p) {
  v16h half;
  std::memcpy(&half, p, sizeof(half));
  const v16u bits = __builtin_convertvector(half, v16u) << 16;
  v16 x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

inline v16h bf16_bits(v16 x) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  __m512 wide;
  std::memcpy(&wide, &x, sizeof(wide));
  const __m256bh narrow = _mm512_cvtneps_pbh(wide);
  v16h half;
  std::memcpy(&half, &narrow, sizeof(half));
  return half;
#else
  v16u bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const v16u rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return __builtin_convertvector(x != x ? v16u{} + 0x7FC0u : rounded, v16h);
#endif
}

inline void store16(c10::BFloat16* p, v16 x) {
  const v16h half = bf16_bits(x);
  std::memcpy(p, &half, sizeof(half));
}

// x rounded to T and widened back to float32 (what `float(T(x))` gives, lane by lane).
template <typename T>
inline v16 round16(v16 x);

template <>
inline v16 round16<float>(v16 x) {
  return x;
}

template <>
inline v16 round16<c10::BFloat16>(v16 x) {
  const v16u bits = __builtin_convertvector(bf16_bits(x), v16u) << 16;
  v16 out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Sum of the 16 lanes.
inline float sum16(v16 x) {
  float total = 0.0f;
  for (int i = 0; i < 16; ++i) total += x[i];
  return total;
}

// exp of 16 lanes, written so it stays in vector registers (no calls, no branches): x = n ln2 + r with
// |r| <= ln2 / 2 (n rounded to nearest by adding and subtracting 1.5 * 2^23; Cody-Waite split of ln2), exp(r) by
// its degree-7 Taylor polynomial (relative error < 1e-8 on that range), 2^n through the exponent bits. Inputs
// below -87 (masked scores included) give exactly 0.
inline v16 exp16(v16 v) {
  const v16 low = splat16(-87.0f), high = splat16(88.0f), round = splat16(12582912.0f);
  v16 clamped = v < low ? low : v;
  clamped = clamped > high ? high : clamped;
  const v16 k = (clamped * 1.44269504088896341f + round) - round;
  const v16 r = (clamped - k * 0.693145751953125f) - k * 1.428606765330187045e-06f;
  v16 p = splat16(1.0f / 5040.0f);
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const v16i bits = (__builtin_convertvector(k, v16i) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return v < low ? splat16(0.0f) : p * scale;
}

// exp(x) for a whole array: exp16 on each 16 floats, the tail padded.
inline void exp_inplace(float* __restrict x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(x + i, exp16(load16(x + i)));
  if (i < n) {
    float tail[16] = {};
    std::memcpy(tail, x + i, (n - i) * sizeof(float));
    const v16 e = exp16(load16(tail));
    std::memcpy(x + i, &e, (n - i) * sizeof(float));
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// 2^t for 16 lanes with t <= 0 (up to a few units above), to the precision the probabilities need before they are
// rounded to bfloat16: t clamped at -200 (2^-200 is 0 in float32, so masked scores give exactly 0), k = round(t),
// 2^(t - k) by its degree-5 Taylor polynomial on [-1/2, 1/2] (relative error below 3e-6, against 4e-3 for the
// rounding to bfloat16), times 2^k by VSCALEFPS: 8 instructions where exp16's range reduction and exponent
// arithmetic take about 20.
inline __m512 exp2_16(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-200.0f));
  const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(t, k);
  __m512 p = _mm512_set1_ps(1.3333558146428443e-3f);  // ln2^i / i!
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.618129107628477e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.550410866482158e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.2402265069591007f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.6931471805599453f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, k);
}

// The index that interleaves the two 16-element halves of 32 bfloat16s into pairs: (x[i], x[16 + i]) at 2i.
inline __m512i pair_index() {
  alignas(64) uint16_t index[32];
  for (int i = 0; i < 16; ++i) {
    index[2 * i] = static_cast<uint16_t>(i);
    index[2 * i + 1] = static_cast<uint16_t>(16 + i);
  }
  return _mm512_load_si512(index);
}
#endif

// x[0:n] rounded to integers on one scale: q[i] = round(x[i] / dx) within [-levels, levels], dx = max|x| / levels
// (returned; q all 0 where x is). x / dx, not x * (1 / dx): tests/ops rebuilds these values in torch with the same
// division. The activations of every GGUF block kernel (int8, 14- and 16-bit) are rounded here: with AVX-512, 16
// values to an instruction (a NaN is passed over by the maximum and rounds to -levels, as in the scalar loop).
// With `sums16` (n a multiple of 16), sums16[g] = q[16g] + ... + q[16g + 15], summed from the integers still in
// registers: summing q after storing it reads back bytes that stores of other widths wrote, which stalls every block.
template <typename Int>
inline float round_to_levels(const float* x, int n, int levels, Int* q, int32_t* sums16 = nullptr) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (n % 16 == 0) {
    __m512 largest = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) largest = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), largest);
    const float amax = _mm512_reduce_max_ps(largest);
    const float dx = amax / static_cast<float>(levels);
    if (amax == 0.0f) {
      std::fill(q, q + n, Int{0});
      if (sums16 != nullptr) std::fill(sums16, sums16 + n / 16, 0);
      return dx;
    }
    const __m512 step = _mm512_set1_ps(dx), top = _mm512_set1_ps(static_cast<float>(levels));
    const __m512 bottom = _mm512_set1_ps(-static_cast<float>(levels));
    for (int i = 0; i < n; i += 16) {
      const __m512 rounded = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), step),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i v = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(rounded, bottom), top));
      if (sums16 != nullptr) sums16[i / 16] = _mm512_reduce_add_epi32(v);
      if constexpr (sizeof(Int) == 1)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(v));
      else if constexpr (sizeof(Int) == 2)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm512_cvtepi32_epi16(v));
      else
        _mm512_storeu_si512(q + i, v);
    }
    return dx;
  }
#endif
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float dx = amax / static_cast<float>(levels);
  for (int i = 0; i < n; ++i) {
    const int32_t v = amax == 0.0f ? 0 : static_cast<int32_t>(std::nearbyint(x[i] / dx));
    q[i] = static_cast<Int>(std::min(levels, std::max(-levels, v)));
  }
  if (sums16 != nullptr)
    for (int g = 0; g < n / 16; ++g) {
      sums16[g] = 0;
      for (int i = 16 * g; i < 16 * g + 16; ++i) sums16[g] += q[i];
    }
  return dx;
}

// A prefetch of the cache line at p. The empty volatile statement that takes p keeps the loops of prefetches:
// GCC 12 otherwise deletes some of them (a prefetch has no effect it must keep) with their address loads.
inline void prefetch(const void* p) {
  __builtin_prefetch(p);
  asm volatile("" : : "r"(p));
}

// The same into L2 only (PREFETCHT1): for lines needed some thousands of cycles later, which would take L1's
// miss buffers meanwhile.
inline void prefetch_l2(const void* p) {
  __builtin_prefetch(p, 0, 2);
  asm volatile("" : : "r"(p));
}

}  // namespace radixserve_cpu
