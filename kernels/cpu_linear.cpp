// Linear layers of a few rows on the CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), float32 or bfloat16 weights in
// their own layout (no packed copy), float32 accumulation.
//
// At a handful of rows (decode batches, speculative verify chains) a linear layer is bound by reading its weight:
// the arithmetic per weight element is M multiply-adds. So the weight is read from memory once per call: the
// output rows are split into tiles of a few weight rows; a tile's rows are streamed once for the first few input
// rows and re-read from L1 for the others (a tile of 4 rows of K = 1536 floats is 24 KB), each loaded weight vector
// feeding one multiply-add per input row of the pass, while the next tile's rows are prefetched. Every (weight row,
// input row) pair keeps its own vector of partial sums over K; a shuffle tree turns a tile's vectors into one vector
// of sums at the end. bfloat16 weights are widened to float32 in registers. The tiles are split over the threads
// (ATen's parallel_for, OpenMP). Measured against F.linear and oneDNN's packed weights in benchmarks/cpu_linear.py
// (figures in docs/benchmarks.md); model_runner/cpu/dispatch.py picks the row counts it runs.
//
// The sum order differs from torch's (per-lane partial sums, then a pairwise reduction): float32 results agree to
// about 1e-6 relative; bfloat16 outputs are the float32 sums (+ bias) rounded once, as oneDNN rounds them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;  // one zmm register per vector, 32 registers
#else
constexpr int kLanes = 8;  // AVX2 (or older): one ymm register, 16 registers
#endif

typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t vh __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t vu __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// bfloat16 is the top half of a float32: widen each lane and shift it up.
inline vf load(const c10::BFloat16* p) {
  vh h;
  std::memcpy(&h, p, sizeof(h));
  const vu bits = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));

// Halve the segments: a and b each hold kLanes / W segments of W lanes (segment s: partial sums of one dot
// product); the result holds a's segments, then b's, each summed down to W / 2 lanes.
template <int W>
inline vf fold(vf a, vf b) {
  vi low, high;
  for (int i = 0; i < kLanes; ++i) {
    const int j = i % (kLanes / 2);
    low[i] = (i < kLanes / 2 ? 0 : kLanes) + j / (W / 2) * W + j % (W / 2);
    high[i] = low[i] + W / 2;
  }
  return __builtin_shuffle(a, b, low) + __builtin_shuffle(a, b, high);
}

// Fold COUNT vectors (a power of two) of segments of W lanes into v[0], then halve its segments down to one lane:
// lane i of v[0] ends as the sum of the lanes of vector i. About 3 instructions per vector instead of a
// horizontal sum of each.
template <int COUNT, int W>
inline void fold_all(vf* v) {
  if constexpr (COUNT > 1) {
#pragma GCC unroll 16
    for (int i = 0; i < COUNT / 2; ++i) v[i] = fold<W>(v[2 * i], v[2 * i + 1]);
    fold_all<COUNT / 2, W / 2>(v);
  } else if constexpr (W > 1) {
    v[0] = fold<W>(v[0], vf{});
    fold_all<1, W / 2>(v);
  }
}

constexpr int pow2_at_least(int n) { return n <= 1 ? 1 : 2 * pow2_at_least((n + 1) / 2); }

template <typename T>
inline T from_float(float v) {
  return static_cast<T>(v);  // float: itself; bfloat16: round to nearest even
}

// y[m, n0 + n] = x[m, :] . w[n0 + n, :] (+ bias) for NB weight rows from n0 and MB input rows (x and y already
// offset to the first of them). With `ahead` (the first pass over a tile), the same positions of the next tile's rows
// are prefetched into L2 as this tile's are read: the memory stream runs a tile ahead of the multiply-adds, which
// the out-of-order window alone does not achieve once a pass has a few input rows of arithmetic per weight vector.
template <int NB, int MB, typename W>
inline void dot_tile(const W* __restrict w, const float* __restrict x, const float* bias, int64_t N, int64_t K,
                     int64_t n0, W* __restrict y, const W* ahead) {
  vf acc[NB][MB];
#pragma GCC unroll 8
  for (int n = 0; n < NB; ++n)
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) acc[n][m] = vf{};
  const W* wt = w + n0 * K;
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    if (ahead != nullptr)
#pragma GCC unroll 8
      for (int n = 0; n < NB; ++n) __builtin_prefetch(ahead + n * K + k, 0, 2);
    vf wv[NB];
#pragma GCC unroll 8
    for (int n = 0; n < NB; ++n) wv[n] = load(wt + n * K + k);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const vf xv = load(x + m * K + k);
#pragma GCC unroll 8
      for (int n = 0; n < NB; ++n) acc[n][m] += wv[n] * xv;
    }
  }
  constexpr int kCount = pow2_at_least(NB * MB);
  static_assert(kCount <= kLanes, "one vector of sums per tile");
  vf flat[kCount];
#pragma GCC unroll 16
  for (int i = 0; i < kCount; ++i) flat[i] = i < NB * MB ? acc[i / MB][i % MB] : vf{};
  fold_all<kCount, kLanes>(flat);
  float sums[kLanes];
  std::memcpy(sums, &flat[0], sizeof(sums));
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < MB; ++m) {
      float s = sums[n * MB + m];
      for (int64_t t = k; t < K; ++t) s += static_cast<float>(wt[n * K + t]) * x[m * K + t];
      y[m * N + n0 + n] = from_float<W>(s + (bias ? bias[n0 + n] : 0.0f));
    }
}

// The last pass over a tile, of `rows` < MB input rows: the instantiation for exactly that many.
template <int NB, int R, typename W>
inline void rest_pass(int rows, const W* w, const float* x, const float* bias, int64_t N, int64_t K, int64_t n0,
                      W* y, const W* ahead) {
  if constexpr (R >= 1) {
    if (rows == R) return dot_tile<NB, R>(w, x, bias, N, K, n0, y, ahead);
    rest_pass<NB, R - 1>(rows, w, x, bias, N, K, n0, y, ahead);
  }
}

// Output rows [n0, n0 + NB) for every input row: passes of MB input rows, then one of the rest.
template <int NB, int MB, typename W>
void tile_all_rows(const W* w, const float* x, const float* bias, int64_t M, int64_t N, int64_t K, int64_t n0,
                   W* y) {
  // The next tile's rows, when they exist (a partial last tile is not prefetched: it would read past W).
  const W* next = n0 + 2 * NB <= N ? w + (n0 + NB) * K : nullptr;
  int64_t m0 = 0;
  for (; m0 + MB <= M; m0 += MB)
    dot_tile<NB, MB>(w, x + m0 * K, bias, N, K, n0, y + m0 * N, m0 == 0 ? next : nullptr);
  if (m0 < M) rest_pass<NB, MB - 1>(static_cast<int>(M - m0), w, x + m0 * K, bias, N, K, n0, y + m0 * N,
                                    m0 == 0 ? next : nullptr);
}

// A tail tile of fewer than the full tile's weight rows.
template <int NBMAX, int MB, typename W>
void tail_tile(int nb, const W* w, const float* x, const float* bias, int64_t M, int64_t N, int64_t K, int64_t n0,
               W* y) {
  if constexpr (NBMAX > 1) {
    if (nb == NBMAX - 1) return tile_all_rows<NBMAX - 1, MB>(w, x, bias, M, N, K, n0, y);
    return tail_tile<NBMAX - 1, MB>(nb, w, x, bias, M, N, K, n0, y);
  }
}

template <int NB, int MB, typename W>
void linear_rows(const W* w, const float* x, const float* bias, int64_t M, int64_t N, int64_t K, W* y) {
  const int64_t tiles = (N + NB - 1) / NB;
  // About 64 KB of weights per thread chunk at the least: a decode-sized call on a small layer stays on one thread.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(NB * K, 1));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * NB;
      const int nb = static_cast<int>(std::min<int64_t>(NB, N - n0));
      if (nb == NB)
        tile_all_rows<NB, MB>(w, x, bias, M, N, K, n0, y);
      else
        tail_tile<NB, MB>(nb, w, x, bias, M, N, K, n0, y);
    }
  });
}

// Tile shapes (weight rows x input rows per pass): as many input rows per weight vector as the registers hold
// accumulators for, and enough independent sums to keep the FMA units busy at one input row.
template <typename W>
void linear_typed(const W* w, const float* x, const float* bias, int64_t M, int64_t N, int64_t K, W* y) {
#if defined(__AVX512F__)
  if (M == 1) return linear_rows<8, 1>(w, x, bias, M, N, K, y);
  if (M == 2) return linear_rows<8, 2>(w, x, bias, M, N, K, y);
  if (M <= 4) return linear_rows<4, 4>(w, x, bias, M, N, K, y);
  return linear_rows<2, 8>(w, x, bias, M, N, K, y);  // 1 x 16 measured slower: 16 x-loads per weight vector
#else
  if (M == 1) return linear_rows<4, 1>(w, x, bias, M, N, K, y);
  if (M == 2) return linear_rows<4, 2>(w, x, bias, M, N, K, y);
  return linear_rows<2, 4>(w, x, bias, M, N, K, y);
#endif
}

at::Tensor small_linear(const at::Tensor& x_in, const at::Tensor& weight, const std::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "small_linear: the weight must be a contiguous [N, K]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "small_linear: float32 or bfloat16 weights, got ", weight.scalar_type());
  TORCH_CHECK(x_in.scalar_type() == weight.scalar_type(), "small_linear: x is ", x_in.scalar_type(),
              ", the weight ", weight.scalar_type());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == K, "small_linear: x's last dimension must be ", K);
  const at::Tensor x = x_in.reshape({-1, K}).to(at::kFloat).contiguous();  // float32 rows (a copy for bfloat16)
  const int64_t M = x.size(0);
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(bias_in->numel() == N, "small_linear: the bias must have ", N, " elements");
    bias = bias_in->to(at::kFloat).contiguous();
  }
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, weight.options());
  if (M == 0 || N == 0) return y;
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  if (weight.scalar_type() == at::kFloat)
    linear_typed(weight.data_ptr<float>(), x.data_ptr<float>(), bp, M, N, K, y.data_ptr<float>());
  else
    linear_typed(weight.data_ptr<c10::BFloat16>(), x.data_ptr<float>(), bp, M, N, K, y.data_ptr<c10::BFloat16>());
  return y;
}

// The routed experts of a mixture-of-experts layer at a few tokens: out[t] = sum_j weights[t, j] * down_e(silu(gate_e(
// x_t)) * up_e(x_t)) over the pairs whose expert e = ids[t, j] this rank holds (ids in [0, E]; E marks another rank's
// expert, skipped, as are pairs of weight 0). The pairs are grouped by expert, in expert order; each visited expert
// runs as the two small linears above on its rows, so a layer costs reading the visited experts' weights once. The
// activation is rounded to the weights' dtype, as the 16-bit path rounds it; each token sums its rows in expert order
// in float32, as model_runner/moe/grouped.py does.
template <typename W>
void experts_typed(const float* x, const W* w13, const W* w2, const int64_t* ids, const float* weights, int64_t T,
                   int64_t k, int64_t E, int64_t H, int64_t I, float* out) {
  std::vector<std::vector<int64_t>> pairs_of(E);
  for (int64_t p = 0; p < T * k; ++p)
    if (ids[p] >= 0 && ids[p] < E && weights[p] != 0.0f) pairs_of[ids[p]].push_back(p);
  std::vector<float> rows, act;
  std::vector<W> gate_up, down;
  for (int64_t e = 0; e < E; ++e) {
    const std::vector<int64_t>& pairs = pairs_of[e];
    const int64_t n = static_cast<int64_t>(pairs.size());
    if (n == 0) continue;
    rows.resize(n * H);
    for (int64_t r = 0; r < n; ++r) std::memcpy(&rows[r * H], x + (pairs[r] / k) * H, H * sizeof(float));
    gate_up.resize(n * 2 * I);
    linear_typed(w13 + e * 2 * I * H, rows.data(), nullptr, n, 2 * I, H, gate_up.data());
    act.resize(n * I);
    for (int64_t r = 0; r < n; ++r) {
      const W* gu = &gate_up[r * 2 * I];
      for (int64_t i = 0; i < I; ++i) {
        const float gate = static_cast<float>(gu[i]), up = static_cast<float>(gu[I + i]);
        act[r * I + i] = static_cast<float>(from_float<W>(gate / (1.0f + std::exp(-gate)) * up));
      }
    }
    down.resize(n * H);
    linear_typed(w2 + e * H * I, act.data(), nullptr, n, H, I, down.data());
    for (int64_t r = 0; r < n; ++r) {
      float* o = out + (pairs[r] / k) * H;
      const float weight = weights[pairs[r]];
      for (int64_t h = 0; h < H; ++h) o[h] += weight * static_cast<float>(down[r * H + h]);
    }
  }
}

at::Tensor small_experts(const at::Tensor& x_in, const at::Tensor& w13, const at::Tensor& w2,
                         const at::Tensor& topk_weights, const at::Tensor& topk_ids) {
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.is_contiguous() && w2.is_contiguous(),
              "small_experts: contiguous w13 [E, 2I, H] and w2 [E, H, I]");
  TORCH_CHECK(w13.scalar_type() == w2.scalar_type() &&
              (w13.scalar_type() == at::kFloat || w13.scalar_type() == at::kBFloat16),
              "small_experts: float32 or bfloat16 experts, got ", w13.scalar_type(), " and ", w2.scalar_type());
  const int64_t E = w13.size(0), H = w13.size(2), I = w2.size(2);
  TORCH_CHECK(w13.size(1) == 2 * I && w2.size(0) == E && w2.size(1) == H, "small_experts: w13 ", w13.sizes(),
              " and w2 ", w2.sizes(), " are not one layer's experts");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == H, "small_experts: hidden states [T, ", H, "], got ", x_in.sizes());
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == x_in.size(0) && topk_weights.sizes() == topk_ids.sizes(),
              "small_experts: routing [T, k] for T = ", x_in.size(0));
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous();
  const int64_t T = x.size(0), k = ids.size(1);
  at::Tensor out = at::zeros({T, H}, x.options());
  if (w13.scalar_type() == at::kFloat)
    experts_typed(x.data_ptr<float>(), w13.data_ptr<float>(), w2.data_ptr<float>(), ids.data_ptr<int64_t>(),
                  weights.data_ptr<float>(), T, k, E, H, I, out.data_ptr<float>());
  else
    experts_typed(x.data_ptr<float>(), w13.data_ptr<c10::BFloat16>(), w2.data_ptr<c10::BFloat16>(),
                  ids.data_ptr<int64_t>(), weights.data_ptr<float>(), T, k, E, H, I, out.data_ptr<float>());
  return out.to(x_in.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("small_experts(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("small_linear", &small_linear);
  m.impl("small_experts", &small_experts);
}
