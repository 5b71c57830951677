// The transformers-conformance suite, shared by the CPU run (tests/models/conformance_test.cpp)
// and the GPU run (tests/backend/cuda_model_test.cpp): every position's log-probs and the greedy
// continuation of small random-weight checkpoints (made by tools/reference/make_reference.py on the
// device machine; references are transformers' own outputs, computed in float32).
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <tuple>

#include "engine/generate.h"
#include "engine/loader.h"
#include "engine/sampler.h"
#include "io/safetensors.h"

namespace fs = std::filesystem;
using namespace hypic;

namespace conformance {

// Buffers the model leaves unset (Backend::alloc_uninit) are NaN-poisoned in these runs, so an op
// that reads an element nobody wrote fails the comparison instead of reading stale values.
inline const bool kPoisonUninit = (::setenv("HYPIC_POISON_UNINIT", "1", 0), true);

// Log-prob tolerance: max abs over the vocabulary, every position. Every backend runs the suite with
// f32-exact products (Backend::set_precise), so a bf16 checkpoint is held to the same
// bound as an f32 one; the GPU's default bf16-activation products are measured separately.
constexpr double kTol = 1e-3;

inline std::vector<std::string> reference_models() {
  std::vector<std::string> out;
  fs::path root = fs::path(HYPIC_TEST_DATA) / "models";
  if (!fs::exists(root)) return out;
  for (auto& e : fs::directory_iterator(root))
    if (fs::exists(e.path() / "reference.safetensors")) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

inline std::vector<int32_t> ids_of(const Tensor& t) {
  std::vector<int32_t> v;
  for (int64_t i = 0; i < t.numel(); ++i) v.push_back(static_cast<int32_t>(t.data<int64_t>()[i]));
  return v;
}

// Max abs difference between log_softmax(logits row r) and ref row r.
inline double row_err(const Tensor& logits, int64_t r, const Tensor& ref, int64_t rr) {
  const int64_t V = logits.dim(1);
  std::span<const float> row(logits.data<float>() + r * V, static_cast<size_t>(V));
  auto lp = log_softmax(row);
  double e = 0;
  for (int64_t j = 0; j < V; ++j) e = std::max(e, std::abs(double(lp[j]) - ref.data<float>()[rr * V + j]));
  return e;
}

inline double top2_margin(const Tensor& ref, int64_t r) {
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

using Param = std::tuple<std::string, std::string>;  // (model folder, backend)

class Conformance : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    model_ = std::get<0>(GetParam());
    backend_ = std::get<1>(GetParam());
    if (const std::string why = backend_unavailable(backend_); !why.empty())
      GTEST_SKIP() << backend_ << " backend unavailable: " << why;
    dir_ = (fs::path(HYPIC_TEST_DATA) / "models" / model_).string();
    ref_ = std::make_unique<SafetensorsFile>(dir_ + "/reference.safetensors");
    lm_ = std::make_unique<LoadedModel>(load_model(dir_, backend_, 2));
    lm_->backend->set_precise(true);
  }
  std::string model_, backend_;
  double tol_ = kTol;
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
    EXPECT_LE(worst, tol_) << model_ << " prompt " << s << " (" << ids.size() << " tokens)";
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
  EXPECT_LE(worst, tol_);
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
        EXPECT_LT(top2_margin(ref_lp, static_cast<int64_t>(i)), tol_)
            << model_ << " prompt " << s << ": step " << i << " got " << r.ids[i] << " want " << want[i];
        break;
      }
      const float ref_chosen = ref_lp.data<float>()[static_cast<int64_t>(i) * ref_lp.dim(1) + want[i]];
      EXPECT_NEAR(r.logprobs[i].logprob, ref_chosen, tol_) << "step " << i;
    }
  }
}

inline std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return std::get<0>(info.param);
}

}  // namespace conformance
