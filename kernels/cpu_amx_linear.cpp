// bfloat16 linear layers of up to a few dozen rows on AMX tiles: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), the
// weight packed once (model_runner/cpu_amx_linear.py) into the tiles' pair layout, float32 accumulation.
//
// A decode batch (8-64 rows) reads every weight once per step, and on a 2-core machine that read is what the step
// costs: oneDNN's packed inner product took twice as long at 64 rows as at 8 for the same weights. Here a thread
// takes 32 output columns at a time (two B tiles of 16 columns, one 1 KB tile per 32 of K), reads them once, and
// multiplies them with every 32-row block of the input (A tiles, re-read from L1/L2) into four C tiles of 16 x 16
// float32 sums; each weight tile is loaded once per row block, so up to 32 rows cost one pass over the weight.
// The sums (+ bias) are rounded once to bfloat16, as oneDNN rounds them; the sum order over K differs from
// oneDNN's (float32 sums of exact bfloat16 products either way).
//
// Packed weight: [N / 16][K / 32][16][16][2] bfloat16, element (nb, kb, r, n, e) = W[16 nb + n][32 kb + 2 r + e]
// (TDPBF16PS's B operand: 16 rows of K pairs, 16 columns). Needs N a multiple of 32 and K of 32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_attention_amx.h"
#include "cpu_vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

namespace {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

// Tiles 0-3: C (16 rows x 16 float32), 4-5: A (16 rows x 32 bfloat16), 6-7: B (16 pairs x 16 columns x 2).
constexpr int kGemmTiles = 8;

constexpr int64_t kAhead = 4;  // K blocks of the weight prefetched ahead of the tile loads

// Columns [32 nb, 32 nb + 32) of y for rows [0, M); `a` holds Mpad (a multiple of 32) rows of K bfloat16.
inline void column_block(const uint16_t* a, const uint16_t* packed, const float* bias, int64_t M, int64_t Mpad,
                         int64_t N, int64_t K, int64_t nb, c10::BFloat16* y, float* sums) {
  const int64_t k_blocks = K / 32;
  const uint16_t* b0 = packed + (2 * nb) * k_blocks * 512;
  const uint16_t* b1 = b0 + k_blocks * 512;
  for (int64_t m0 = 0; m0 < Mpad; m0 += 32) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* rows = a + m0 * K;
    for (int64_t kb = 0; kb < k_blocks; ++kb) {
      if (m0 == 0 && kb + kAhead < k_blocks) {  // the weight streams from memory once: ask for it ahead
        for (int line = 0; line < 16; ++line) {
          radixserve_cpu::prefetch(b0 + (kb + kAhead) * 512 + line * 32);
          radixserve_cpu::prefetch(b1 + (kb + kAhead) * 512 + line * 32);
        }
      }
      _tile_loadd(4, rows + kb * 32, K * 2);
      _tile_loadd(5, rows + 16 * K + kb * 32, K * 2);
      _tile_loadd(6, b0 + kb * 512, 64);
      _tile_loadd(7, b1 + kb * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, sums, 32 * 4);
    _tile_stored(1, sums + 16, 32 * 4);
    _tile_stored(2, sums + 16 * 32, 32 * 4);
    _tile_stored(3, sums + 16 * 32 + 16, 32 * 4);
    const int64_t rows_here = std::min<int64_t>(32, M - m0);
    for (int64_t r = 0; r < rows_here; ++r) {
      c10::BFloat16* out = y + (m0 + r) * N + nb * 32;
      for (int j = 0; j < 2; ++j) {
        radixserve_cpu::v16 v = radixserve_cpu::load16(sums + r * 32 + 16 * j);
        if (bias != nullptr) v += radixserve_cpu::load16(bias + nb * 32 + 16 * j);
        radixserve_cpu::store16(out + 16 * j, v);
      }
    }
  }
}

bool amx_usable() { return radixserve_cpu::amx_ready() && radixserve_cpu::amx_enabled(); }

#else

bool amx_usable() { return false; }

#endif

bool amx_linear_ready() { return amx_usable(); }

at::Tensor amx_linear(const at::Tensor& x_in, const at::Tensor& packed, const std::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(amx_usable(), "amx_linear: AMX-BF16 tiles are not available in this process");
  TORCH_CHECK(packed.dim() == 5 && packed.size(2) == 16 && packed.size(3) == 16 && packed.size(4) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "amx_linear: the packed weight must be a contiguous bfloat16 [N / 16, K / 32, 16, 16, 2]");
  const int64_t N = packed.size(0) * 16, K = packed.size(1) * 32;
  TORCH_CHECK(N % 32 == 0, "amx_linear: out_features must be a multiple of 32, got ", N);
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && x_in.dim() >= 1 && x_in.size(-1) == K,
              "amx_linear: x must be bfloat16 with a last dimension of ", K);
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0), Mpad = (M + 31) / 32 * 32;
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(bias_in->numel() == N, "amx_linear: the bias must have ", N, " elements");
    bias = bias_in->to(at::kFloat).contiguous();
  }
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x_in.options());
  if (M == 0) return y;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  at::Tensor a = x;
  if (Mpad != M) {  // whole 32-row blocks for the A tiles; the padding rows' sums are dropped
    a = at::zeros({Mpad, K}, x.options());
    a.narrow(0, 0, M).copy_(x);
  }
  const uint16_t* ap = reinterpret_cast<const uint16_t*>(a.data_ptr<c10::BFloat16>());
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, N / 32, 1, [&](int64_t begin, int64_t end) {
    radixserve_cpu::AmxTiles tiles(kGemmTiles);
    alignas(64) float sums[32 * 32];
    for (int64_t nb = begin; nb < end; ++nb) column_block(ap, pp, bp, M, Mpad, N, K, nb, yp, sums);
  });
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("amx_linear_ready() -> bool", &amx_linear_ready);
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("amx_linear", &amx_linear); }
