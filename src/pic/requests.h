// Turning user input into a segmented request: the separator `<<PIC_SEP>>` inside a prompt
// (compatible with the published HYPIC server) or a JSON segments file
// {"segments": [{"text": "..."} | {"ids": [1, 2, 3]}, ...]}. Each segment is tokenised on its own.
// Layout: first segment = exact prefix, middle segments = reusable anywhere, last = the question.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace hypic {

class Tokenizer;

inline constexpr const char* kPicSeparator = "<<PIC_SEP>>";

struct SegmentSpec {
  std::string text;
  std::vector<int32_t> ids;
  bool has_ids = false;
};

// Splits on kPicSeparator (a prompt without it is one segment).
std::vector<SegmentSpec> split_prompt(const std::string& prompt);
// Parses the JSON text of a segments file; `path` names it in errors.
std::vector<SegmentSpec> parse_segments_json(const std::string& json_text, const std::string& path);
std::vector<SegmentSpec> load_segments_file(const std::string& path);
// Tokenises text segments (tok may be null only if every segment has ids). Throws on empty
// segments, naming their index.
std::vector<std::vector<int32_t>> tokenize_segments(const std::vector<SegmentSpec>& specs, const Tokenizer* tok);

}  // namespace hypic
