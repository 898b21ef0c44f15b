// Every decoder layer of a Llama-family model (Llama, Qwen2's q/k/v biases, Qwen3's per-head q/k norms) on GGUF
// blocks in one call, for batches of a few tokens (decode): the same kernels the Python layers call (rms_norm,
// gguf_linear, rotary, paged_attention, silu_and_mul of this library), in the same order on the same tensors, reached
// through the dispatcher from C++ (each typed as its kernel is declared). A decode step of a small model on two cores
// spends about as long in the layers' Python around its kernels (argument checks, splits and views, the attention
// backend's bookkeeping) as in its attention and norms together; here that is one call per step.
// model_runner/fused_decode.py decides when a batch may take it; its output equals the layers' bit for bit.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace {

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using Pair = std::tuple<at::Tensor, at::Tensor>;
// input norm, qkv, qkv bias, o, post-attention norm, gate_up, down, q norm, k norm; an empty tensor for a bias or
// q/k norms the model does not have
constexpr int64_t kWeightsPerLayer = 9;
constexpr int64_t kLinearsPerLayer = 4;  // qkv, o, gate_up, down
constexpr int64_t kPlanTensors = 10;     // out_cache_loc, items, then the plan's eight index tensors

// hidden [T, H] float32 (the embeddings); weights: kWeightsPerLayer a layer; types, activation_bits: the four
// linears' GGML types and gguf_linear's activation_bits, a layer after another; cos, sin: the rotary tables;
// plan: out_cache_loc, items, group_member_indptr, group_kv_indptr, member_q_start, member_q_len, member_q_pos0,
// member_kv_indptr, member_kv_pos0, kv_slots (kernels/cpu_attention.cpp). Returns the last layer's (mlp output,
// residual), which the model's final norm adds.
Pair decode_layers(const at::Tensor& hidden_in, const at::Tensor& positions, at::TensorList weights,
                   at::IntArrayRef types, at::IntArrayRef activation_bits, const at::Tensor& cos,
                   const at::Tensor& sin, at::TensorList k_buffers, at::TensorList v_buffers, at::TensorList plan,
                   double scale, double eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, bool amx,
                   bool row_invariant) {
  static const auto rms_norm =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("radixserve_cpu::rms_norm");
  static const auto add_rms_norm =
      find_op<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>("radixserve_cpu::add_rms_norm");
  static const auto linear =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&, int64_t)>(
          "radixserve_cpu::gguf_linear");
  static const auto rotary =
      find_op<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
          "radixserve_cpu::rotary");
  static const auto silu_and_mul = find_op<at::Tensor(const at::Tensor&)>("radixserve_cpu::silu_and_mul");
  static const auto attention = find_op<at::Tensor(
      const at::Tensor&, at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double, at::Tensor, bool, bool)>(
      "radixserve_cpu::paged_attention");

  const int64_t layers = static_cast<int64_t>(k_buffers.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kWeightsPerLayer * layers &&
                  static_cast<int64_t>(v_buffers.size()) == layers,
              "decode_layers: ", kWeightsPerLayer, " weights and one K and V buffer a layer");
  TORCH_CHECK(static_cast<int64_t>(types.size()) == kLinearsPerLayer * layers &&
                  static_cast<int64_t>(activation_bits.size()) == kLinearsPerLayer * layers,
              "decode_layers: a GGML type and activation bits for each of a layer's ", kLinearsPerLayer, " linears");
  TORCH_CHECK(static_cast<int64_t>(plan.size()) == kPlanTensors, "decode_layers: ", kPlanTensors, " plan tensors");
  TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.scalar_type() == at::kFloat, "decode_layers: hidden [T, H] float32");
  const int64_t tokens = hidden_in.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const std::optional<at::Tensor> no_bias;
  at::Tensor lse = at::empty({0}, hidden_in.options());
  at::Tensor hidden = hidden_in, residual;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + kWeightsPerLayer * l;
    const int64_t* t = types.data() + kLinearsPerLayer * l;
    const int64_t* bits = activation_bits.data() + kLinearsPerLayer * l;
    at::Tensor x;
    if (l == 0) {
      residual = hidden;
      x = rms_norm.call(hidden, w[0], eps);
    } else {
      std::tie(x, residual) = add_rms_norm.call(hidden, residual, w[0], eps);
    }
    const at::Tensor qkv = linear.call(x, w[1], t[0], w[2].numel() ? std::optional<at::Tensor>(w[2]) : no_bias,
                                       bits[0]);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    if (w[7].numel()) {
      q = rms_norm.call(q, w[7], eps);
      k = rms_norm.call(k, w[8], eps);
    }
    const auto [q_rot, k_rot] = rotary.call(positions, q, k, cos, sin);
    const at::Tensor out = attention.call(q_rot, k_buffers[l], v_buffers[l], k_rot, v, plan[0], plan[1], plan[2],
                                          plan[3], plan[4], plan[5], plan[6], plan[7], plan[8], plan[9], scale, lse,
                                          amx, row_invariant);
    const at::Tensor o = linear.call(out.reshape({tokens, q_size}), w[3], t[1], no_bias, bits[1]);
    std::tie(x, residual) = add_rms_norm.call(o, residual, w[4], eps);
    const at::Tensor gate_up = linear.call(x, w[5], t[2], no_bias, bits[2]);
    hidden = linear.call(silu_and_mul.call(gate_up), w[6], t[3], no_bias, bits[3]);
  }
  return {hidden, residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def(
      "decode_layers(Tensor hidden, Tensor positions, Tensor[] weights, int[] types, int[] activation_bits, "
      "Tensor cos, Tensor sin, Tensor(a!)[] k_buffers, Tensor(b!)[] v_buffers, Tensor[] plan, float scale, float eps, "
      "int num_heads, int num_kv_heads, int head_dim, bool amx, bool row_invariant) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }
