// GGUF checkpoints written by llama.cpp's own converter (convert_hf_to_gguf.py, tests/data/gguf/
// README.md) from the committed reference checkpoints: the mapping back onto the Hugging Face
// layout is exact, the tokenizer gives tokenizer.json's ids, and the models answer as transformers
// did (bf16 and f32 files to the conformance bound, Q8_0 within a stated bound).
#include "models/gguf_checkpoint.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>

#include "backend/cpu/quant_dot.h"
#include "engine/generate.h"
#include "engine/loader.h"
#include "engine/sampler.h"
#include "io/gguf_writer.h"
#include "io/safetensors.h"
#include "tensor/quant.h"

namespace fs = std::filesystem;
using namespace hypic;

namespace {

const fs::path kData = fs::path(HYPIC_TEST_DATA);
std::string gguf(const std::string& name) {
  return (kData / "gguf" / name).string();
}
std::string model(const std::string& name) {
  return (kData / "models" / name).string();
}

std::vector<int32_t> ids_of(const Tensor& t) {
  std::vector<int32_t> v;
  for (int64_t i = 0; i < t.numel(); ++i) v.push_back(static_cast<int32_t>(t.data<int64_t>()[i]));
  return v;
}

double max_abs_f32(const Tensor& a, const Tensor& b) {
  double e = 0;
  for (int64_t i = 0; i < a.numel(); ++i) e = std::max(e, std::abs(double(a.data<float>()[i]) - b.data<float>()[i]));
  return e;
}

// The worst element of b against a, as a share of what its storage may round: Q8_0 half a block
// scale (at most max|row| / 254) plus the f16 rounding of the scale; otherwise |a| * rel + 1e-6.
double worst_over_rounding(const Tensor& a, const Tensor& b, bool q8_0, double rel) {
  const int64_t rows = a.shape().empty() ? 1 : a.shape()[0], cols = a.numel() / rows;
  double worst = 0;
  for (int64_t r = 0; r < rows; ++r) {
    double rowmax = 0;
    for (int64_t j = 0; j < cols; ++j) rowmax = std::max(rowmax, std::abs(double(a.data<float>()[r * cols + j])));
    for (int64_t j = 0; j < cols; ++j) {
      const double x = a.data<float>()[r * cols + j], y = b.data<float>()[r * cols + j];
      const double bound = q8_0 ? rowmax / 254.0 + rowmax * std::ldexp(1.0, -10) : std::abs(x) * rel + 1e-6;
      worst = std::max(worst, std::abs(x - y) / bound);
    }
  }
  return worst;
}

// Every position's log-probs of both reference prompts: the worst max-abs error over the vocabulary,
// and the share of positions whose top token is the reference's.
std::pair<double, double> prompt_error(LoadedModel& lm, const SafetensorsFile& ref) {
  double worst = 0;
  int64_t same = 0, n = 0;
  for (std::string s : {"a", "b"}) {
    auto ids = ids_of(ref.get("prompt_" + s));
    Tensor lp_ref = ref.get("logprobs_" + s);
    SequenceState st = lm.model->new_state();
    Tensor lg = lm.backend->to_host(lm.model->forward(ids, st, {.all_logits = true}));
    const int64_t V = lg.dim(1);
    for (int64_t r = 0; r < lg.dim(0); ++r) {
      auto lp = log_softmax(std::span<const float>(lg.data<float>() + r * V, static_cast<size_t>(V)));
      const float* want = lp_ref.data<float>() + r * V;
      int64_t top = 0, top_ref = 0;
      for (int64_t j = 0; j < V; ++j) {
        worst = std::max(worst, std::abs(double(lp[j]) - want[j]));
        if (lp[j] > lp[top]) top = j;
        if (want[j] > want[top_ref]) top_ref = j;
      }
      same += top == top_ref;
      ++n;
    }
  }
  return {worst, n ? double(same) / double(n) : 0.0};
}

// Greedy continuations of both prompts against the reference's; the first step that differs, or -1.
int greedy_mismatch(LoadedModel& lm, const SafetensorsFile& ref) {
  for (std::string s : {"a", "b"}) {
    auto want = ids_of(ref.get("greedy_" + s));
    GenerateRequest req;
    req.prompt = ids_of(ref.get("prompt_" + s));
    req.max_tokens = static_cast<int>(want.size());
    GenerateResult r = generate(*lm.model, nullptr, req);
    for (size_t i = 0; i < want.size(); ++i)
      if (i >= r.ids.size() || r.ids[i] != want[i]) return static_cast<int>(i);
  }
  return -1;
}

}  // namespace

// The inverse of every converter transform: each tensor the model loads equals the checkpoint's
// own (f32 file: bitwise, except the +1 norms and A_log, which went through f32 arithmetic).
TEST(GgufCheckpoint, F32FileMapsBackOntoTheCheckpoint) {
  for (const std::string name : {"qwen3_5_dense"}) {
    auto file = std::make_shared<GgufFile>(gguf(name + "-f32.gguf"));
    const ModelConfig c = gguf_model_config(*file);
    const ModelConfig want = load_model_config(model(name) + "/config.json");
    EXPECT_EQ(c.architecture, want.architecture);
    EXPECT_EQ(c.vocab_size, want.vocab_size);
    EXPECT_EQ(c.num_hidden_layers, want.num_hidden_layers);
    EXPECT_EQ(c.layer_types, want.layer_types);
    EXPECT_EQ(c.linear_num_key_heads, want.linear_num_key_heads);
    EXPECT_EQ(c.linear_num_value_heads, want.linear_num_value_heads);
    EXPECT_EQ(c.linear_value_head_dim, want.linear_value_head_dim);
    EXPECT_EQ(c.rotary_dim(), want.rotary_dim());
    EXPECT_EQ(c.tie_word_embeddings, want.tie_word_embeddings);
    EXPECT_DOUBLE_EQ(c.rope_theta, want.rope_theta);
    ASSERT_NE(c.linear_num_key_heads, c.linear_num_value_heads) << "the value-head regrouping must be exercised";
    auto ws = weights_from_gguf(file, c);
    SafetensorsFile st(model(name) + "/model.safetensors");
    int compared = 0;
    for (const auto& key : st.names()) {
      if (!ws->has(key)) {
        ADD_FAILURE() << "no GGUF tensor for " << key;
        continue;
      }
      Tensor a = st.get(key).to_f32(), b = ws->get(key, st.get(key).shape()).to_f32();
      const bool approx = key.find("norm.weight") != std::string::npos || key.find("A_log") != std::string::npos;
      EXPECT_LE(max_abs_f32(a, b), approx ? 1e-6 : 0.0) << key;
      ++compared;
    }
    EXPECT_GT(compared, 100);
    EXPECT_FALSE(ws->has("model.layers.0.linear_attn.nothing"));
    EXPECT_THROW(ws->get("model.layers.0.linear_attn.in_proj_qkv.weight", {3, 3}), std::runtime_error);
  }
}

// Every file's tensors against the checkpoint's, within what its storage type can round: bf16
// and f16 to their relative precision, Q8_0 to half a block scale (at most max|row| / 254) plus the
// f16 rounding of the scale. A mapping error (a head regrouped wrongly, a missed +1) is of the order
// of the weights themselves.
TEST(GgufCheckpoint, QuantizedFilesHoldTheCheckpointWithinTheirRounding) {
  const std::pair<const char*, const char*> files[] = {{"qwen3_5_dense-q8_0.gguf", "qwen3_5_dense"},
                                                       {"qwen3_5_dense_bf16-bf16.gguf", "qwen3_5_dense_bf16"},
                                                       {"qwen3_5_moe-bf16.gguf", "qwen3_5_moe"},
                                                       {"qwen3_5_moe-q8_0.gguf", "qwen3_5_moe"}};
  for (auto [fname, ref] : files) {
    auto file = std::make_shared<GgufFile>(gguf(fname));
    const ModelConfig c = gguf_model_config(*file);
    auto ws = weights_from_gguf(file, c);
    SafetensorsFile st(model(ref) + "/model.safetensors");
    int q8 = 0;
    for (const auto& key : st.names()) {
      ASSERT_TRUE(ws->has(key)) << fname << ": no GGUF tensor for " << key;
      const GgufTensorInfo* info = gguf_tensor_for(*file, c, key);
      ASSERT_NE(info, nullptr) << key;
      Tensor a = st.get(key).to_f32(), b = ws->get(key, st.get(key).shape()).to_f32();
      const bool q = std::string(info->type->name) == "Q8_0";
      q8 += q;
      // bf16, f16 and the f32 +1 / A_log to bf16's precision
      EXPECT_LE(worst_over_rounding(a, b, q, std::ldexp(1.0, -7)), 1.0)
          << fname << " " << key << " (" << info->type->name << ")";
    }
    if (std::string(fname).find("q8_0") != std::string::npos) EXPECT_GT(q8, 10) << fname;
  }
}

struct Case {
  std::string file, reference;
  double tol;        // max abs log-prob error, every position of both prompts
  double min_agree;  // share of positions whose top token is the reference's
  bool greedy;       // the reference's greedy tokens exactly
};

// The models answer as transformers did. f32 files and the bf16 file of the bf16 checkpoint hold the
// same numbers: the conformance suite's bound and the reference's greedy tokens. The bf16 file of
// an f32 checkpoint and the Q8_0 files round the weights; these random checkpoints are built to be
// sensitive (logits std ~4, small top-2 margins), so the rounding moves log-probs by whole units in
// the vocabulary's tail: stated (docs/gguf.md), and held to agreeing on the top token at most
// positions.
TEST(GgufCheckpoint, ModelsAnswerAsTheReference) {
  const Case cases[] = {
      {"qwen3_5_dense-f32.gguf", "qwen3_5_dense", 1e-3, 1.0, true},
      {"qwen3_5_dense_bf16-bf16.gguf", "qwen3_5_dense_bf16", 1e-3, 1.0, true},
      {"qwen3_5_dense-q8_0.gguf", "qwen3_5_dense", 30, 0.6, false},
      {"qwen3_5_moe-bf16.gguf", "qwen3_5_moe", 30, 0.6, false},
      {"qwen3_5_moe-q8_0.gguf", "qwen3_5_moe", 30, 0.6, false},
      // Q8_0 of the KDA / MLA checkpoint: within the same bound; the top token agrees at fewer positions
      // (48%; its f32 file: max error 1.8e-4, every top token and the greedy tokens as transformers').
      {"kimi_linear-q8_0.gguf", "kimi_linear", 30, 0.45, false},
  };
  for (const Case& k : cases) {
    LoadedModel lm = load_model(gguf(k.file), "cpu", 2);
    lm.backend->set_precise(true);
    ASSERT_NE(lm.tokenizer, nullptr) << k.file;
    SafetensorsFile ref(model(k.reference) + "/reference.safetensors");
    const auto [err, agree] = prompt_error(lm, ref);
    EXPECT_LE(err, k.tol) << k.file;
    EXPECT_GE(agree, k.min_agree) << k.file;
    const int miss = greedy_mismatch(lm, ref);
    if (k.greedy) EXPECT_EQ(miss, -1) << k.file << ": greedy tokens differ from the reference";
    std::printf("%-30s max |log-prob error| %.3g, top token agrees at %.1f%% of positions, greedy %s\n", k.file.c_str(),
                err, 100 * agree, miss < 0 ? "identical" : ("differs at step " + std::to_string(miss)).c_str());
  }
}

namespace {
// Passes a source through and records every name and shape a model asks of it.
struct NameRecorder : WeightSource {
  const WeightSource& in;
  mutable std::vector<std::pair<std::string, Shape>> seen;
  explicit NameRecorder(const WeightSource& i) : in(i) {}
  bool has(const std::string& n) const override { return in.has(n); }
  Tensor get(const std::string& n, const Shape& s) const override {
    seen.emplace_back(n, s);
    return in.get(n, s);
  }
  std::string describe() const override { return in.describe(); }
};

// The reference Qwen3-Next checkpoint as llama.cpp's qwen3next holds it (every layer sparse): layer
// 1's dense MLP read as layer 0's sparse one, as tools/gguf/qwen3_next_all_moe.py derived the folder
// that the committed file was converted from.
class AllMoeQwen3Next : public WeightSource {
 public:
  explicit AllMoeQwen3Next(const std::string& dir) : store_(dir), inner_(weights_from_store(store_)) {}
  static std::string alias(const std::string& n) {
    const std::string l1 = "model.layers.1.mlp.";
    return n.rfind(l1, 0) == 0 ? "model.layers.0.mlp." + n.substr(l1.size()) : n;
  }
  bool has(const std::string& n) const override { return inner_->has(alias(n)); }
  Tensor get(const std::string& n, const Shape& s) const override { return inner_->get(alias(n), s); }
  std::string describe() const override { return "qwen3_next, every layer sparse"; }

 private:
  WeightStore store_;
  std::unique_ptr<WeightSource> inner_;
};
}  // namespace

// llama.cpp's qwen3next (Qwen3-Next): the config from the metadata, in_proj_qkvz interleaved per key
// head again from the file's q|k|v and z halves (no value-head regrouping, unlike qwen35), and the
// model answering as the same checkpoint quantized to Q8_0 as it loads from the Hugging Face folder.
TEST(GgufCheckpoint, Qwen3NextFileHoldsTheCheckpoint) {
  auto file = std::make_shared<GgufFile>(gguf("qwen3_next_moe-q8_0.gguf"));
  const ModelConfig c = gguf_model_config(*file);
  ModelConfig want = load_model_config(model("qwen3_next") + "/config.json");
  want.mlp_only_layers.clear();
  EXPECT_EQ(c.arch, Arch::Qwen3Next);
  EXPECT_EQ(c.architecture, want.architecture);
  EXPECT_EQ(c.layer_types, want.layer_types);
  EXPECT_EQ(c.num_experts, want.num_experts);
  EXPECT_EQ(c.num_experts_per_tok, want.num_experts_per_tok);
  EXPECT_EQ(c.moe_intermediate_size, want.moe_intermediate_size);
  EXPECT_EQ(c.shared_expert_intermediate_size, want.shared_expert_intermediate_size);
  EXPECT_EQ(c.linear_num_key_heads, want.linear_num_key_heads);
  EXPECT_EQ(c.linear_num_value_heads, want.linear_num_value_heads);
  EXPECT_EQ(c.linear_value_head_dim, want.linear_value_head_dim);
  EXPECT_EQ(c.rotary_dim(), want.rotary_dim());
  EXPECT_TRUE(c.mlp_only_layers.empty());
  ASSERT_NE(c.linear_num_key_heads, c.linear_num_value_heads) << "several value heads per key head";

  // Every tensor the model loads, against the checkpoint's within Q8_0's rounding (half a block
  // scale plus the scale's f16 rounding; f16 and f32 tensors to f16's precision). A row of another
  // head or half lands whole weights away.
  auto ws = weights_from_gguf(file, c);
  AllMoeQwen3Next ref(model("qwen3_next"));
  NameRecorder names(ref);
  auto cpu = make_backend("cpu", 1);
  { Model probe(want, names, *cpu); }
  int q8 = 0;
  bool qkvz = false;
  for (const auto& [key, shape] : names.seen) {
    ASSERT_TRUE(ws->has(key)) << "no GGUF tensor for " << key;
    const GgufTensorInfo* info = gguf_tensor_for(*file, c, key);
    ASSERT_NE(info, nullptr) << key;
    const bool q = std::string(info->type->name) == "Q8_0";
    q8 += q;
    qkvz |= key.find("in_proj_qkvz") != std::string::npos;
    Tensor a = ref.get(key, shape).to_f32(), b = ws->get(key, shape).to_f32();
    ASSERT_EQ(a.numel(), b.numel()) << key;
    EXPECT_LE(worst_over_rounding(a, b, q, std::ldexp(1.0, -10)), 1.0) << key << " (" << info->type->name << ")";
  }
  EXPECT_TRUE(qkvz);
  EXPECT_GT(q8, 20);

  // Answers: every position's log-probs of both reference prompts against the checkpoint quantized
  // to Q8_0 as it loads (hypic's quantizer writes gguf-py's bytes), and the greedy tokens.
  LoadedModel lm = load_model(gguf("qwen3_next_moe-q8_0.gguf"), "cpu", 2);
  lm.backend->set_precise(true);
  auto be = make_backend("cpu", 2);
  be->set_precise(true);
  // The converter wrote the shared experts' down projections (48 columns: no whole Q8_0 blocks) as
  // f16, where quantizing at load keeps f32: round those through f16 as the file did.
  struct LikeTheFile : WeightSource {
    AllMoeQwen3Next in;
    const GgufFile& file;
    const ModelConfig& cfg;
    LikeTheFile(const std::string& dir, const GgufFile& f, const ModelConfig& c) : in(dir), file(f), cfg(c) {}
    bool has(const std::string& n) const override { return in.has(n); }
    Tensor get(const std::string& n, const Shape& sh) const override {
      Tensor t = in.get(n, sh);
      const GgufTensorInfo* i = gguf_tensor_for(file, cfg, n);
      if (!i || std::string(i->type->name) != "F16") return t;
      Tensor h = Tensor::empty(DType::F16, t.shape()), f = t.to_f32().clone();
      convert_from_f32(f.data<float>(), DType::F16, h.raw(), static_cast<size_t>(f.numel()));
      return h.to_f32();
    }
    std::string describe() const override { return in.describe(); }
  };
  int f16 = 0;
  for (const auto& [key, shape] : names.seen) f16 += std::string(gguf_tensor_for(*file, c, key)->type->name) == "F16";
  EXPECT_GT(f16, 0) << "the rounding above is exercised";
  Model hf(want, *quantized_weights(std::make_unique<LikeTheFile>(model("qwen3_next"), *file, c), DType::Q8_0), *be);
  SafetensorsFile prompts(model("qwen3_next") + "/reference.safetensors");
  double worst = 0;
  for (std::string s : {"a", "b"}) {
    const auto ids = ids_of(prompts.get("prompt_" + s));
    SequenceState sa = lm.model->new_state(), sb = hf.new_state();
    Tensor la = lm.backend->to_host(lm.model->forward(ids, sa, {.all_logits = true}));
    Tensor lb = be->to_host(hf.forward(ids, sb, {.all_logits = true}));
    ASSERT_EQ(la.shape(), lb.shape());
    const int64_t V = la.dim(1);
    for (int64_t r = 0; r < la.dim(0); ++r) {
      auto pa = log_softmax(std::span<const float>(la.data<float>() + r * V, static_cast<size_t>(V)));
      auto pb = log_softmax(std::span<const float>(lb.data<float>() + r * V, static_cast<size_t>(V)));
      for (int64_t j = 0; j < V; ++j) worst = std::max(worst, std::abs(double(pa[j]) - pb[j]));
    }
    GenerateRequest req;
    req.prompt = ids;
    req.max_tokens = 24;
    EXPECT_EQ(generate(*lm.model, nullptr, req).ids, generate(hf, nullptr, req).ids) << "prompt " << s;
  }
  std::printf("qwen3_next_moe-q8_0.gguf against the checkpoint quantized as it loads: max |log-prob error| %.3g\n",
              worst);
  EXPECT_LE(worst, 1e-3);
}

// The tokenizer rebuilt from the GGUF metadata gives tokenizer.json's ids on the whole corpus.
TEST(GgufCheckpoint, TokenizerMatchesTokenizerJson) {
  LoadedModel lm = load_model(gguf("qwen3_5_dense-q8_0.gguf"), "cpu", 1);
  ASSERT_NE(lm.tokenizer, nullptr);
  const Tokenizer want =
      Tokenizer::load(model("qwen3_5_dense") + "/tokenizer.json", model("qwen3_5_dense") + "/tokenizer_config.json");
  std::ifstream in(kData / "tokenizer" / "corpus.jsonl");
  int n = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const std::string text = nlohmann::json::parse(line).get<std::string>();
    EXPECT_EQ(lm.tokenizer->encode(text), want.encode(text)) << text;
    ++n;
  }
  EXPECT_GT(n, 20);
  const std::string chat = "<|im_start|>user\nhello<|im_end|>";
  EXPECT_EQ(lm.tokenizer->encode(chat), want.encode(chat));
  EXPECT_EQ(lm.tokenizer->chat_template(), want.chat_template());
  EXPECT_EQ(lm.tokenizer->eos_token(), "<|im_end|>");
  EXPECT_EQ(lm.tokenizer->vocab_size(), want.vocab_size());
  EXPECT_EQ(lm.model->config().eos_token_ids, std::vector<int64_t>{511});
}

// Files that are not a supported checkpoint get an error naming the problem.
TEST(GgufCheckpoint, UnsupportedFilesAreRefusedClearly) {
  try {
    load_model(gguf("small.gguf"), "cpu", 1);
    ADD_FAILURE() << "loaded a GGUF of no supported architecture";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("small.gguf"), std::string::npos) << e.what();
  }
  EXPECT_THROW(load_model(gguf("missing.gguf"), "cpu", 1), std::runtime_error);
}

// A block count beyond the file's tensor table is damage: refused by name before it sizes anything
// (the fuzzer found a 2 GiB layer list from one changed byte).
TEST(GgufCheckpoint, BlockCountBeyondTheTensorsIsRefused) {
  GgufFile src(gguf("qwen3_5_dense-f32.gguf"));
  const ModelConfig ok = gguf_model_config(src);
  for (const uint64_t blocks : {uint64_t{1} << 31, uint64_t{src.tensors().size() + 1}}) {
    GgufWriter w;
    for (const auto& [k, v] : src.metadata()) w.set(k, v);
    w.set_u32("qwen35.block_count", static_cast<uint32_t>(blocks));
    for (const auto& t : src.tensors()) w.add_tensor(t.name, src.get(t.name));
    const std::string p = (fs::temp_directory_path() / ("hypic_blocks_" + std::to_string(blocks) + ".gguf")).string();
    w.write(p);
    GgufFile f(p);
    try {
      (void)gguf_model_config(f);
      ADD_FAILURE() << "accepted block_count " << blocks;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("qwen35.block_count " + std::to_string(blocks)), std::string::npos)
          << e.what();
    }
    fs::remove(p);
  }
  EXPECT_GT(ok.num_hidden_layers, 0);
}

// The CLI takes a GGUF file wherever it takes a model folder: the same answer from both.
TEST(GgufCheckpoint, CliGeneratesFromAGgufFile) {
  auto run = [](const std::string& m) {
    const std::string cmd = "timeout -k 5 300 " + std::string(HYPIC_BIN) + " generate --model " + m +
                            " --prompt 'The quick brown fox' --max-tokens 12 --temperature 0 --json 2>&1";
    std::string out;
    if (FILE* p = popen(cmd.c_str(), "r")) {
      char buf[4096];
      while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
      pclose(p);
    }
    const auto j = nlohmann::json::parse(out, nullptr, false);
    return j.is_object() && j.contains("ids") ? j["ids"].dump() : "no answer: " + out;
  };
  const std::string folder = run(model("qwen3_5_dense_bf16"));
  EXPECT_EQ(run(gguf("qwen3_5_dense_bf16-bf16.gguf")), folder);
  EXPECT_EQ(folder.rfind("no answer", 0), std::string::npos) << folder;
}

namespace {
// A source that takes every matrix in Hugging Face's column order (the default of
// WeightSource::get_with_col_order): a GGUF's out_proj through f32, as before value heads narrower
// than a block stayed quantized.
struct InOrder : WeightSource {
  const WeightSource& in;
  explicit InOrder(const WeightSource& i) : in(i) {}
  bool has(const std::string& n) const override { return in.has(n); }
  Tensor get(const std::string& n, const Shape& s) const override { return in.get(n, s); }
  std::string describe() const override { return in.describe() + " in order"; }
};

// Log-probs [rows, V]: every position of one forward (all_logits), or, stepwise, the positions
// from `head` on fed one token at a time after a forward of the first `head` (products of one row).
std::vector<float> logprobs_of(Model& m, Backend& be, const std::vector<int32_t>& ids, bool stepwise, int64_t head) {
  std::vector<float> out;
  auto take = [&](const Tensor& logits) {
    Tensor lg = be.to_host(logits);
    const int64_t V = lg.dim(1);
    for (int64_t r = 0; r < lg.dim(0); ++r) {
      auto lp = log_softmax(std::span<const float>(lg.data<float>() + r * V, static_cast<size_t>(V)));
      out.insert(out.end(), lp.begin(), lp.end());
    }
  };
  SequenceState st = m.new_state();
  if (!stepwise) {
    take(m.forward(ids, st, {.all_logits = true}));
    return out;
  }
  m.forward(std::span<const int32_t>(ids.data(), static_cast<size_t>(head)), st);
  for (size_t i = static_cast<size_t>(head); i < ids.size(); ++i)
    take(m.forward(std::span<const int32_t>(&ids[i], 1), st));
  return out;
}

// The worst |a - b| over the rows of [rows, V] log-probs, the mean KL(a || b) per row, and the share
// of rows whose top token agrees.
struct LpDiff {
  double worst = 0, kl = 0, agree = 0;
};
LpDiff lp_diff(const std::vector<float>& a, const std::vector<float>& b, int64_t V) {
  LpDiff d;
  const int64_t R = static_cast<int64_t>(a.size()) / V;
  for (int64_t r = 0; r < R; ++r) {
    const float *x = a.data() + r * V, *y = b.data() + r * V;
    int64_t tx = 0, ty = 0;
    for (int64_t v = 0; v < V; ++v) {
      d.worst = std::max(d.worst, std::abs(double(x[v]) - y[v]));
      d.kl += std::exp(double(x[v])) * (double(x[v]) - y[v]) / double(R);
      if (x[v] > x[tx]) tx = v;
      if (y[v] > y[ty]) ty = v;
    }
    d.agree += (tx == ty ? 1.0 : 0.0) / double(R);
  }
  return d;
}
}  // namespace

// qwen35 files store the linear layers' value heads in (repeat, key head) order. out_proj's columns
// are value heads, and where a block of the file's type is wider than a head (Q4_K and Q6_K blocks
// of 256 over heads of 64 or 128, Q8_0 blocks of 32 over heads of 24) they cannot move without
// changing the weights: the reader keeps the blocks in the file's order and names each head's place
// (get_with_col_order), and the layer gathers its activations' heads into that order before the
// product. Checked on llama.cpp's files (its Q4_K_M of the default model; Q8_0 of the dense and MoE
// reference checkpoints) and on a Q4_K and a Q6_K file of 4 key heads over 8 value heads (an order
// that is not its own inverse, unlike 2 over 4):
//  - the blocks are the file's, and the order maps them bit for bit onto get()'s f32 matrix (the
//    path before: dequantized, heads moved); the model holds exactly the difference fewer bytes;
//  - the products: one row (decode: the integer GEMV) equals get()'s f32 matrix times the
//    activations as the kernel rounds them (8-bit blocks, taken in the file's order); 40 rows
//    (prefill: dequantized panels, f32 activations) equal the f32 product to f32 summation;
//  - the model: prefill log-probs as the f32 path's to the products' summation order (not for the
//    MoE file, whose router turns such differences into another expert at some positions), and on
//    the trained default model decode as well within the activations' rounding (KL, top token).
TEST(GgufCheckpoint, OutProjStaysQuantizedWhereBlocksStraddleHeads) {
  // The synthetic files: the dense reference config with 4 key heads, 8 value heads of 32 (out_proj
  // [64, 256]: one K-quant block a row), random weights.
  ModelConfig wide = load_model_config(model("qwen3_5_dense") + "/config.json");
  wide.linear_num_key_heads = 4;
  wide.linear_num_value_heads = 8;
  wide.linear_value_head_dim = 32;
  std::vector<std::string> files = {gguf("default-q4_k_m.gguf"), gguf("qwen3_5_dense-q8_0.gguf"),
                                    gguf("qwen3_5_moe-q8_0.gguf")};
  for (DType t : {DType::Q4_K, DType::Q6_K}) {
    files.push_back((fs::temp_directory_path() /
                     ("hypic_wide_" + std::string(dtype_name(t)) + "_" + std::to_string(::getpid()) + ".gguf"))
                        .string());
    write_gguf_checkpoint(wide, *random_weights(7, DType::F32), nullptr, t, files.back());
  }
  auto be = make_backend("cpu", 2);
  be->set_precise(true);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  for (const std::string& path : files) {
    SCOPED_TRACE(path);
    auto file = std::make_shared<GgufFile>(path);
    const ModelConfig c = gguf_model_config(*file);
    ASSERT_NE(c.linear_num_key_heads, c.linear_num_value_heads);
    auto ws = weights_from_gguf(file, c);
    const int64_t nv = c.linear_num_value_heads, dv = c.linear_value_head_dim, H = c.hidden_size, K = nv * dv;
    const std::string P = c.nested_text ? "model.language_model." : "model.";
    size_t saved = 0;
    int kept = 0;
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      if (c.layer_types[static_cast<size_t>(i)] != LayerKind::Linear) continue;
      const std::string name = P + "layers." + std::to_string(i) + ".linear_attn.out_proj.weight";
      const GgufTensorInfo* info = gguf_tensor_for(*file, c, name);
      ASSERT_NE(info, nullptr) << name;
      std::vector<int64_t> order;
      const Tensor q = ws->get_with_col_order(name, {H, K}, order);
      const Tensor f = ws->get(name, {H, K});
      ASSERT_TRUE(dtype_is_quantized(q.dtype())) << name << " is " << dtype_name(q.dtype());
      EXPECT_EQ(dtype_from_name(info->type->name), q.dtype()) << name << ": the file's blocks";
      ASSERT_NE(dv % dtype_block(q.dtype()), 0) << name << ": a block straddles heads";
      EXPECT_EQ(f.dtype(), DType::F32) << name << ": get() in Hugging Face's order, through f32";
      // A permutation of the heads, not the identity; the file's block p is Hugging Face's head
      // order[p], to the bit.
      ASSERT_EQ(static_cast<int64_t>(order.size()), nv) << name;
      std::vector<int64_t> sorted = order;
      std::sort(sorted.begin(), sorted.end());
      for (int64_t h = 0; h < nv; ++h) ASSERT_EQ(sorted[static_cast<size_t>(h)], h) << name;
      EXPECT_FALSE(std::is_sorted(order.begin(), order.end())) << name;
      const Tensor d = q.to_f32();
      double worst = 0;
      for (int64_t r = 0; r < H; ++r)
        for (int64_t p = 0; p < nv; ++p)
          for (int64_t j = 0; j < dv; ++j)
            worst = std::max(worst, std::abs(double(d.data<float>()[r * K + p * dv + j]) -
                                             f.data<float>()[r * K + order[static_cast<size_t>(p)] * dv + j]));
      EXPECT_EQ(worst, 0.0) << name;
      saved += f.nbytes() - q.nbytes();
      ++kept;
      // --quantize over the file keeps the file's blocks and their order.
      std::vector<int64_t> order2;
      auto requant = quantized_weights(weights_from_gguf(file, c), DType::Q8_0);
      EXPECT_EQ(requant->get_with_col_order(name, {H, K}, order2).dtype(), q.dtype()) << name;
      EXPECT_EQ(order2, order) << name;
      if (kept > 1) continue;

      // The products, on activations whose heads differ in scale (as the gated norm's do).
      for (const int64_t M : {int64_t{1}, int64_t{40}}) {
        Tensor x = Tensor::empty(DType::F32, {M, K});
        for (int64_t m = 0; m < M; ++m)
          for (int64_t k = 0; k < K; ++k)
            x.data<float>()[m * K + k] = normal(rng) * static_cast<float>(1 + (k / dv) % 3);
        Tensor xg = be->alloc(DType::F32, {M, K}), y = be->alloc(DType::F32, {M, H});
        be->gather_col_blocks(x, order, xg);
        be->matmul(xg, q, y);
        // The activations the product sees: for one row, rounded as the kernel rounds them, in the
        // file's order, then put back in Hugging Face's order.
        std::vector<float> xr(static_cast<size_t>(M * K));
        for (int64_t m = 0; m < M; ++m) {
          std::vector<float> xp(xg.data<float>() + m * K, xg.data<float>() + (m + 1) * K), xh(static_cast<size_t>(K));
          if (M == 1) {
            std::vector<char> xq(quant::act_bytes(q.dtype(), K));
            quant::quantize_act(q.dtype(), xp.data(), K, xq.data());
            if (q.dtype() == DType::Q8_0)
              quant::dequantize(DType::Q8_0, xq.data(), K, xp.data());
            else
              quant::dequantize_q8_k(reinterpret_cast<const quant::BlockQ8_K*>(xq.data()), K, xp.data());
          }
          for (int64_t p = 0; p < nv; ++p)
            std::copy_n(xp.data() + p * dv, dv, xr.data() + m * K + order[static_cast<size_t>(p)] * dv);
        }
        double over = 0;
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < H; ++n) {
            double want = 0, mag = 0;
            for (int64_t k = 0; k < K; ++k) {
              want += double(f.data<float>()[n * K + k]) * xr[static_cast<size_t>(m * K + k)];
              mag += std::abs(double(f.data<float>()[n * K + k]) * xr[static_cast<size_t>(m * K + k)]);
            }
            over = std::max(over, std::abs(y.data<float>()[m * H + n] - want) / (1e-5 * mag + 1e-6));
          }
        EXPECT_LE(over, 1.0) << name << ", " << M << " rows: the product against f32 arithmetic";
      }
    }
    EXPECT_GT(kept, 0);

    InOrder f32_path(*ws);
    Model a(c, *ws, *be), b(c, f32_path, *be);
    EXPECT_EQ(b.weight_bytes() - a.weight_bytes(), saved) << "out_proj held quantized";
    EXPECT_NE(a.fingerprint(), b.fingerprint());
    // 40 tokens: prefill's products take dequantized panels from 32 rows; the last 8 decoded.
    std::vector<int32_t> ids;
    for (int i = 0; i < 40; ++i) ids.push_back(static_cast<int32_t>((i * 7919 + 13) % c.vocab_size));
    const int64_t V = c.vocab_size;
    const LpDiff pre = lp_diff(logprobs_of(b, *be, ids, false, 0), logprobs_of(a, *be, ids, false, 0), V);
    const LpDiff dec = lp_diff(logprobs_of(b, *be, ids, true, 32), logprobs_of(a, *be, ids, true, 32), V);
    std::printf(
        "%s: out_proj quantized in %d layers (%zu bytes fewer); against the f32 path: prefill max "
        "|log-prob difference| %.3g, decode %.3g (KL %.2g, top token agrees at %.0f%%)\n",
        fs::path(path).filename().c_str(), kept, saved, pre.worst, dec.worst, dec.kl, 100 * dec.agree);
    if (c.arch != Arch::Qwen3_5Moe) EXPECT_LE(pre.worst, 1e-3);
    if (path == files[0]) {  // the trained model: decode within its activations' rounding
      EXPECT_LT(dec.kl, 0.01);
      // 8 decoded positions of arbitrary ids: a near tie may flip one (KL 0.0044, 8 of 8 on the
      // first fine-tune's weights; 0.0048, 7 of 8 on the shipped ones).
      EXPECT_GE(dec.agree, 0.75);
    }
  }
  for (size_t i = 3; i < files.size(); ++i) fs::remove(files[i]);
}

namespace {
// A reference checkpoint folder with some layers' tensors read from another layer's (prefix `to`
// read from prefix `from`), as tools/gguf/nemotron_h_for_llama.py derived the folders that the
// Nemotron-H files were converted from.
class AliasedFolder : public WeightSource {
 public:
  AliasedFolder(const std::string& dir, std::vector<std::pair<std::string, std::string>> alias)
      : store_(dir), inner_(weights_from_store(store_)), alias_(std::move(alias)) {}
  std::string map(const std::string& n) const {
    for (const auto& [to, from] : alias_)
      if (n.rfind(to, 0) == 0) return from + n.substr(to.size());
    return n;
  }
  bool has(const std::string& n) const override { return inner_->has(map(n)); }
  Tensor get(const std::string& n, const Shape& s) const override { return inner_->get(map(n), s); }
  std::string describe() const override { return "aliased " + inner_->describe(); }

 private:
  WeightStore store_;
  std::unique_ptr<WeightSource> inner_;
  std::vector<std::pair<std::string, std::string>> alias_;
};

// A folder's weights rounded as llama.cpp's converter stored them in a file: Q8_0 blocks where
// the file's tensor is Q8_0 (hypic's quantizer writes gguf-py's bytes, so the products run on the
// same blocks), f16-rounded where it is F16 (rows that are not whole blocks), as they are where it
// is F32; kv_b_proj as the converter split it (key rows as k_b's type rounds them, value rows as
// v_b's), in f32 as the reader returns it.
class AsTheFileStoresIt : public WeightSource {
 public:
  AsTheFileStoresIt(const WeightSource& in, const GgufFile& f, const ModelConfig& c, bool file_a_log)
      : in_(in), f_(f), c_(c), file_a_log_(file_a_log) {}
  bool has(const std::string& n) const override { return in_.has(n); }
  std::string describe() const override { return in_.describe() + " rounded as the file"; }
  Tensor get(const std::string& n, const Shape& sh) const override {
    Tensor t = in_.get(n, sh).to_f32().clone();
    const GgufTensorInfo* info = gguf_tensor_for(f_, c_, n);
    if (!info) return t;
    if (file_a_log_ && n.ends_with("A_log")) {  // log(-A) of the file's A = -exp(A_log)
      const Tensor a = f_.get(info->name).to_f32();
      for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = std::log(-a.data<float>()[i]);
      return t;
    }
    const std::string type = info->type->name;
    float* p = t.data<float>();
    auto f16 = [](float* x, int64_t n) {
      std::vector<uint16_t> h(static_cast<size_t>(n));
      convert_from_f32(x, DType::F16, h.data(), static_cast<size_t>(n));
      convert_to_f32(h.data(), DType::F16, x, static_cast<size_t>(n));
    };
    auto q8 = [](float* x, int64_t n) {
      std::vector<char> b(dtype_bytes(DType::Q8_0, n));
      quant::quantize(DType::Q8_0, x, n, b.data());
      quant::dequantize(DType::Q8_0, b.data(), n, x);
    };
    if (n.ends_with("kv_b_proj.weight")) {
      const int64_t D = c_.head_dim, r = c_.kv_lora_rank;
      const GgufTensorInfo* vb = f_.find(std::string(info->name).replace(info->name.find("attn_k_b"), 8, "attn_v_b"));
      const bool k16 = type == "F16", v8 = vb && std::string(vb->type->name) == "Q8_0";
      for (int64_t row = 0; row < t.dim(0); ++row) {
        if (row % (2 * D) < D && k16) f16(p + row * r, r);
        if (row % (2 * D) >= D && v8) q8(p + row * r, r);
      }
      return t;
    }
    if (type == "F16" && t.ndim() == 2) {  // kept f16, as the reader serves it
      Tensor h = Tensor::empty(DType::F16, t.shape());
      convert_from_f32(p, DType::F16, h.raw(), static_cast<size_t>(t.numel()));
      return h;
    }
    if (type == "F16") f16(p, t.numel());
    if (type != "Q8_0" || t.ndim() != 2) return t;
    Tensor q = Tensor::empty(DType::Q8_0, t.shape());
    const size_t rb = dtype_bytes(DType::Q8_0, t.dim(1));
    for (int64_t r = 0; r < t.dim(0); ++r)
      quant::quantize(DType::Q8_0, p + r * t.dim(1), t.dim(1), static_cast<char*>(q.raw()) + r * rb);
    return q;
  }

 private:
  const WeightSource& in_;
  const GgufFile& f_;
  const ModelConfig& c_;
  bool file_a_log_;
};

// The fields a hybrid GGUF's metadata must give as its checkpoint's config.json does (both
// architectures below: the layer pattern, attention without RoPE, the linear mixer's heads).
void expect_hybrid_fields(const ModelConfig& c, const ModelConfig& want) {
  EXPECT_EQ(c.architecture, want.architecture);
  EXPECT_EQ(c.layer_types, want.layer_types);
  EXPECT_EQ(c.moe_blocks, want.moe_blocks);
  EXPECT_EQ(c.num_attention_heads, want.num_attention_heads);
  EXPECT_EQ(c.num_key_value_heads, want.num_key_value_heads);
  EXPECT_EQ(c.head_dim, want.head_dim);
  EXPECT_EQ(c.rotary_dim(), 0);
  EXPECT_EQ(c.linear_num_key_heads, want.linear_num_key_heads);
  EXPECT_EQ(c.linear_num_value_heads, want.linear_num_value_heads);
  EXPECT_EQ(c.linear_key_head_dim, want.linear_key_head_dim);
  EXPECT_EQ(c.linear_conv_kernel_dim, want.linear_conv_kernel_dim);
  EXPECT_NEAR(c.rms_norm_eps, want.rms_norm_eps, 1e-12);
  EXPECT_EQ(c.vocab_size, want.vocab_size);
}

// A Q8_0 file of llama.cpp's converter against the folder `ref` it was converted from, as the model
// `want` loads it:
//  - every tensor within Q8_0's rounding (half a block scale plus the scale's f16 rounding; f16 and
//    f32 tensors to f16's precision): a row of another head, a missed transpose or permutation
//    lands whole weights away;
//  - the model answers as the folder rounded as the file stores it (AsTheFileStoresIt): every
//    position's log-probs of both reference prompts within 1e-3, 24 greedy tokens identical.
// Returns the worst log-prob difference.
double holds_and_answers(const std::string& fname, const ModelConfig& want, const WeightSource& ref,
                         const std::string& prompts_of) {
  auto file = std::make_shared<GgufFile>(gguf(fname));
  const ModelConfig c = gguf_model_config(*file);
  auto ws = weights_from_gguf(file, c);
  NameRecorder names(ref);
  auto cpu = make_backend("cpu", 1);
  { Model probe(want, names, *cpu); }
  int q8 = 0;
  for (const auto& [key, shape] : names.seen) {
    EXPECT_TRUE(ws->has(key)) << "no GGUF tensor for " << key;
    const GgufTensorInfo* info = gguf_tensor_for(*file, c, key);
    if (!info) {
      ADD_FAILURE() << "no GGUF tensor for " << key;
      continue;
    }
    const bool q = std::string(info->type->name) == "Q8_0" || key.ends_with("kv_b_proj.weight");
    q8 += q;
    Tensor a = ref.get(key, shape).to_f32(), b = ws->get(key, shape).to_f32();
    EXPECT_EQ(b.shape(), shape) << key;
    if (a.numel() != b.numel()) continue;
    EXPECT_LE(worst_over_rounding(a, b, q, std::ldexp(1.0, -10)), 1.0) << key << " (" << info->type->name << ")";
  }
  EXPECT_GT(q8, 20);

  LoadedModel lm = load_model(gguf(fname), "cpu", 2);
  lm.backend->set_precise(true);
  EXPECT_NE(lm.tokenizer, nullptr);
  auto be = make_backend("cpu", 2);
  be->set_precise(true);
  SafetensorsFile prompts(model(prompts_of) + "/reference.safetensors");
  // Every position's log-probs of both reference prompts, and 24 greedy tokens of each, from `m`
  // against the file's model; the worst |log-prob difference|.
  auto answers = [&](Model& m) {
    double worst = 0;
    for (std::string s : {"a", "b"}) {
      const auto ids = ids_of(prompts.get("prompt_" + s));
      SequenceState sa = lm.model->new_state(), sb = m.new_state();
      Tensor la = lm.backend->to_host(lm.model->forward(ids, sa, {.all_logits = true}));
      Tensor lb = be->to_host(m.forward(ids, sb, {.all_logits = true}));
      EXPECT_EQ(la.shape(), lb.shape());
      if (la.shape() != lb.shape()) return 1e9;
      const int64_t V = la.dim(1);
      for (int64_t r = 0; r < la.dim(0); ++r) {
        auto pa = log_softmax(std::span<const float>(la.data<float>() + r * V, static_cast<size_t>(V)));
        auto pb = log_softmax(std::span<const float>(lb.data<float>() + r * V, static_cast<size_t>(V)));
        for (int64_t j = 0; j < V; ++j) worst = std::max(worst, std::abs(double(pa[j]) - pb[j]));
      }
      GenerateRequest req;
      req.prompt = ids;
      req.max_tokens = 24;
      EXPECT_EQ(generate(*lm.model, nullptr, req).ids, generate(m, nullptr, req).ids) << "prompt " << s;
    }
    return worst;
  };
  // The file holds A = -exp(A_log) in f32, whose log is an ulp or so from the checkpoint's A_log:
  // with A_log as the file holds it the models must agree to the products' rounding; with the
  // checkpoint's own, these sensitive random checkpoints move by more where a router's choice turns.
  AsTheFileStoresIt as_file(ref, *file, c, true), own_a_log(ref, *file, c, false);
  Model m_file(want, as_file, *be), m_own(want, own_a_log, *be);
  const double worst = answers(m_file), worst_own = answers(m_own);
  std::printf(
      "%s against the folder rounded as the file stores it: max |log-prob error| %.3g (with the checkpoint's own "
      "A_log %.3g)\n",
      fname.c_str(), worst, worst_own);
  EXPECT_LE(worst, 1e-3);
  EXPECT_LE(worst_own, 0.1);
  return worst;
}
}  // namespace

// llama.cpp's nemotron_h_moe and nemotron_h: the block kinds from the per-layer head_count_kv and
// feed_forward_length arrays, the Mamba2 sizes from the ssm keys, the routing from the expert keys;
// the weights with A_log, D, conv1d and the grouped norm reshaped back and the attention's q / k rows
// put back in order (the converter permutes them for RoPE though Nemotron-H has none). llama.cpp has
// no model with both MLP and MoE blocks (the reference has both), so the files come from folders
// where every feed-forward block is of one kind (tools/gguf/nemotron_h_for_llama.py); the test reads
// the reference folder the same way.
TEST(GgufCheckpoint, NemotronHFilesHoldTheCheckpoint) {
  struct Variant {
    const char* file;
    bool moe;
    std::vector<std::pair<std::string, std::string>> alias;
  };
  const Variant variants[] = {
      {"nemotron_h_moe-q8_0.gguf",
       true,
       {{"backbone.layers.4.mixer.", "backbone.layers.1.mixer."},
        {"backbone.layers.9.mixer.", "backbone.layers.8.mixer."}}},
      {"nemotron_h_mlp-q8_0.gguf",
       false,
       {{"backbone.layers.1.mixer.", "backbone.layers.4.mixer."},
        {"backbone.layers.8.mixer.", "backbone.layers.9.mixer."}}},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.file);
    GgufFile file(gguf(v.file));
    EXPECT_EQ(file.get_string("general.architecture"), v.moe ? "nemotron_h_moe" : "nemotron_h");
    const ModelConfig c = gguf_model_config(file);
    ModelConfig want = load_model_config(model("nemotron_h") + "/config.json");
    for (size_t i = 0; i < want.layer_types.size(); ++i)
      if (want.layer_types[i] == LayerKind::Ffn) want.moe_blocks[i] = v.moe;
    EXPECT_EQ(c.arch, Arch::NemotronH);
    expect_hybrid_fields(c, want);
    EXPECT_EQ(c.linear_value_head_dim, want.linear_value_head_dim);
    EXPECT_EQ(c.conv_bias, want.conv_bias);
    EXPECT_DOUBLE_EQ(c.time_step_min, want.time_step_min);
    EXPECT_EQ(c.mlp_act, want.mlp_act);
    EXPECT_EQ(c.tie_word_embeddings, want.tie_word_embeddings);
    if (v.moe) {
      EXPECT_EQ(c.num_experts, want.num_experts);
      EXPECT_EQ(c.num_experts_per_tok, want.num_experts_per_tok);
      EXPECT_EQ(c.moe_intermediate_size, want.moe_intermediate_size);
      EXPECT_EQ(c.shared_expert_intermediate_size, want.shared_expert_intermediate_size);
      EXPECT_EQ(c.n_group, want.n_group);
      EXPECT_EQ(c.topk_group, want.topk_group);
      EXPECT_EQ(c.norm_topk_prob, want.norm_topk_prob);
      EXPECT_NEAR(c.routed_scaling_factor, want.routed_scaling_factor, 1e-6);
    } else {
      EXPECT_EQ(c.intermediate_size, want.intermediate_size);
    }
    holds_and_answers(v.file, want, AliasedFolder(model("nemotron_h"), v.alias), "nemotron_h");
  }
}

// llama.cpp's kimi-linear: KDA and MLA layers from head_count_kv, the KDA heads from head_count and
// kda.head_dim, MLA's latent and head sizes from the *_mla keys, dense feed-forward in the leading
// blocks and grouped sigmoid routing after; the weights with A_log and the short convs reshaped
// back and kv_b_proj rebuilt from k_b (transposed per head) and v_b. The file comes from the
// reference folder in Moonshot's spelling (tools/gguf/kimi_linear_for_llama.py: same values), so it
// answers as the reference folder itself.
TEST(GgufCheckpoint, KimiLinearFileHoldsTheCheckpoint) {
  GgufFile file(gguf("kimi_linear-q8_0.gguf"));
  const ModelConfig c = gguf_model_config(file);
  const ModelConfig want = load_model_config(model("kimi_linear") + "/config.json");
  EXPECT_EQ(c.arch, Arch::KimiLinear);
  expect_hybrid_fields(c, want);
  EXPECT_EQ(c.kv_lora_rank, want.kv_lora_rank);
  EXPECT_EQ(c.q_lora_rank, want.q_lora_rank);
  EXPECT_EQ(c.intermediate_size, want.intermediate_size);
  EXPECT_EQ(c.num_experts, want.num_experts);
  EXPECT_EQ(c.num_experts_per_tok, want.num_experts_per_tok);
  EXPECT_EQ(c.moe_intermediate_size, want.moe_intermediate_size);
  EXPECT_EQ(c.shared_expert_intermediate_size, want.shared_expert_intermediate_size);
  EXPECT_EQ(c.n_group, want.n_group);
  EXPECT_EQ(c.topk_group, want.topk_group);
  ASSERT_GT(c.n_group, c.topk_group) << "grouped routing is exercised";
  EXPECT_EQ(c.norm_topk_prob, want.norm_topk_prob);
  EXPECT_NEAR(c.routed_scaling_factor, want.routed_scaling_factor, 1e-6);
  WeightStore store(model("kimi_linear"));
  holds_and_answers("kimi_linear-q8_0.gguf", want, *weights_from_store(store), "kimi_linear");
}

// Damage to these files is refused naming the tensor or key: a missing tensor, a per-layer array of
// the wrong length, a gating function or RoPE that the architecture does not have, a truncated file.
TEST(GgufCheckpoint, NemotronHAndKimiLinearDamageIsNamed) {
  struct Damage {
    const char* file;
    const char* drop;  // a tensor left out, or null
    std::function<void(GgufWriter&)> edit;
    std::string named;
  };
  const Damage cases[] = {
      {"nemotron_h_moe-q8_0.gguf", "blk.2.attn_k.weight", nullptr, "blk.2.attn_k.weight"},
      {"nemotron_h_moe-q8_0.gguf", "blk.3.ssm_norm.weight", nullptr, "blk.3.ssm_norm.weight"},
      {"nemotron_h_mlp-q8_0.gguf", nullptr,
       [](GgufWriter& w) {
         w.set_i32s("nemotron_h.attention.head_count_kv", {0, 0, 2});
       },
       "nemotron_h.attention.head_count_kv"},
      {"nemotron_h_mlp-q8_0.gguf", nullptr,
       [](GgufWriter& w) {
         w.set_i32s("nemotron_h.feed_forward_length", {0, 96, 0, 0, 96, 0, 0, 0, 96, 64});
       },
       "nemotron_h.feed_forward_length"},
      {"kimi_linear-q8_0.gguf", "blk.3.attn_v_b.weight", nullptr, "blk.3.attn_v_b.weight"},
      {"kimi_linear-q8_0.gguf", "blk.5.ssm_conv1d_k.weight", nullptr, "blk.5.ssm_conv1d_k.weight"},
      {"kimi_linear-q8_0.gguf", nullptr, [](GgufWriter& w) { w.set_u32("kimi-linear.expert_gating_func", 1); },
       "kimi-linear.expert_gating_func"},
      {"kimi_linear-q8_0.gguf", nullptr, [](GgufWriter& w) { w.set_u32("kimi-linear.rope.dimension_count", 64); },
       "kimi-linear.rope.dimension_count"},
  };
  int n = 0;
  for (const Damage& d : cases) {
    GgufFile src(gguf(d.file));
    GgufWriter w;
    for (const auto& [k, v] : src.metadata()) w.set(k, v);
    if (d.edit) d.edit(w);
    for (const auto& t : src.tensors())
      if (!d.drop || t.name != d.drop) w.add_tensor(t.name, src.get(t.name));
    const std::string p = (fs::temp_directory_path() /
                           ("hypic_damaged_" + std::to_string(::getpid()) + "_" + std::to_string(n++) + ".gguf"))
                              .string();
    w.write(p);
    try {
      load_model(p, "cpu", 1);
      ADD_FAILURE() << d.file << ": accepted without " << d.named;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(d.named), std::string::npos) << e.what();
    }
    fs::remove(p);
  }
  // Truncated: the tensor data ends early.
  for (const char* f : {"nemotron_h_moe-q8_0.gguf", "kimi_linear-q8_0.gguf"}) {
    const std::string p =
        (fs::temp_directory_path() / ("hypic_truncated_" + std::to_string(::getpid()) + ".gguf")).string();
    fs::copy_file(gguf(f), p, fs::copy_options::overwrite_existing);
    fs::resize_file(p, fs::file_size(p) - 4096);
    try {
      load_model(p, "cpu", 1);
      ADD_FAILURE() << f << ": a truncated copy loaded";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
      std::printf("truncated %s: %s\n", f, e.what());
    }
    fs::remove(p);
  }
}
