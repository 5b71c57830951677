#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "models/config.h"

namespace hypic {
namespace {

using json = nlohmann::json;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr const char* kPath = "/models/x/config.json";

std::vector<std::string> layer_strings(int n, int interval) {
  std::vector<std::string> v;
  for (int i = 0; i < n; ++i) v.push_back((i + 1) % interval == 0 ? "full_attention" : "linear_attention");
  return v;
}

// Text hyper-parameters shared by the families (small, Qwen3.5-like).
json text_fields() {
  return json{{"vocab_size", 1000},
              {"hidden_size", 64},
              {"num_hidden_layers", 8},
              {"intermediate_size", 128},
              {"hidden_act", "silu"},
              {"rms_norm_eps", 1e-6},
              {"max_position_embeddings", 4096},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 2},
              {"head_dim", 32},
              {"attention_bias", false},
              {"linear_num_key_heads", 2},
              {"linear_num_value_heads", 4},
              {"linear_key_head_dim", 16},
              {"linear_value_head_dim", 16},
              {"linear_conv_kernel_dim", 4},
              {"eos_token_id", 7}};
}

// Qwen3_5ForConditionalGeneration as transformers 5 writes it: nested text_config,
// rope_parameters with mrope fields, layer_types, tie_word_embeddings at top level.
json qwen3_5_vl() {
  json t = text_fields();
  t["layer_types"] = layer_strings(8, 4);
  t["full_attention_interval"] = 4;
  t["rope_parameters"] = {{"rope_type", "default"},
                          {"rope_theta", 10000000},
                          {"partial_rotary_factor", 0.25},
                          {"mrope_section", {11, 11, 10}},
                          {"mrope_interleaved", true}};
  t["dtype"] = "bfloat16";
  t["model_type"] = "qwen3_5_text";
  return json{{"architectures", {"Qwen3_5ForConditionalGeneration"}},
              {"model_type", "qwen3_5"},
              {"tie_word_embeddings", true},
              {"image_token_id", 999},
              {"text_config", t},
              {"vision_config", {{"depth", 2}}}};
}

// Qwen3_5ForCausalLM, flat, legacy RoPE fields, layer schedule from full_attention_interval.
json qwen3_5_text_legacy() {
  json c = text_fields();
  c["architectures"] = {"Qwen3_5ForCausalLM"};
  c["model_type"] = "qwen3_5_text";
  c["rope_theta"] = 5000000.0;
  c["partial_rotary_factor"] = 0.5;
  c["rope_scaling"] = nullptr;
  c["full_attention_interval"] = 2;
  c["torch_dtype"] = "float16";
  c["tie_word_embeddings"] = false;
  return c;
}

json qwen3_5_moe_vl() {
  json t = text_fields();
  t.erase("intermediate_size");
  t["num_experts"] = 16;
  t["num_experts_per_tok"] = 4;
  t["moe_intermediate_size"] = 32;
  t["shared_expert_intermediate_size"] = 48;
  t["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e7}, {"partial_rotary_factor", 0.25}};
  t["eos_token_id"] = json::array({7, 8});
  return json{
      {"architectures", {"Qwen3_5MoeForConditionalGeneration"}}, {"model_type", "qwen3_5_moe"}, {"text_config", t}};
}

json qwen3_next() {
  json c = text_fields();
  c["architectures"] = {"Qwen3NextForCausalLM"};
  c["model_type"] = "qwen3_next";
  c["num_experts"] = 8;
  c["num_experts_per_tok"] = 2;
  c["moe_intermediate_size"] = 32;
  c["shared_expert_intermediate_size"] = 32;
  c["norm_topk_prob"] = false;
  c["decoder_sparse_step"] = 2;
  c["mlp_only_layers"] = {3};
  c["full_attention_interval"] = 4;
  c["rope_theta"] = 10000000;
  c["partial_rotary_factor"] = 0.25;
  c["torch_dtype"] = "bfloat16";
  c["bos_token_id"] = 1;
  c["pad_token_id"] = nullptr;
  return c;
}

ModelConfig parse(const json& j) {
  return parse_model_config(j.dump(), kPath);
}

std::string error_of(const json& j) {
  try {
    parse(j);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an error for " << j.dump();
  return "";
}

std::vector<LayerKind> kinds(const std::string& pattern) {
  std::vector<LayerKind> v;
  for (char c : pattern) v.push_back(c == 'A' ? LayerKind::Attention : LayerKind::Linear);
  return v;
}

TEST(ModelConfig, Qwen3_5ConditionalGenerationNested) {
  ModelConfig c = parse(qwen3_5_vl());
  EXPECT_EQ(c.architecture, "Qwen3_5ForConditionalGeneration");
  EXPECT_EQ(c.arch, Arch::Qwen3_5);
  EXPECT_STREQ(arch_name(c.arch), "qwen3_5");
  EXPECT_TRUE(c.nested_text);
  EXPECT_EQ(c.vocab_size, 1000);
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.num_hidden_layers, 8);
  EXPECT_EQ(c.intermediate_size, 128);
  EXPECT_EQ(c.hidden_act, "silu");
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_TRUE(c.tie_word_embeddings);  // from the top level
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_EQ(c.dtype, DType::BF16);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e7);
  EXPECT_DOUBLE_EQ(c.partial_rotary_factor, 0.25);
  EXPECT_EQ(c.rotary_dim(), 8);
  EXPECT_EQ(c.linear_num_key_heads, 2);
  EXPECT_EQ(c.linear_num_value_heads, 4);
  EXPECT_EQ(c.linear_key_head_dim, 16);
  EXPECT_EQ(c.linear_value_head_dim, 16);
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  EXPECT_EQ(c.layer_types, kinds("LLLALLLA"));
  EXPECT_EQ(c.num_linear_layers(), 6);
  EXPECT_EQ(c.num_attention_layers(), 2);
  EXPECT_EQ(c.num_experts, 0);
  for (int i = 0; i < 8; ++i) EXPECT_FALSE(c.layer_is_moe(i));
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{7});
  EXPECT_EQ(c.bos_token_id, -1);
  EXPECT_EQ(c.pad_token_id, -1);
}

TEST(ModelConfig, NestedTieWordEmbeddingsWins) {
  json j = qwen3_5_vl();
  j["text_config"]["tie_word_embeddings"] = false;
  EXPECT_FALSE(parse(j).tie_word_embeddings);
  j["tie_word_embeddings"] = false;
  j["text_config"]["tie_word_embeddings"] = true;
  EXPECT_TRUE(parse(j).tie_word_embeddings);
}

TEST(ModelConfig, TextFieldsAreNotReadFromTheTopLevel) {
  json j = qwen3_5_vl();
  j["text_config"].erase("hidden_size");
  j["hidden_size"] = 64;
  EXPECT_THAT(error_of(j), AllOf(HasSubstr(kPath), HasSubstr("missing field 'hidden_size'")));
}

TEST(ModelConfig, Qwen3_5CausalLMLegacyRope) {
  ModelConfig c = parse(qwen3_5_text_legacy());
  EXPECT_EQ(c.architecture, "Qwen3_5ForCausalLM");
  EXPECT_EQ(c.arch, Arch::Qwen3_5);
  EXPECT_FALSE(c.nested_text);
  EXPECT_DOUBLE_EQ(c.rope_theta, 5e6);
  EXPECT_DOUBLE_EQ(c.partial_rotary_factor, 0.5);
  EXPECT_EQ(c.rotary_dim(), 16);
  EXPECT_EQ(c.dtype, DType::F16);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.layer_types, kinds("LALALALA"));
  EXPECT_EQ(c.num_attention_layers(), 4);
}

TEST(ModelConfig, LegacyRopeScalingWithMropeIsAccepted) {
  json j = qwen3_5_text_legacy();
  j["rope_scaling"] = {{"rope_type", "default"}, {"mrope_section", {8, 4, 4}}, {"mrope_interleaved", true}};
  EXPECT_DOUBLE_EQ(parse(j).rope_theta, 5e6);
  j["rope_scaling"] = {{"type", "mrope"}, {"mrope_section", {8, 4, 4}}};
  EXPECT_DOUBLE_EQ(parse(j).partial_rotary_factor, 0.5);
}

TEST(ModelConfig, RopeParametersOverrideLegacyFields) {
  json j = qwen3_5_text_legacy();
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1234.0}};
  ModelConfig c = parse(j);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1234.0);
  EXPECT_DOUBLE_EQ(c.partial_rotary_factor, 0.5);  // not in rope_parameters: legacy value kept
}

TEST(ModelConfig, Defaults) {
  json j = qwen3_5_text_legacy();
  for (const char* k : {"head_dim", "num_key_value_heads", "rope_theta", "partial_rotary_factor", "hidden_act",
                        "rms_norm_eps", "torch_dtype", "linear_conv_kernel_dim", "full_attention_interval",
                        "eos_token_id", "tie_word_embeddings", "max_position_embeddings", "attention_bias"})
    j.erase(k);
  ModelConfig c = parse(j);
  EXPECT_EQ(c.head_dim, 16);  // hidden / heads
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(c.partial_rotary_factor, 1.0);
  EXPECT_EQ(c.dtype, DType::BF16);
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  EXPECT_EQ(c.layer_types, kinds("LLLALLLA"));
  EXPECT_TRUE(c.eos_token_ids.empty());
  EXPECT_FALSE(c.tie_word_embeddings);
}

TEST(ModelConfig, Qwen3_5MoeNested) {
  ModelConfig c = parse(qwen3_5_moe_vl());
  EXPECT_EQ(c.architecture, "Qwen3_5MoeForConditionalGeneration");
  EXPECT_EQ(c.arch, Arch::Qwen3_5Moe);
  EXPECT_STREQ(arch_name(c.arch), "qwen3_5_moe");
  EXPECT_TRUE(c.nested_text);
  EXPECT_EQ(c.intermediate_size, 0);
  EXPECT_EQ(c.num_experts, 16);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.moe_intermediate_size, 32);
  EXPECT_EQ(c.shared_expert_intermediate_size, 48);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.decoder_sparse_step, 1);
  EXPECT_TRUE(c.mlp_only_layers.empty());
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(c.layer_is_moe(i)) << i;
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{7, 8}));
  EXPECT_EQ(c.layer_types, kinds("LLLALLLA"));  // default interval 4
}

TEST(ModelConfig, Qwen3NextSparseStepAndMlpOnlyLayers) {
  ModelConfig c = parse(qwen3_next());
  EXPECT_EQ(c.architecture, "Qwen3NextForCausalLM");
  EXPECT_EQ(c.arch, Arch::Qwen3Next);
  EXPECT_STREQ(arch_name(c.arch), "qwen3_next");
  EXPECT_FALSE(c.nested_text);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.mlp_only_layers, std::vector<int64_t>{3});
  // (i + 1) % 2 == 0 and i != 3: layers 1, 5, 7.
  std::vector<bool> moe;
  for (int i = 0; i < 8; ++i) moe.push_back(c.layer_is_moe(i));
  EXPECT_EQ(moe, (std::vector<bool>{false, true, false, false, false, true, false, true}));
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.pad_token_id, -1);
  EXPECT_EQ(c.dtype, DType::BF16);
}

TEST(ModelConfig, ModelTypeFallback) {
  json j = qwen3_next();
  j.erase("architectures");
  EXPECT_EQ(parse(j).arch, Arch::Qwen3Next);
  json v = qwen3_5_vl();
  v.erase("architectures");
  ModelConfig c = parse(v);
  EXPECT_EQ(c.architecture, "Qwen3_5ForConditionalGeneration");
  EXPECT_TRUE(c.nested_text);
  json t = qwen3_5_text_legacy();
  t["architectures"] = json::array();
  EXPECT_EQ(parse(t).architecture, "Qwen3_5ForCausalLM");
  json m = qwen3_5_moe_vl();
  m.erase("architectures");
  EXPECT_EQ(parse(m).arch, Arch::Qwen3_5Moe);
  json mt = qwen3_5_moe_vl()["text_config"];
  mt["model_type"] = "qwen3_5_moe_text";
  EXPECT_EQ(parse(mt).architecture, "Qwen3_5MoeForCausalLM");
}

TEST(ModelConfig, LoadFromMissingFile) {
  try {
    load_model_config("/nonexistent/dir/config.json");
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("/nonexistent/dir/config.json"));
  }
}

// ---- errors ----------------------------------------------------------------------------------

TEST(ModelConfigErrors, UnsupportedArchitecture) {
  json j = qwen3_next();
  j["architectures"] = {"LlamaForCausalLM"};
  EXPECT_THAT(error_of(j), AllOf(HasSubstr("unsupported architecture 'LlamaForCausalLM' in /models/x/config.json"),
                                 HasSubstr("supported: "), HasSubstr("Qwen3NextForCausalLM"),
                                 HasSubstr("Qwen3_5MoeForConditionalGeneration")));
  j.erase("architectures");
  j["model_type"] = "llama";
  EXPECT_THAT(error_of(j), HasSubstr("unsupported architecture 'llama'"));
  j.erase("model_type");
  EXPECT_THAT(error_of(j), AllOf(HasSubstr(kPath), HasSubstr("model_type")));
}

TEST(ModelConfigErrors, MalformedJson) {
  try {
    parse_model_config("{\"vocab_size\": ", kPath);
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr(kPath), HasSubstr("malformed JSON")));
  }
  try {
    parse_model_config("[1]", kPath);
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr(kPath), HasSubstr("not a JSON object")));
  }
}

// transformers 4 saves Nemotron-H's time_step_limit as [0.0, Infinity] (Python's json words, not
// JSON's): such a file loads, the words inside strings stay as they are, and a non-finite value in a
// field the engine reads is refused by name.
TEST(ModelConfig, PythonNonFiniteFloatsAreAccepted) {
  std::ifstream in(std::string(HYPIC_TEST_DATA) + "/models/nemotron_h/config.json");
  std::stringstream ss;
  ss << in.rdbuf();
  json j = json::parse(ss.str());
  j["time_step_limit"] = {0.0, 1.0};
  j["comment"] = "NaN and Infinity stay words here";
  std::string text = j.dump();
  const std::string limit = "[0.0,1.0]";
  ASSERT_NE(text.find(limit), std::string::npos);
  text.replace(text.find(limit), limit.size(), "[0.0, Infinity, -Infinity, NaN]");
  const ModelConfig c = parse_model_config(text, kPath);
  EXPECT_EQ(c.arch, Arch::NemotronH);
  EXPECT_EQ(c.num_hidden_layers, j["layers_block_type"].size());
  const std::string eps = "\"layer_norm_epsilon\":1e-05";
  ASSERT_NE(text.find(eps), std::string::npos);
  text.replace(text.find(eps), eps.size(), "\"layer_norm_epsilon\": NaN");
  try {
    parse_model_config(text, kPath);
    FAIL() << "a NaN epsilon was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("layer_norm_epsilon"));
  }
}

TEST(ModelConfigErrors, MissingTextConfig) {
  json j = qwen3_5_vl();
  j.erase("text_config");
  EXPECT_THAT(error_of(j), AllOf(HasSubstr(kPath), HasSubstr("'text_config'")));
}

TEST(ModelConfigErrors, PositiveIntegers) {
  json j = qwen3_5_text_legacy();
  j["hidden_size"] = -3;
  EXPECT_THAT(error_of(j),
              HasSubstr("/models/x/config.json: field 'hidden_size' must be a positive integer, found -3"));
  j["hidden_size"] = "64";
  EXPECT_THAT(error_of(j), HasSubstr("field 'hidden_size' must be a positive integer, found \"64\""));
  j["hidden_size"] = 64.5;
  EXPECT_THAT(error_of(j), HasSubstr("field 'hidden_size' must be an integer, found 64.5"));
  j["hidden_size"] = 64.0;  // integral float: tolerated
  EXPECT_EQ(parse(j).hidden_size, 64);
  for (const char* k : {"vocab_size", "num_hidden_layers", "num_attention_heads", "head_dim", "num_key_value_heads",
                        "linear_num_key_heads", "linear_value_head_dim", "linear_conv_kernel_dim"}) {
    json b = qwen3_5_text_legacy();
    b[k] = 0;
    EXPECT_THAT(error_of(b), AllOf(HasSubstr(kPath), HasSubstr("field '" + std::string(k) + "' must be a positive")));
  }
  json n = qwen3_5_vl();
  n["text_config"]["vocab_size"] = -1;
  EXPECT_THAT(error_of(n), HasSubstr("field 'vocab_size' must be a positive integer, found -1"));
}

// Sizes are bounded one by one and in the products the engine forms of them (the fuzzer found a
// linear_value_head_dim of 5.6e18 that overflowed a layer's state size in describe_layer).
TEST(ModelConfigErrors, SizesAndTheirProductsAreBounded) {
  json j = qwen3_5_text_legacy();
  j["linear_value_head_dim"] = int64_t{5555555555555555524};
  EXPECT_THAT(error_of(j), AllOf(HasSubstr(kPath), HasSubstr("field 'linear_value_head_dim' must be a positive "
                                                             "integer up to 16777216, found 5555555555555555524")));
  j["linear_value_head_dim"] = int64_t{1} << 24;  // each within bounds, the state is not
  j["linear_key_head_dim"] = int64_t{1} << 24;
  EXPECT_THAT(error_of(j), AllOf(HasSubstr(kPath), HasSubstr("implausible sizes: a linear layer's state would hold "
                                                             "more than 2^40 values")));
  j["linear_key_head_dim"] = 16;  // and back within bounds: parsed
  EXPECT_EQ(parse(j).linear_value_head_dim, int64_t{1} << 24);
}

// A damaged layer count is refused before it sizes anything (the fuzzer found a 2 GiB allocation).
TEST(ModelConfigErrors, LayerCountIsBounded) {
  json j = qwen3_5_text_legacy();
  j.erase("layer_types");
  j["num_hidden_layers"] = int64_t{1} << 40;
  EXPECT_THAT(error_of(j), AllOf(HasSubstr(kPath), HasSubstr("field 'num_hidden_layers' must be a positive integer up "
                                                             "to 16777216")));
  j["num_hidden_layers"] = 100000;
  EXPECT_THAT(error_of(j), AllOf(HasSubstr(kPath), HasSubstr("field 'num_hidden_layers' must be at most 4096 layers")));
  j["num_hidden_layers"] = 8;
  EXPECT_EQ(parse(j).num_hidden_layers, 8);
}

TEST(ModelConfigErrors, MissingRequiredFields) {
  for (const char* k : {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "linear_num_key_heads",
                        "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"}) {
    json j = qwen3_5_text_legacy();
    j.erase(k);
    EXPECT_THAT(error_of(j), AllOf(HasSubstr(kPath), HasSubstr("missing field '" + std::string(k) + "'")));
  }
}

TEST(ModelConfigErrors, DenseLayersNeedIntermediateSize) {
  json j = qwen3_5_text_legacy();
  j.erase("intermediate_size");
  EXPECT_THAT(error_of(j), AllOf(HasSubstr(kPath), HasSubstr("'intermediate_size'")));
  json n = qwen3_next();  // mlp_only_layers [3] is dense
  n.erase("intermediate_size");
  EXPECT_THAT(error_of(n), HasSubstr("layer 0"));
  json moe = qwen3_5_moe_vl();
  moe["text_config"]["intermediate_size"] = -5;
  EXPECT_THAT(error_of(moe), HasSubstr("field 'intermediate_size' must be a non-negative integer, found -5"));
}

TEST(ModelConfigErrors, HeadDivisibility) {
  json j = qwen3_5_text_legacy();
  j["num_key_value_heads"] = 3;
  EXPECT_THAT(error_of(j),
              AllOf(HasSubstr(kPath), HasSubstr("'num_attention_heads' (4)"), HasSubstr("'num_key_value_heads' (3)")));
  j = qwen3_5_text_legacy();
  j["linear_num_value_heads"] = 5;
  EXPECT_THAT(error_of(j), AllOf(HasSubstr(kPath), HasSubstr("'linear_num_value_heads' (5)"),
                                 HasSubstr("'linear_num_key_heads' (2)")));
  j = qwen3_5_text_legacy();
  j.erase("head_dim");
  j["hidden_size"] = 66;
  EXPECT_THAT(error_of(j), AllOf(HasSubstr("head_dim"), HasSubstr("66")));
}

TEST(ModelConfigErrors, TopKAtMostExperts) {
  json j = qwen3_next();
  j["num_experts_per_tok"] = 9;
  EXPECT_THAT(error_of(j),
              AllOf(HasSubstr(kPath), HasSubstr("'num_experts_per_tok' (9)"), HasSubstr("'num_experts' (8)")));
  j = qwen3_next();
  j.erase("num_experts");
  EXPECT_THAT(error_of(j), HasSubstr("missing field 'num_experts'"));
  j = qwen3_next();
  j.erase("moe_intermediate_size");
  EXPECT_THAT(error_of(j), HasSubstr("missing field 'moe_intermediate_size'"));
  j = qwen3_next();
  j["mlp_only_layers"] = {8};
  EXPECT_THAT(error_of(j), HasSubstr("'mlp_only_layers'"));
  j["mlp_only_layers"] = {"a"};
  EXPECT_THAT(error_of(j), HasSubstr("'mlp_only_layers' must be a list of integers"));
  j = qwen3_next();
  j["decoder_sparse_step"] = 0;
  EXPECT_THAT(error_of(j), HasSubstr("'decoder_sparse_step' must be a positive integer, found 0"));
}

TEST(ModelConfigErrors, PartialRotaryFactor) {
  for (double f : {0.0, -0.5, 1.5}) {
    json j = qwen3_5_text_legacy();
    j["partial_rotary_factor"] = f;
    EXPECT_THAT(error_of(j), AllOf(HasSubstr(kPath), HasSubstr("'partial_rotary_factor' must be in (0, 1]")));
  }
  json j = qwen3_5_vl();
  j["text_config"]["rope_parameters"]["partial_rotary_factor"] = 2.0;
  EXPECT_THAT(error_of(j), HasSubstr("'partial_rotary_factor' must be in (0, 1], found 2.0"));
  // head_dim 32 * 0.1 = 3.2: not an integer; 32 * 0.09375 = 3: odd.
  for (double f : {0.1, 0.09375}) {
    json k = qwen3_5_text_legacy();
    k["partial_rotary_factor"] = f;
    EXPECT_THAT(error_of(k), AllOf(HasSubstr("'partial_rotary_factor'"), HasSubstr("even")));
  }
}

TEST(ModelConfigErrors, UnsupportedRopeType) {
  json j = qwen3_5_vl();
  j["text_config"]["rope_parameters"]["rope_type"] = "yarn";
  EXPECT_THAT(error_of(j),
              AllOf(HasSubstr(kPath), HasSubstr("rope_parameters"), HasSubstr("'yarn'"), HasSubstr("unsupported")));
  json l = qwen3_5_text_legacy();
  l["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  EXPECT_THAT(error_of(l), AllOf(HasSubstr("rope_scaling"), HasSubstr("'linear'")));
  l["rope_scaling"] = 3;
  EXPECT_THAT(error_of(l), HasSubstr("field 'rope_scaling' must be an object"));
  json t = qwen3_5_text_legacy();
  t["rope_theta"] = "big";
  EXPECT_THAT(error_of(t), HasSubstr("field 'rope_theta' must be a number"));
  t["rope_theta"] = -1;
  EXPECT_THAT(error_of(t), HasSubstr("'rope_theta' must be a positive number"));
}

TEST(ModelConfigErrors, LayerTypes) {
  json j = qwen3_5_vl();
  j["text_config"]["layer_types"] = layer_strings(7, 4);
  EXPECT_THAT(error_of(j),
              AllOf(HasSubstr(kPath), HasSubstr("'layer_types' has 7 entries"), HasSubstr("'num_hidden_layers' is 8")));
  j["text_config"]["layer_types"] = layer_strings(8, 4);
  j["text_config"]["layer_types"][2] = "sliding_attention";
  EXPECT_THAT(error_of(j), AllOf(HasSubstr("layer_types[2]"), HasSubstr("sliding_attention")));
  j["text_config"]["layer_types"] = "full_attention";
  EXPECT_THAT(error_of(j), HasSubstr("'layer_types' must be a list of strings"));
  json k = qwen3_5_text_legacy();
  k["full_attention_interval"] = 0;
  EXPECT_THAT(error_of(k), HasSubstr("'full_attention_interval' must be a positive integer, found 0"));
}

TEST(ModelConfigErrors, TypedFields) {
  json j = qwen3_5_text_legacy();
  j["torch_dtype"] = "float8";
  EXPECT_THAT(error_of(j), AllOf(HasSubstr(kPath), HasSubstr("'torch_dtype'"), HasSubstr("float8")));
  j = qwen3_5_text_legacy();
  j["dtype"] = "int4";
  EXPECT_THAT(error_of(j), HasSubstr("field 'dtype' must be one of bfloat16, float16, float32, found \"int4\""));
  j = qwen3_5_text_legacy();
  j["eos_token_id"] = "</s>";
  EXPECT_THAT(error_of(j), HasSubstr("field 'eos_token_id' must be an integer or a list of integers"));
  j = qwen3_5_text_legacy();
  j["tie_word_embeddings"] = "yes";
  EXPECT_THAT(error_of(j), HasSubstr("field 'tie_word_embeddings' must be true or false"));
  j = qwen3_5_text_legacy();
  j["rms_norm_eps"] = 0;
  EXPECT_THAT(error_of(j), HasSubstr("field 'rms_norm_eps' must be a positive number"));
  j = qwen3_5_text_legacy();
  j["architectures"] = {42};
  EXPECT_THAT(error_of(j), HasSubstr("field 'architectures' must be a list of strings"));
}

// Nemotron-H: blocks named by layers_block_type (transformers 5 names or the older ones) or by
// hybrid_override_pattern; the Mamba2 fields land in the linear_* fields as the recurrence sees them.
json nemotron_h() {
  return json{{"architectures", {"NemotronHForCausalLM"}},
              {"model_type", "nemotron_h"},
              {"vocab_size", 512},
              {"hidden_size", 64},
              {"layers_block_type", {"linear_attention", "moe", "full_attention", "mlp"}},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 2},
              {"head_dim", 16},
              {"intermediate_size", 96},
              {"mlp_hidden_act", "relu2"},
              {"mamba_num_heads", 8},
              {"mamba_head_dim", 16},
              {"ssm_state_size", 16},
              {"n_groups", 2},
              {"conv_kernel", 4},
              {"n_routed_experts", 8},
              {"num_experts_per_tok", 2},
              {"moe_intermediate_size", 32},
              {"moe_shared_expert_intermediate_size", 48},
              {"n_group", 1},
              {"topk_group", 1},
              {"routed_scaling_factor", 2.5},
              {"time_step_limit", {0.0, {{"__float__", "Infinity"}}}}};
}

TEST(ModelConfig, NemotronHBlocks) {
  const ModelConfig c = parse(nemotron_h());
  EXPECT_EQ(c.arch, Arch::NemotronH);
  ASSERT_EQ(c.num_hidden_layers, 4);
  EXPECT_EQ(c.layer_types,
            (std::vector<LayerKind>{LayerKind::Linear, LayerKind::Ffn, LayerKind::Attention, LayerKind::Ffn}));
  EXPECT_TRUE(c.layer_is_moe(1));
  EXPECT_FALSE(c.layer_is_moe(3));
  EXPECT_EQ(c.linear_num_key_heads, 2);
  EXPECT_EQ(c.linear_key_head_dim, 16);
  EXPECT_EQ(c.linear_num_value_heads, 8);
  EXPECT_EQ(c.linear_value_head_dim, 16);
  EXPECT_EQ(c.rotary_dim(), 0);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_DOUBLE_EQ(c.time_step_min, 0.001);
  EXPECT_TRUE(c.conv_bias);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  // The older spellings name the same model.
  json old = nemotron_h();
  old.erase("layers_block_type");
  old["hybrid_override_pattern"] = "ME*-";
  old.erase("n_groups");
  old["mamba_n_groups"] = 2;
  const ModelConfig o = parse(old);
  EXPECT_EQ(o.layer_types, c.layer_types);
  EXPECT_EQ(o.moe_blocks, c.moe_blocks);
  EXPECT_EQ(o.linear_num_key_heads, 2);
  old.erase("hybrid_override_pattern");
  old["layers_block_type"] = {"mamba", "moe", "attention", "mlp"};
  EXPECT_EQ(parse(old).layer_types, c.layer_types);
}

TEST(ModelConfigErrors, NemotronH) {
  json j = nemotron_h();
  j["layers_block_type"][2] = "hybrid";
  EXPECT_THAT(error_of(j), AllOf(HasSubstr(kPath), HasSubstr("'layers_block_type[2]'"), HasSubstr("'hybrid'")));
  j = nemotron_h();
  j.erase("layers_block_type");
  EXPECT_THAT(error_of(j), HasSubstr("missing field 'layers_block_type'"));
  j["hybrid_override_pattern"] = "M?";
  EXPECT_THAT(error_of(j), HasSubstr("'hybrid_override_pattern' character 1"));
  j = nemotron_h();
  j["mlp_hidden_act"] = "gelu";
  EXPECT_THAT(error_of(j), HasSubstr("'mlp_hidden_act': 'gelu' is not supported"));
  j = nemotron_h();
  j["n_groups"] = 3;
  EXPECT_THAT(error_of(j), HasSubstr("'mamba_num_heads' (8) must be a multiple of 'n_groups' (3)"));
  j = nemotron_h();
  j["num_hidden_layers"] = 5;
  EXPECT_THAT(error_of(j), HasSubstr("'num_hidden_layers' (5) disagrees with the 4 blocks"));
  j = nemotron_h();
  j["moe_latent_size"] = 32;
  EXPECT_THAT(error_of(j), HasSubstr("'moe_latent_size'"));
  j = nemotron_h();
  j.erase("mamba_head_dim");
  EXPECT_THAT(error_of(j), HasSubstr("missing field 'mamba_head_dim'"));
  j = nemotron_h();
  j["n_group"] = 3;
  EXPECT_THAT(error_of(j), HasSubstr("do not divide the 8 experts"));
}

json minimax() {
  return json{{"architectures", {"MiniMaxForCausalLM"}},
              {"model_type", "minimax"},
              {"vocab_size", 512},
              {"hidden_size", 64},
              {"num_hidden_layers", 4},
              {"layer_types", {"linear_attention", "full_attention", "linear_attention", "full_attention"}},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 2},
              {"head_dim", 16},
              {"intermediate_size", 32},
              {"num_local_experts", 8},
              {"num_experts_per_tok", 2},
              {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.5}}},
              {"linear_attn_alpha_factor", 1.7},
              {"mlp_beta_factor", 1.1}};
}

TEST(ModelConfig, MiniMax) {
  const ModelConfig c = parse(minimax());
  EXPECT_EQ(c.arch, Arch::MiniMax);
  EXPECT_EQ(c.layer_types,
            (std::vector<LayerKind>{LayerKind::Linear, LayerKind::Attention, LayerKind::Linear, LayerKind::Attention}));
  // Lightning state: one [head_dim, head_dim] per attention head; every layer an MoE of SwiGLU experts.
  EXPECT_EQ(c.linear_num_value_heads, 4);
  EXPECT_EQ(c.linear_key_head_dim, 16);
  EXPECT_EQ(c.linear_value_head_dim, 16);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.moe_intermediate_size, 32);
  for (int64_t i = 0; i < 4; ++i) EXPECT_TRUE(c.layer_is_moe(i));
  EXPECT_EQ(c.rotary_dim(), 16);  // the whole head, as transformers 5.17 rotates it
  EXPECT_DOUBLE_EQ(c.linear_attn_alpha, 1.7);
  EXPECT_DOUBLE_EQ(c.linear_attn_beta, 1.0);
  EXPECT_DOUBLE_EQ(c.mlp_beta, 1.1);
}

TEST(ModelConfigErrors, MiniMax) {
  json j = minimax();
  j["sliding_window"] = 4096;
  EXPECT_THAT(error_of(j), HasSubstr("'sliding_window'"));
  j = minimax();
  j.erase("num_local_experts");
  EXPECT_THAT(error_of(j), HasSubstr("'num_local_experts'"));
  j = minimax();
  j["num_experts_per_tok"] = 9;
  EXPECT_THAT(error_of(j), HasSubstr("must not exceed 'num_local_experts' (8)"));
}

// Kimi-Linear in the checkpoint's own names (linear_attn_config with 1-based layer numbers,
// num_experts_per_token, moe_renormalize, num_expert_group, model_max_length).
json kimi_linear() {
  return json{{"architectures", {"KimiLinearForCausalLM"}},
              {"model_type", "kimi_linear"},
              {"vocab_size", 512},
              {"hidden_size", 64},
              {"num_hidden_layers", 4},
              {"linear_attn_config",
               {{"full_attn_layers", {2, 4}},
                {"kda_layers", {1, 3}},
                {"head_dim", 16},
                {"num_heads", 4},
                {"short_conv_kernel_size", 4}}},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 4},
              {"kv_lora_rank", 32},
              {"q_lora_rank", nullptr},
              {"qk_nope_head_dim", 16},
              {"qk_rope_head_dim", 0},
              {"v_head_dim", 16},
              {"intermediate_size", 96},
              {"moe_intermediate_size", 32},
              {"num_experts", 8},
              {"num_experts_per_token", 2},
              {"num_shared_experts", 1},
              {"first_k_dense_replace", 1},
              {"moe_renormalize", true},
              {"num_expert_group", 4},
              {"topk_group", 2},
              {"routed_scaling_factor", 2.446},
              {"model_max_length", 4096}};
}

TEST(ModelConfig, KimiLinear) {
  const ModelConfig c = parse(kimi_linear());
  EXPECT_EQ(c.arch, Arch::KimiLinear);
  EXPECT_EQ(c.layer_types,
            (std::vector<LayerKind>{LayerKind::Linear, LayerKind::Attention, LayerKind::Linear, LayerKind::Attention}));
  EXPECT_FALSE(c.layer_is_moe(0));
  EXPECT_TRUE(c.layer_is_moe(1));
  EXPECT_EQ(c.linear_num_value_heads, 4);
  EXPECT_EQ(c.linear_key_head_dim, 16);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.kv_lora_rank, 32);
  EXPECT_EQ(c.q_lora_rank, 0);
  EXPECT_EQ(c.rotary_dim(), 0);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.shared_expert_intermediate_size, 32);
  EXPECT_EQ(c.n_group, 4);
  EXPECT_EQ(c.topk_group, 2);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  // The released 48B-A3B: keys of 128 + 64 (the second part shared by the heads), values of 128;
  // the cache rows are as wide as the keys.
  json r = kimi_linear();
  r["qk_nope_head_dim"] = 128, r["qk_rope_head_dim"] = 64, r["v_head_dim"] = 128, r["mla_use_nope"] = true;
  const ModelConfig cr = parse(r);
  EXPECT_EQ(cr.head_dim, 192);
  EXPECT_EQ(cr.qk_nope_head_dim, 128);
  EXPECT_EQ(cr.qk_rope_head_dim, 64);
  EXPECT_EQ(cr.v_head_dim, 128);
  EXPECT_EQ(cr.rotary_dim(), 0);
  // transformers 5 names give the same model.
  json t = kimi_linear();
  t.erase("linear_attn_config");
  t["layer_types"] = {"linear_attention", "full_attention", "linear_attention", "full_attention"};
  t["linear_num_heads"] = 4;
  t["linear_head_dim"] = 16;
  t["mlp_layer_types"] = {"dense", "sparse", "sparse", "sparse"};
  const ModelConfig c2 = parse(t);
  EXPECT_EQ(c2.layer_types, c.layer_types);
  EXPECT_EQ(c2.moe_blocks, c.moe_blocks);
  EXPECT_EQ(c2.linear_key_head_dim, 16);
}

TEST(ModelConfigErrors, KimiLinear) {
  json j = kimi_linear();
  j["mla_use_nope"] = false;
  EXPECT_THAT(error_of(j), HasSubstr("'mla_use_nope' = false (MLA with RoPE) is not supported"));
  j = kimi_linear();
  j["num_key_value_heads"] = 2;
  EXPECT_THAT(error_of(j), HasSubstr("must equal 'num_attention_heads'"));
  j = kimi_linear();
  j["v_head_dim"] = 32;
  EXPECT_THAT(error_of(j), HasSubstr("'v_head_dim' (32) must not exceed qk_nope_head_dim + qk_rope_head_dim (16)"));
  j["qk_rope_head_dim"] = 16;  // values as wide as the keys: accepted
  EXPECT_EQ(parse(j).head_dim, 32);
  j = kimi_linear();
  j["linear_attn_config"]["full_attn_layers"] = {5};
  EXPECT_THAT(error_of(j), HasSubstr("linear_attn_config.full_attn_layers"));
  j = kimi_linear();
  j["mla_use_output_gate"] = true;
  EXPECT_THAT(error_of(j), HasSubstr("'mla_use_output_gate'"));
  j = kimi_linear();
  j["num_expert_group"] = 3;
  EXPECT_THAT(error_of(j), HasSubstr("do not divide the 8 experts"));
}

}  // namespace
}  // namespace hypic
