// Paged attention on the CPU: every request of a batch in one call per layer, keys and values read straight from
// the KV pool through their slot indices (no gathered copies), query heads that share a KV head attended together.
//
// The batch is described as groups (see kernels/cpu_attention.py for how they are planned):
//   - a group holds one or more members (requests); its shared keys (a cached prefix whose KV slots all members
//     hold, before any of their queries) are read once for all the members' query rows;
//   - each member owns a contiguous range of the batch's query tokens and its own keys after the shared part.
// One work item is (group, block of a lone member's queries); an item runs all heads, so a key's row of the pool
// (every KV head) is read once, contiguously, except where the batch has fewer groups of several members than
// two per thread: then such a group runs as one unit per KV head, so even a single group keeps every thread
// busy. Units are handed to the threads from an atomic counter, so
// uneven ones balance. Per unit the scores are computed tile by tile of keys with an online softmax in float32
// (running max and sum per query row), whatever the storage dtype: many rows per KV head (a group's members, a
// block of new tokens) as the small matrix products of cpu_attention_lanes.h, few rows as dot products.
//
// Causality: the key at position p is seen by the query at position t iff p <= t. Shared keys sit at positions
// [0, n); a member's own keys at [kv_pos0, kv_pos0 + n).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_attention_dots.h"
#include "cpu_attention_lanes.h"
#include "cpu_vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using radixserve_cpu::exp_inplace;
using radixserve_cpu::LaneBlock;
using radixserve_cpu::scores_dots;
using radixserve_cpu::softmax_row;
using radixserve_cpu::values_block;

constexpr int64_t kKeyTile = 32;     // keys per tile
// A group of several members runs as one unit (every KV head) where the batch has at least this many such groups
// per thread, else as one unit per KV head so that few groups still keep every thread busy.
constexpr int64_t kGroupsPerThread = 2;
constexpr int64_t kLaneMinRows = 8;  // rows per KV head from which they attend as lanes (cpu_attention_lanes.h)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::Half>) {  // F16C: 16 values an instruction (n is a multiple of 16 here)
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
    return;
  }
#endif
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

struct Plan {
  const int64_t* group_member_indptr;  // [groups + 1]
  const int64_t* group_kv_indptr;      // [groups + 1] into kv_slots: the shared keys
  const int64_t* member_q_start;       // [members] first query token (row of q) of the member
  const int64_t* member_q_len;         // [members]
  const int64_t* member_q_pos0;        // [members] position of the member's first query
  const int64_t* member_kv_indptr;     // [members + 1] into kv_slots: the member's own keys
  const int64_t* member_kv_pos0;       // [members] position of the member's first own key
  const int64_t* kv_slots;
};

struct Item {
  int64_t group, q_begin, q_end;  // q range only for a lone member (else the whole group)
  int64_t kv_head_begin, kv_head_end;
};

// Query rows of an item are laid out KV head major: row (h, t, g) = h * T * G + t * G + g for query token t of the
// item and query head h * G + g, so the rows that read one KV head are contiguous. The queries and the output are
// scalar_t; the pool holds kv_t: the same type, or float16 beside float32 queries (each tile's keys and values
// converted to float32 once, as for any pool that is not float32).
template <typename scalar_t, typename kv_t = scalar_t>
class ItemKernel {
  // bfloat16 keys are read in place by bfloat16 dot products where the CPU has them (cpu_attention_lanes.h).
  static constexpr bool kKeysAsBf16 = std::is_same_v<scalar_t, c10::BFloat16> &&
                                      std::is_same_v<kv_t, c10::BFloat16> && radixserve_cpu::kBf16Dots;
  // Pools whose rows attend_dots reads in place, converting in registers (float64 ones are converted per tile).
  static constexpr bool kTypedRows = std::is_same_v<kv_t, float> || std::is_same_v<kv_t, c10::Half> ||
                                     std::is_same_v<kv_t, c10::BFloat16>;

 public:
  ItemKernel(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer, at::Tensor& out,
             float* lse, const Plan& plan, float scale, bool use_amx, bool row_invariant)
      : q_(q.data_ptr<scalar_t>()),
        k_(k_buffer.data_ptr<kv_t>()),
        v_(v_buffer.data_ptr<kv_t>()),
        out_(out.data_ptr<scalar_t>()),
        lse_(lse),
        plan_(plan),
        scale_(scale),
        q_stride_token_(q.stride(0)),
        q_stride_head_(q.stride(1)),
        kv_stride_slot_(k_buffer.stride(0)),
        num_heads_(q.size(1)),
        num_kv_heads_(k_buffer.size(1)),
        head_dim_(q.size(2)),
        group_(num_heads_ / num_kv_heads_),
        kv_row_(num_kv_heads_ * head_dim_),
        use_amx_(use_amx),
        row_invariant_(row_invariant) {
    k_tile_.resize(kKeyTile * kv_row_);
    v_tile_.resize(kKeyTile * kv_row_);
    zeros_.assign(kv_row_, 0.0f);
  }

  void run(const Item& item) {
    const int64_t D = head_dim_, G = group_;
    h_begin_ = item.kv_head_begin, h_end_ = item.kv_head_end;
    const int64_t first = plan_.group_member_indptr[item.group];
    const int64_t last = plan_.group_member_indptr[item.group + 1];
    // Tokens of each member: [member_token_start_[m - first], member_token_start_[m - first + 1]).
    member_token_start_.assign(1, 0);
    tokens_.clear();
    positions_.clear();
    for (int64_t m = first; m < last; ++m) {
      int64_t j0 = 0, j1 = plan_.member_q_len[m];
      if (last - first == 1) j0 = item.q_begin, j1 = item.q_end;
      for (int64_t j = j0; j < j1; ++j) {
        tokens_.push_back(plan_.member_q_start[m] + j);
        positions_.push_back(plan_.member_q_pos0[m] + j);
      }
      member_token_start_.push_back(static_cast<int64_t>(tokens_.size()));
    }
    T_ = static_cast<int64_t>(tokens_.size());
    const int64_t R = T_ * num_heads_;
    if (R == 0) return;
    if constexpr (kKeysAsBf16) q_bf16_.resize(R * D);
    else q_rows_.resize(R * D);
    acc_.assign(R * D, 0.0f);
    max_.assign(R, kNegInf);
    sum_.assign(R, 0.0f);
    scores_.resize(R * kKeyTile);
    for (int64_t h = h_begin_; h < h_end_; ++h)
      for (int64_t t = 0; t < T_; ++t)
        for (int64_t g = 0; g < G; ++g) {
          const scalar_t* src = q_ + tokens_[t] * q_stride_token_ + (h * G + g) * q_stride_head_;
          if constexpr (kKeysAsBf16) {  // read as bfloat16 bits only
            std::memcpy(q_bf16_.data() + row(h, t, g) * D, src, D * sizeof(uint16_t));
          } else {
            float* dst = q_rows_.data() + row(h, t, g) * D;
            to_float(src, dst, D);
            for (int64_t d = 0; d < D; ++d) dst[d] *= scale_;
          }
        }
    // The shared keys, for every token; then each member's own keys, for its tokens.
    attend(plan_.group_kv_indptr[item.group], plan_.group_kv_indptr[item.group + 1], 0, 0, T_);
    for (int64_t m = first; m < last; ++m) {
      // The next member's first tile of keys comes in while this member's keys are computed.
      if (m + 1 < last)
        prefetch_keys(plan_.member_kv_indptr[m + 1],
                      std::min(plan_.member_kv_indptr[m + 1] + kKeyTile, plan_.member_kv_indptr[m + 2]), h_begin_,
                      h_end_);
      attend(plan_.member_kv_indptr[m], plan_.member_kv_indptr[m + 1], plan_.member_kv_pos0[m],
             member_token_start_[m - first], member_token_start_[m - first + 1]);
    }
    for (int64_t h = h_begin_; h < h_end_; ++h)
      for (int64_t t = 0; t < T_; ++t)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = row(h, t, g), head = h * G + g;
          scalar_t* dst = out_ + (tokens_[t] * num_heads_ + head) * D;
          const float inv = sum_[r] > 0.0f ? 1.0f / sum_[r] : 0.0f;
          const float* a = acc_.data() + r * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(a[d] * inv);
          if (lse_ != nullptr)
            lse_[tokens_[t] * num_heads_ + head] = sum_[r] > 0.0f ? max_[r] + std::log(sum_[r]) : kNegInf;
        }
  }

 private:
  int64_t row(int64_t h, int64_t t, int64_t g) const { return (h * T_ + t) * group_ + g; }

  // Online softmax of the item's tokens [t_begin, t_end), the unit's heads, over the keys kv_slots[kv_begin,
  // kv_end) at positions from pos0.
  void attend(int64_t kv_begin, int64_t kv_end, int64_t pos0, int64_t t_begin, int64_t t_end) {
    if (kv_end <= kv_begin || t_end <= t_begin) return;
    int64_t max_position = 0;
    for (int64_t t = t_begin; t < t_end; ++t) max_position = std::max(max_position, positions_[t]);
    // Keys past the last query's position are seen by no row.
    kv_end = std::min(kv_end, kv_begin + std::max<int64_t>(0, max_position - pos0 + 1));
    if ((t_end - t_begin) * group_ >= kLaneMinRows && !row_invariant_) {
      attend_lanes(kv_begin, kv_end, pos0, t_begin, t_end);
    } else {
      attend_dots(kv_begin, kv_end, pos0, t_begin, t_end);
    }
  }

  // Many rows per KV head: per KV head, blocks of rows against each key tile, the tile's keys and values of that
  // head read in place (float32), the keys in place and the values transposed into key pairs (bfloat16 with
  // AVX-512 BF16), or both converted to float32 once.
  void attend_lanes(int64_t kv_begin, int64_t kv_end, int64_t pos0, int64_t t_begin, int64_t t_end) {
    const int64_t D = head_dim_, rows = (t_end - t_begin) * group_;
    const int64_t blocks = (rows + radixserve_cpu::kLaneRows - 1) / radixserve_cpu::kLaneRows;
    const int64_t heads = h_end_ - h_begin_;
    if (static_cast<int64_t>(lanes_.size()) < heads * blocks) lanes_.resize(heads * blocks);
    row_positions_.resize(rows);
    for (int64_t r = 0; r < rows; ++r) row_positions_[r] = positions_[t_begin + r / group_];
    // bfloat16 values as transposed key pairs (vdpbf16ps), and on AMX tiles with the scores where the CPU and the
    // OS allow them (cpu_attention_amx.h).
    const bool pairs = kKeysAsBf16 && D % 16 == 0;
    const bool amx = pairs && radixserve_cpu::kAmx && D % 32 == 0 && use_amx_ && radixserve_cpu::amx_ready();
    std::optional<radixserve_cpu::AmxTiles> tiles;
    if (pairs) vt_.resize(kKeyTile * D);
    if (amx) {
      tiles.emplace(radixserve_cpu::kAttentionTiles);
      k_amx_.resize(kKeyTile * D);
    }
    // Block b of head h is lanes_[(h - h_begin_) * blocks + b].
    for (int64_t h = h_begin_; h < h_end_; ++h) {
      const int64_t r0 = row(h, t_begin, 0);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t r = r0 + b * radixserve_cpu::kLaneRows;
        const int64_t block_rows = std::min<int64_t>(radixserve_cpu::kLaneRows, rows - b * radixserve_cpu::kLaneRows);
        LaneBlock& lanes = lanes_[(h - h_begin_) * blocks + b];
        if constexpr (kKeysAsBf16) {
          lanes.load_bf16(block_rows, D, q_bf16_.data() + r * D, scale_, acc_.data() + r * D, max_.data() + r,
                          sum_.data() + r, row_positions_.data() + (r - r0));
        } else {
          lanes.load(block_rows, D, q_rows_.data() + r * D, acc_.data() + r * D, max_.data() + r, sum_.data() + r,
                     row_positions_.data() + (r - r0));
        }
      }
    }
    // Tile by tile of keys, every head of the unit in turn: a key's row of the pool (the unit's heads, contiguous)
    // is read once per tile, so keys stored in consecutive slots stream from memory.
    for (int64_t t0 = kv_begin; t0 < kv_end; t0 += kKeyTile) {
      const int64_t n = std::min(kKeyTile, kv_end - t0);
      const int64_t ahead = t0 + kKeyTile;  // the next tile's rows, a key at a time
      const int64_t tile_pos0 = pos0 + (t0 - kv_begin);
      for (int64_t h = h_begin_; h < h_end_; ++h) {
        for (int64_t k = 0; k < n; ++k) {
          if (h == h_begin_ && ahead + k < kv_end) prefetch_keys(ahead + k, ahead + k + 1, h_begin_, h_end_);
          const int64_t offset = plan_.kv_slots[t0 + k] * kv_stride_slot_ + h * D;
          if constexpr (std::is_same_v<kv_t, float>) {
            k_rows_[k] = k_ + offset;
            v_rows_[k] = v_ + offset;
          } else {
            if constexpr (kKeysAsBf16) {
              k_bf16_rows_[k] = reinterpret_cast<const uint16_t*>(k_ + offset);
              if (pairs) {
                if (amx) std::memcpy(k_amx_.data() + k * D, k_ + offset, D * sizeof(uint16_t));
                v_bf16_rows_[k] = reinterpret_cast<const uint16_t*>(v_ + offset);
                continue;  // the values go to the lanes transposed, not as float32
              }
            } else {
              to_float(k_ + offset, k_tile_.data() + k * D, D);
              k_rows_[k] = k_tile_.data() + k * D;
            }
            to_float(v_ + offset, v_tile_.data() + k * D, D);
            v_rows_[k] = v_tile_.data() + k * D;
          }
        }
        for (int64_t k = n; k < kKeyTile; ++k) {  // a partial tile
          k_rows_[k] = v_rows_[k] = zeros_.data();
          k_bf16_rows_[k] = v_bf16_rows_[k] = reinterpret_cast<const uint16_t*>(zeros_.data());
        }
        if (amx && n < kKeyTile) std::fill(k_amx_.begin() + n * D, k_amx_.end(), 0);
#if defined(__AVX512BF16__)
        static_assert(kKeyTile == 32, "transpose_values takes tiles of 32 keys");
        if (pairs) radixserve_cpu::transpose_values(v_bf16_rows_, D, vt_.data());
#endif
        for (int64_t b = 0; b < blocks; ++b) {
          LaneBlock& lanes = lanes_[(h - h_begin_) * blocks + b];
          if constexpr (kKeysAsBf16) {
            lanes.tile<kKeyTile>(k_bf16_rows_, v_rows_, n, tile_pos0, amx ? k_amx_.data() : nullptr,
                                 pairs ? vt_.data() : nullptr);
          } else {
            lanes.tile<kKeyTile>(k_rows_, v_rows_, n, tile_pos0);
          }
        }
      }
    }
    for (int64_t h = h_begin_; h < h_end_; ++h) {
      const int64_t r0 = row(h, t_begin, 0);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t r = r0 + b * radixserve_cpu::kLaneRows;
        lanes_[(h - h_begin_) * blocks + b].store(acc_.data() + r * D, max_.data() + r, sum_.data() + r);
      }
    }
  }

  // The K/V rows (heads [h_begin, h_end)) of the keys kv_slots[begin, end), into the caches while other keys are
  // computed.
  void prefetch_keys(int64_t begin, int64_t end, int64_t h_begin, int64_t h_end) {
    const int64_t bytes = (h_end - h_begin) * head_dim_ * static_cast<int64_t>(sizeof(kv_t));
    for (int64_t k = begin; k < end; ++k) {
      const int64_t offset = plan_.kv_slots[k] * kv_stride_slot_ + h_begin * head_dim_;
      const char* k_row = reinterpret_cast<const char*>(k_ + offset);
      const char* v_row = reinterpret_cast<const char*>(v_ + offset);
      for (int64_t b = 0; b < bytes; b += 64) {
        radixserve_cpu::prefetch(k_row + b);
        radixserve_cpu::prefetch(v_row + b);
      }
    }
  }

  // One head's key and value rows from these bytes, into L2.
  void prefetch_rows(const char* k_row, const char* v_row) const {
    for (int64_t b = 0; b < head_dim_ * static_cast<int64_t>(sizeof(kv_t)); b += 64) {
      radixserve_cpu::prefetch_l2(k_row + b);
      radixserve_cpu::prefetch_l2(v_row + b);
    }
  }

  // The `between` of a values loop over KV head h: with `first` (the head's first loop of the tile), key k's step
  // brings head h's rows of the next tile's key k into L2. Steady prefetches, a key at a time while the values are
  // summed, where a burst of a whole tile's lines at once stalls on the miss buffers.
  auto next_tile_prefetch(int64_t h, bool first) const {
    const int64_t head_bytes = h * head_dim_ * static_cast<int64_t>(sizeof(kv_t)), n = first ? next_n_ : 0;
    return [this, head_bytes, n](int64_t k) {
      if (k < n) prefetch_rows(next_k_[k] + head_bytes, next_v_[k] + head_bytes);
    };
  }

  // Few rows per KV head: per tile, each KV head's rows against the tile's keys and values read in place from the
  // pool (converted to float32 in registers where it is not float32), three rows at a time; bfloat16 keys with
  // bfloat16 queries as pair products (dots_bf16).
  void attend_dots(int64_t kv_begin, int64_t kv_end, int64_t pos0, int64_t t_begin, int64_t t_end) {
#if defined(__AVX512F__)
    if constexpr (kTypedRows) {
      const int64_t D = head_dim_, G = group_;
      const int64_t rows = (t_end - t_begin) * G;  // per KV head
      const kv_t* zeros = reinterpret_cast<const kv_t*>(zeros_.data());
      for (int64_t t0 = kv_begin; t0 < kv_end; t0 += kKeyTile) {
        const int64_t n = std::min(kKeyTile, kv_end - t0);
        const int64_t tile_pos0 = pos0 + (t0 - kv_begin);
        const int64_t ahead = t0 + kKeyTile;  // the next tile's rows, a key at a time
        for (int64_t k = 0; k < n; ++k) {
          const int64_t offset = plan_.kv_slots[t0 + k] * kv_stride_slot_;
          if constexpr (kKeysAsBf16) {
            k_bf16_rows_[k] = reinterpret_cast<const uint16_t*>(k_ + offset);
            v_bf16_rows_[k] = reinterpret_cast<const uint16_t*>(v_ + offset);
          } else {
            k_pool_rows_[k] = k_ + offset;
            v_pool_rows_[k] = v_ + offset;
          }
        }
        // the next tile's rows, for the values' steady prefetches
        next_n_ = std::max<int64_t>(0, std::min(kKeyTile, kv_end - ahead));
        for (int64_t k = 0; k < next_n_; ++k) {
          const int64_t offset = plan_.kv_slots[ahead + k] * kv_stride_slot_;
          next_k_[k] = reinterpret_cast<const char*>(k_ + offset);
          next_v_[k] = reinterpret_cast<const char*>(v_ + offset);
        }
        for (int64_t k = n; k < kKeyTile; ++k) {  // a partial tile
          if constexpr (kKeysAsBf16) k_bf16_rows_[k] = v_bf16_rows_[k] = reinterpret_cast<const uint16_t*>(zeros);
          else k_pool_rows_[k] = v_pool_rows_[k] = zeros;
        }
        for (int64_t h = h_begin_; h < h_end_; ++h) {
          const int64_t r0 = row(h, t_begin, 0);
          float* s = scores_.data() + r0 * kKeyTile;
          if constexpr (kKeysAsBf16) {
            dots_bf16(s, r0, rows, h, n, tile_pos0, t_begin);
            continue;
          }
          const float* q = q_rows_.data() + r0 * D;
          for (int64_t i = 0; i < rows;) {
            const int64_t left = rows - i;
            const float* qi = q + i * D;
            float* si = s + i * kKeyTile;
            if (left >= 3) radixserve_cpu::scores_rows<3>(qi, D, k_pool_rows_, h * D, n, D, si, kKeyTile), i += 3;
            else if (left == 2) radixserve_cpu::scores_rows<2>(qi, D, k_pool_rows_, h * D, n, D, si, kKeyTile), i += 2;
            else radixserve_cpu::scores_rows<1>(qi, D, k_pool_rows_, h * D, n, D, si, kKeyTile), i += 1;
          }
          for (int64_t r = r0; r < r0 + rows; ++r)
            radixserve_cpu::softmax_row32(scores_.data() + r * kKeyTile, n,
                                          positions_[t_begin + (r - r0) / G] - tile_pos0, max_[r], sum_[r],
                                          acc_.data() + r * D, D);
          float* out = acc_.data() + r0 * D;
          for (int64_t i = 0; i < rows;) {
            const int64_t left = rows - i;
            const float* pi = s + i * kKeyTile;
            float* oi = out + i * D;
            const auto next = next_tile_prefetch(h, i == 0);
            if (left >= 4) radixserve_cpu::values_rows<4>(pi, kKeyTile, v_pool_rows_, h * D, n, D, oi, D, next), i += 4;
            else if (left == 3) radixserve_cpu::values_rows<3>(pi, kKeyTile, v_pool_rows_, h * D, n, D, oi, D, next), i += 3;
            else if (left == 2) radixserve_cpu::values_rows<2>(pi, kKeyTile, v_pool_rows_, h * D, n, D, oi, D, next), i += 2;
            else radixserve_cpu::values_rows<1>(pi, kKeyTile, v_pool_rows_, h * D, n, D, oi, D, next), i += 1;
          }
        }
      }
      return;
    }
#endif
    attend_dots_converted(kv_begin, kv_end, pos0, t_begin, t_end);
  }

  // attend_dots for a build without AVX-512 or a float64 pool (never bfloat16 dot products, which need AVX-512):
  // each tile's key rows (the unit's heads) as float32 once, dot products per row.
  void attend_dots_converted(int64_t kv_begin, int64_t kv_end, int64_t pos0, int64_t t_begin, int64_t t_end) {
    const int64_t D = head_dim_, G = group_, KV = kv_row_;
    const int64_t head_offset = h_begin_ * D, width = (h_end_ - h_begin_) * D;
    const int64_t rows = (t_end - t_begin) * G;  // per KV head
    for (int64_t t0 = kv_begin; t0 < kv_end; t0 += kKeyTile) {
      const int64_t n = std::min(kKeyTile, kv_end - t0);
      const int64_t tile_pos0 = pos0 + (t0 - kv_begin);
      const int64_t ahead = t0 + kKeyTile;  // the next tile's rows, a key at a time
      // Each key's row as float32: the pool's own row when it stores float32, else a converted copy.
      for (int64_t k = 0; k < n; ++k) {
        if (ahead + k < kv_end) prefetch_keys(ahead + k, ahead + k + 1, h_begin_, h_end_);
        const int64_t offset = plan_.kv_slots[t0 + k] * kv_stride_slot_;
        if constexpr (std::is_same_v<kv_t, float>) {
          k_rows_[k] = k_ + offset;
          v_rows_[k] = v_ + offset;
        } else {
          to_float(k_ + offset + head_offset, k_tile_.data() + k * KV + head_offset, width);
          to_float(v_ + offset + head_offset, v_tile_.data() + k * KV + head_offset, width);
          k_rows_[k] = k_tile_.data() + k * KV;
          v_rows_[k] = v_tile_.data() + k * KV;
        }
      }
      for (int64_t k = n; k < kKeyTile; ++k) k_rows_[k] = v_rows_[k] = zeros_.data();  // a partial tile
      for (int64_t h = h_begin_; h < h_end_; ++h) {
        const int64_t r0 = row(h, t_begin, 0);
        float* s = scores_.data() + r0 * kKeyTile;
        const float* q = q_rows_.data() + r0 * D;
        for (int64_t i = 0; i < rows;) {
          const int64_t left = rows - i;
          float* si = s + i * kKeyTile;
          const float* qi = q + i * D;
          if (left >= 4) scores_dots<4>(qi, D, k_rows_, h * D, n, D, si, kKeyTile), i += 4;
          else if (left == 3) scores_dots<3>(qi, D, k_rows_, h * D, n, D, si, kKeyTile), i += 3;
          else if (left == 2) scores_dots<2>(qi, D, k_rows_, h * D, n, D, si, kKeyTile), i += 2;
          else scores_dots<1>(qi, D, k_rows_, h * D, n, D, si, kKeyTile), i += 1;
        }
        for (int64_t r = r0; r < r0 + rows; ++r) {
          softmax_row(scores_.data() + r * kKeyTile, kKeyTile, n, positions_[t_begin + (r - r0) / G] - tile_pos0,
                      max_[r], sum_[r], acc_.data() + r * D, D);
        }
        float* out = acc_.data() + r0 * D;
        for (int64_t i = 0; i < rows;) {
          const int64_t left = rows - i;
          const float* pi = s + i * kKeyTile;
          float* oi = out + i * D;
          if (left >= 4) values_block<4>(pi, kKeyTile, v_rows_, h * D, n, D, oi, D), i += 4;
          else if (left == 3) values_block<3>(pi, kKeyTile, v_rows_, h * D, n, D, oi, D), i += 3;
          else if (left == 2) values_block<2>(pi, kKeyTile, v_rows_, h * D, n, D, oi, D), i += 2;
          else values_block<1>(pi, kKeyTile, v_rows_, h * D, n, D, oi, D), i += 1;
        }
      }
    }
  }

#if defined(__AVX512BF16__)
  // The bfloat16 form of attend_dots' inner step for KV head h: the scores of the unscaled bfloat16 queries
  // against the keys in place (pair products, float32 sums; then scaled), the probabilities rounded to bfloat16
  // against pairs of value rows in place (float32 sums), no float32 copies of the tile.
  void dots_bf16(float* s, int64_t r0, int64_t rows, int64_t h, int64_t n, int64_t tile_pos0, int64_t t_begin) {
    const int64_t D = head_dim_;
    for (int64_t i = 0; i < rows; ++i)
      radixserve_cpu::scores_bf16(q_bf16_.data() + (r0 + i) * D, k_bf16_rows_, h * D, n, D, scale_, s + i * kKeyTile);
    p_bf16_.resize(rows * kKeyTile);
    static_assert(kKeyTile == 32, "softmax_row32_bf16 takes tiles of 32 keys");
    for (int64_t r = r0; r < r0 + rows; ++r) {
      radixserve_cpu::softmax_row32_bf16(scores_.data() + r * kKeyTile, n,
                                         positions_[t_begin + (r - r0) / group_] - tile_pos0, max_[r], sum_[r],
                                         acc_.data() + r * D, D, p_bf16_.data() + (r - r0) * kKeyTile);
    }
    float* out = acc_.data() + r0 * D;
    const uint16_t* p = p_bf16_.data();
    for (int64_t i = 0; i < rows;) {
      const int64_t left = rows - i;
      const uint16_t* pi = p + i * kKeyTile;
      float* oi = out + i * D;
      const auto prefetch = next_tile_prefetch(h, i == 0);
      const auto next = [&prefetch](int64_t k) { prefetch(k), prefetch(k + 1); };  // two keys a step
      if (left >= 4) radixserve_cpu::values_bf16<4>(pi, kKeyTile, v_bf16_rows_, h * D, n, D, oi, D, next), i += 4;
      else if (left == 3) radixserve_cpu::values_bf16<3>(pi, kKeyTile, v_bf16_rows_, h * D, n, D, oi, D, next), i += 3;
      else if (left == 2) radixserve_cpu::values_bf16<2>(pi, kKeyTile, v_bf16_rows_, h * D, n, D, oi, D, next), i += 2;
      else radixserve_cpu::values_bf16<1>(pi, kKeyTile, v_bf16_rows_, h * D, n, D, oi, D, next), i += 1;
    }
  }
#else
  void dots_bf16(float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t) {}
#endif

  const scalar_t* q_;
  const kv_t* k_;
  const kv_t* v_;
  scalar_t* out_;
  float* lse_;
  const Plan& plan_;
  const float scale_;
  const int64_t q_stride_token_, q_stride_head_, kv_stride_slot_;
  const int64_t num_heads_, num_kv_heads_, head_dim_, group_, kv_row_;
  const bool use_amx_;
  const bool row_invariant_;  // every row as dot products: its bits never depend on the item's other rows
  int64_t T_ = 0, h_begin_ = 0, h_end_ = 0;  // the unit's KV heads
  std::vector<int64_t> tokens_, positions_, member_token_start_, row_positions_;
  std::vector<float> q_rows_, acc_, max_, sum_, scores_, k_tile_, v_tile_, zeros_;
  std::vector<LaneBlock> lanes_;
  std::vector<uint16_t> q_bf16_, k_amx_, vt_;  // the unscaled queries' bits; a key tile; a value tile transposed
  std::vector<uint16_t> p_bf16_;               // probabilities of a tile as bfloat16, [row][key]
  const uint16_t* k_bf16_rows_[kKeyTile];
  const uint16_t* v_bf16_rows_[kKeyTile];
  const float* k_rows_[kKeyTile];
  const float* v_rows_[kKeyTile];
  const kv_t* k_pool_rows_[kKeyTile];  // a tile's rows in the pool
  const kv_t* v_pool_rows_[kKeyTile];
  const char* next_k_[kKeyTile];  // the next tile's rows (next_n_ of them), prefetched while a tile's values are summed
  const char* next_v_[kKeyTile];
  int64_t next_n_ = 0;
};

// The new tokens' k/v (scalar_t) into the pool (kv_t) at their slots.
template <typename scalar_t, typename kv_t>
void store_kv(at::Tensor& k_buffer, at::Tensor& v_buffer, const at::Tensor& loc, const at::Tensor& k,
              const at::Tensor& v) {
  const int64_t tokens = loc.size(0), row = k_buffer.size(1) * k_buffer.size(2);
  const int64_t* slots = loc.data_ptr<int64_t>();
  kv_t* kb = k_buffer.data_ptr<kv_t>();
  kv_t* vb = v_buffer.data_ptr<kv_t>();
  const scalar_t* ks = k.data_ptr<scalar_t>();
  const scalar_t* vs = v.data_ptr<scalar_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    if constexpr (std::is_same_v<scalar_t, kv_t>) {
      std::memcpy(kb + slots[t] * row, ks + t * row, row * sizeof(kv_t));
      std::memcpy(vb + slots[t] * row, vs + t * row, row * sizeof(kv_t));
    } else {
      for (int64_t i = 0; i < row; ++i) {
        kb[slots[t] * row + i] = static_cast<kv_t>(ks[t * row + i]);
        vb[slots[t] * row + i] = static_cast<kv_t>(vs[t * row + i]);
      }
    }
  }
}

// Stores the new tokens and runs every unit, queries scalar_t and the pool kv_t.
template <typename scalar_t, typename kv_t>
void attend_units(const at::Tensor& q, at::Tensor& k_buffer, at::Tensor& v_buffer, const at::Tensor& loc,
                  const at::Tensor& k_new, const at::Tensor& v_new, at::Tensor& out, float* lse, const Plan& plan,
                  float scale, bool amx, bool row_invariant, const std::vector<Item>& units) {
  store_kv<scalar_t, kv_t>(k_buffer, v_buffer, loc, k_new, v_new);
  std::atomic<int64_t> next{0};
  const int64_t num_units = static_cast<int64_t>(units.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_units);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    ItemKernel<scalar_t, kv_t> kernel(q, k_buffer, v_buffer, out, lse, plan, scale, amx, row_invariant);
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t i = next.fetch_add(1); i < num_units; i = next.fetch_add(1)) kernel.run(units[i]);
    }
  });
}

void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.device().is_cpu(), name,
              " must be a contiguous int64 CPU tensor");
}

// Writes k/v (the batch's new tokens, [tokens, kv_heads, head_dim]) at slots `loc`, then returns attention
// output [tokens, heads, head_dim] of q over the planned keys; fills `lse` ([tokens, heads] float32) when it is
// not empty. `items` is [n, 3] int64: (group, q_begin, q_end). `amx`: bfloat16 scores on AMX tiles where the CPU and
// the OS grant them (false: AVX-512 BF16 dot products; the runner decides, model_runner/cpu/dispatch.py).
// `row_invariant` (deterministic inference): every query row is computed as a decode row is, dot products against
// key tiles aligned to the request's first key, so a row's bits depend only on its query and its keys, never on how
// many rows share its item (a prefill block, one new token after a cached prefix, a chunk).
at::Tensor paged_attention(const at::Tensor& q, at::Tensor k_buffer, at::Tensor v_buffer, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& loc, const at::Tensor& items,
                           const at::Tensor& group_member_indptr, const at::Tensor& group_kv_indptr,
                           const at::Tensor& member_q_start, const at::Tensor& member_q_len,
                           const at::Tensor& member_q_pos0, const at::Tensor& member_kv_indptr,
                           const at::Tensor& member_kv_pos0, const at::Tensor& kv_slots, double scale,
                           at::Tensor lse, bool amx, bool row_invariant) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [tokens, heads, head_dim] with unit stride");
  TORCH_CHECK(k_buffer.is_contiguous() && v_buffer.is_contiguous(), "the KV buffers must be contiguous");
  // One dtype for all, or float32 queries and new k/v over a float16 or bfloat16 pool.
  const bool half_pool = q.scalar_type() == at::kFloat && k_buffer.scalar_type() == at::kHalf;
  const bool bf16_pool = q.scalar_type() == at::kFloat && k_buffer.scalar_type() == at::kBFloat16;
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  v_buffer.scalar_type() == k_buffer.scalar_type() &&
                  (q.scalar_type() == k_buffer.scalar_type() || half_pool || bf16_pool),
              "q, k, v and the KV buffers must share one dtype (or be float32 over float16 or bfloat16 buffers)");
  if (bf16_pool) {  // the queries rounded to bfloat16 as the new keys and values are: a bfloat16 model's attention
    return paged_attention(q.to(at::kBFloat16), k_buffer, v_buffer, k.to(at::kBFloat16), v.to(at::kBFloat16), loc,
                           items, group_member_indptr, group_kv_indptr, member_q_start, member_q_len, member_q_pos0,
                           member_kv_indptr, member_kv_pos0, kv_slots, scale, lse, amx, row_invariant)
        .to(at::kFloat);
  }
  TORCH_CHECK(q.size(1) % k_buffer.size(1) == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(2) % 16 == 0 && q.size(2) <= 256, "head_dim must be a multiple of 16, at most 256");
  for (const auto* t : {&loc, &items, &group_member_indptr, &group_kv_indptr, &member_q_start, &member_q_len,
                        &member_q_pos0, &member_kv_indptr, &member_kv_pos0, &kv_slots})
    check_index(*t, "plan tensors");
  TORCH_CHECK(loc.size(0) == k.size(0) && loc.size(0) == v.size(0), "one KV slot per new token");
  const at::Tensor k_new = k.contiguous(), v_new = v.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  float* lse_ptr = nullptr;
  if (lse.numel() > 0) {
    TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous(), "lse must be contiguous float32");
    lse_ptr = lse.data_ptr<float>();
  }
  const Plan plan{group_member_indptr.data_ptr<int64_t>(), group_kv_indptr.data_ptr<int64_t>(),
                  member_q_start.data_ptr<int64_t>(),      member_q_len.data_ptr<int64_t>(),
                  member_q_pos0.data_ptr<int64_t>(),       member_kv_indptr.data_ptr<int64_t>(),
                  member_kv_pos0.data_ptr<int64_t>(),      kv_slots.data_ptr<int64_t>()};
  TORCH_CHECK(items.dim() == 2 && items.size(1) == 3, "items must be [n, 3]: (group, q_begin, q_end)");
  // The work units, in the items' order: a group of several members as one unit per KV head.
  const int64_t* item_data = items.data_ptr<int64_t>();
  const int64_t kv_heads = k_buffer.size(1);
  std::vector<Item> units;
  // A group's unit of every KV head reads each key's row of the pool (all heads, contiguous) at once, so keys in
  // consecutive slots stream from memory; per-KV-head units read a third of each row, three times.
  int64_t shared_groups = 0;
  for (int64_t i = 0; i < items.size(0); ++i) {
    const int64_t group = item_data[3 * i];
    shared_groups += plan.group_member_indptr[group + 1] - plan.group_member_indptr[group] > 1;
  }
  const bool split_groups = shared_groups < kGroupsPerThread * at::get_num_threads();
  for (int64_t i = 0; i < items.size(0); ++i) {
    const int64_t* it = item_data + 3 * i;
    const int64_t members = plan.group_member_indptr[it[0] + 1] - plan.group_member_indptr[it[0]];
    if (members > 1 && split_groups) {
      for (int64_t h = 0; h < kv_heads; ++h) units.push_back(Item{it[0], it[1], it[2], h, h + 1});
    } else {
      units.push_back(Item{it[0], it[1], it[2], 0, kv_heads});
    }
  }
  if (half_pool) {
    attend_units<float, c10::Half>(q, k_buffer, v_buffer, loc, k_new, v_new, out, lse_ptr, plan,
                                   static_cast<float>(scale), amx, row_invariant, units);
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_attention", [&] {
    attend_units<scalar_t, scalar_t>(q, k_buffer, v_buffer, loc, k_new, v_new, out, lse_ptr, plan,
                                     static_cast<float>(scale), amx, row_invariant, units);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(radixserve_cpu, m) {
  m.def(
      "paged_attention(Tensor q, Tensor(a!) k_buffer, Tensor(b!) v_buffer, Tensor k, Tensor v, Tensor loc, "
      "Tensor items, Tensor group_member_indptr, Tensor group_kv_indptr, Tensor member_q_start, "
      "Tensor member_q_len, Tensor member_q_pos0, Tensor member_kv_indptr, Tensor member_kv_pos0, "
      "Tensor kv_slots, float scale, Tensor(c!) lse, bool amx, bool row_invariant=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
