// `hypic quantize`'s writer (write_gguf_checkpoint) against llama.cpp's own converter: the
// committed reference checkpoints written by us and by convert_hf_to_gguf.py (tests/data/gguf)
// must hold the same metadata, the same tensors under the same names, shapes and types, and the
// same bytes (f32 tensors to a rounding: llama.cpp computes the +1 of the norms and -exp(A_log) in
// numpy). Then a file we wrote runs: the same greedy tokens as its checkpoint.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <type_traits>
#include <variant>

#include "../io/gguf_values.h"
#include "engine/loader.h"
#include "io/gguf.h"
#include "io/model_dir.h"
#include "io/safetensors.h"
#include "models/gguf_checkpoint.h"

using namespace hypic;

namespace {

std::string model(const std::string& n) {
  return std::string(HYPIC_TEST_DATA) + "/models/" + n;
}
std::string gguf(const std::string& n) {
  return std::string(HYPIC_TEST_DATA) + "/gguf/" + n;
}

std::string tmp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("hypic_export_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

using hypic::testing::same_value;

void write_from_folder(const std::string& folder, DType type, const std::string& out) {
  ModelDir dir = open_model_dir(folder);
  auto src = weights_from_store(*dir.weights);
  TokenizerTexts tok;
  const bool has_tok = !dir.tokenizer_json.empty();
  if (has_tok) {
    tok.tokenizer_json = read_text_file(dir.tokenizer_json);
    if (!dir.tokenizer_config_json.empty()) tok.config_json = read_text_file(dir.tokenizer_config_json);
  }
  write_gguf_checkpoint(dir.config, *src, has_tok ? &tok : nullptr, type, out);
}

// Every key llama.cpp's converter wrote (the file's name and size aside) with the same value and
// type, the same tensors under the same names, shapes and types, the same bytes (f32 within 1e-6).
void expect_same_file(const GgufFile& ours, const GgufFile& theirs, const std::set<std::string>& also_skip = {}) {
  std::set<std::string> skip = {"general.name", "general.size_label", "general.file_type", "general.basename",
                                "general.finetune"};
  skip.insert(also_skip.begin(), also_skip.end());
  for (const auto& [k, v] : theirs.metadata()) {
    if (skip.count(k)) continue;
    if (!ours.has(k)) {
      ADD_FAILURE() << "missing key " << k;
      continue;
    }
    EXPECT_TRUE(same_value(ours.metadata().at(k), v)) << "key " << k;
  }
  EXPECT_EQ(ours.tensors().size(), theirs.tensors().size());
  for (const auto& t : theirs.tensors()) {
    const GgufTensorInfo* o = ours.find(t.name);
    if (!o) {
      ADD_FAILURE() << "missing tensor " << t.name;
      continue;
    }
    EXPECT_EQ(o->ne, t.ne) << t.name;
    EXPECT_STREQ(o->type->name, t.type->name) << t.name;
    if (o->bytes != t.bytes || std::string(o->type->name) != t.type->name) continue;
    if (std::string(t.type->name) == "F32") {
      const auto* a = reinterpret_cast<const float*>(ours.data(*o));
      const auto* b = reinterpret_cast<const float*>(theirs.data(t));
      double worst = 0;
      for (uint64_t i = 0; i < t.bytes / 4; ++i)
        worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]) / std::max(1.0, std::abs(double(b[i]))));
      EXPECT_LE(worst, 1e-6) << t.name;
    } else {
      EXPECT_EQ(std::memcmp(ours.data(*o), theirs.data(t), t.bytes), 0) << t.name << " bytes differ";
    }
  }
}

TEST(GgufExport, MatchesLlamaCppsConverter) {
  struct Case {
    const char* ref;
    const char* file;
    DType type;
  };
  for (const Case& c : {Case{"qwen3_5_dense_bf16", "qwen3_5_dense_bf16-bf16.gguf", DType::BF16},
                        Case{"qwen3_5_moe", "qwen3_5_moe-bf16.gguf", DType::BF16},
                        Case{"qwen3_5_dense", "qwen3_5_dense-q8_0.gguf", DType::Q8_0},
                        Case{"qwen3_5_moe", "qwen3_5_moe-q8_0.gguf", DType::Q8_0}}) {
    SCOPED_TRACE(c.file);
    const std::string out = tmp_path(c.file);
    write_from_folder(model(c.ref), c.type, out);
    GgufFile ours(out), theirs(gguf(c.file));
    expect_same_file(ours, theirs);
    std::filesystem::remove(out);
  }
}

// Qwen3-Next and Nemotron-H: the converter's files were made from derived folders (every feed-forward
// block sparse, or of one kind: tests/data/gguf/README.md) that only python builds, so the model
// comes from the converter's file itself, through the reader (config, weights with every change
// undone, tokenizer), and is written back at the file's type: the same file again (Q8_0 blocks
// requantize to themselves). Then our file runs to the same logits as theirs, bit for bit.
TEST(GgufExport, RewritesLlamaCppsFilesOfTheOtherArchitectures) {
  for (const char* name : {"qwen3_next_moe-q8_0.gguf", "nemotron_h_mlp-q8_0.gguf", "nemotron_h_moe-q8_0.gguf"}) {
    SCOPED_TRACE(name);
    auto theirs = std::make_shared<GgufFile>(gguf(name));
    const ModelConfig cfg = gguf_model_config(*theirs);
    auto src = weights_from_gguf(theirs, cfg);
    const TokenizerTexts tok = gguf_tokenizer_texts(*theirs);
    const std::string out = tmp_path(std::string("re_") + name);
    write_gguf_checkpoint(cfg, *src, &tok, DType::Q8_0, out);
    {
      // The converter sets add_bos_token for every dense Nemotron-H, whose released tokenizer adds
      // BOS in its post-processor; this reference tokenizer does not, and we write what it says.
      GgufFile ours(out);
      const bool dense_nemotron = std::string(name) == "nemotron_h_mlp-q8_0.gguf";
      expect_same_file(
          ours, *theirs,
          dense_nemotron ? std::set<std::string>{"tokenizer.ggml.add_bos_token"} : std::set<std::string>{});
    }
    LoadedModel a = load_model(gguf(name), "cpu", 1), b = load_model(out, "cpu", 1);
    const std::vector<int32_t> ids = {1, 17, 200, 33, 401, 5, 64};
    SequenceState sa = a.model->new_state(), sb = b.model->new_state();
    Tensor la = a.model->forward(ids, sa, {.all_logits = true}), lb = b.model->forward(ids, sb, {.all_logits = true});
    ASSERT_EQ(la.shape(), lb.shape());
    EXPECT_EQ(std::memcmp(la.raw(), lb.raw(), la.nbytes()), 0) << "logits differ";
    std::filesystem::remove(out);
  }
}

// A bf16 file we wrote runs as its checkpoint (the bf16 reference checkpoint: the file holds its
// numbers): the same token ids from the rebuilt tokenizer, logits to the f32 round trips of the
// norms and A_log.
TEST(GgufExport, WrittenFileRunsAsItsCheckpoint) {
  const std::string out = tmp_path("run_bf16.gguf");
  write_from_folder(model("qwen3_5_dense_bf16"), DType::BF16, out);
  LoadedModel a = load_model(model("qwen3_5_dense_bf16"), "cpu", 1);
  LoadedModel b = load_model(out, "cpu", 1);
  ASSERT_NE(b.tokenizer, nullptr);
  const std::string text = "Hello world, the quick brown fox.";
  const std::vector<int32_t> ids = a.tokenizer->encode(text);
  EXPECT_EQ(b.tokenizer->encode(text), ids);
  SequenceState sa = a.model->new_state(), sb = b.model->new_state();
  Tensor la = a.model->forward(ids, sa, {.all_logits = true}), lb = b.model->forward(ids, sb, {.all_logits = true});
  ASSERT_EQ(la.shape(), lb.shape());
  double worst = 0, scale = 0;
  for (int64_t i = 0; i < la.numel(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(la.data<float>()[i]) - lb.data<float>()[i]));
    scale = std::max(scale, std::abs(static_cast<double>(la.data<float>()[i])));
  }
  EXPECT_LE(worst, 1e-3 * std::max(1.0, scale));
  std::filesystem::remove(out);
}

// A quantized file holds what --quantize makes of the checkpoint as it loads: the same blocks
// (dequantized values equal) for every matrix both quantize, the f16 fallback within its rounding.
// (The two do not run to equal logits: the reader turns a quantized out_proj whose value heads are
// not whole blocks into f32, and these random checkpoints amplify any difference.)
TEST(GgufExport, QuantizedFileHoldsTheQuantizedCheckpoint) {
  // Q4_K blocks are 256 wide: the default model's matrices are, the small MoE's are not.
  for (auto [folder, type] : {std::pair<std::string, DType>{model("qwen3_5_moe"), DType::Q8_0},
                              std::pair<std::string, DType>{default_model_dir(), DType::Q4_K}}) {
    SCOPED_TRACE(dtype_name(type));
    const std::string out = tmp_path(std::string("q_") + dtype_name(type) + ".gguf");
    write_from_folder(folder, type, out);
    ModelDir dir = open_model_dir(folder);
    auto q = quantized_weights(weights_from_store(*dir.weights), type);
    auto file = std::make_shared<GgufFile>(out);
    auto g = weights_from_gguf(file, gguf_model_config(*file));
    SafetensorsFile st(folder + "/model.safetensors");
    int same_blocks = 0;
    for (const auto& key : st.names()) {
      const Shape sh = st.get(key).shape();
      Tensor a = q->get(key, sh), b = g->get(key, sh);
      if (a.dtype() == b.dtype() && dtype_is_quantized(a.dtype())) {
        EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << key;
        ++same_blocks;
        continue;
      }
      Tensor fa = a.to_f32(), fb = b.to_f32();
      double worst = 0;
      for (int64_t i = 0; i < fa.numel(); ++i)
        worst = std::max(worst, std::abs(static_cast<double>(fa.data<float>()[i]) - fb.data<float>()[i]) /
                                    std::max(1.0, std::abs(static_cast<double>(fa.data<float>()[i]))));
      EXPECT_LE(worst, dtype_is_quantized(a.dtype()) ? 0.1 : 1e-3) << key;
    }
    EXPECT_GT(same_blocks, 20);
    std::filesystem::remove(out);
  }
}

// --type q4_k_m gives every tensor the type llama-quantize's Q4_K_M gave it in the committed file
// of the default model (the blocks themselves come from our quantizer).
TEST(GgufExport, Q4KMMixHasLlamaQuantizesTypes) {
  const std::string out = tmp_path("q4_k_m.gguf");
  ModelDir dir = open_model_dir(default_model_dir());
  auto src = weights_from_store(*dir.weights);
  write_gguf_checkpoint(dir.config, *src, nullptr, DType::Q4_K, out, true);
  GgufFile ours(out), theirs(gguf("default-q4_k_m.gguf"));
  ASSERT_EQ(ours.tensors().size(), theirs.tensors().size());
  int q6 = 0;
  for (const auto& t : theirs.tensors()) {
    const GgufTensorInfo* o = ours.find(t.name);
    ASSERT_NE(o, nullptr) << t.name;
    EXPECT_STREQ(o->type->name, t.type->name) << t.name;
    EXPECT_EQ(o->ne, t.ne) << t.name;
    q6 += std::string(o->type->name) == "Q6_K";
  }
  EXPECT_GE(q6, 10);
  EXPECT_THROW(write_gguf_checkpoint(dir.config, *src, nullptr, DType::Q8_0, out, true), std::invalid_argument);
  std::filesystem::remove(out);
}

TEST(GgufExport, RefusesWhatTheFormatCannotHold) {
  ModelDir dir = open_model_dir(model("qwen3_5_dense"));
  auto src = weights_from_store(*dir.weights);
  auto err = [&](auto&& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(err([&] {
              write_gguf_checkpoint(dir.config, *src, nullptr, DType::F16, tmp_path("f16.gguf"));
            }).find("cannot write matrices as f16"),
            std::string::npos);
  ModelConfig odd = dir.config;
  odd.layer_types[0] = LayerKind::Attention;  // breaks the every-n-th pattern
  EXPECT_NE(err([&] {
              write_gguf_checkpoint(odd, *src, nullptr, DType::BF16, tmp_path("odd.gguf"));
            }).find("full_attention_interval"),
            std::string::npos);
  // Checkpoints llama.cpp has no form for: Kimi-Linear (read, not written), Qwen3-Next with a dense
  // layer (its loader puts experts in every layer), Nemotron-H mixing MLP and MoE blocks.
  auto folder_error = [&](const std::string& ref) {
    ModelDir d = open_model_dir(model(ref));
    auto w = weights_from_store(*d.weights);
    return err([&] { write_gguf_checkpoint(d.config, *w, nullptr, DType::Q8_0, tmp_path(ref + ".gguf")); });
  };
  EXPECT_NE(folder_error("kimi_linear").find("is not written as GGUF here"), std::string::npos);
  EXPECT_NE(folder_error("qwen3_next").find("layer 1 has a dense MLP"), std::string::npos);
  EXPECT_NE(folder_error("nemotron_h").find("is an MLP block"), std::string::npos);
  const std::string bad = "/nonexistent-dir/x.gguf";
  EXPECT_NE(err([&] { write_gguf_checkpoint(dir.config, *src, nullptr, DType::BF16, bad); }).find(bad),
            std::string::npos);
}

}  // namespace
