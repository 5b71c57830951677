// The architecture registry (models/architectures.h) and what the model derives from it: every
// committed checkpoint resolves to the row that names it, `hypic info`'s per-layer state sizes are
// the states Model allocates, and the model's FLOPs per token agree with a count of its matrices
// from the config alone.
#include "models/architectures.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <set>
#include <string>

#include "engine/loader.h"
#include "models/config.h"

namespace fs = std::filesystem;
using namespace hypic;

namespace {

std::vector<std::string> checkpoints() {
  std::vector<std::string> out;
  for (auto& e : fs::directory_iterator(fs::path(HYPIC_TEST_DATA) / "models"))
    if (fs::exists(e.path() / "config.json")) out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

// 2 x the multiply-adds of the decoder layers' weight matrices one token goes through, counted from
// the config for the Qwen families and Nemotron-H (gated or ReLU^2 MLPs, experts at k of E), plus
// the linear layers' recurrence (6 dk dv a value head).
double flops_from_config(const ModelConfig& c) {
  const double H = static_cast<double>(c.hidden_size);
  const bool nemotron = c.arch == Arch::NemotronH;
  const double mlp_mats = nemotron ? 2 : 3;
  double f = 0;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const LayerKind kind = c.layer_types[static_cast<size_t>(i)];
    if (kind == LayerKind::Linear) {
      const double kd = static_cast<double>(c.linear_num_key_heads * c.linear_key_head_dim),
                   vd = static_cast<double>(c.linear_num_value_heads * c.linear_value_head_dim),
                   hv = static_cast<double>(c.linear_num_value_heads);
      f += H * (2 * kd + 2 * vd + (nemotron ? 1 : 2) * hv) + vd * H;
      f += 3.0 * hv * static_cast<double>(c.linear_key_head_dim * c.linear_value_head_dim);  // x 2 below
    } else if (kind == LayerKind::Attention) {
      const double qd = static_cast<double>(c.num_attention_heads * c.head_dim),
                   kvd = static_cast<double>(c.num_key_value_heads * c.head_dim);
      f += H * ((nemotron ? 1 : 2) * qd + 2 * kvd) + qd * H;
    }
    if (nemotron && kind != LayerKind::Ffn) continue;
    if (c.layer_is_moe(i))
      f += H * static_cast<double>(c.num_experts) +
           mlp_mats * H * static_cast<double>(c.moe_intermediate_size * c.num_experts_per_tok) +
           mlp_mats * H * static_cast<double>(c.shared_expert_intermediate_size) +
           (c.shared_expert_intermediate_size > 0 && !nemotron ? H : 0.0);
    else
      f += mlp_mats * H * static_cast<double>(c.intermediate_size);
  }
  return 2 * f;
}

}  // namespace

TEST(ArchRegistry, EveryArchitectureHasOneRowAndEveryNameOneArchitecture) {
  std::set<Arch> archs;
  std::set<std::string> names, model_types, gguf;
  for (const ArchSpec& s : arch_specs()) {
    EXPECT_TRUE(archs.insert(s.arch).second) << s.name << " has two rows";
    EXPECT_EQ(&arch_spec(s.arch), &s);
    EXPECT_STREQ(arch_name(s.arch), s.name);
    ASSERT_NE(s.parse, nullptr) << s.name;
    EXPECT_NE(std::string(s.linear_family), "") << s.name;
    ASSERT_NE(s.hf[0].architecture, nullptr) << s.name;
    for (const auto& n : s.hf) {
      if (!n.architecture) continue;
      EXPECT_TRUE(names.insert(n.architecture).second) << n.architecture << " is listed twice";
      EXPECT_TRUE(model_types.insert(n.model_type).second) << n.model_type << " is listed twice";
    }
    // Blocks in a file of their own come with the names of the weights Model loads for them.
    if (s.blocks) EXPECT_TRUE(s.embed && s.final_norm) << s.name;
    for (const char* g : s.gguf)
      if (g) {
        EXPECT_TRUE(gguf.insert(g).second) << g << " is listed twice";
        EXPECT_TRUE(s.gguf_config && s.gguf_source) << s.name << " answers to " << g << " without a mapping";
      }
  }
  EXPECT_EQ(archs.size(), 6u);  // one row per value of Arch
}

TEST(ArchRegistry, ConfigsResolveToTheRowThatNamesThem) {
  for (const ArchSpec& s : arch_specs())
    for (const auto& n : s.hf) {
      if (!n.architecture) continue;
      // A config that names only the architecture stops at its first missing field, after the
      // lookup: the error is about a field, never "unsupported architecture".
      try {
        parse_model_config(std::string("{\"architectures\": [\"") + n.architecture + "\"]}", "x.json");
        ADD_FAILURE() << n.architecture << ": an empty config parsed";
      } catch (const std::runtime_error& e) {
        EXPECT_EQ(std::string(e.what()).find("unsupported architecture"), std::string::npos)
            << n.architecture << ": " << e.what();
      }
    }
  try {
    parse_model_config(R"({"architectures": ["LlamaForCausalLM"]})", "x.json");
    ADD_FAILURE() << "an unknown architecture parsed";
  } catch (const std::runtime_error& e) {
    // The refusal names the architecture and lists every supported one from the registry.
    const std::string what = e.what();
    EXPECT_NE(what.find("'LlamaForCausalLM'"), std::string::npos) << what;
    for (const ArchSpec& s : arch_specs()) EXPECT_NE(what.find(s.hf[0].architecture), std::string::npos) << what;
  }
  for (const std::string& dir : checkpoints()) {
    const ModelConfig c = load_model_config(dir + "/config.json");
    bool listed = false;
    for (const auto& n : arch_spec(c.arch).hf) listed |= n.architecture && c.architecture == n.architecture;
    EXPECT_TRUE(listed) << dir;
  }
}

TEST(ArchRegistry, DescribedStateIsTheStateTheModelAllocates) {
  for (const std::string& dir : checkpoints()) {
    LoadedModel lm = load_model(dir, "cpu", 1);
    const ModelConfig& c = lm.model->config();
    SequenceState st = lm.model->new_state(4);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      const LayerDesc d = describe_layer(c, i);
      const LayerState& ls = st.layers[static_cast<size_t>(i)];
      SCOPED_TRACE(dir + " layer " + std::to_string(i) + " (" + d.mixer + ")");
      const LayerKind kind = c.layer_types[static_cast<size_t>(i)];
      if (kind == LayerKind::Linear) {
        // The conv tail counts only where the layer reads it (MiniMax allocates one and never does).
        const int64_t conv = arch_spec(c.arch).short_conv ? ls.conv.numel() : 0;
        EXPECT_EQ(d.state_floats, ls.ssm.numel() + conv);
        EXPECT_EQ(d.kv_floats_per_token, 0);
      } else if (kind == LayerKind::Attention) {
        EXPECT_EQ(d.state_floats, 0);
        EXPECT_EQ(d.kv_floats_per_token * st.capacity, ls.k.numel() + ls.v.numel());
      } else {
        EXPECT_EQ(d.mixer, "none");
        EXPECT_FALSE(ls.ssm.defined() || ls.k.defined());
      }
    }
  }
}

TEST(ArchRegistry, FlopsPerTokenComeFromTheModelsWeights) {
  int compared = 0;
  for (const std::string& dir : checkpoints()) {
    LoadedModel lm = load_model(dir, "cpu", 1);
    const Model& m = *lm.model;
    const ModelConfig& c = m.config();
    SCOPED_TRACE(dir);
    // Attention's share grows with the context, 4 Hq D a key per attention layer, exactly.
    const double slope = m.flops_per_token(1000) - m.flops_per_token(0);
    EXPECT_NEAR(slope, 4.0 * 1000 * c.num_attention_heads * c.head_dim * c.num_attention_layers(), 1e-6 * slope);
    if (c.arch == Arch::MiniMax || c.arch == Arch::KimiLinear) continue;  // no config formula here
    // The weights' count against the config's matrices: the model's also holds norms, conv taps
    // and A_log / dt_bias, 2-4% in these tiny checkpoints (hidden 64); every routed expert counted
    // (k/E missed) or the untied embedding counted as a product would add far more.
    const double from_config = flops_from_config(c);
    EXPECT_GT(m.flops_per_token(0), from_config);
    EXPECT_LT(m.flops_per_token(0), 1.05 * from_config);
    // The head: a product of every row of logits with the vocabulary's H values, tied or not.
    EXPECT_EQ(m.head_flops(), 2.0 * c.vocab_size * c.hidden_size);
    ++compared;
  }
  EXPECT_GE(compared, 5);
}
