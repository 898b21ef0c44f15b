// Helpers shared by the CPU kernels (cpu_attention.cpp, cpu_elementwise.cpp).
#pragma once

#include <cstdint>
#include <cstring>

namespace radixserve_cpu {

// exp(x) for a whole array, written so the compiler vectorizes it (no calls, no branches): x = n ln2 + r with
// |r| <= ln2 / 2 (n rounded to nearest by adding and subtracting 1.5 * 2^23; Cody-Waite split of ln2), exp(r) by
// its degree-7 Taylor polynomial (relative error < 1e-8 on that range), 2^n through the exponent bits. Inputs
// below -87 (masked scores included) give exactly 0.
inline void exp_inplace(float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    float clamped = v < -87.0f ? -87.0f : v;
    clamped = clamped > 88.0f ? 88.0f : clamped;
    const float k = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (clamped - k * 0.693145751953125f) - k * 1.428606765330187045e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    x[i] = v < -87.0f ? 0.0f : p * scale;
  }
}

}  // namespace radixserve_cpu
