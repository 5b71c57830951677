// Conformance with transformers 5.17: every position's log-probs and the greedy continuation of
// small random-weight checkpoints (made by tools/reference/make_reference.py on the device
// machine; references are transformers' own outputs).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "engine/generate.h"
#include "engine/loader.h"
#include "engine/sampler.h"
#include "io/safetensors.h"

namespace fs = std::filesystem;
using namespace hypic;

namespace {

constexpr double kTol = 1e-3;

std::vector<std::string> reference_models() {
  std::vector<std::string> out;
  fs::path root = fs::path(HYPIC_TEST_DATA) / "models";
  if (!fs::exists(root)) return out;
  for (auto& e : fs::directory_iterator(root))
    if (fs::exists(e.path() / "reference.safetensors")) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<int32_t> ids_of(const Tensor& t) {
  std::vector<int32_t> v;
  for (int64_t i = 0; i < t.numel(); ++i) v.push_back(static_cast<int32_t>(t.data<int64_t>()[i]));
  return v;
}

// Max abs difference between log_softmax(logits row r) and ref row r.
double row_err(const Tensor& logits, int64_t r, const Tensor& ref, int64_t rr) {
  const int64_t V = logits.dim(1);
  std::span<const float> row(logits.data<float>() + r * V, static_cast<size_t>(V));
  auto lp = log_softmax(row);
  double e = 0;
  for (int64_t j = 0; j < V; ++j) e = std::max(e, std::abs(double(lp[j]) - ref.data<float>()[rr * V + j]));
  return e;
}

double top2_margin(const Tensor& ref, int64_t r) {
  const int64_t V = ref.dim(1);
  const float* p = ref.data<float>() + r * V;
  float a = -INFINITY, b = -INFINITY;
  for (int64_t j = 0; j < V; ++j) {
    if (p[j] > a) {
      b = a;
      a = p[j];
    } else if (p[j] > b) {
      b = p[j];
    }
  }
  return a - b;
}

class Conformance : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = (fs::path(HYPIC_TEST_DATA) / "models" / GetParam()).string();
    ref_ = std::make_unique<SafetensorsFile>(dir_ + "/reference.safetensors");
    lm_ = std::make_unique<LoadedModel>(load_model(dir_, "cpu", 2));
  }
  std::string dir_;
  std::unique_ptr<SafetensorsFile> ref_;
  std::unique_ptr<LoadedModel> lm_;
};

TEST_P(Conformance, PromptLogprobsEveryPosition) {
  for (std::string s : {"a", "b"}) {
    auto ids = ids_of(ref_->get("prompt_" + s));
    Tensor ref = ref_->get("logprobs_" + s);
    SequenceState st = lm_->model->new_state();
    Tensor lg = lm_->backend->to_host(lm_->model->forward(ids, st, {.all_logits = true}));
    ASSERT_EQ(lg.dim(0), static_cast<int64_t>(ids.size()));
    double worst = 0;
    for (int64_t r = 0; r < lg.dim(0); ++r) worst = std::max(worst, row_err(lg, r, ref, r));
    EXPECT_LE(worst, kTol) << GetParam() << " prompt " << s << " (" << ids.size() << " tokens)";
    RecordProperty("max_abs_err_" + s, std::to_string(worst));
  }
}

// Feeding the prompt in spans that cross the 64-token chunk boundary and the conv kernel must
// give the same log-probs as one pass: conv, recurrent and KV state carry exactly.
TEST_P(Conformance, SplitPrefillMatchesReference) {
  auto ids = ids_of(ref_->get("prompt_a"));
  Tensor ref = ref_->get("logprobs_a");
  SequenceState st = lm_->model->new_state();
  const size_t cuts[] = {0, 2, 67, 130, ids.size()};
  double worst = 0;
  for (size_t c = 0; c + 1 < std::size(cuts); ++c) {
    std::span<const int32_t> span(ids.data() + cuts[c], cuts[c + 1] - cuts[c]);
    Tensor lg = lm_->backend->to_host(lm_->model->forward(span, st, {.all_logits = true}));
    for (int64_t r = 0; r < lg.dim(0); ++r) worst = std::max(worst, row_err(lg, r, ref, cuts[c] + r));
  }
  EXPECT_LE(worst, kTol);
}

TEST_P(Conformance, GreedyContinuationWithCachedDecode) {
  for (std::string s : {"a", "b"}) {
    auto prompt = ids_of(ref_->get("prompt_" + s));
    auto want = ids_of(ref_->get("greedy_" + s));
    Tensor ref_lp = ref_->get("greedy_logprobs_" + s);
    GenerateRequest req;
    req.prompt = prompt;
    req.max_tokens = static_cast<int>(want.size());
    req.logprobs = 0;
    GenerateResult r = generate(*lm_->model, nullptr, req);
    ASSERT_EQ(r.ids.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      if (r.ids[i] != want[i]) {
        // Only acceptable where the reference itself is undecided.
        EXPECT_LT(top2_margin(ref_lp, static_cast<int64_t>(i)), kTol)
            << GetParam() << " prompt " << s << ": step " << i << " got " << r.ids[i] << " want " << want[i];
        break;
      }
      const float ref_chosen = ref_lp.data<float>()[static_cast<int64_t>(i) * ref_lp.dim(1) + want[i]];
      EXPECT_NEAR(r.logprobs[i].logprob, ref_chosen, kTol) << "step " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, Conformance, ::testing::ValuesIn(reference_models()),
                         [](const auto& info) { return info.param; });

TEST(ConformanceData, ReferenceModelsPresent) {
  // The conformance suite must not pass vacuously.
  auto models = reference_models();
  EXPECT_GE(models.size(), 5u) << "expected reference checkpoints under tests/data/models";
}

}  // namespace

// Batched forward (continuous batching) gives each sequence exactly what it gets alone.
TEST(BatchedForward, MatchesSeparateSequences) {
  for (const std::string name : {"qwen3_5_dense", "qwen3_5_moe", "qwen3_next"}) {
    auto lm = load_model((fs::path(HYPIC_TEST_DATA) / "models" / name).string(), "cpu", 2);
    auto& m = *lm.model;
    std::vector<std::vector<int32_t>> prompts = {
        {1, 2, 3, 4, 5, 6, 7}, {9, 8}, {100, 200, 300, 400, 17, 23, 5, 77, 3, 1, 2}};
    std::vector<SequenceState> alone, batched;
    std::vector<Tensor> ref;
    for (auto& p : prompts) {
      alone.push_back(m.new_state());
      batched.push_back(m.new_state());
    }
    // Prefill: separately for `alone`; one mixed batch for `batched`.
    std::vector<BatchItem> items;
    for (size_t i = 0; i < prompts.size(); ++i) {
      ref.push_back(lm.backend->to_host(m.forward(prompts[i], alone[i])));
      items.push_back({&batched[i], prompts[i]});
    }
    Tensor got = lm.backend->to_host(m.forward_batch(items));
    const int64_t V = m.config().vocab_size;
    for (size_t i = 0; i < prompts.size(); ++i)
      for (int64_t j = 0; j < V; ++j) ASSERT_NEAR(got.data<float>()[i * V + j], ref[i].data<float>()[j], 5e-4) << name;
    // Three decode steps, all sequences at once.
    for (int step = 0; step < 3; ++step) {
      std::vector<int32_t> next = {int32_t(10 + step), int32_t(20 + step), int32_t(30 + step)};
      items.clear();
      for (size_t i = 0; i < prompts.size(); ++i) {
        ref[i] = lm.backend->to_host(m.forward(std::span<const int32_t>(&next[i], 1), alone[i]));
        items.push_back({&batched[i], std::span<const int32_t>(&next[i], 1)});
      }
      got = lm.backend->to_host(m.forward_batch(items));
      for (size_t i = 0; i < prompts.size(); ++i)
        for (int64_t j = 0; j < V; ++j)
          ASSERT_NEAR(got.data<float>()[i * V + j], ref[i].data<float>()[j], 5e-4) << name << " step " << step;
      for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(batched[i].n_past, alone[i].n_past);
    }
  }
}
