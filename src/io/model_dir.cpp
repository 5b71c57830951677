#include "io/model_dir.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

namespace hypic {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

namespace {

[[noreturn]] void bad_field(const std::string& path, const std::string& field, const std::string& what, const json& v) {
  throw std::runtime_error(path + ": field '" + field + "' must be " + what + ", found " + v.dump());
}

const json* field(const json& obj, const char* name) {
  auto it = obj.find(name);
  return it != obj.end() && !it->is_null() ? &*it : nullptr;
}

}  // namespace

GenerationDefaults parse_generation_config(const std::string& json_text, const std::string& path) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    throw std::runtime_error(path + ": malformed JSON: " + e.what());
  }
  if (!j.is_object()) throw std::runtime_error(path + ": top level is not a JSON object");
  GenerationDefaults g;
  if (const json* v = field(j, "eos_token_id")) {
    if (v->is_number_integer()) {
      g.eos_token_ids.push_back(v->get<int64_t>());
    } else if (v->is_array()) {
      for (const json& x : *v) {
        if (!x.is_number_integer()) bad_field(path, "eos_token_id", "an integer or a list of integers", *v);
        g.eos_token_ids.push_back(x.get<int64_t>());
      }
    } else {
      bad_field(path, "eos_token_id", "an integer or a list of integers", *v);
    }
  }
  if (const json* v = field(j, "temperature")) {
    if (!v->is_number() || v->get<double>() < 0) bad_field(path, "temperature", "a non-negative number", *v);
    g.temperature = v->get<float>();
  }
  if (const json* v = field(j, "top_p")) {
    if (!v->is_number() || !(v->get<double>() > 0 && v->get<double>() <= 1))
      bad_field(path, "top_p", "a number in (0, 1]", *v);
    g.top_p = v->get<float>();
  }
  if (const json* v = field(j, "top_k")) {
    if (!v->is_number_integer() || v->get<int64_t>() < 0 || v->get<int64_t>() > INT32_MAX)
      bad_field(path, "top_k", "a non-negative integer", *v);
    g.top_k = static_cast<int>(v->get<int64_t>());
  }
  return g;
}

ModelDir open_model_dir(const std::string& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) throw std::runtime_error("model folder " + dir + " does not exist");
  if (!fs::is_directory(dir, ec)) throw std::runtime_error("model folder " + dir + " is not a directory");
  const std::string config_path = (fs::path(dir) / "config.json").string();
  if (!fs::is_regular_file(config_path, ec))
    throw std::runtime_error("model folder " + dir + " has no config.json (expected " + config_path + ")");

  ModelDir m;
  m.dir = dir;
  m.config = load_model_config(config_path);

  const std::string gen_path = (fs::path(dir) / "generation_config.json").string();
  if (fs::is_regular_file(gen_path, ec)) {
    m.generation = parse_generation_config(read_text_file(gen_path), gen_path);
    for (int64_t id : m.generation.eos_token_ids) {
      auto& ids = m.config.eos_token_ids;
      if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
    }
  }
  for (auto [name, out] :
       {std::pair{"tokenizer.json", &m.tokenizer_json}, std::pair{"tokenizer_config.json", &m.tokenizer_config_json}}) {
    const std::string p = (fs::path(dir) / name).string();
    if (fs::is_regular_file(p, ec)) *out = p;
  }
  m.weights = std::make_unique<WeightStore>(dir);
  return m;
}

}  // namespace hypic
