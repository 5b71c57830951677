#include "io/model_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <stdexcept>

#include "test_tmpdir.h"

namespace hypic {
namespace {

using json = nlohmann::json;
using ::testing::AllOf;
using ::testing::HasSubstr;

using hypic::testing::error_of;

json tiny_config() {
  return json{{"architectures", {"Qwen3_5ForCausalLM"}},
              {"vocab_size", 16},
              {"hidden_size", 8},
              {"num_hidden_layers", 2},
              {"intermediate_size", 16},
              {"num_attention_heads", 2},
              {"num_key_value_heads", 1},
              {"head_dim", 4},
              {"linear_num_key_heads", 1},
              {"linear_num_value_heads", 2},
              {"linear_key_head_dim", 4},
              {"linear_value_head_dim", 4},
              {"full_attention_interval", 2},
              {"eos_token_id", 5}};
}

class ModelDirTest : public testing::TmpDirTest {
 protected:
  void write_weights() {
    write_safetensors(path("model.safetensors"), {{"model.embed_tokens.weight", Tensor::empty(DType::BF16, {16, 8})}});
  }
};

TEST_F(ModelDirTest, OpensACompleteFolder) {
  write_file("config.json", tiny_config().dump());
  write_file("generation_config.json",
             R"({"eos_token_id": [5, 6, 6], "temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": true})");
  write_file("tokenizer.json", "{}");
  write_file("tokenizer_config.json", "{}");
  write_weights();
  ModelDir m = open_model_dir(dir_);
  EXPECT_EQ(m.dir, dir_);
  EXPECT_EQ(m.config.arch, Arch::Qwen3_5);
  EXPECT_EQ(m.config.num_hidden_layers, 2);
  EXPECT_EQ(m.config.eos_token_ids, (std::vector<int64_t>{5, 6}));  // merged, no duplicates
  EXPECT_EQ(m.generation.eos_token_ids, (std::vector<int64_t>{5, 6, 6}));
  ASSERT_TRUE(m.generation.temperature.has_value());
  EXPECT_FLOAT_EQ(*m.generation.temperature, 0.6f);
  ASSERT_TRUE(m.generation.top_p.has_value());
  EXPECT_FLOAT_EQ(*m.generation.top_p, 0.95f);
  ASSERT_TRUE(m.generation.top_k.has_value());
  EXPECT_EQ(*m.generation.top_k, 20);
  EXPECT_EQ(m.tokenizer_json, path("tokenizer.json"));
  EXPECT_EQ(m.tokenizer_config_json, path("tokenizer_config.json"));
  ASSERT_NE(m.weights, nullptr);
  EXPECT_EQ(m.weights->get("model.embed_tokens.weight", {16, 8}).dtype(), DType::BF16);
}

TEST_F(ModelDirTest, OptionalFilesAbsent) {
  write_file("config.json", tiny_config().dump());
  write_weights();
  ModelDir m = open_model_dir(dir_);
  EXPECT_EQ(m.config.eos_token_ids, std::vector<int64_t>{5});
  EXPECT_TRUE(m.generation.eos_token_ids.empty());
  EXPECT_FALSE(m.generation.temperature.has_value());
  EXPECT_FALSE(m.generation.top_p.has_value());
  EXPECT_FALSE(m.generation.top_k.has_value());
  EXPECT_TRUE(m.tokenizer_json.empty());
  EXPECT_TRUE(m.tokenizer_config_json.empty());
}

TEST_F(ModelDirTest, GenerationEosAsSingleInt) {
  json c = tiny_config();
  c.erase("eos_token_id");
  write_file("config.json", c.dump());
  write_file("generation_config.json", R"({"eos_token_id": 9, "temperature": null})");
  write_weights();
  ModelDir m = open_model_dir(dir_);
  EXPECT_EQ(m.config.eos_token_ids, std::vector<int64_t>{9});
  EXPECT_FALSE(m.generation.temperature.has_value());
}

TEST_F(ModelDirTest, MissingFolderOrConfig) {
  EXPECT_THAT(error_of([&] { open_model_dir(path("absent")); }),
              AllOf(HasSubstr(path("absent")), HasSubstr("does not exist")));
  write_file("file", "x");
  EXPECT_THAT(error_of([&] { open_model_dir(path("file")); }),
              AllOf(HasSubstr(path("file")), HasSubstr("not a directory")));
  write_weights();
  EXPECT_THAT(error_of([&] { open_model_dir(dir_); }), AllOf(HasSubstr(dir_), HasSubstr("config.json")));
}

TEST_F(ModelDirTest, ErrorsFromTheFilesNameThem) {
  json c = tiny_config();
  c["hidden_size"] = -3;
  write_file("config.json", c.dump());
  write_weights();
  EXPECT_THAT(error_of([&] { open_model_dir(dir_); }),
              HasSubstr(path("config.json") + ": field 'hidden_size' must be a positive integer, found -3"));
  write_file("config.json", tiny_config().dump());
  write_file("generation_config.json", R"({"eos_token_id": "x"})");
  EXPECT_THAT(error_of([&] { open_model_dir(dir_); }),
              AllOf(HasSubstr(path("generation_config.json")), HasSubstr("'eos_token_id'")));
  write_file("generation_config.json", R"({"top_p": 0})");
  EXPECT_THAT(error_of([&] { open_model_dir(dir_); }),
              AllOf(HasSubstr(path("generation_config.json")), HasSubstr("'top_p'")));
  write_file("generation_config.json", "{oops");
  EXPECT_THAT(error_of([&] { open_model_dir(dir_); }),
              AllOf(HasSubstr(path("generation_config.json")), HasSubstr("malformed JSON")));
  write_file("generation_config.json", "{}");
  std::filesystem::remove(path("model.safetensors"));
  EXPECT_THAT(error_of([&] { open_model_dir(dir_); }), HasSubstr("no safetensors weights in " + dir_));
}

}  // namespace
}  // namespace hypic
