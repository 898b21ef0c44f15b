// pack_shared_kv: the packed copy of a shared prefix's keys and values for one layer (layout in
// cpu_attention_pack.h), gathered from the KV pool through the prefix's slots once, so the attention's group path
// reads it sequentially at every later decode step instead of gathering and transposing the same keys again.
// Only bfloat16 pools with head_dim a multiple of 32 on a CPU with AMX-BF16 have a packed form (the float32 and
// dot-product paths read the pool in place, with no copy to save): elsewhere the result is an empty tensor and
// the kernel gathers as before.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_attention_amx.h"
#include "cpu_attention_pack.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

using radixserve_cpu::kPackTile;

at::Tensor pack_shared_kv(const at::Tensor& k_buffer, const at::Tensor& v_buffer, const at::Tensor& slots) {
  TORCH_CHECK(k_buffer.dim() == 3 && k_buffer.sizes() == v_buffer.sizes(),
              "the KV buffers must be [slots, kv_heads, head_dim], both the same shape");
  TORCH_CHECK(k_buffer.is_contiguous() && v_buffer.is_contiguous(), "the KV buffers must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "slots must be a contiguous 1-D int64 tensor");
  const int64_t heads = k_buffer.size(1), D = k_buffer.size(2), n = slots.size(0);
  const bool packable = radixserve_cpu::kAmx && k_buffer.scalar_type() == at::kBFloat16 &&
                        v_buffer.scalar_type() == at::kBFloat16 && D % 32 == 0;
  if (!packable || n == 0) return at::empty({0}, k_buffer.options());
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < k_buffer.size(0), "slot ", slot[i], " is outside the KV buffers");
  const int64_t tiles = radixserve_cpu::pack_tiles(n);
  at::Tensor packed = at::empty({tiles * heads * radixserve_cpu::pack_block_elements(D)}, k_buffer.options());
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  const uint16_t* k = reinterpret_cast<const uint16_t*>(k_buffer.data_ptr<at::BFloat16>());
  const uint16_t* v = reinterpret_cast<const uint16_t*>(v_buffer.data_ptr<at::BFloat16>());
  uint16_t* out = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t row = heads * D;  // elements of one slot's row (every KV head)
  at::parallel_for(0, tiles * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> zeros(D, 0);
    const uint16_t* value_rows[kPackTile];
    for (int64_t block = begin; block < end; ++block) {
      const int64_t tile = block / heads, head = block % heads;
      const int64_t first = tile * kPackTile, keys = std::min(kPackTile, n - first);
      uint16_t* dst = out + radixserve_cpu::pack_block_offset(tile, head, heads, D);
      for (int64_t j = 0; j < kPackTile; ++j) {
        if (j < keys) {
          const int64_t offset = slot[first + j] * row + head * D;
          std::memcpy(dst + j * D, k + offset, D * sizeof(uint16_t));
          value_rows[j] = v + offset;
        } else {
          std::memset(dst + j * D, 0, D * sizeof(uint16_t));
          value_rows[j] = zeros.data();
        }
      }
      radixserve_cpu::transpose_values(value_rows, D, dst + kPackTile * D);
    }
  });
#endif
  return packed;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("pack_shared_kv(Tensor k_buffer, Tensor v_buffer, Tensor slots) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("pack_shared_kv", &pack_shared_kv); }
