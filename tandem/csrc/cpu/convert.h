// fp32 -> storage dtype rounding written so that loops calling it vectorize: c10::BFloat16's
// constructor branches on NaN and stays scalar. Same results as c10's casts (round to nearest
// even; NaN to the canonical quiet NaN).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <bit>
#include <cstdint>

namespace tandem_cpu {

template <typename T>
inline T round_to(float v) {
  return static_cast<T>(v);
}

template <>
inline c10::BFloat16 round_to<c10::BFloat16>(float v) {
  const uint32_t bits = std::bit_cast<uint32_t>(v);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(v != v ? 0x7fc0u : rounded), c10::BFloat16::from_bits());
}

}  // namespace tandem_cpu
