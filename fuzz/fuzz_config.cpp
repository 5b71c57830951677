// config.json of a checkpoint: every field type-checked, sizes and layer layouts validated.
#include <cstdint>
#include <string>

#include "models/config.h"

using namespace hypic;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const ModelConfig c = parse_model_config(std::string(reinterpret_cast<const char*>(data), size), "config.json");
    // What a parsed config promises: one kind per layer, each describable (hypic info).
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) (void)describe_layer(c, i);
  } catch (const std::exception&) {
  }
  return 0;
}
