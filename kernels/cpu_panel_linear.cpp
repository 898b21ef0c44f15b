// Linear layers of a decode batch on the CPU (a few to a few dozen rows) on AVX-512: y[M, N] = x[M, K] @ W[N, K]^T
// (+ bias), with the weight packed once into column panels (model_runner/cpu/panel_linear.py):
//   float32:  packed[p][k][c]    = W[32 p + c][k]              ([N / 32, K, 32])
//   bfloat16: packed[p][j][c][e] = W[32 p + c][2 j + e]        ([N / 32, K / 2, 32, 2], VDPBF16PS's pairs)
//
// A panel's 32 output columns are two vectors. The micro-kernel holds a block of up to 12 input rows x 32 columns in
// 24 accumulators; each step loads the panel's next two vectors (one k, or one pair of k in bfloat16) and adds the
// products with each row's broadcast input, 24 multiply-adds for 2 vector loads and 12 broadcasts. The batch's
// rows go in balanced blocks, every block of a panel over the whole of K: the first block reads the panel from
// memory, the others from L2 (a panel is 32 x K elements: 72 KB at K = 576 in float32).
//
// At these row counts oneDNN's packed inner product waits for the weight: with the weights of many layers cycling
// through memory, its time is about the time to read them plus the time to multiply (benchmarks/cpu_linear.py,
// docs/benchmarks.md). Here each row block prefetches its share of the thread's next panel into L2 as it runs, so
// the next panel's reads overlap this panel's arithmetic. Panels are split over the threads (ATen's parallel_for).
//
// Sums run over k in order per output (float32 accumulation in both dtypes); bfloat16 outputs are the float32 sums
// (+ bias) rounded once to nearest even, as oneDNN rounds them. VDPBF16PS adds a pair's two products before the
// accumulator, as oneDNN's bfloat16 kernels on this instruction do.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kPanel = 32;     // output columns of a panel
constexpr int kMaxBlock = 12;  // input rows of a micro tile: 24 accumulators

bool supported(at::ScalarType dtype) {
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return true;
#endif
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return true;
#endif
  return false;
}

#if defined(__AVX512F__)

// Where a row block prefetches: `count` steps of the next panel from `first` (each step 128 bytes, two lines), one
// every `every` of the block's own steps; `at(k)` at each of them.
struct Prefetch {
  const char* first = nullptr;
  int64_t count = 0;
  int64_t every = 1;
  int64_t next = 0;
  int64_t issued = 0;

  inline void at(int64_t k) {
    if (k != next || issued >= count) return;
    const char* p = first + 128 * issued++;
    _mm_prefetch(p, _MM_HINT_T1);
    _mm_prefetch(p + 64, _MM_HINT_T1);
    next += every;
  }
};

inline void store_row(float* y, __m512 lo, __m512 hi, const float* bias) {
  if (bias != nullptr) {
    lo = _mm512_add_ps(lo, _mm512_loadu_ps(bias));
    hi = _mm512_add_ps(hi, _mm512_loadu_ps(bias + 16));
  }
  _mm512_storeu_ps(y, lo);
  _mm512_storeu_ps(y + 16, hi);
}

// R rows x 32 columns over `steps` steps of the panel `b` (128 bytes a step); x rows `ldx` elements apart.
template <int R>
inline void block_f32(const float* __restrict x, int64_t ldx, const float* __restrict b, int64_t steps,
                      float* __restrict y, int64_t ldy, const float* bias, Prefetch pf) {
  __m512 acc[R][2];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < steps; ++k) {
    pf.at(k);
    const __m512 b0 = _mm512_loadu_ps(b + k * kPanel), b1 = _mm512_loadu_ps(b + k * kPanel + 16);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) store_row(y + r * ldy, acc[r][0], acc[r][1], bias);
}

#if defined(__AVX512BF16__)
// The same over pairs of k: step j multiplies x[r][2j], x[r][2j + 1] with the panel's pairs.
template <int R>
inline void block_bf16(const c10::BFloat16* __restrict x, int64_t ldx, const c10::BFloat16* __restrict b,
                       int64_t steps, c10::BFloat16* __restrict y, int64_t ldy, const float* bias, Prefetch pf) {
  __m512 acc[R][2];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t j = 0; j < steps; ++j) {
    pf.at(j);
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + j * 2 * kPanel);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + j * 2 * kPanel + kPanel);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * j, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    __m512 lo = acc[r][0], hi = acc[r][1];
    if (bias != nullptr) {
      lo = _mm512_add_ps(lo, _mm512_loadu_ps(bias));
      hi = _mm512_add_ps(hi, _mm512_loadu_ps(bias + 16));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), (__m256i)_mm512_cvtneps_pbh(lo));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + 16), (__m256i)_mm512_cvtneps_pbh(hi));
  }
}
#endif

template <typename T>
struct Block;

template <>
struct Block<float> {
  template <int R>
  static void run(const float* x, int64_t ldx, const float* b, int64_t steps, float* y, int64_t ldy,
                  const float* bias, Prefetch pf) {
    block_f32<R>(x, ldx, b, steps, y, ldy, bias, pf);
  }
};

#if defined(__AVX512BF16__)
template <>
struct Block<c10::BFloat16> {
  template <int R>
  static void run(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* b, int64_t steps, c10::BFloat16* y,
                  int64_t ldy, const float* bias, Prefetch pf) {
    block_bf16<R>(x, ldx, b, steps, y, ldy, bias, pf);
  }
};
#endif

// The instantiation for exactly `rows` (1..R) rows.
template <typename T, int R>
inline void block_rows(int rows, const T* x, int64_t ldx, const T* b, int64_t steps, T* y, int64_t ldy,
                       const float* bias, Prefetch pf) {
  if constexpr (R >= 1) {
    if (rows == R) return Block<T>::template run<R>(x, ldx, b, steps, y, ldy, bias, pf);
    block_rows<T, R - 1>(rows, x, ldx, b, steps, y, ldy, bias, pf);
  }
}

// Steps of a panel: k (float32) or pairs of k (bfloat16); a step is 32 columns x 4 bytes either way.
template <typename T>
void panel_linear_typed(const T* x, const T* packed, const float* bias, int64_t M, int64_t N, int64_t K, T* y) {
  const int64_t panels = N / kPanel;
  const int64_t steps = sizeof(T) == 4 ? K : K / 2;
  const int64_t panel_elems = steps * 128 / static_cast<int64_t>(sizeof(T));
  const int64_t blocks = (M + kMaxBlock - 1) / kMaxBlock;
  const int64_t share = (steps + blocks - 1) / blocks;  // next-panel steps each block prefetches
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const T* panel = packed + p * panel_elems;
      const char* next = p + 1 < end ? reinterpret_cast<const char*>(panel + panel_elems) : nullptr;
      int64_t m0 = 0;
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const int rows = static_cast<int>(M / blocks + (blk < M % blocks ? 1 : 0));  // balanced blocks
        Prefetch pf;
        if (next != nullptr && blk * share < steps) {
          pf.first = next + 128 * blk * share;
          pf.count = std::min(share, steps - blk * share);
          pf.every = std::max<int64_t>(1, steps / pf.count);
        }
        block_rows<T, kMaxBlock>(rows, x + m0 * K, K, panel, steps, y + m0 * N + p * kPanel, N,
                                 bias == nullptr ? nullptr : bias + p * kPanel, pf);
        m0 += rows;
      }
    }
  });
}

#endif  // __AVX512F__

at::Tensor panel_linear(const at::Tensor& x_in, const at::Tensor& packed, const std::optional<at::Tensor>& bias_in) {
  const at::ScalarType dtype = packed.scalar_type();
  TORCH_CHECK(supported(dtype), "panel_linear: ", dtype, " weights need AVX-512 (bfloat16: AVX512_BF16) here");
  TORCH_CHECK(x_in.scalar_type() == dtype, "panel_linear: x is ", x_in.scalar_type(), ", the weight ", dtype);
  TORCH_CHECK(packed.is_contiguous() && packed.size(-1) == (dtype == at::kFloat ? kPanel : 2) &&
                  packed.dim() == (dtype == at::kFloat ? 3 : 4),
              "panel_linear: the weight must be packed by model_runner/cpu/panel_linear.py");
  const int64_t N = packed.size(0) * kPanel;
  const int64_t K = dtype == at::kFloat ? packed.size(1) : 2 * packed.size(1);
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == K, "panel_linear: x's last dimension must be ", K);
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(bias_in->numel() == N, "panel_linear: the bias must have ", N, " elements");
    bias = bias_in->to(at::kFloat).contiguous();
  }
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x_in.options());
  if (M == 0) return y;
#if defined(__AVX512F__)
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  if (dtype == at::kFloat)
    panel_linear_typed(x.data_ptr<float>(), packed.data_ptr<float>(), bp, M, N, K, y.data_ptr<float>());
#if defined(__AVX512BF16__)
  else
    panel_linear_typed(x.data_ptr<c10::BFloat16>(), packed.data_ptr<c10::BFloat16>(), bp, M, N, K,
                       y.data_ptr<c10::BFloat16>());
#endif
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("panel_linear_supported(ScalarType dtype) -> bool", &supported);
  m.def("panel_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("panel_linear", &panel_linear); }
