// Half-precision bits -> float32, exactly: float16 (scales of the block matmul's nibble form,
// and K/V pages), bfloat16 and the 8-bit floats (K/V pages).
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

namespace jaxserve {

// A float32's bits -> the float.
inline float float_of_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// A narrower float's subnormal (or zero): man * unit, exact in float32, with its sign.
inline float subnormal(uint32_t sign, uint32_t man, float unit) {
  const float f = float(man) * unit;
  return sign ? -f : f;
}

// A float16's bits -> float32. The portable path, for CPUs without F16C; its branches are
// cheap next to what the callers do with each value.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f) return float_of_bits(sign | 0x7f800000u | (man << 13));  // inf, nan
  if (exp) return float_of_bits(sign | ((exp + 112) << 23) | (man << 13));
  return subnormal(sign, man, 0x1p-24f);
}

// A bfloat16's bits -> float32: the top half of a float32.
inline float bfloat16_to_float(uint16_t h) { return float_of_bits(uint32_t(h) << 16); }

// A float8_e4m3fn's bits -> float32: bias 7, three mantissa bits, no infinities (S.1111.111 is
// the NaN).
inline float e4m3fn_to_float(uint8_t b) {
  const uint32_t sign = uint32_t(b & 0x80) << 24, exp = (b >> 3) & 0xf, man = b & 0x7;
  if (exp == 0xf && man == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (exp) return float_of_bits(sign | ((exp + 120) << 23) | (man << 20));
  return subnormal(sign, man, 0x1p-9f);
}

// A float8_e5m2's bits -> float32: they are the top byte of a float16.
inline float e5m2_to_float(uint8_t b) { return half_to_float(uint16_t(b) << 8); }

}  // namespace jaxserve
