// The model's elementwise blocks on the CPU, one pass over the data each (torch runs each as 4-18 separate ops):
// RMSNorm, residual add + RMSNorm, SiLU-and-mul, neox rotary embedding. Same roundings as the torch reference
// (model_runner/layers.py): statistics in float32, every intermediate the torch code rounds to the model's dtype
// rounded here too; only the float32 reduction order and exp differ. Rows are split over the threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace radixserve_cpu {

// float64 inputs (dispatched too, never on a hot path) through the same float32 vector code.
inline v16 load16(const double* p) {
  v16 x;
  for (int i = 0; i < 16; ++i) x[i] = static_cast<float>(p[i]);
  return x;
}

inline void store16(double* p, v16 x) {
  for (int i = 0; i < 16; ++i) p[i] = x[i];
}

template <>
inline v16 round16<double>(v16 x) {
  return x;
}

}  // namespace radixserve_cpu

namespace {

using radixserve_cpu::exp16;
using radixserve_cpu::load16;
using radixserve_cpu::round16;
using radixserve_cpu::store16;
using radixserve_cpu::sum16;
using radixserve_cpu::v16;

// Rows per thread chunk: small inputs (a decode batch) stay on one thread, where a fork would cost more.
int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)); }

template <typename T>
inline T round_to(float x) {
  return static_cast<T>(x);
}

// out = weight * dtype(x * rsqrt(mean(x^2) + eps)) over one row; `x` already float32. Whole 16-float vectors, the
// tail (cols not a multiple of 16) element by element.
template <typename scalar_t>
inline void norm_row(const float* x, const scalar_t* weight, int64_t cols, float eps, scalar_t* out) {
  const int64_t body = cols / 16 * 16;
  v16 squares{};
  for (int64_t c = 0; c < body; c += 16) {
    const v16 v = load16(x + c);
    squares += v * v;
  }
  float sum = sum16(squares);
  for (int64_t c = body; c < cols; ++c) sum += x[c] * x[c];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(cols) + eps);
  for (int64_t c = 0; c < body; c += 16) {
    const v16 normed = round16<scalar_t>(load16(x + c) * inv);
    store16(out + c, load16(weight + c) * normed);
  }
  for (int64_t c = body; c < cols; ++c) {
    const float normed = static_cast<float>(round_to<scalar_t>(x[c] * inv));
    out[c] = round_to<scalar_t>(static_cast<float>(weight[c]) * normed);
  }
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  const at::Tensor x = x_in.contiguous(), weight = weight_in.to(x.scalar_type()).contiguous();
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
      std::vector<float> row(cols);
      for (int64_t r = begin; r < end; ++r) {
        const int64_t body = cols / 16 * 16;
        for (int64_t c = 0; c < body; c += 16) store16(row.data() + c, load16(xp + r * cols + c));
        for (int64_t c = body; c < cols; ++c) row[c] = static_cast<float>(xp[r * cols + c]);
        norm_row(row.data(), wp, cols, static_cast<float>(eps), op + r * cols);
      }
    });
  });
  return out;
}

// (rms_norm(s), s) with s = dtype(residual + x).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& residual_in,
                                                const at::Tensor& weight_in, double eps) {
  const at::Tensor x = x_in.contiguous(), residual = residual_in.to(x.scalar_type()).contiguous();
  const at::Tensor weight = weight_in.to(x.scalar_type()).contiguous();
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  at::Tensor out = at::empty_like(x), summed = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    scalar_t* sp = summed.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
      std::vector<float> row(cols);
      for (int64_t r = begin; r < end; ++r) {
        const int64_t body = cols / 16 * 16;
        for (int64_t c = 0; c < body; c += 16) {
          const v16 s = round16<scalar_t>(load16(rp + r * cols + c) + load16(xp + r * cols + c));
          store16(sp + r * cols + c, s);
          store16(row.data() + c, s);
        }
        for (int64_t c = body; c < cols; ++c) {
          const scalar_t s = round_to<scalar_t>(static_cast<float>(rp[r * cols + c]) + static_cast<float>(xp[r * cols + c]));
          sp[r * cols + c] = s;
          row[c] = static_cast<float>(s);
        }
        norm_row(row.data(), wp, cols, static_cast<float>(eps), op + r * cols);
      }
    });
  });
  return {out, summed};
}

// dtype(silu(gate)) * up for gate_up = [..., 2 * I] laid out [gate | up].
at::Tensor silu_and_mul(const at::Tensor& gate_up_in) {
  const at::Tensor gate_up = gate_up_in.contiguous();
  const int64_t width = gate_up.size(-1) / 2, rows = gate_up.numel() / (2 * width);
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = width;
  at::Tensor out = at::empty(shape, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(2 * width), [&](int64_t begin, int64_t end) {
      std::vector<float> g(16), e(16);  // the tail
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = in + r * 2 * width;
        const scalar_t* up = gate + width;
        scalar_t* o = op + r * width;
        const int64_t body = width / 16 * 16;
        for (int64_t c = 0; c < body; c += 16) {
          const v16 g16 = load16(gate + c);
          const v16 activated = round16<scalar_t>(g16 / (1.0f + exp16(-g16)));
          store16(o + c, activated * load16(up + c));
        }
        for (int64_t c = body; c < width; ++c) {
          g[c - body] = static_cast<float>(gate[c]);
          e[c - body] = -g[c - body];
        }
        radixserve_cpu::exp_inplace(e.data(), width - body);
        for (int64_t c = body; c < width; ++c) {
          const float activated = static_cast<float>(round_to<scalar_t>(g[c - body] / (1.0f + e[c - body])));
          o[c] = round_to<scalar_t>(activated * static_cast<float>(up[c]));
        }
      }
    });
  });
  return out;
}

// Neox rotation of x [T, H, D] (any strides with unit last stride) by the float32 tables' rows at `positions`,
// with cos/sin rounded to x's dtype and every product and sum rounded as torch's ops round them.
template <typename scalar_t>
void rotate(const at::Tensor& x, const int64_t* positions, const float* cos, const float* sin, at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const int64_t st = x.stride(0), sh = x.stride(1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, tokens, grain_rows(heads * 2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c_row = cos + positions[t] * half;
      const float* s_row = sin + positions[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* in = xp + t * st + h * sh;
        scalar_t* o = op + (t * heads + h) * 2 * half;
        const int64_t body = half / 16 * 16;
        for (int64_t i = 0; i < body; i += 16) {
          const v16 c = round16<scalar_t>(load16(c_row + i)), s = round16<scalar_t>(load16(s_row + i));
          const v16 x1 = load16(in + i), x2 = load16(in + i + half);
          store16(o + i, round16<scalar_t>(x1 * c) - round16<scalar_t>(x2 * s));
          store16(o + i + half, round16<scalar_t>(x2 * c) + round16<scalar_t>(x1 * s));
        }
        for (int64_t i = body; i < half; ++i) {
          const float c = static_cast<float>(round_to<scalar_t>(c_row[i]));
          const float s = static_cast<float>(round_to<scalar_t>(s_row[i]));
          const float x1 = static_cast<float>(in[i]), x2 = static_cast<float>(in[i + half]);
          const float a = static_cast<float>(round_to<scalar_t>(x1 * c));
          const float b = static_cast<float>(round_to<scalar_t>(x2 * s));
          const float e = static_cast<float>(round_to<scalar_t>(x2 * c));
          const float f = static_cast<float>(round_to<scalar_t>(x1 * s));
          o[i] = round_to<scalar_t>(a - b);
          o[i + half] = round_to<scalar_t>(e + f);
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& positions_in, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& cos_in, const at::Tensor& sin_in) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1,
              "q and k must be [tokens, heads, head_dim] with unit stride");
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.size(1) * 2 == q.size(2), "float32 tables [positions, D/2]");
  TORCH_CHECK(positions.numel() == q.size(0) && positions.numel() == k.size(0), "one position per token");
  if (positions.numel() > 0) {  // a table row past the end would be read out of bounds
    const auto [low, high] = at::aminmax(positions);
    TORCH_CHECK(low.item<int64_t>() >= 0 && high.item<int64_t>() < cos.size(0), "position outside the rotary table");
  }
  at::Tensor q_out = at::empty(q.sizes(), q.options()), k_out = at::empty(k.sizes(), k.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "rotary", [&] {
    rotate<scalar_t>(q, positions.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(), q_out);
    rotate<scalar_t>(k, positions.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(), k_out);
  });
  return {q_out, k_out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary(Tensor positions, Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary", &rotary);
}
