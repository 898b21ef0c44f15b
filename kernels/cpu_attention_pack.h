// The packed copy of a shared prefix's keys and values (one layer), in the layout the group path's AMX tile
// products read (cpu_attention_amx.h): per key tile of kPackTile keys and KV head, the tile's keys as rows
// ([kPackTile][head_dim] bfloat16, contiguous) and then its values transposed ([head_dim][kPackTile], from
// transpose_values). Keys past the prefix's end in its last tile are zero. The attention kernel reads a group's
// shared keys from this copy instead of gathering and transposing them from the pool at every call; it is made
// by pack_shared_kv (cpu_attention_pack.cpp) and kept across decode steps by model_runner/attention/
// cpu_shared_packs.py.
#pragma once

#include <cstdint>

namespace radixserve_cpu {

constexpr int64_t kPackTile = 32;  // keys per tile: the attention's key tile

// Elements (bfloat16) of one (tile, KV head) block: the keys, then the transposed values.
inline int64_t pack_block_elements(int64_t head_dim) { return 2 * kPackTile * head_dim; }

// Where the keys of tile `tile`, KV head `head` start; the transposed values follow kPackTile * head_dim later.
inline int64_t pack_block_offset(int64_t tile, int64_t head, int64_t num_kv_heads, int64_t head_dim) {
  return (tile * num_kv_heads + head) * pack_block_elements(head_dim);
}

// Tiles of a prefix of n keys.
inline int64_t pack_tiles(int64_t n) { return (n + kPackTile - 1) / kPackTile; }

}  // namespace radixserve_cpu
