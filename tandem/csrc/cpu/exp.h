// e^x in fp32 by Cody-Waite reduction by ln 2 and Cephes' degree-6 polynomial for expf
// (relative error ~2e-7), written so that loops calling it vectorize (libm's expf does not
// without -ffast-math): x is clamped to [-87, 88] (results flush to e^-87 below, no infinity
// above), k = round(x / ln 2) by the 1.5 * 2^23 trick, and 2^k is built from its bits. The
// same on every machine and build.
#pragma once

#include <bit>
#include <cstdint>

namespace tandem_cpu {

inline float exp_approx(float x) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float y = x * 1.44269504088896341f + kRound;
  const int32_t k = std::bit_cast<int32_t>(y) - std::bit_cast<int32_t>(kRound);
  const float kf = y - kRound;
  float r = x - kf * 0.693359375f;
  r = r - kf * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>((k + 127) << 23);
}

}  // namespace tandem_cpu
