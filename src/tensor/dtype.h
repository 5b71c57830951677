// Element types and the half-precision conversions used across hypic.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

namespace hypic {

// Q8_0, Q4_K and Q6_K are ggml's block-quantized weight formats, stored as GGUF files hold them
// (backend/cpu/quant.h): a block of dtype_block() values takes dtype_size() bytes. Only weights are
// quantized, only the CPU backend runs them, and a row's length is a whole number of blocks.
enum class DType : uint8_t { F32, F16, BF16, F64, I32, I64, U8, Q8_0, Q4_K, Q6_K };

inline bool dtype_is_quantized(DType t) {
  return t == DType::Q8_0 || t == DType::Q4_K || t == DType::Q6_K;
}

// Values per block: 1 for plain types.
inline int64_t dtype_block(DType t) {
  return t == DType::Q8_0 ? 32 : (t == DType::Q4_K || t == DType::Q6_K) ? 256 : 1;
}

// Bytes per block (per value for plain types).
inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32:
      return 4;
    case DType::F16:
      return 2;
    case DType::BF16:
      return 2;
    case DType::F64:
      return 8;
    case DType::I32:
      return 4;
    case DType::I64:
      return 8;
    case DType::U8:
      return 1;
    case DType::Q8_0:
      return 34;
    case DType::Q4_K:
      return 144;
    case DType::Q6_K:
      return 210;
  }
  return 0;
}

// Bytes of n values (n a multiple of dtype_block(t) for quantized types).
inline size_t dtype_bytes(DType t, int64_t n) {
  return static_cast<size_t>(n / dtype_block(t)) * dtype_size(t);
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "f32";
    case DType::F16:
      return "f16";
    case DType::BF16:
      return "bf16";
    case DType::F64:
      return "f64";
    case DType::I32:
      return "i32";
    case DType::I64:
      return "i64";
    case DType::U8:
      return "u8";
    case DType::Q8_0:
      return "q8_0";
    case DType::Q4_K:
      return "q4_k";
    case DType::Q6_K:
      return "q6_k";
  }
  return "?";
}

// The dtype dtype_name() calls `name` (any case), if any.
inline std::optional<DType> dtype_from_name(std::string_view name) {
  for (int i = 0; i <= static_cast<int>(DType::Q6_K); ++i) {
    const std::string_view n = dtype_name(static_cast<DType>(i));
    if (n.size() == name.size() && std::equal(n.begin(), n.end(), name.begin(), [](char a, char b) {
          return a == (b | (b >= 'A' && b <= 'Z' ? 0x20 : 0));
        }))
      return static_cast<DType>(i);
  }
  return std::nullopt;
}

// Round-to-nearest-even fp32 -> bf16, as torch does.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE half conversions (F16C is not assumed; these are exact for all finite values).
inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu, u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400u)) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      u = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  int32_t exp = static_cast<int32_t>((u >> 23) & 0xff) - 127 + 15;
  uint32_t mant = u & 0x7fffffu;
  if (((u >> 23) & 0xff) == 0xff) return static_cast<uint16_t>(sign | 0x7c00u | (mant ? 0x200u : 0));
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  if (exp <= 0) {
    if (exp < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000u;
    uint32_t shift = static_cast<uint32_t>(14 - exp);
    uint32_t half = mant >> shift, rem = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = sign | (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1))) ++half;  // may carry into exponent: correct
  return static_cast<uint16_t>(half);
}

}  // namespace hypic
