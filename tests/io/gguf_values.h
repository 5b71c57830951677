// GGUF metadata values compared by type and contents (tests of the GGUF reader and writer).
#pragma once
#include <type_traits>
#include <variant>

#include "io/gguf.h"

namespace hypic::testing {

inline bool same_value(const GgufValue& a, const GgufValue& b) {
  if (a.type != b.type) return false;
  if (a.type == GgufType::Array) {
    const auto& x = std::get<GgufArray>(a.v);
    const auto& y = std::get<GgufArray>(b.v);
    if (x.elem != y.elem || x.items.size() != y.items.size()) return false;
    for (size_t i = 0; i < x.items.size(); ++i)
      if (!same_value(x.items[i], y.items[i])) return false;
    return true;
  }
  if (a.v.index() != b.v.index()) return false;
  return std::visit(
      [&](const auto& x) -> bool {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, GgufArray>)
          return false;
        else
          return x == std::get<T>(b.v);
      },
      a.v);
}

}  // namespace hypic::testing
