// Names of the dtype words on the wire (DLPack: code << 16 | bits << 8 |
// lanes; python/varcomm/dtypes.py maps torch and numpy dtypes onto them).
// Every error, repr and message that shows a dtype names it with dtype_name(),
// and varcomm.dtypes.describe() is this function: one table.
#pragma once
#include <cstdint>
#include <string>

namespace varcomm {

// Bytes of one element of dtype word w (bits x lanes, rounded up to a byte);
// what every sender multiplies its shape by (python: tensor.nbytes).
inline uint64_t dtype_bytes(uint32_t w) {
  uint64_t bits = (w >> 8) & 0xFF, lanes = w & 0xFF;
  return (bits * (lanes ? lanes : 1) + 7) / 8;
}

// A shape in Python's tuple spelling, so messages read like the caller's values.
inline std::string tuple_str(const int64_t* v, size_t n) {
  std::string s = "(";
  for (size_t i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + (n == 1 ? ",)" : ")");
}

inline std::string dtype_name(uint32_t w) {
  uint32_t code = w >> 16, bits = (w >> 8) & 0xFF, lanes = w & 0xFF;
  // DLPack type codes (dlpack.h DLDataTypeCode); 0x80: varcomm-private raw bits.
  const char* base = nullptr;
  switch (code) {
    case 0: base = "int"; break;
    case 1: base = "uint"; break;
    case 2: base = "float"; break;
    case 4: base = "bfloat"; break;
    case 5: base = "complex"; break;
    case 6: if (bits == 8 && lanes == 1) return "bool"; break;
    case 10: if (bits == 8 && lanes == 1) return "float8_e4m3fn"; break;
    case 11: if (bits == 8 && lanes == 1) return "float8_e4m3fnuz"; break;
    case 12: if (bits == 8 && lanes == 1) return "float8_e5m2"; break;
    case 13: if (bits == 8 && lanes == 1) return "float8_e5m2fnuz"; break;
    case 14: if (bits == 8 && lanes == 1) return "float8_e8m0fnu"; break;
    case 17: if (bits == 4 && lanes == 2) return "float4_e2m1fn_x2"; break;
    case 0x80: base = "bits"; break;
    default: break;
  }
  if (base && lanes == 1 && bits && bits % 8 == 0) return base + std::to_string(bits);
  return "dtype code " + std::to_string(code) + ", " + std::to_string(bits) + " bits x " + std::to_string(lanes);
}

}  // namespace varcomm
