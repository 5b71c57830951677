// A safetensors file (checkpoints are outside input): header JSON, dtypes, shapes and offsets are
// checked before any tensor is read; every tensor the header names is then read.
#include <cstdint>
#include <string>

#include "fuzz_common.h"
#include "io/safetensors.h"

using namespace hypic;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::scratch_dir() + "/input.safetensors";
  fuzz::write_file(path, data, size);
  try {
    SafetensorsFile f(path);
    for (const auto& n : f.names()) {
      Tensor t = f.get(n);
      if (t.nbytes() > 0) (void)static_cast<volatile const char*>(t.raw())[t.nbytes() - 1];
    }
  } catch (const std::exception&) {
  }
  return 0;
}
