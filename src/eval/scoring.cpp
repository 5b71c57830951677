#include "eval/scoring.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <stdexcept>

namespace hypic::eval {

std::vector<std::string> normalize(const std::string& s) {
  std::vector<std::string> words;
  std::string cur;
  auto flush = [&] {
    if (!cur.empty() && cur != "a" && cur != "an" && cur != "the") words.push_back(cur);
    cur.clear();
  };
  for (unsigned char c : s) {
    if (c < 128 && std::ispunct(c)) continue;  // Python's string.punctuation is ASCII punctuation
    if (c < 128 && std::isspace(c)) {
      flush();
      continue;
    }
    cur.push_back(static_cast<char>(c < 128 ? std::tolower(c) : c));
  }
  flush();
  return words;
}

namespace {
template <typename F>
double best_of(const std::string& pred, const std::vector<std::string>& answers, F&& f) {
  const auto p = normalize(pred);
  double best = 0;
  for (const auto& a : answers) {
    const auto g = normalize(a);
    if (p.empty() || g.empty()) {
      best = std::max(best, p == g ? 1.0 : 0.0);
      continue;
    }
    best = std::max(best, f(p, g));
  }
  return best;
}
double f_from(double overlap, size_t np, size_t ng) {
  if (overlap == 0) return 0;
  const double pr = overlap / np, rc = overlap / ng;
  return 2 * pr * rc / (pr + rc);
}
}  // namespace

double exact_match(const std::string& pred, const std::vector<std::string>& answers) {
  const auto p = normalize(pred);
  for (const auto& a : answers)
    if (normalize(a) == p) return 1.0;
  return 0.0;
}

double token_f1(const std::string& pred, const std::vector<std::string>& answers) {
  return best_of(pred, answers, [](const auto& p, const auto& g) {
    std::map<std::string, int> cg;
    for (const auto& w : g) ++cg[w];
    std::map<std::string, int> cp;
    for (const auto& w : p) ++cp[w];
    double same = 0;
    for (const auto& [w, c] : cp) {
      auto it = cg.find(w);
      if (it != cg.end()) same += std::min(c, it->second);
    }
    return f_from(same, p.size(), g.size());
  });
}

double rouge_l(const std::string& pred, const std::vector<std::string>& answers) {
  return best_of(pred, answers, [](const auto& p, const auto& g) {
    std::vector<size_t> prev(g.size() + 1, 0), cur(g.size() + 1, 0);
    for (const auto& x : p) {
      cur[0] = 0;
      for (size_t j = 0; j < g.size(); ++j) cur[j + 1] = x == g[j] ? prev[j] + 1 : std::max(prev[j + 1], cur[j]);
      std::swap(prev, cur);
    }
    return f_from(static_cast<double>(prev[g.size()]), p.size(), g.size());
  });
}

double score(const std::string& metric, const std::string& pred, const std::vector<std::string>& answers) {
  if (metric == "em") return exact_match(pred, answers);
  if (metric == "f1") return token_f1(pred, answers);
  if (metric == "rougeL") return rouge_l(pred, answers);
  throw std::invalid_argument("unknown metric '" + metric + "' (expected em, f1 or rougeL)");
}

}  // namespace hypic::eval
