#include "pic/requests.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "tokenizer/tokenizer.h"

namespace hypic {

std::vector<SegmentSpec> split_prompt(const std::string& prompt) {
  std::vector<SegmentSpec> out;
  const std::string sep = kPicSeparator;
  size_t pos = 0;
  while (true) {
    size_t at = prompt.find(sep, pos);
    SegmentSpec s;
    s.text = prompt.substr(pos, at == std::string::npos ? std::string::npos : at - pos);
    out.push_back(std::move(s));
    if (at == std::string::npos) break;
    pos = at + sep.size();
  }
  return out;
}

std::vector<SegmentSpec> parse_segments_json(const std::string& text, const std::string& path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    throw std::invalid_argument(path + ": malformed JSON: " + e.what());
  }
  if (!j.is_object() || !j.contains("segments") || !j["segments"].is_array())
    throw std::invalid_argument(path + ": expected an object with a \"segments\" array");
  std::vector<SegmentSpec> out;
  size_t i = 0;
  for (const auto& s : j["segments"]) {
    const std::string where = path + ": segments[" + std::to_string(i++) + "]";
    if (!s.is_object()) throw std::invalid_argument(where + " must be an object with \"text\" or \"ids\"");
    SegmentSpec spec;
    if (s.contains("ids")) {
      if (s.contains("text")) throw std::invalid_argument(where + " has both \"text\" and \"ids\"");
      if (!s["ids"].is_array()) throw std::invalid_argument(where + ".ids must be an array of token ids");
      for (const auto& v : s["ids"]) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX)
          throw std::invalid_argument(where + ".ids: " + v.dump() + " is not a valid token id");
        spec.ids.push_back(static_cast<int32_t>(v.get<int64_t>()));
      }
      spec.has_ids = true;
    } else if (s.contains("text")) {
      if (!s["text"].is_string()) throw std::invalid_argument(where + ".text must be a string");
      spec.text = s["text"].get<std::string>();
    } else {
      throw std::invalid_argument(where + " needs \"text\" or \"ids\"");
    }
    out.push_back(std::move(spec));
  }
  return out;
}

std::vector<SegmentSpec> load_segments_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::invalid_argument("cannot open segments file " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_segments_json(ss.str(), path);
}

std::vector<std::vector<int32_t>> tokenize_segments(const std::vector<SegmentSpec>& specs, const Tokenizer* tok) {
  if (specs.empty()) throw std::invalid_argument("the request has no segments");
  std::vector<std::vector<int32_t>> out;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].has_ids) {
      out.push_back(specs[i].ids);
    } else {
      if (!tok) throw std::invalid_argument("segment " + std::to_string(i) + " is text but the model has no tokenizer");
      out.push_back(tok->encode(specs[i].text));
    }
    if (out.back().empty()) throw std::invalid_argument("segment " + std::to_string(i) + " is empty");
  }
  return out;
}

}  // namespace hypic
