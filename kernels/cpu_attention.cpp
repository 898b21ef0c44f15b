// Paged attention on the CPU: every request of a batch in one call per layer, keys and values read straight from
// the KV pool through their slot indices (no gathered copies), query heads that share a KV head attended together.
//
// The batch is described as groups (see kernels/cpu_attention.py for how they are planned):
//   - a group holds one or more members (requests); its shared keys (a cached prefix whose KV slots all members
//     hold, before any of their queries) are read once for all the members' query rows;
//   - each member owns a contiguous range of the batch's query tokens and its own keys after the shared part.
// One work item is (group, block of a lone member's queries), all heads: a key's row of the pool (every KV head)
// is read once, contiguously. Items are handed to the threads from an atomic counter, so uneven items balance.
// Per item the scores are computed tile by tile of keys with an online softmax in float32 (running max and sum
// per query row), whatever the storage dtype.
//
// Causality: the key at position p is seen by the query at position t iff p <= t. Shared keys sit at positions
// [0, n); a member's own keys at [kv_pos0, kv_pos0 + n).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using radixserve_cpu::exp_inplace;

constexpr int64_t kKeyTile = 32;     // keys per tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
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
};

// 16 floats as one value: GCC lowers it to one AVX-512 register, two AVX2 registers or scalar code, whatever the
// CPU the library is built for.
typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

inline void store16(float* p, v16 x) { std::memcpy(p, &x, sizeof(x)); }

// scores[i][0:32] = q_i . keys for `rows` (1..4) query rows against a key tile stored transposed ([d][32]).
template <int kRows>
inline void scores_block(const float* q, int64_t q_stride, const float* kt, int64_t D, float* s, int64_t s_stride) {
  v16 acc[kRows][2] = {};
  for (int64_t d = 0; d < D; ++d) {
    const v16 k0 = load16(kt + d * kKeyTile), k1 = load16(kt + d * kKeyTile + 16);
    for (int i = 0; i < kRows; ++i) {
      const float qd = q[i * q_stride + d];
      acc[i][0] += qd * k0;
      acc[i][1] += qd * k1;
    }
  }
  for (int i = 0; i < kRows; ++i) {
    store16(s + i * s_stride, acc[i][0]);
    store16(s + i * s_stride + 16, acc[i][1]);
  }
}

// The sum of x's 16 lanes, as a tree.
inline float reduce16(v16 x) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  const v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// scores[i][k] = q_i . key_k for `rows` (1..4) query rows and n keys stored as rows ([k][stride]); for few rows,
// where transposing the tile would cost more than it saves.
template <int kRows>
inline void scores_dots(const float* q, int64_t q_stride, const float* const* keys, int64_t offset, int64_t n,
                        int64_t D, float* s, int64_t s_stride) {
  for (int64_t k = 0; k < n; ++k) {
    const float* key = keys[k] + offset;
    v16 acc[kRows] = {};
    for (int64_t d = 0; d < D; d += 16) {
      const v16 kd = load16(key + d);
      for (int i = 0; i < kRows; ++i) acc[i] += load16(q + i * q_stride + d) * kd;
    }
    for (int i = 0; i < kRows; ++i) s[i * s_stride + k] = reduce16(acc[i]);
  }
}

// out[i][0:D] += sum_k p[i][k] * v[k][0:D] for `rows` (1..4) rows, D a multiple of 16 up to 256.
template <int kRows>
inline void values_block(const float* p, int64_t p_stride, const float* const* v, int64_t offset, int64_t n,
                         int64_t D, float* out, int64_t out_stride) {
  for (int64_t c = 0; c < D; c += 64) {
    const int chunks = static_cast<int>(std::min<int64_t>(64, D - c) / 16);
    v16 acc[kRows][4];
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < chunks; ++j) acc[i][j] = load16(out + i * out_stride + c + 16 * j);
    for (int64_t k = 0; k < n; ++k) {
      v16 vk[4];
      for (int j = 0; j < chunks; ++j) vk[j] = load16(v[k] + offset + c + 16 * j);
      for (int i = 0; i < kRows; ++i) {
        const float pk = p[i * p_stride + k];
        for (int j = 0; j < chunks; ++j) acc[i][j] += pk * vk[j];
      }
    }
    for (int i = 0; i < kRows; ++i)
      for (int j = 0; j < chunks; ++j) store16(out + i * out_stride + c + 16 * j, acc[i][j]);
  }
}

// Query rows of an item are laid out KV head major: row (h, t, g) = h * T * G + t * G + g for query token t of the
// item and query head h * G + g, so the rows that read one KV head are contiguous.
template <typename scalar_t>
class ItemKernel {
 public:
  ItemKernel(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer, at::Tensor& out,
             float* lse, const Plan& plan, float scale)
      : q_(q.data_ptr<scalar_t>()),
        k_(k_buffer.data_ptr<scalar_t>()),
        v_(v_buffer.data_ptr<scalar_t>()),
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
        kv_row_(num_kv_heads_ * head_dim_) {
    k_tile_.resize(kKeyTile * kv_row_);
    k_tile_t_.resize(kKeyTile * kv_row_);
    v_tile_.resize(kKeyTile * kv_row_);
    zeros_.assign(kv_row_, 0.0f);
  }

  void run(const Item& item) {
    const int64_t D = head_dim_, G = group_;
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
    q_rows_.resize(R * D);
    acc_.assign(R * D, 0.0f);
    max_.assign(R, kNegInf);
    sum_.assign(R, 0.0f);
    scores_.resize(R * kKeyTile);
    for (int64_t h = 0; h < num_kv_heads_; ++h)
      for (int64_t t = 0; t < T_; ++t)
        for (int64_t g = 0; g < G; ++g) {
          const scalar_t* src = q_ + tokens_[t] * q_stride_token_ + (h * G + g) * q_stride_head_;
          float* dst = q_rows_.data() + row(h, t, g) * D;
          to_float(src, dst, D);
          for (int64_t d = 0; d < D; ++d) dst[d] *= scale_;
        }
    // The shared keys, for every token; then each member's own keys, for its tokens.
    attend(plan_.group_kv_indptr[item.group], plan_.group_kv_indptr[item.group + 1], 0, 0, T_);
    for (int64_t m = first; m < last; ++m) {
      attend(plan_.member_kv_indptr[m], plan_.member_kv_indptr[m + 1], plan_.member_kv_pos0[m],
             member_token_start_[m - first], member_token_start_[m - first + 1]);
    }
    for (int64_t h = 0; h < num_kv_heads_; ++h)
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

  // Online softmax of the item's tokens [t_begin, t_end), all heads, over the keys kv_slots[kv_begin, kv_end) at
  // positions from pos0.
  void attend(int64_t kv_begin, int64_t kv_end, int64_t pos0, int64_t t_begin, int64_t t_end) {
    const int64_t D = head_dim_, G = group_, KV = kv_row_;
    if (kv_end <= kv_begin || t_end <= t_begin) return;
    int64_t max_position = 0;
    for (int64_t t = t_begin; t < t_end; ++t) max_position = std::max(max_position, positions_[t]);
    // Keys past the last query's position are seen by no row.
    kv_end = std::min(kv_end, kv_begin + std::max<int64_t>(0, max_position - pos0 + 1));
    const int64_t rows = (t_end - t_begin) * G;  // per KV head
    for (int64_t t0 = kv_begin; t0 < kv_end; t0 += kKeyTile) {
      const int64_t n = std::min(kKeyTile, kv_end - t0);
      const int64_t tile_pos0 = pos0 + (t0 - kv_begin);
      // Each key's row (all KV heads) as float32: the pool's own row when it stores float32, else a converted copy.
      for (int64_t k = 0; k < n; ++k) {
        const int64_t offset = plan_.kv_slots[t0 + k] * kv_stride_slot_;
        if constexpr (std::is_same_v<scalar_t, float>) {
          k_rows_[k] = k_ + offset;
          v_rows_[k] = v_ + offset;
        } else {
          to_float(k_ + offset, k_tile_.data() + k * KV, KV);
          to_float(v_ + offset, v_tile_.data() + k * KV, KV);
          k_rows_[k] = k_tile_.data() + k * KV;
          v_rows_[k] = v_tile_.data() + k * KV;
        }
      }
      for (int64_t k = n; k < kKeyTile; ++k) k_rows_[k] = v_rows_[k] = zeros_.data();  // a partial tile
      if (t0 + kKeyTile < kv_end) {  // the next tile's rows, while this one is computed
        const int64_t next = std::min(kKeyTile, kv_end - t0 - kKeyTile);
        const int64_t row_bytes = KV * static_cast<int64_t>(sizeof(scalar_t));
        for (int64_t k = 0; k < next; ++k) {
          const char* k_row = reinterpret_cast<const char*>(k_ + plan_.kv_slots[t0 + kKeyTile + k] * kv_stride_slot_);
          const char* v_row = reinterpret_cast<const char*>(v_ + plan_.kv_slots[t0 + kKeyTile + k] * kv_stride_slot_);
          for (int64_t b = 0; b < row_bytes; b += 64) {
            __builtin_prefetch(k_row + b);
            __builtin_prefetch(v_row + b);
          }
        }
      }
      // Many rows per KV head: the scores as a small GEMM over the transposed tile; few: dot products.
      const bool transposed = rows >= 8;
      if (transposed) {
        for (int64_t k = 0; k < kKeyTile; ++k)
          for (int64_t c = 0; c < KV; ++c) k_tile_t_[c * kKeyTile + k] = k_rows_[k][c];
      }
      for (int64_t h = 0; h < num_kv_heads_; ++h) {
        const int64_t r0 = row(h, t_begin, 0);
        float* s = scores_.data() + r0 * kKeyTile;
        const float* q = q_rows_.data() + r0 * D;
        if (transposed) {
          const float* kt = k_tile_t_.data() + h * D * kKeyTile;
          int64_t i = 0;
          for (; i + 4 <= rows; i += 4) scores_block<4>(q + i * D, D, kt, D, s + i * kKeyTile, kKeyTile);
          for (; i < rows; ++i) scores_block<1>(q + i * D, D, kt, D, s + i * kKeyTile, kKeyTile);
        } else {
          for (int64_t i = 0; i < rows;) {
            const int64_t left = rows - i;
            float* si = s + i * kKeyTile;
            const float* qi = q + i * D;
            if (left >= 4) scores_dots<4>(qi, D, k_rows_, h * D, n, D, si, kKeyTile), i += 4;
            else if (left == 3) scores_dots<3>(qi, D, k_rows_, h * D, n, D, si, kKeyTile), i += 3;
            else if (left == 2) scores_dots<2>(qi, D, k_rows_, h * D, n, D, si, kKeyTile), i += 2;
            else scores_dots<1>(qi, D, k_rows_, h * D, n, D, si, kKeyTile), i += 1;
          }
        }
        for (int64_t r = r0; r < r0 + rows; ++r) softmax_update(r, n, positions_[t_begin + (r - r0) / G] - tile_pos0);
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

  // Row r's scores of a tile become probabilities (0 past the `last_visible` key) under the running max; the
  // row's sum and accumulator are rescaled when the max grows.
  void softmax_update(int64_t r, int64_t n, int64_t last_visible) {
    float* s = scores_.data() + r * kKeyTile;
    const int64_t visible = std::min(n, std::max<int64_t>(0, last_visible + 1));
    for (int64_t k = visible; k < kKeyTile; ++k) s[k] = kNegInf;
    if (visible == 0) {
      for (int64_t k = 0; k < kKeyTile; ++k) s[k] = 0.0f;
      return;
    }
    float tile_max = kNegInf;
    for (int64_t k = 0; k < visible; ++k) tile_max = std::max(tile_max, s[k]);
    const float new_max = std::max(max_[r], tile_max);
    if (max_[r] != kNegInf && new_max != max_[r]) {
      const float correction = std::exp(max_[r] - new_max);
      sum_[r] *= correction;
      float* a = acc_.data() + r * head_dim_;
      for (int64_t d = 0; d < head_dim_; ++d) a[d] *= correction;
    }
    max_[r] = new_max;
    for (int64_t k = 0; k < kKeyTile; ++k) s[k] -= new_max;
    exp_inplace(s, kKeyTile);
    float tile_sum = 0.0f;
    for (int64_t k = 0; k < kKeyTile; ++k) tile_sum += s[k];
    sum_[r] += tile_sum;
  }

  const scalar_t* q_;
  const scalar_t* k_;
  const scalar_t* v_;
  scalar_t* out_;
  float* lse_;
  const Plan& plan_;
  const float scale_;
  const int64_t q_stride_token_, q_stride_head_, kv_stride_slot_;
  const int64_t num_heads_, num_kv_heads_, head_dim_, group_, kv_row_;
  int64_t T_ = 0;
  std::vector<int64_t> tokens_, positions_, member_token_start_;
  std::vector<float> q_rows_, acc_, max_, sum_, scores_, k_tile_, k_tile_t_, v_tile_, zeros_;
  const float* k_rows_[kKeyTile];
  const float* v_rows_[kKeyTile];
};

template <typename scalar_t>
void store_kv(at::Tensor& k_buffer, at::Tensor& v_buffer, const at::Tensor& loc, const at::Tensor& k,
              const at::Tensor& v) {
  const int64_t tokens = loc.size(0), row = k_buffer.size(1) * k_buffer.size(2);
  const int64_t* slots = loc.data_ptr<int64_t>();
  scalar_t* kb = k_buffer.data_ptr<scalar_t>();
  scalar_t* vb = v_buffer.data_ptr<scalar_t>();
  const scalar_t* ks = k.data_ptr<scalar_t>();
  const scalar_t* vs = v.data_ptr<scalar_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(kb + slots[t] * row, ks + t * row, row * sizeof(scalar_t));
    std::memcpy(vb + slots[t] * row, vs + t * row, row * sizeof(scalar_t));
  }
}

void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.device().is_cpu(), name,
              " must be a contiguous int64 CPU tensor");
}

// Writes k/v (the batch's new tokens, [tokens, kv_heads, head_dim]) at slots `loc`, then returns attention
// output [tokens, heads, head_dim] of q over the planned keys; fills `lse` ([tokens, heads] float32) when it is
// not empty. `items` is [n, 3] int64: (group, q_begin, q_end).
at::Tensor paged_attention(const at::Tensor& q, at::Tensor k_buffer, at::Tensor v_buffer, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& loc, const at::Tensor& items,
                           const at::Tensor& group_member_indptr, const at::Tensor& group_kv_indptr,
                           const at::Tensor& member_q_start, const at::Tensor& member_q_len,
                           const at::Tensor& member_q_pos0, const at::Tensor& member_kv_indptr,
                           const at::Tensor& member_kv_pos0, const at::Tensor& kv_slots, double scale,
                           at::Tensor lse) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [tokens, heads, head_dim] with unit stride");
  TORCH_CHECK(k_buffer.is_contiguous() && v_buffer.is_contiguous(), "the KV buffers must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_buffer.scalar_type() && k.scalar_type() == k_buffer.scalar_type(),
              "q, k, v and the KV buffers must share one dtype");
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
  const int64_t num_items = items.size(0);
  const int64_t* item_data = items.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_attention", [&] {
    store_kv<scalar_t>(k_buffer, v_buffer, loc, k_new, v_new);
    std::atomic<int64_t> next{0};
    const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
    at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
      ItemKernel<scalar_t> kernel(q, k_buffer, v_buffer, out, lse_ptr, plan, static_cast<float>(scale));
      for (int64_t worker = begin; worker < end; ++worker) {
        for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
          const int64_t* it = item_data + 3 * i;
          kernel.run(Item{it[0], it[1], it[2]});
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(radixserve_cpu, m) {
  m.def(
      "paged_attention(Tensor q, Tensor(a!) k_buffer, Tensor(b!) v_buffer, Tensor k, Tensor v, Tensor loc, "
      "Tensor items, Tensor group_member_indptr, Tensor group_kv_indptr, Tensor member_q_start, "
      "Tensor member_q_len, Tensor member_q_pos0, Tensor member_kv_indptr, Tensor member_kv_pos0, "
      "Tensor kv_slots, float scale, Tensor(c!) lse) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
