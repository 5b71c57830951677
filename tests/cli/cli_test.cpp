// End-to-end checks of the hypic binary: JSON shapes and clear errors for bad input.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "padded_vocab.h"

namespace {

struct Run {
  int rc;
  std::string out;
};

// A shell command line, stdout and stderr together.
Run run_cmd(const std::string& line) {
  std::string cmd = "timeout -k 5 300 " + line + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  int st = pclose(p);
  return {WEXITSTATUS(st), out};
}

Run run(const std::string& args) {
  return run_cmd(std::string(HYPIC_BIN) + " " + args);
}

std::string model() {
  return std::string(HYPIC_TEST_DATA) + "/models/qwen3_5_dense";
}

TEST(Cli, GenerateJsonWithLogprobs) {
  auto r =
      run("generate --model " + model() + " --prompt 'Hello world' --max-tokens 6 --logprobs 3 --json --ignore-eos");
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["ids"].size(), 6u);
  ASSERT_TRUE(j["text"].is_string());
  ASSERT_EQ(j["logprobs"].size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    auto& e = j["logprobs"][i];
    EXPECT_EQ(e["id"], j["ids"][i]);
    ASSERT_EQ(e["top"].size(), 3u);
    EXPECT_LE(e["logprob"].get<double>(), 0.0);
    EXPECT_EQ(e["top"][0][0], e["id"]);  // greedy picks the most likely token
  }
}

TEST(Cli, SegmentedPromptReportsCacheUse) {
  auto r = run(
      "generate --model " + model() +
      " --prompt 'System.<<PIC_SEP>>Doc one text here.<<PIC_SEP>>Doc two text.<<PIC_SEP>>Q?' --max-tokens 2 --json");
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["segments"], 4);
  EXPECT_EQ(j["mode"], "pic");
  EXPECT_EQ(j["cache"]["miss_segments"], 3);
  // A cold request reuses nothing: every segment was computed (in isolation) for it.
  EXPECT_EQ(j["cache"]["reused_tokens"].get<int>(), 0);
  EXPECT_GE(j["cache"]["computed_tokens"].get<int>(), j["prompt_tokens"].get<int>());
}

TEST(Cli, ModesAgreeOnOneSegment) {
  auto a = run("generate --model " + model() + " --prompt-ids 5,6,7,8,9 --max-tokens 8 --json --mode full");
  auto b = run("generate --model " + model() + " --prompt-ids 5,6,7,8,9 --max-tokens 8 --json --mode pic");
  ASSERT_EQ(a.rc, 0);
  ASSERT_EQ(b.rc, 0);
  EXPECT_EQ(nlohmann::json::parse(a.out)["ids"], nlohmann::json::parse(b.out)["ids"]);
}

TEST(Cli, SeededSamplingRepeats) {
  const std::string args =
      "generate --model " + model() +
      " --prompt-ids 1,2,3 --max-tokens 12 --temperature 1 --top-p 0.9 --top-k 50 --seed 7 --json --ignore-eos";
  auto a = run(args), b = run(args);
  ASSERT_EQ(a.rc, 0) << a.out;
  EXPECT_EQ(nlohmann::json::parse(a.out)["ids"], nlohmann::json::parse(b.out)["ids"]);
}

TEST(Cli, BadInputGivesClearErrors) {
  struct Case {
    std::string args, needle;
  };
  const std::string m = " --model " + model();
  auto tmp = std::filesystem::temp_directory_path() / ("hypic_cli_test_segments_" + std::to_string(getpid()) + ".json");
  std::ofstream(tmp) << "{\"segments\": [{\"text\": 3}]}";
  const Case cases[] = {
      {"generate --model /nonexistent/dir --prompt x", "/nonexistent/dir"},
      {"generate" + m + " --prompt x --top-p 2", "top_p"},
      {"generate" + m + " --prompt x --temperature -1", "temperature"},
      {"generate" + m + " --prompt-ids 1,abc", "abc"},
      {"generate" + m + " --prompt-ids 99999", "99999"},
      {"generate" + m + " --prompt x --mode fast", "unknown mode"},
      {"generate" + m + " --segments-file " + tmp.string(), "segments[0].text"},
      {"generate" + m + " --segments-file /nonexistent.json", "/nonexistent.json"},
      {"generate" + m + " --prompt 'a<<PIC_SEP>><<PIC_SEP>>b'", "segment 1 is empty"},
      {"tokenize" + m + " --ids 1,2,-5", "-5"},
      {"bench prefill --config /nonexistent.json --random-weights --tokens 8", "/nonexistent.json"},
  };
  for (const auto& c : cases) {
    auto r = run(c.args);
    EXPECT_NE(r.rc, 0) << c.args;
    EXPECT_NE(r.out.find(c.needle), std::string::npos) << c.args << "\n" << r.out;
  }
  // An over-long prompt is refused before any work.
  std::string ids = "1";
  for (int i = 0; i < 4200; ++i) ids += ",1";
  auto r = run("generate" + m + " --prompt-ids " + ids);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("exceeds the model's context"), std::string::npos) << r.out;
}

// The drift report must show what the method guarantees: exact prefix caching has no drift, PIC
// is exact at layer 0 and naive addition is not.
TEST(Cli, FidelityReportShowsTheExactLayers) {
  auto r =
      run("bench fidelity --json --model " + model() + " --segments 4 --segment-tokens 40 --requests 2 --seams 0,8");
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  std::map<std::string, nlohmann::json> rows;
  for (auto& row : j["results"]) rows[row["config"].get<std::string>()] = row;
  ASSERT_TRUE(rows.count("prefix") && rows.count("pic/seam=8") && rows.count("naive")) << r.out;
  for (auto& d : rows["prefix"]["layer_rel_l2"]) EXPECT_LT(d.get<double>(), 1e-5);
  EXPECT_LT(rows["pic/seam=8"]["layer_rel_l2"][0].get<double>(), 1e-5);
  EXPECT_GT(rows["naive"]["layer_rel_l2"][0].get<double>(), 1e-3);
  EXPECT_GT(rows["naive"]["kl"].get<double>(), rows["pic/seam=8"]["kl"].get<double>());
  // The bf16-entry rows (issue 11's dtype choice) are measured alongside.
  for (const char* c : {"pic/T-bf16=8", "pic/entry-bf16=8"}) {
    ASSERT_TRUE(rows.count(c)) << c;
    EXPECT_TRUE(std::isfinite(rows[c]["kl"].get<double>())) << c;
    EXPECT_LT(rows[c]["layer_rel_l2"][0].get<double>(), 0.05) << c;
  }
}

TEST(Cli, TtftReportCountsComputedTokens) {
  auto r = run("bench ttft --json --model " + model() +
               " --segments 3 --segment-tokens 30 --query-tokens 5 --prefix-tokens 6 --requests 2");
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  std::map<std::string, double> computed;
  for (auto& m : j["modes"]) computed[m["mode"].get<std::string>()] = m["computed_tokens_median"].get<double>();
  EXPECT_EQ(computed["full"], 6 + 3 * 30 + 5);
  EXPECT_EQ(computed["pic"], 3 * 8 + 5);  // a seam per document (all follow the prefix) + question
  EXPECT_EQ(computed["naive"], 5);
}

// bench entry: the three levels' times, the entry's size, and a clear refusal where the linear
// layers are not Gated DeltaNet.
TEST(Cli, BenchEntryReportsTheCostOfAnEntry) {
  auto r = run("bench entry --json --model " + model() + " --tokens 40 --repeats 1");
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  for (const char* k :
       {"op_ms", "op_with_T_ms", "layer_ms", "layer_with_T_ms", "prefill_ms", "entry_build_ms", "entry_mib"})
    EXPECT_GT(j[k].get<double>(), 0) << k;
  EXPECT_EQ(j["tokens"], 40);
  EXPECT_EQ(j["linear_layers"], 6);  // qwen3_5_dense: 8 layers, every fourth full attention
  auto bad = run("bench entry --model " + std::string(HYPIC_TEST_DATA) + "/models/nemotron_h --tokens 8");
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.out.find("the linear layers of NemotronHForCausalLM are mamba2"), std::string::npos) << bad.out;
}

// `--activations bf16` on the CPU: oneDNN's bf16 products where the build and CPU have them (the
// benchmark says which activations ran), otherwise refused with the reason before any work.
TEST(Cli, CpuBf16ActivationsRunOrAreRefusedByName) {
  const std::string dflt = std::string(HYPIC_SOURCE_DIR) + "/models/default";
  auto r = run("bench prefill --json --model " + dflt + " --tokens 64 --repeats 1 --activations bf16");
  if (r.rc == 0) {
    auto j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
    EXPECT_EQ(j["activations"], "bf16");
    EXPECT_GT(j["tokens_per_s"].get<double>(), 0);
    auto g = run("generate --json --model " + dflt +
                 " --prompt 'The lighthouse keeper is' --max-tokens 4 --activations bf16");
    EXPECT_EQ(g.rc, 0) << g.out;
  } else {
    EXPECT_NE(r.out.find("--activations bf16: the cpu backend cannot run bf16 products: "), std::string::npos) << r.out;
  }
  auto f = run("bench prefill --json --model " + dflt + " --tokens 64 --repeats 1 --activations f32");
  ASSERT_EQ(f.rc, 0) << f.out;
  EXPECT_EQ(nlohmann::json::parse(f.out.substr(f.out.find('{')))["activations"], "f32");
}

// OpenBLAS picks its kernels from the CPU model when it loads; where a virtual machine hides the
// model it falls back to SSE3 kernels (4-5x slower sgemm). hypic runs itself again on the kernels
// its CPU's instruction sets allow, unless OPENBLAS_CORETYPE names a choice; bench reports it.
TEST(Cli, RunsOnTheOpenBlasKernelsOfItsCpu) {
  auto core_of = [](const std::string& env) {
    auto r = run_cmd(env + " " + HYPIC_BIN + " bench prefill --json --model " + model() + " --tokens 8 --repeats 1");
    EXPECT_EQ(r.rc, 0) << r.out;
    auto j = nlohmann::json::parse(r.out.substr(r.out.find('{')), nullptr, false);
    return j.is_discarded() ? std::string("?") : j.value("openblas_core", std::string("?"));
  };
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const std::string picked = core_of("env -u OPENBLAS_CORETYPE");
  if (avx512)
    EXPECT_TRUE(picked == "SkylakeX" || picked == "Cooperlake" || picked == "SapphireRapids") << picked;
  else
    EXPECT_NE(picked, "?");
  // The user's choice stands, and bench says what it costs.
  EXPECT_EQ(core_of("env OPENBLAS_CORETYPE=Prescott"), "Prescott");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  auto r = run_cmd("env OPENBLAS_CORETYPE=Prescott " + std::string(HYPIC_BIN) + " bench prefill --json --model " +
                   model() + " --tokens 8 --repeats 1");
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
  const std::string cpu = avx512 ? "SkylakeX" : avx2 ? "Haswell" : "";
  EXPECT_EQ(j.value("openblas_core_cpu", std::string("?")), cpu);
  if (!cpu.empty()) {  // braces: gtest's EXPECT_* ends in an else (-Wdangling-else)
    EXPECT_NE(r.out.find("OpenBLAS runs its Prescott kernels where this CPU runs " + cpu), std::string::npos) << r.out;
  }
  auto quiet = run_cmd("env -u OPENBLAS_CORETYPE " + std::string(HYPIC_BIN) + " bench prefill --json --model " +
                       model() + " --tokens 8 --repeats 1");
  EXPECT_EQ(quiet.out.find("OpenBLAS runs its"), std::string::npos) << quiet.out;
}

// Multi-turn: each turn repeats the previous prompt as its exact prefix and adds the previous
// turn (question + answer) and a new question. pic starts from the previous turn's composed
// context; prefix from its exact snapshot; both compute only the new turn.
TEST(Cli, TtftMultiTurnReusesThePreviousTurn) {
  auto r = run("bench ttft --json --workload multi-turn --model " + model() +
               " --segments 3 --segment-tokens 30 --query-tokens 5 --answer-tokens 7 --prefix-tokens 6 --requests 3");
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["workload"], "multi-turn");
  std::map<std::string, double> computed, cached;
  for (auto& m : j["modes"]) {
    computed[m["mode"].get<std::string>()] = m["computed_tokens_median"].get<double>();
    cached[m["mode"].get<std::string>()] = m["cached_tokens_median"].get<double>();
  }
  // Median turn (the second timed one): prefix, 3 documents, 2 earlier turns, the question.
  EXPECT_EQ(computed["full"], 6 + 3 * 30 + 2 * 12 + 5);
  EXPECT_EQ(computed["prefix"], 12 + 5);   // the previous turn and the question
  EXPECT_EQ(computed["pic"], 12 + 8 + 5);  // the previous turn built alone, its seam, the question
  EXPECT_EQ(cached["prefix"], 6 + 3 * 30 + 12);
  EXPECT_EQ(cached["pic"], 6 + 3 * 30 + 12);  // everything before the previous turn
  auto bad = run("bench ttft --workload chat --model " + model());
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.out.find("unknown --workload 'chat'"), std::string::npos) << bad.out;
}

TEST(Cli, InfoAndTokenize) {
  auto r = run("info --json --model " + model());
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["layer_map"], "LLLALLLA");
  EXPECT_GT(j["parameters"].get<int64_t>(), 0);
  ASSERT_EQ(j["layer_list"].size(), 8u);
  EXPECT_EQ(j["layer_list"][0]["family"], "gated_deltanet");
  // 4 value heads x 16 x 24 f32 state + 3 conv rows of 2*2*16 + 4*24 channels.
  EXPECT_EQ(j["layer_list"][0]["state_bytes"], 4 * (4 * 16 * 24 + 3 * (2 * 2 * 16 + 4 * 24)));
  EXPECT_EQ(j["layer_list"][3]["mixer"], "attention");
  EXPECT_EQ(j["layer_list"][3]["kv_bytes_per_token"], 4 * 2 * 2 * 32);
  // Other architectures name their own families; Nemotron-H's MLP/MoE blocks mix nothing.
  for (auto [dir, family] : {std::pair<const char*, const char*>{"nemotron_h", "mamba2"},
                             {"minimax", "lightning"},
                             {"kimi_linear", "kda"}}) {
    auto o = run(std::string("info --json --model ") + HYPIC_TEST_DATA + "/models/" + dir);
    ASSERT_EQ(o.rc, 0) << o.out;
    auto oj = nlohmann::json::parse(o.out);
    EXPECT_EQ(oj["layer_list"][0]["family"], family) << dir;
    if (std::string(dir) == "nemotron_h") {
      EXPECT_EQ(oj["layer_map"], "L-AL-LLA--");
      EXPECT_EQ(oj["layer_list"][1]["mixer"], "none");
      EXPECT_EQ(oj["layer_list"][1]["ffn"], "moe");
      EXPECT_EQ(oj["layer_list"][0]["ffn"], "none");
    }
    if (std::string(dir) == "kimi_linear") {
      EXPECT_EQ(oj["layer_list"][3]["mixer"], "mla");
    }
  }
  auto text = run("info --model " + model());
  EXPECT_NE(text.out.find("gated_deltanet"), std::string::npos) << text.out;
  auto t = run("tokenize --json --text 'hello there' --model " + model());
  ASSERT_EQ(t.rc, 0) << t.out;
  auto ids = nlohmann::json::parse(t.out)["ids"];
  std::string csv;
  for (auto& v : ids) csv += (csv.empty() ? "" : ",") + std::to_string(v.get<int>());
  auto d = run("tokenize --json --ids " + csv + " --model " + model());
  EXPECT_EQ(nlohmann::json::parse(d.out)["text"], "hello there");
  // --jsonl: one JSON string per stdin line, the same ids as --text gives, one object per line.
  auto b = run_cmd("printf '%s\\n' '\"hello there\"' '' '\"x\\ny\"' | " + std::string(HYPIC_BIN) +
                   " tokenize --jsonl --model " + model());
  ASSERT_EQ(b.rc, 0) << b.out;
  std::istringstream lines(b.out);
  std::string first, second, extra;
  ASSERT_TRUE(std::getline(lines, first) && std::getline(lines, second)) << b.out;
  EXPECT_FALSE(std::getline(lines, extra)) << "blank input lines are skipped: " << b.out;
  EXPECT_EQ(nlohmann::json::parse(first)["ids"], ids);
  auto xy = run("tokenize --json --text \"$(printf 'x\\ny')\" --model " + model());
  EXPECT_EQ(nlohmann::json::parse(second)["ids"], nlohmann::json::parse(xy.out)["ids"]) << b.out;
  auto bad = run_cmd("echo '[1]' | " + std::string(HYPIC_BIN) + " tokenize --jsonl --model " + model());
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.out.find("stdin line 1 is not a JSON string"), std::string::npos) << bad.out;
}

// A padded vocabulary (more embedding rows than tokenizer entries, as every released Qwen3.5 has):
// the reference model with a tokenizer that lacks ids 400..508. Greedy decoding of its reference
// prompt emits such ids; they must come out as no text, not as a failed request (issue 19).
TEST(Cli, PaddedVocabularyIdsDecodeToNothing) {
  namespace fs = std::filesystem;
  const fs::path src = model();
  const fs::path dir = fs::temp_directory_path() / ("hypic_padded_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(src / "config.json", dir / "config.json");
  fs::create_symlink(src / "model.safetensors", dir / "model.safetensors");
  nlohmann::json tok = nlohmann::json::parse(std::ifstream(src / "tokenizer.json"));
  auto& vocab = tok["model"]["vocab"];
  nlohmann::json kept = nlohmann::json::object();
  for (auto& [k, v] : vocab.items())
    if (v.get<int>() < 400) kept[k] = v;
  nlohmann::json merges = nlohmann::json::array();
  for (auto& m : tok["model"]["merges"]) {
    const std::string a = m[0], b = m[1];
    if (kept.contains(a) && kept.contains(b) && kept.contains(a + b)) merges.push_back(m);
  }
  vocab = kept;
  tok["model"]["merges"] = merges;
  std::ofstream(dir / "tokenizer.json") << tok.dump();

  hypic::SafetensorsFile ref((src / "reference.safetensors").string());
  hypic::Tensor prompt = ref.get("prompt_a");
  std::string csv;
  for (int64_t i = 0; i < prompt.numel(); ++i) csv += (i ? "," : "") + std::to_string(prompt.data<int64_t>()[i]);
  auto r = run("generate --model " + dir.string() + " --prompt-ids " + csv + " --max-tokens 24 --ignore-eos --json");
  fs::remove_all(dir);
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  int padded = 0;
  for (auto& id : j["ids"]) padded += id.get<int>() >= 400 && id.get<int>() < 509;
  EXPECT_GT(padded, 0) << "the continuation never reached an id without a tokenizer entry: " << r.out;
  EXPECT_TRUE(j["text"].is_string());
  EXPECT_EQ(j["ids"].size(), 24u);
}

// --mask-padded-ids on a checkpoint with more output rows than tokenizer entries: no id without an
// entry is generated, and generate / eval accept the flag; a model without a tokenizer is refused.
TEST(Cli, MaskPaddedIds) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("hypic_cli_padded_" + std::to_string(getpid()));
  hypic::testing::make_padded_vocab_model(dir);
  const std::string base = "generate --model " + dir.string() + " --prompt 'Once upon a time' --max-tokens 24 --json";
  auto plain = run(base);
  auto masked = run(base + " --mask-padded-ids");
  ASSERT_EQ(plain.rc, 0) << plain.out;
  ASSERT_EQ(masked.rc, 0) << masked.out;
  const auto pj = nlohmann::json::parse(plain.out), mj = nlohmann::json::parse(masked.out);
  int padded = 0;
  for (auto& id : pj["ids"]) padded += id.get<int>() >= 512;
  EXPECT_GT(padded, 0) << plain.out;
  for (auto& id : mj["ids"]) EXPECT_LT(id.get<int>(), 512);
  const fs::path data = dir / "examples.jsonl";
  std::ofstream(data)
      << R"({"task": "lookup", "metric": "em", "segments": ["Answer.", "Doc: the key is blue.", "Q: what is blue?"], "answer": "key"})"
      << "\n";
  for (const char* flag : {"", " --mask-padded-ids"}) {
    auto e = run("eval --model " + dir.string() + " --data " + data.string() +
                 " --modes full,pic --no-extra-rows --json" + flag);
    EXPECT_EQ(e.rc, 0) << e.out;
  }
  // No tokenizer: nothing says which ids have an entry.
  const fs::path bare = dir / "bare";
  fs::create_directories(bare);
  fs::copy_file(dir / "config.json", bare / "config.json");
  fs::create_symlink(dir / "model.safetensors", bare / "model.safetensors");
  auto r = run("generate --model " + bare.string() + " --prompt-ids 1,2,3 --max-tokens 2 --mask-padded-ids");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("needs a model with a tokenizer"), std::string::npos) << r.out;
  fs::remove_all(dir);
}

}  // namespace

// `hypic eval` over every task ends with the table docs/quality.md shows: each configuration's
// per-task scores as the task tables printed them, their mean, and the difference from full.
TEST(Cli, EvalSummarisesEveryTask) {
  const std::string dflt = std::string(HYPIC_SOURCE_DIR) + "/models/default";
  auto r = run("eval --model " + dflt + " --task all --set smoke --n 2 --modes full,naive --threads 1");
  ASSERT_EQ(r.rc, 0) << r.out;
  // Per-task rows: "  <config> <score> <vs full> <ttft>" after "task <name> (...)".
  std::map<std::string, std::map<std::string, double>> score;
  std::istringstream in(r.out);
  std::string line, task;
  std::vector<std::string> summary;
  while (std::getline(in, line)) {
    if (line.rfind("task ", 0) == 0) task = line.substr(5, line.find(' ', 5) - 5);
    std::istringstream ls(line);
    std::string config;
    double s = 0;
    if (line.rfind("  ", 0) == 0 && (ls >> config >> s) && config != "config") score[config][task] = s;
    if (line.rfind("| ", 0) == 0) summary.push_back(line);
  }
  ASSERT_EQ(summary.size(), 3u) << r.out;  // header, full, naive
  EXPECT_NE(summary[0].find("lookup"), std::string::npos);
  EXPECT_NE(summary[0].find("mean vs full"), std::string::npos);
  for (size_t i = 1; i < summary.size(); ++i) {
    std::vector<std::string> cells;
    std::istringstream cs(summary[i]);
    for (std::string c; std::getline(cs, c, '|');)
      if (c.find_first_not_of(' ') != std::string::npos) cells.push_back(c.substr(c.find_first_not_of(' ')));
    ASSERT_EQ(cells.size(), 10u) << summary[i];  // config, 3 x (score, vs full), mean, mean vs full, TTFT
    const std::string config = cells[0].substr(0, cells[0].find(' '));
    double mean = 0;
    int k = 1;
    for (const char* t : {"lookup", "twohop", "aggregate"}) {
      ASSERT_TRUE(score[config].count(t)) << config << " " << t << "\n" << r.out;
      EXPECT_NEAR(std::stod(cells[k]), score[config][t], 0.051) << config << " " << t;
      EXPECT_NEAR(std::stod(cells[k + 1]), score[config][t] - score["full"][t], 0.11) << config << " " << t;
      mean += score[config][t] / 3;
      k += 2;
    }
    EXPECT_NEAR(std::stod(cells[7]), mean, 0.051) << summary[i];
  }
  // A --data file scores each task on its own examples; a task without any is said and skipped.
  const std::string data = ::testing::TempDir() + "/hypic_eval_one_lookup.jsonl";
  ASSERT_EQ(run_cmd("python3 " + std::string(HYPIC_SOURCE_DIR) +
                    "/tools/tasks/rag_tasks.py --task lookup --n 1 --seed 7003 --min-docs 2 --max-docs 3 "
                    "--min-doc-tokens 50 --max-doc-tokens 80 > " +
                    data)
                .rc,
            0);
  auto one = run("eval --model " + dflt + " --data " + data + " --task all --modes full --threads 1");
  ASSERT_EQ(one.rc, 0) << one.out;
  EXPECT_NE(one.out.find("task lookup (1 prompts"), std::string::npos) << one.out;
  EXPECT_NE(one.out.find("task twohop: no examples"), std::string::npos) << one.out;
  EXPECT_EQ(one.out.find("| config |"), std::string::npos) << "one task: no summary\n" << one.out;
  auto none = run("eval --model " + dflt + " --data " + data + " --task twohop --modes full --threads 1");
  EXPECT_NE(none.rc, 0);
  EXPECT_NE(none.out.find("no examples of task 'twohop'"), std::string::npos) << none.out;
  auto bad = run("eval --model " + dflt + " --set huge");
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.out.find("longdocs"), std::string::npos) << bad.out;
}

// The configs take turns prompt by prompt: a config's answers are those of a run of its own, and a
// budget too small for a config's share says that the budget is shared.
TEST(Cli, EvalConfigsInTurnsAnswerAsAlone) {
  const std::string dflt = std::string(HYPIC_SOURCE_DIR) + "/models/default";
  const std::string dir = ::testing::TempDir();
  auto predictions = [](const std::string& path, const std::string& config) {
    std::ifstream in(path);
    std::string out;
    for (std::string line; std::getline(in, line);) {
      auto j = nlohmann::json::parse(line);
      if (j["config"] == config) out += j["id"].get<std::string>() + ": " + j["prediction"].get<std::string>() + "\n";
    }
    return out;
  };
  const std::string args = "eval --model " + dflt + " --task aggregate --set smoke --n 3 --seams 8 --threads 1";
  auto both = run(args + " --modes full,pic,naive --predictions " + dir + "/hypic_turns_both.jsonl");
  auto alone = run(args + " --modes naive --no-extra-rows --predictions " + dir + "/hypic_turns_alone.jsonl");
  ASSERT_EQ(both.rc, 0) << both.out;
  ASSERT_EQ(alone.rc, 0) << alone.out;
  const std::string p = predictions(dir + "/hypic_turns_both.jsonl", "naive");
  EXPECT_EQ(std::count(p.begin(), p.end(), '\n'), 3) << p;
  EXPECT_EQ(p, predictions(dir + "/hypic_turns_alone.jsonl", "naive"));
  auto small = run("eval --model " + dflt +
                   " --task lookup --set smoke --n 1 --modes full,pic --no-extra-rows "
                   "--threads 1 --cache-budget-mib 0.01");
  EXPECT_NE(small.rc, 0);
  EXPECT_NE(small.out.find("is shared by the 2 configs"), std::string::npos) << small.out;
}

// rag_tasks.py --first-hop / --second-hop ask a two-hop prompt's hops alone over the same documents:
// the first hop's answer is the bridge named in a link sentence about the first entity, the second
// hop's the two-hop answer (the drills first_hop and bridge_lookup of tools/train/train.py).
TEST(Cli, TwoHopPromptsAskedTheirHopsAlone) {
  const std::string tasks = std::string(HYPIC_SOURCE_DIR) + "/tools/tasks";
  const std::string check =
      "import sys; sys.path.insert(0, '" + tasks +
      "'); import rag_tasks as R\n"
      "for i in range(5):\n"
      "    ex = R.example('twohop', 7001, i, 4, 16, 100, 400); m = ex['meta']\n"
      "    h1, h2 = R.first_hop(ex), R.second_hop(ex)\n"
      "    assert h1['segments'][:-1] == ex['segments'][:-1] == h2['segments'][:-1]\n"
      "    assert h1['segments'][-1] == 'Question: Who is the %s of %s?\\nAnswer:' % (m['relation'], m['first'])\n"
      "    assert h1['answers'] == [m['bridge']] and ex['answers'][1].startswith(m['bridge'] + ': ')\n"
      "    assert h2['answers'] == [ex['answer']]\n"
      "    links = [t.format(rel=m['relation'], e1=m['first'], e2=m['bridge']) for t in R.LINK_TEMPLATES]\n"
      "    assert sum(l[:-1] in s for l in links for s in ex['segments'][1:-1]) == 1, ex['id']\n";
  const std::string py = ::testing::TempDir() + "/hypic_hops_check.py";
  std::ofstream(py) << check;
  auto r = run_cmd("python3 " + py);
  EXPECT_EQ(r.rc, 0) << r.out;
  auto both = run_cmd("python3 " + tasks + "/rag_tasks.py --task twohop --first-hop --second-hop --n 1");
  EXPECT_NE(both.rc, 0);
  EXPECT_NE(both.out.find("--first-hop"), std::string::npos) << both.out;
}
