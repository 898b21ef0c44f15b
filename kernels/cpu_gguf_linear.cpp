// Linear layers on GGUF's block-quantized weights, kept in llama.cpp's own blocks: y[M, N] = x[M, K] @ W[N, K]^T
// (+ bias), float32 activations and outputs.
//
// A weight row is K / 32 blocks of 32 values, each block its own scale (and, for Q4_1, an offset), stored as the
// GGUF file stores them:
//
//     Q8_0  34 bytes: d (float16), 32 x int8 q                         w = d * q
//     Q4_0  18 bytes: d (float16), 16 bytes of nibbles                 w = d * (q - 8)
//     Q4_1  20 bytes: d (float16), m (float16), 16 bytes of nibbles    w = d * q + m
//
// (byte j of the nibbles holds value j in its low half and value j + 16 in its high half.)
//
// The blocks are dequantized in registers: bytes widened to float32 lanes, one multiply-add by the block's scale and
// offset, and the values go straight into float32 multiply-adds with the activations, which stay float32. So the
// result is the float32 product of the dequantized weight (what Hugging Face computes on the dequantized checkpoint),
// in another summation order. llama.cpp instead quantizes the activations to int8 per block, which moves results by
// about half a percent: `activation_bits` 8 asks for that arithmetic (integer dot products, cpu_gguf_q8.h).
//
// A pass reads a tile of NB weight rows against MB input rows: each block dequantized feeds MB rows, so at decode
// (one row) the cost is reading the packed weight once (a Q4_1 weight is 5/8 of a byte per value, against 4 bytes in
// float32). Prefill row counts dequantize the whole weight once (`gguf_dequantize`) and multiply with oneDNN
// (model_runner/cpu/gguf_linear.py picks by rows). The tiles are split over the threads (ATen's parallel_for, OpenMP).
// tests/ops/test_cpu_gguf_linear.py checks both against float64 products of gguf-py's dequantization.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_gguf_kquants.h"
#include "cpu_gguf_q8.h"
#include "cpu_gguf_x16.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

namespace {

constexpr int kBlock = 32;

#if defined(__AVX512F__)
constexpr int kLanes = 16;  // one zmm register per vector, 32 registers
constexpr int kTileRows = 4;
#else
constexpr int kLanes = 8;  // AVX2 (or older): one ymm register, 16 registers
constexpr int kTileRows = 2;
#endif
constexpr int kPassRows = 4;
constexpr int kVectors = kBlock / kLanes;  // vectors per block

typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));

// ggml's type ids, as gguf.GGMLQuantizationType numbers them.
enum GgmlType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vf splat(float v) { return vf{} + v; }

// kLanes bytes from p as floats: int8 (SIGNED) or, shifted right by `shift` and masked to 4 bits, nibbles.
template <bool SIGNED>
inline vf widen_bytes(const uint8_t* p, int shift) {
#if defined(__AVX512F__)
  __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
#elif defined(__AVX2__)
  __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
#endif
#if defined(__AVX2__)
  if constexpr (SIGNED) {
#if defined(__AVX512F__)
    return reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
#else
    return reinterpret_cast<vf>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
#endif
  } else {
    q = _mm_and_si128(_mm_srl_epi16(q, _mm_cvtsi32_si128(shift)), _mm_set1_epi8(0x0F));
#if defined(__AVX512F__)
    return reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)));
#else
    return reinterpret_cast<vf>(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)));
#endif
  }
#else  // no AVX2: lane by lane
  vf out;
  for (int i = 0; i < kLanes; ++i)
    out[i] = SIGNED ? static_cast<float>(static_cast<int8_t>(p[i])) : static_cast<float>((p[i] >> shift) & 0x0F);
  return out;
#endif
}

template <int64_t T>
struct Format;

template <>
struct Format<kQ8_0> {
  static constexpr int64_t kBytes = 34;
  // Vector c (values c * kLanes ...) of the block's q, as floats.
  static vf values(const uint8_t* block, int c) { return widen_bytes<true>(block + 2 + c * kLanes, 0); }
  static float scale(const uint8_t* block) { return half_to_float(block); }
  static float offset(const uint8_t*) { return 0.0f; }
};

// The nibble formats: value e < 16 is byte e's low half, value e >= 16 byte e - 16's high half.
inline vf nibbles(const uint8_t* qs, int c) {
  const int first = c * kLanes;
  return widen_bytes<false>(qs + first % 16, first < 16 ? 0 : 4);
}

template <>
struct Format<kQ4_0> {
  static constexpr int64_t kBytes = 18;
  static vf values(const uint8_t* block, int c) { return nibbles(block + 2, c); }
  static float scale(const uint8_t* block) { return half_to_float(block); }
  static float offset(const uint8_t* block) { return -8.0f * half_to_float(block); }
};

template <>
struct Format<kQ4_1> {
  static constexpr int64_t kBytes = 20;
  static vf values(const uint8_t* block, int c) { return nibbles(block + 4, c); }
  static float scale(const uint8_t* block) { return half_to_float(block); }
  static float offset(const uint8_t* block) { return half_to_float(block + 2); }
};

// The 32 float32 weights of one block, in kVectors vectors.
template <int64_t T>
inline void dequantize_block(const uint8_t* block, vf* out) {
  const vf d = splat(Format<T>::scale(block)), m = splat(Format<T>::offset(block));
#pragma GCC unroll 4
  for (int c = 0; c < kVectors; ++c) out[c] = Format<T>::values(block, c) * d + m;
}

inline float lane_sum(vf v) {
  float lanes[kLanes];
  std::memcpy(lanes, &v, sizeof(lanes));
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += lanes[i];
  return s;
}

// y[m, n0 + n] for NB weight rows from n0 and MB input rows from m0. With `ahead` (the first pass over a tile), the
// same blocks of a later tile's rows are prefetched into L2 as this tile's are read (q8::kAheadTiles).
template <int64_t T, int NB, int MB>
inline void tile(const uint8_t* w, int64_t row_bytes, const float* x, const float* bias, int64_t N, int64_t K,
                 int64_t n0, int64_t m0, float* y, const uint8_t* ahead) {
  const int64_t blocks = K / kBlock;
  vf acc[NB][MB];
#pragma GCC unroll 8
  for (int n = 0; n < NB; ++n)
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) acc[n][m] = vf{};
  for (int64_t b = 0; b < blocks; ++b) {
    vf wv[NB][kVectors];
    if (ahead != nullptr)
#pragma GCC unroll 8
      for (int n = 0; n < NB; ++n) __builtin_prefetch(ahead + n * row_bytes + b * Format<T>::kBytes, 0, 2);
#pragma GCC unroll 8
    for (int n = 0; n < NB; ++n) dequantize_block<T>(w + (n0 + n) * row_bytes + b * Format<T>::kBytes, wv[n]);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const float* xb = x + (m0 + m) * K + b * kBlock;
#pragma GCC unroll 4
      for (int c = 0; c < kVectors; ++c) {
        const vf xv = load(xb + c * kLanes);
#pragma GCC unroll 8
        for (int n = 0; n < NB; ++n) acc[n][m] += wv[n][c] * xv;
      }
    }
  }
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < MB; ++m) y[(m0 + m) * N + n0 + n] = lane_sum(acc[n][m]) + (bias ? bias[n0 + n] : 0.0f);
}

template <int64_t T, int NB, int R>
inline void rest_pass(int rows, const uint8_t* w, int64_t row_bytes, const float* x, const float* bias, int64_t N,
                      int64_t K, int64_t n0, int64_t m0, float* y, const uint8_t* ahead) {
  if constexpr (R >= 1) {
    if (rows == R) return tile<T, NB, R>(w, row_bytes, x, bias, N, K, n0, m0, y, ahead);
    rest_pass<T, NB, R - 1>(rows, w, row_bytes, x, bias, N, K, n0, m0, y, ahead);
  }
}

template <int64_t T, int NB>
inline void tile_all_rows(const uint8_t* w, int64_t row_bytes, const float* x, const float* bias, int64_t M,
                          int64_t N, int64_t K, int64_t n0, float* y, const uint8_t* ahead) {
  int64_t m0 = 0;
  for (; m0 + kPassRows <= M; m0 += kPassRows, ahead = nullptr)
    tile<T, NB, kPassRows>(w, row_bytes, x, bias, N, K, n0, m0, y, ahead);
  if (m0 < M)
    rest_pass<T, NB, kPassRows - 1>(static_cast<int>(M - m0), w, row_bytes, x, bias, N, K, n0, m0, y, ahead);
}

template <int64_t T>
void linear_typed(const uint8_t* w, int64_t row_bytes, const float* x, const float* bias, int64_t M, int64_t N,
                  int64_t K, float* y) {
  const int64_t tiles = N / kTileRows;
  at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t later = t + q8::kAheadTiles;
      const uint8_t* ahead = later < end ? w + later * kTileRows * row_bytes : nullptr;
      tile_all_rows<T, kTileRows>(w, row_bytes, x, bias, M, N, K, t * kTileRows, y, ahead);
    }
  });
  for (int64_t n = tiles * kTileRows; n < N; ++n) tile_all_rows<T, 1>(w, row_bytes, x, bias, M, N, K, n, y, nullptr);
}

template <int64_t T>
void dequantize_typed(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, float* out) {
  const int64_t blocks = K / kBlock;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    vf values[kVectors];
    for (int64_t n = begin; n < end; ++n)
      for (int64_t b = 0; b < blocks; ++b) {
        dequantize_block<T>(w + n * row_bytes + b * Format<T>::kBytes, values);
        std::memcpy(out + n * K + b * kBlock, values, sizeof(values));
      }
  });
}

// K-quants: integer dot products against the activations quantized per super-block to Int (cpu_gguf_kquants.h), in
// tiles of kRows weight rows: each super-block is unpacked once and meets every input row.
template <typename Int>
void kquant_linear(const uint8_t* w, int64_t row_bytes, int64_t type, const float* x, const float* bias, int64_t M,
                   int64_t N, int64_t K, float* y) {
  using kquants::kSuper;
  constexpr int kRows = 4;
  const int64_t blocks = K / kSuper, bytes = kquants::super_block_bytes(type);
  std::vector<kquants::QuantizedBlock<Int>> xq(M * blocks);  // [M, blocks]: row m's block b at m * blocks + b
  at::parallel_for(0, M * blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) kquants::quantize_activations(x + i * kSuper, xq[i]);
  });
  at::parallel_for(0, (N + kRows - 1) / kRows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(M * kRows);
    kquants::Unpacked unpacked[kRows];
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n0 = tile * kRows;
      const int rows = static_cast<int>(std::min<int64_t>(kRows, N - n0));
      std::fill(acc.begin(), acc.end(), 0.0f);
      // a later tile's super-blocks are prefetched as q8::tile does, when that tile is whole
      const bool ahead = tile + q8::kAheadTiles < end && (tile + q8::kAheadTiles + 1) * kRows <= N;
      for (int64_t b = 0; b < blocks; ++b) {
        if (ahead)
          for (int r = 0; r < kRows; ++r)
            for (int64_t line = 0; line < bytes; line += 64)
              __builtin_prefetch(w + (n0 + q8::kAheadTiles * kRows + r) * row_bytes + b * bytes + line, 0, 2);
        for (int r = 0; r < rows; ++r) kquants::unpack(type, w + (n0 + r) * row_bytes + b * bytes, unpacked[r]);
        for (int64_t m = 0; m < M; ++m)
          for (int r = 0; r < rows; ++r) acc[m * kRows + r] += kquants::block_dot(unpacked[r], xq[m * blocks + b]);
      }
      for (int64_t m = 0; m < M; ++m)
        for (int r = 0; r < rows; ++r) y[m * N + n0 + r] = acc[m * kRows + r] + (bias ? bias[n0 + r] : 0.0f);
    }
  });
}

void kquant_dequantize(const uint8_t* w, int64_t row_bytes, int64_t type, int64_t N, int64_t K, float* out) {
  const int64_t blocks = K / kquants::kSuper, bytes = kquants::super_block_bytes(type);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    kquants::Unpacked unpacked;
    for (int64_t n = begin; n < end; ++n)
      for (int64_t b = 0; b < blocks; ++b) {
        kquants::unpack(type, w + n * row_bytes + b * bytes, unpacked);
        kquants::dequantize(unpacked, out + n * K + b * kquants::kSuper);
      }
  });
}

bool is_kquant(int64_t type) { return kquants::super_block_bytes(type) != 0; }

// An interleaved type's activation bits (16 for GGML type + x16::kFlag16, 8 for + x16::kFlag8), else 0.
int interleaved_bits(int64_t type) {
  for (const auto& [flag, bits] : {std::pair<int64_t, int>{x16::kFlag16, 16}, {x16::kFlag8, 8}}) {
    const int64_t base = type - flag;
    if (base == kQ4_0 || base == kQ4_1 || base == kQ8_0) return bits;
  }
  return 0;
}

bool is_interleaved(int64_t type) { return interleaved_bits(type) != 0; }

int64_t base_type(int64_t type) {
  const int bits = interleaved_bits(type);
  return bits == 0 ? type : type - (bits == 16 ? x16::kFlag16 : x16::kFlag8);
}

// (bytes, values) of one block of `type` (an interleaved type: of its GGML type).
std::pair<int64_t, int64_t> block_shape(int64_t type) {
  type = base_type(type);
  switch (type) {
    case kQ8_0: return {Format<kQ8_0>::kBytes, kBlock};
    case kQ4_0: return {Format<kQ4_0>::kBytes, kBlock};
    case kQ4_1: return {Format<kQ4_1>::kBytes, kBlock};
    default:
      TORCH_CHECK(is_kquant(type), "gguf_linear: unsupported GGML type ", type,
                  " (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14; interleaved Q4_0, Q4_1, Q8_0: ",
                  x16::kFlag16, " or ", x16::kFlag8, " + the type)");
      return {kquants::super_block_bytes(type), kquants::kSuper};
  }
}

#define DISPATCH_GGML_TYPE(type, FN, ...)                         \
  switch (type) {                                                 \
    case kQ8_0: FN<kQ8_0>(__VA_ARGS__); break;                    \
    case kQ4_0: FN<kQ4_0>(__VA_ARGS__); break;                    \
    case kQ4_1: FN<kQ4_1>(__VA_ARGS__); break;                    \
  }

// FN<GGML type, activation bits>(...) for an interleaved type
#define DISPATCH_INTERLEAVED(type, FN, ...)                                      \
  switch (type) {                                                                \
    case x16::kFlag16 + kQ8_0: FN<x16::kQ8_0, 16>(__VA_ARGS__); break;           \
    case x16::kFlag16 + kQ4_0: FN<x16::kQ4_0, 16>(__VA_ARGS__); break;           \
    case x16::kFlag16 + kQ4_1: FN<x16::kQ4_1, 16>(__VA_ARGS__); break;           \
    case x16::kFlag8 + kQ8_0: FN<x16::kQ8_0, 8>(__VA_ARGS__); break;             \
    case x16::kFlag8 + kQ4_0: FN<x16::kQ4_0, 8>(__VA_ARGS__); break;             \
    case x16::kFlag8 + kQ4_1: FN<x16::kQ4_1, 8>(__VA_ARGS__); break;             \
  }

// The weight's shape in values: (N, K), after checking it is whole blocks of `type`.
std::pair<int64_t, int64_t> weight_shape(const at::Tensor& weight, int64_t type, const char* op) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kByte,
              op, ": the weight must be a contiguous uint8 [N, row bytes]");
  const auto [bytes, values] = block_shape(type);
  TORCH_CHECK(weight.size(1) % bytes == 0, op, ": a row of ", weight.size(1), " bytes is not whole blocks of ", bytes);
  TORCH_CHECK(!is_interleaved(type) || weight.size(0) % x16::kRows == 0, op,
              ": an interleaved weight has a multiple of ", x16::kRows, " rows, got ", weight.size(0));
  return {weight.size(0), weight.size(1) / bytes * values};
}

}  // namespace

// x [..., K] float32; weight [N, K / block values * block bytes] uint8, llama.cpp's blocks of each row (or, for an
// interleaved type, `gguf_interleave`'s groups of 16 rows); type: the GGML type id (+ x16::kFlag16 or kFlag8 where
// interleaved); activation_bits: 8, llama.cpp's int8 activations (the K-quants' per block of 256, Q8_K; the other
// types' per block of 32, cpu_gguf_q8.h and cpu_gguf_x16.h), or 16 (the K-quants' 14-bit integers; interleaved
// types' 16-bit integers; the other types multiply the float32 activations). An interleaved type names its own.
at::Tensor gguf_linear(const at::Tensor& x_in, const at::Tensor& weight, int64_t type,
                       const std::optional<at::Tensor>& bias_in, int64_t activation_bits) {
  TORCH_CHECK(activation_bits == 8 || activation_bits == 16, "gguf_linear: activation_bits is 8 or 16, got ",
              activation_bits);
  const auto [N, K] = weight_shape(weight, type, "gguf_linear");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "gguf_linear: float32 activations, got ", x_in.scalar_type());
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == K, "gguf_linear: x's last dimension must be ", K);
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(bias_in->numel() == N, "gguf_linear: the bias must have ", N, " elements");
    bias = bias_in->to(at::kFloat).contiguous();
  }
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x_in.options());
  if (M == 0 || N == 0) return y;
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  TORCH_CHECK(!is_interleaved(type) || activation_bits == interleaved_bits(type), "gguf_linear: blocks of type ", type,
              " were interleaved for ", interleaved_bits(type), "-bit activations, not ", activation_bits);
  if (is_interleaved(type))
    DISPATCH_INTERLEAVED(type, x16::linear, weight.data_ptr<uint8_t>(), weight.size(1), x.data_ptr<float>(), bp, M, N,
                         K, y.data_ptr<float>())
  else if (is_kquant(type) && activation_bits == 8)
    kquant_linear<int8_t>(weight.data_ptr<uint8_t>(), weight.size(1), type, x.data_ptr<float>(), bp, M, N, K,
                          y.data_ptr<float>());
  else if (is_kquant(type))
    kquant_linear<int16_t>(weight.data_ptr<uint8_t>(), weight.size(1), type, x.data_ptr<float>(), bp, M, N, K,
                           y.data_ptr<float>());
  else if (activation_bits == 8)
    DISPATCH_GGML_TYPE(type, q8::linear, weight.data_ptr<uint8_t>(), weight.size(1), x.data_ptr<float>(), bp, M, N, K,
                       y.data_ptr<float>())
  else
    DISPATCH_GGML_TYPE(type, linear_typed, weight.data_ptr<uint8_t>(), weight.size(1), x.data_ptr<float>(), bp, M, N,
                       K, y.data_ptr<float>());
  return y;
}

// The float32 values [N, K] of a weight in blocks.
at::Tensor gguf_dequantize(const at::Tensor& weight, int64_t type) {
  const auto [N, K] = weight_shape(weight, type, "gguf_dequantize");
  at::Tensor out = at::empty({N, K}, weight.options().dtype(at::kFloat));
  if (is_interleaved(type))
    DISPATCH_INTERLEAVED(type, x16::dequantize, weight.data_ptr<uint8_t>(), weight.size(1), N, K,
                         out.data_ptr<float>())
  else if (is_kquant(type))
    kquant_dequantize(weight.data_ptr<uint8_t>(), weight.size(1), type, N, K, out.data_ptr<float>());
  else
    DISPATCH_GGML_TYPE(type, dequantize_typed, weight.data_ptr<uint8_t>(), weight.size(1), N, K,
                       out.data_ptr<float>());
  return out;
}

// The same weight re-laid in groups of 16 rows (cpu_gguf_x16.h) for activations of activation_bits (16 or 8), for
// type + x16::kFlag16 or kFlag8; rows a multiple of 16.
at::Tensor gguf_interleave(const at::Tensor& weight, int64_t type, int64_t activation_bits) {
  TORCH_CHECK(type == kQ4_0 || type == kQ4_1 || type == kQ8_0,
              "gguf_interleave: Q4_0 (2), Q4_1 (3) or Q8_0 (8) blocks, got type ", type);
  TORCH_CHECK(activation_bits == 16 || activation_bits == 8, "gguf_interleave: activation_bits is 16 or 8, got ",
              activation_bits);
  const int64_t interleaved = type + (activation_bits == 16 ? x16::kFlag16 : x16::kFlag8);
  weight_shape(weight, interleaved, "gguf_interleave");
  at::Tensor out = at::empty_like(weight);
  DISPATCH_INTERLEAVED(interleaved, x16::interleave, weight.data_ptr<uint8_t>(), weight.size(1), weight.size(0),
                       out.data_ptr<uint8_t>());
  return out;
}

// Whether interleaved blocks multiply in vector registers here (AVX-512 BW + VNNI); elsewhere value by value.
bool gguf_interleaved_vectorized() { return x16::kVectorized; }

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("gguf_linear(Tensor x, Tensor weight, int type, Tensor? bias, int activation_bits=16) -> Tensor");
  m.def("gguf_dequantize(Tensor weight, int type) -> Tensor");
  m.def("gguf_interleave(Tensor weight, int type, int activation_bits=16) -> Tensor");
  m.def("gguf_interleaved_vectorized() -> bool", &gguf_interleaved_vectorized);
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_dequantize", &gguf_dequantize);
  m.impl("gguf_interleave", &gguf_interleave);
}
