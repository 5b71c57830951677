// A GGUF file (checkpoints are outside input): header, metadata of every type, the tensor table
// and its offsets are checked before anything is read; every metadata value and every tensor's
// last byte is then touched. Then the model layer's reading of it: the config from the metadata,
// and the tokenizer rebuilt from tokenizer.ggml.* (seed: a qwen35 file with a 16-token vocabulary).
#include <cstdint>
#include <string>

#include "fuzz_common.h"
#include "io/gguf.h"
#include "models/gguf_checkpoint.h"
#include "tokenizer/tokenizer.h"

using namespace hypic;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::scratch_dir() + "/input.gguf";
  fuzz::write_file(path, data, size);
  try {
    GgufFile f(path);
    for (const auto& [k, v] : f.metadata()) {
      (void)f.has(k);
      if (v.type == GgufType::String) (void)f.get_string(k);
    }
    for (const auto& t : f.tensors()) {
      if (t.bytes > 0) (void)static_cast<volatile const uint8_t*>(f.data(t))[t.bytes - 1];
      if (t.type->block == 1) {
        try {
          Tensor x = f.get(t.name);
          (void)x.nbytes();
        } catch (const std::runtime_error&) {
        }
      }
    }
    try {
      (void)gguf_model_config(f);
    } catch (const std::exception&) {
    }
    const TokenizerTexts t = gguf_tokenizer_texts(f);
    Tokenizer tok = Tokenizer::from_json_text(t.tokenizer_json, t.config_json, path);
    (void)tok.decode(tok.encode("Hello, world! <|im_end|> 123"));
  } catch (const std::exception&) {
  }
  return 0;
}
