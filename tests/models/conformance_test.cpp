// Conformance with transformers 5.17 on the CPU backend (the suite: conformance_suite.h), and
// batched forwards against separate ones.
#include "models/conformance_suite.h"

namespace {
using namespace conformance;

INSTANTIATE_TEST_SUITE_P(Models, Conformance,
                         ::testing::Combine(::testing::ValuesIn(reference_models()), ::testing::Values("cpu")),
                         param_name);

TEST(ConformanceData, ReferenceModelsPresent) {
  // The conformance suite must not pass vacuously.
  auto models = reference_models();
  EXPECT_GE(models.size(), 5u) << "expected reference checkpoints under tests/data/models";
}

}  // namespace

// Batched forward (continuous batching) gives each sequence exactly what it gets alone.
TEST(BatchedForward, MatchesSeparateSequences) {
  for (const std::string name :
       {"qwen3_5_dense", "qwen3_5_moe", "qwen3_next", "nemotron_h", "minimax", "kimi_linear", "kimi_linear_rope"}) {
    auto lm = load_model((fs::path(HYPIC_TEST_DATA) / "models" / name).string(), "cpu", 2);
    auto& m = *lm.model;
    std::vector<std::vector<int32_t>> prompts = {
        {1, 2, 3, 4, 5, 6, 7}, {9, 8}, {100, 200, 300, 400, 17, 23, 5, 77, 3, 1, 2}};
    std::vector<SequenceState> alone, batched;
    std::vector<Tensor> ref;
    for (size_t i = 0; i < prompts.size(); ++i) {
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
