// Answer scoring for the multi-document tasks (tools/tasks/rag_tasks.py): SQuAD-style
// normalisation (lower case, drop ASCII punctuation and the articles a/an/the, split on
// whitespace), then exact match, token F1 or ROUGE-L F1 against the best of the gold answers.
#pragma once
#include <string>
#include <vector>

namespace hypic::eval {

std::vector<std::string> normalize(const std::string& s);
double exact_match(const std::string& pred, const std::vector<std::string>& answers);
double token_f1(const std::string& pred, const std::vector<std::string>& answers);
double rouge_l(const std::string& pred, const std::vector<std::string>& answers);
// metric: "em", "f1" or "rougeL"; throws std::invalid_argument otherwise.
double score(const std::string& metric, const std::string& pred, const std::vector<std::string>& answers);

}  // namespace hypic::eval
