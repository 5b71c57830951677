// config.json of a checkpoint: every field type-checked, sizes and layer layouts validated.
#include <cstdint>
#include <string>

#include "models/config.h"

using namespace hypic;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    (void)parse_model_config(std::string(reinterpret_cast<const char*>(data), size), "config.json");
  } catch (const std::exception&) {
  }
  return 0;
}
