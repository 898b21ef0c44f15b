// bfloat16 linear layers on AMX tiles: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), the weight packed once
// (model_runner/cpu/amx_linear.py) into the tiles' pair layout, float32 accumulation. Two loops over the same
// packed weight, chosen by the caller by row count:
//
// `amx_linear`, decode (a few dozen rows): a batch reads every weight once per step, and on a 2-core machine that
// read is what the step costs: oneDNN's packed inner product took twice as long at 64 rows as at 8 for the same
// weights. A thread takes 32 output columns at a time (two B tiles of 16 columns, one 1 KB tile per 32 of K), reads
// them once, and multiplies them with every 32-row block of the input (A tiles, re-read from L1/L2) into four C
// tiles of 16 x 16 float32 sums; each weight tile is loaded once per row block, so up to 32 rows cost one pass
// over the weight.
//
// `amx_gemm`, prefill (hundreds of rows): the tile products are what costs, and they run at the tiles' rate only
// when their operands come from L1 (a 2 x 2 tile step with a 72 KB working set ran at ~1.6 TFLOP/s a core, with
// 36 KB at ~2.3, on random data). Each thread takes a contiguous range of column blocks, in chunks whose weight
// panels stay in L2; per chunk and 32-row block of the input, K goes in slices of at most 9 tiles (32 rows x 288
// of the input, 18 KB, stay in L1 while every column block's slice, 18 KB, streams past), the sums of the chunk's
// column blocks kept in a float32 buffer between slices. The rounding of one block's sums to y runs during the
// next block's tile products (a few rows per K step), and in the first row block the next column block's weight
// is prefetched as the current one is multiplied (it comes from memory then).
//
// Either way the sums (+ bias) are rounded once to bfloat16, as oneDNN rounds them; the sum order over K differs
// from oneDNN's (float32 sums of exact bfloat16 products either way).
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
#include <vector>

namespace {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

// Tiles 0-3: C (16 rows x 16 float32), 4-5: A (16 rows x 32 bfloat16), 6-7: B (16 pairs x 16 columns x 2).
constexpr int kGemmTiles = 8;

constexpr int64_t kAhead = 4;  // K blocks of the weight prefetched ahead of the tile loads (decode)
constexpr int64_t kSliceBlocks = 9;         // prefill: at most this many K blocks of 32 per slice
constexpr int64_t kChunkBytes = 1 << 20;    // prefill: the weight panels of one chunk of column blocks (L2)

// A 32 x 32 block of float32 sums waiting to be rounded into y: `rows` rows of 32 columns at `out` (row stride
// `ld`), + `bias` (32 floats) where not null.
struct Pending {
  const float* sums = nullptr;
  c10::BFloat16* out = nullptr;
  const float* bias = nullptr;
  int64_t rows = 0, ld = 0;
};

// Rows [r0, r1) of a pending block (+ bias) rounded to bfloat16 into y.
inline void store_rows(const Pending& p, int64_t r0, int64_t r1) {
  r1 = std::min(r1, p.rows);
  for (int64_t r = r0; r < r1; ++r) {
    for (int j = 0; j < 2; ++j) {
      radixserve_cpu::v16 v = radixserve_cpu::load16(p.sums + r * 32 + 16 * j);
      if (p.bias != nullptr) v += radixserve_cpu::load16(p.bias + 16 * j);
      radixserve_cpu::store16(p.out + r * p.ld + 16 * j, v);
    }
  }
}

// The four C tiles into or from `sums`, a 32 x 32 block of float32 sums (row stride 32): C(a, b) holds rows
// 16a.., columns 16b.. (cpu_attention_amx.h's 2 x 2 tile layout).
template <bool kStore>
inline void move_sum_tiles(float* sums) {
  radixserve_cpu::tile_move_2x2<kStore, true, true>(sums, 16 * 32, 16, 32 * 4);
}

// Columns [32 nb, 32 nb + 32) of y for rows [0, M); `a` holds Mpad (a multiple of 32) rows of K bfloat16.
inline void column_block(const uint16_t* a, const uint16_t* packed, const float* bias, int64_t M, int64_t Mpad,
                         int64_t N, int64_t K, int64_t nb, c10::BFloat16* y, float* sums) {
  const int64_t k_blocks = K / 32;
  const uint16_t* b0 = packed + (2 * nb) * k_blocks * 512;
  const uint16_t* b1 = b0 + k_blocks * 512;
  for (int64_t m0 = 0; m0 < Mpad; m0 += 32) {
    radixserve_cpu::tile_zero_2x2<true, true>();
    const uint16_t* rows = a + m0 * K;
    for (int64_t kb = 0; kb < k_blocks; ++kb) {
      if (m0 == 0 && kb + kAhead < k_blocks) {  // the weight streams from memory once: ask for it ahead
        for (int line = 0; line < 16; ++line) {
          radixserve_cpu::prefetch(b0 + (kb + kAhead) * 512 + line * 32);
          radixserve_cpu::prefetch(b1 + (kb + kAhead) * 512 + line * 32);
        }
      }
      // Both A tiles, then both B tiles: at 32 rows ~8% faster here than tile_step_2x2's order (A0, B0, B1, A1).
      _tile_loadd(4, rows + kb * 32, K * 2);
      _tile_loadd(5, rows + 16 * K + kb * 32, K * 2);
      _tile_loadd(6, b0 + kb * 512, 64);
      _tile_loadd(7, b1 + kb * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    move_sum_tiles<true>(sums);
    const Pending block{sums, y + m0 * N + nb * 32, bias == nullptr ? nullptr : bias + nb * 32,
                        std::min<int64_t>(32, M - m0), N};
    store_rows(block, 0, 32);
  }
}

// Prefill: one 32 x 32 block of sums over K blocks [k0, k1), the 2 x 2 tiles of one step (A: two 16-row tiles of
// `rows`, row stride K; B: the two 16-column panels b0, b1) into four C tiles, which start at zero (`first`) or
// at `sums`, and end in `sums`. Meanwhile the previous block's sums (`pending`, if any) are rounded into y, a few
// rows per K step, so that vector work overlaps the tile products instead of following them. `ahead`, where not
// null, is the next column block's weight (its slice [k0, k1)), prefetched into L1 step by step.
inline void tile_block(const uint16_t* rows, const uint16_t* b0, const uint16_t* b1, int64_t K, int64_t k0,
                       int64_t k1, bool first, float* sums, const Pending& pending, const uint16_t* ahead) {
  const int64_t per_step = (pending.rows + (k1 - k0) - 1) / (k1 - k0);
  if (first) {
    radixserve_cpu::tile_zero_2x2<true, true>();
  } else {
    move_sum_tiles<false>(sums);
  }
  for (int64_t kb = k0; kb < k1; ++kb) {
    _tile_loadd(4, rows + kb * 32, K * 2);
    _tile_loadd(6, b0 + kb * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b1 + kb * 512, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, rows + 16 * K + kb * 32, K * 2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    if (pending.rows > 0) store_rows(pending, (kb - k0) * per_step, (kb - k0 + 1) * per_step);
    if (ahead != nullptr) {
      for (int line = 0; line < 16; ++line) {
        radixserve_cpu::prefetch(ahead + kb * 512 + line * 32);
        radixserve_cpu::prefetch(ahead + (K / 32) * 512 + kb * 512 + line * 32);
      }
    }
  }
  move_sum_tiles<true>(sums);
}

// Column blocks [begin, end) of y for all Mpad rows. Per chunk of `chunk` column blocks (their weight panels
// stay in L2) and 32-row block of the input, K is taken in slices of `k_slice` blocks: one slice of the 32 input
// rows (re-read from L1) meets each column block's slice of the weight (from L2) in turn, the sums of every column
// block of the chunk kept in `sums` (chunk x 32 x 32 float32) between slices; a column block's sums are rounded
// to y during the next block's last slice.
inline void prefill_columns(const uint16_t* a, const uint16_t* packed, const float* bias, int64_t M, int64_t Mpad,
                            int64_t N, int64_t K, int64_t begin, int64_t end, int64_t chunk, int64_t k_slice,
                            c10::BFloat16* y, float* sums) {
  const int64_t k_blocks = K / 32;
  Pending pending, none;
  for (int64_t c0 = begin; c0 < end; c0 += chunk) {
    const int64_t c1 = std::min(end, c0 + chunk);
    for (int64_t m0 = 0; m0 < Mpad; m0 += 32) {
      const uint16_t* rows = a + m0 * K;
      for (int64_t k0 = 0; k0 < k_blocks; k0 += k_slice) {
        const int64_t k1 = std::min(k_blocks, k0 + k_slice);
        const bool last = k1 == k_blocks;
        for (int64_t nb = c0; nb < c1; ++nb) {
          const uint16_t* b0 = packed + (2 * nb) * k_blocks * 512;
          float* here = sums + (nb - c0) * 1024;
          // The first row block reads the weight from memory: the next column block's slice is asked for ahead.
          const uint16_t* ahead = m0 == 0 && nb + 1 < end ? b0 + 2 * k_blocks * 512 : nullptr;
          tile_block(rows, b0, b0 + k_blocks * 512, K, k0, k1, k0 == 0, here, last ? pending : none, ahead);
          if (!last) continue;
          pending.sums = here;
          pending.out = y + m0 * N + nb * 32;
          pending.bias = bias == nullptr ? nullptr : bias + nb * 32;
          pending.rows = std::min<int64_t>(32, M - m0);
          pending.ld = N;
        }
      }
      if (pending.rows > 0) {  // the sums buffer is reused by the next row block
        store_rows(pending, 0, 32);
        pending.rows = 0;
      }
    }
  }
}

bool amx_usable() { return radixserve_cpu::amx_ready(); }

#else

bool amx_usable() { return false; }

#endif

bool amx_linear_ready() { return amx_usable(); }

// Checked operands of either loop: x as [M, K] rows padded with zeros to whole 32-row blocks (the padding rows'
// sums are dropped), the bias in float32, y allocated with x's leading dimensions.
struct Operands {
  at::Tensor a, bias, y;
  int64_t M = 0, Mpad = 0, N = 0, K = 0;
};

Operands operands(const char* op, const at::Tensor& x_in, const at::Tensor& packed,
                  const std::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(amx_usable(), op, ": AMX-BF16 tiles are not available in this process");
  TORCH_CHECK(packed.dim() == 5 && packed.size(2) == 16 && packed.size(3) == 16 && packed.size(4) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              op, ": the packed weight must be a contiguous bfloat16 [N / 16, K / 32, 16, 16, 2]");
  Operands o;
  o.N = packed.size(0) * 16;
  o.K = packed.size(1) * 32;
  TORCH_CHECK(o.N % 32 == 0, op, ": out_features must be a multiple of 32, got ", o.N);
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && x_in.dim() >= 1 && x_in.size(-1) == o.K,
              op, ": x must be bfloat16 with a last dimension of ", o.K);
  const at::Tensor x = x_in.reshape({-1, o.K}).contiguous();
  o.M = x.size(0);
  o.Mpad = (o.M + 31) / 32 * 32;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(bias_in->numel() == o.N, op, ": the bias must have ", o.N, " elements");
    o.bias = bias_in->to(at::kFloat).contiguous();
  }
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = o.N;
  o.y = at::empty(shape, x_in.options());
  o.a = x;
  if (o.Mpad != o.M && o.M > 0) {
    o.a = at::zeros({o.Mpad, o.K}, x.options());
    o.a.narrow(0, 0, o.M).copy_(x);
  }
  return o;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<c10::BFloat16>()); }
#endif

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  Operands o = operands("amx_linear", x, packed, bias);
  if (o.M == 0) return o.y;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  const uint16_t *ap = bits(o.a), *pp = bits(packed);
  const float* bp = o.bias.defined() ? o.bias.data_ptr<float>() : nullptr;
  c10::BFloat16* yp = o.y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, o.N / 32, 1, [&](int64_t begin, int64_t end) {
    radixserve_cpu::AmxTiles tiles(kGemmTiles);
    alignas(64) float sums[32 * 32];
    for (int64_t nb = begin; nb < end; ++nb) column_block(ap, pp, bp, o.M, o.Mpad, o.N, o.K, nb, yp, sums);
  });
#endif
  return o.y;
}

at::Tensor amx_gemm(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  Operands o = operands("amx_gemm", x, packed, bias);
  if (o.M == 0) return o.y;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  const uint16_t *ap = bits(o.a), *pp = bits(packed);
  const float* bp = o.bias.defined() ? o.bias.data_ptr<float>() : nullptr;
  c10::BFloat16* yp = o.y.data_ptr<c10::BFloat16>();
  const int64_t k_blocks = o.K / 32, slices = (k_blocks + kSliceBlocks - 1) / kSliceBlocks;
  const int64_t k_slice = (k_blocks + slices - 1) / slices;  // even slices: K 576 -> 2 x 9, 1536 -> 6 x 8
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (32 * o.K * 2));
  const int64_t blocks = o.N / 32, threads = std::min<int64_t>(at::get_num_threads(), blocks);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {  // one contiguous range of column blocks each
    radixserve_cpu::AmxTiles tiles(kGemmTiles);
    std::vector<float> buffer(chunk * 32 * 32 + 16);
    float* sums = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
    for (int64_t t = t0; t < t1; ++t) {
      prefill_columns(ap, pp, bp, o.M, o.Mpad, o.N, o.K, blocks * t / threads, blocks * (t + 1) / threads, chunk,
                      k_slice, yp, sums);
    }
  });
#endif
  return o.y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("amx_linear_ready() -> bool", &amx_linear_ready);
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("amx_gemm(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("amx_linear", &amx_linear);
  m.impl("amx_gemm", &amx_gemm);
}
