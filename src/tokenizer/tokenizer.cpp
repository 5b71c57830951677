// Byte-level BPE tokenizer; see tokenizer.h for the pipeline and the reference behaviour it follows.
#include "tokenizer/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

namespace hypic {

namespace {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// UTF-8 helpers

// Classifies the sequence starting at p[0] (n > 0 bytes available), per Unicode Table 3-7.
//   len > 0, ok:             a well-formed sequence of len bytes, code point in *cp.
//   len > 0, !ok:            an ill-formed maximal subpart of len bytes (replace by one U+FFFD).
//   truncated:               a well-formed prefix that runs into the end of the input (len bytes).
struct Utf8Seq {
  int len;
  bool ok;
  bool truncated;
};

Utf8Seq utf8_seq(const unsigned char* p, size_t n, uint32_t* cp) {
  unsigned char b = p[0];
  if (b < 0x80) {
    *cp = b;
    return {1, true, false};
  }
  int need;
  unsigned char lo = 0x80, hi = 0xBF;
  uint32_t c;
  if (b >= 0xC2 && b <= 0xDF) {
    need = 1;
    c = b & 0x1F;
  } else if (b >= 0xE0 && b <= 0xEF) {
    need = 2;
    c = b & 0x0F;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    need = 3;
    c = b & 0x07;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
  } else {
    return {1, false, false};
  }
  for (int k = 1; k <= need; ++k) {
    if (static_cast<size_t>(k) >= n) return {k, false, true};
    unsigned char x = p[k];
    if (x < lo || x > hi) return {k, false, false};
    lo = 0x80;
    hi = 0xBF;
    c = (c << 6) | (x & 0x3F);
  }
  *cp = c;
  return {need + 1, true, false};
}

bool is_valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0, n = s.size();
  while (i < n) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    uint32_t cp;
    Utf8Seq q = utf8_seq(p + i, n - i, &cp);
    if (!q.ok) return false;
    i += q.len;
  }
  return true;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::string sanitize(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 8);
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0, n = s.size();
  while (i < n) {
    uint32_t cp;
    Utf8Seq q = utf8_seq(p + i, n - i, &cp);
    if (q.ok)
      out.append(s.data() + i, q.len);
    else
      out += "\xEF\xBF\xBD";
    i += q.len;
  }
  return out;
}

// Decodes the code point at s[i] (s is valid UTF-8); advances i.
uint32_t next_cp(std::string_view s, size_t& i) {
  uint32_t cp;
  Utf8Seq q = utf8_seq(reinterpret_cast<const unsigned char*>(s.data()) + i, s.size() - i, &cp);
  i += q.len;
  return q.ok ? cp : 0xFFFD;
}

// Rust's char::is_whitespace (Unicode White_Space).
bool is_white_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// Approximation of Rust's char::is_alphanumeric (letters and numbers).
bool is_alnum(uint32_t c) {
  if (c < 0x80) return std::isalnum(static_cast<int>(c)) != 0;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

uint32_t last_cp(std::string_view s) {
  size_t i = s.size();
  while (i > 0 && (static_cast<unsigned char>(s[i - 1]) & 0xC0) == 0x80) --i;
  if (i > 0) --i;
  size_t j = i;
  return next_cp(s, j);
}

std::string nfc(std::string_view s) {
  bool ascii = true;
  for (char ch : s)
    if (static_cast<unsigned char>(ch) >= 0x80) {
      ascii = false;
      break;
    }
  if (ascii) return std::string(s);
  utf8proc_uint8_t* dst = nullptr;
  utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()), &dst,
                   static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) return std::string(s);  // only on invalid input, which was repaired before
  std::string out(reinterpret_cast<char*>(dst), static_cast<size_t>(n));
  std::free(dst);
  return out;
}

// ---------------------------------------------------------------------------------------------
// GPT-2 byte <-> unicode table.

struct ByteLevelTable {
  std::array<uint32_t, 256> byte_to_cp{};
  std::array<std::string, 256> byte_to_str{};
  std::array<int16_t, 324> cp_to_byte{};
  ByteLevelTable() {
    cp_to_byte.fill(-1);
    std::array<bool, 256> direct{};
    for (int b = '!'; b <= '~'; ++b) direct[b] = true;
    for (int b = 0xA1; b <= 0xAC; ++b) direct[b] = true;
    for (int b = 0xAE; b <= 0xFF; ++b) direct[b] = true;
    uint32_t n = 0;
    for (int b = 0; b < 256; ++b) byte_to_cp[b] = direct[b] ? static_cast<uint32_t>(b) : 256 + n++;
    for (int b = 0; b < 256; ++b) {
      append_utf8(byte_to_str[b], byte_to_cp[b]);
      cp_to_byte[byte_to_cp[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteLevelTable& byte_table() {
  static const ByteLevelTable t;
  return t;
}

const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ---------------------------------------------------------------------------------------------
// PCRE2 regex (UTF + UCP, JIT when available). HF compiles patterns with Oniguruma; in UCP mode PCRE2's
// \s, \p{L}, \p{N} agree with it on the corpus (including U+0085, which both count as \s).

struct MatchScratch {
  pcre2_match_data* md = nullptr;
  pcre2_match_context* mctx = nullptr;
  pcre2_jit_stack* stack = nullptr;
  MatchScratch() {
    md = pcre2_match_data_create(32, nullptr);
    mctx = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
    if (mctx && stack) pcre2_jit_stack_assign(mctx, nullptr, stack);
  }
  ~MatchScratch() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(mctx);
    pcre2_match_data_free(md);
  }
};

MatchScratch& scratch() {
  thread_local MatchScratch s;
  return s;
}

class Regex {
 public:
  Regex(const std::string& pattern, bool literal) {
    int err = 0;
    PCRE2_SIZE off = 0;
    uint32_t opts = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), opts, &err, &off, nullptr);
    if (!code_) {
      PCRE2_UCHAR buf[256];
      pcre2_get_error_message(err, buf, sizeof buf);
      throw std::runtime_error("regex /" + pattern + "/ does not compile at offset " + std::to_string(off) + ": " +
                               reinterpret_cast<char*>(buf));
    }
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Appends (begin, end, is_match) ranges covering s (HF's Pattern::find_matches; empty pieces dropped).
  void split(std::string_view s, std::vector<std::pair<size_t, size_t>>& ranges, std::vector<bool>& is_match) const {
    MatchScratch& ms = scratch();
    auto subj = reinterpret_cast<PCRE2_SPTR>(s.data());
    size_t n = s.size(), off = 0, prev = 0;
    while (off <= n) {
      int rc = jit_ ? pcre2_jit_match(code_, subj, n, off, 0, ms.md, ms.mctx)
                    : pcre2_match(code_, subj, n, off, PCRE2_NO_UTF_CHECK, ms.md, ms.mctx);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        PCRE2_UCHAR buf[256];
        pcre2_get_error_message(rc, buf, sizeof buf);
        throw std::runtime_error(std::string("tokenizer: regex match failed: ") + reinterpret_cast<char*>(buf));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(ms.md);
      size_t b = ov[0], e = ov[1];
      if (e == b) {  // empty match: step one character forward
        if (b >= n) break;
        size_t j = b;
        next_cp(s, j);
        off = j;
        continue;
      }
      if (b > prev) {
        ranges.emplace_back(prev, b);
        is_match.push_back(false);
      }
      ranges.emplace_back(b, e);
      is_match.push_back(true);
      prev = off = e;
    }
    if (prev < n) {
      ranges.emplace_back(prev, n);
      is_match.push_back(false);
    }
  }

 private:
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

// ---------------------------------------------------------------------------------------------

struct SvHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using StrMap = std::unordered_map<std::string, int32_t, SvHash, std::equal_to<>>;

struct AddedToken {
  int32_t id;
  std::string content;  // normalized content for tokens with normalized == true
  bool special, single_word, lstrip, rstrip, normalized;
};

// Byte trie for leftmost-longest matching of added tokens.
class TokenTrie {
 public:
  bool empty() const { return nodes_.size() <= 1; }
  void add(std::string_view s, int32_t tok_index) {
    if (s.empty()) return;
    int cur = 0;
    for (unsigned char c : s) {
      int nx = child(cur, c);
      if (nx < 0) {
        nx = static_cast<int>(nodes_.size());
        nodes_.emplace_back();
        nodes_[cur].kids.emplace_back(c, nx);
      }
      cur = nx;
    }
    nodes_[cur].tok = tok_index;
    first_[static_cast<unsigned char>(s[0])] = true;
  }
  // Longest token starting at s[i]: returns its end and sets *tok; returns 0 if none.
  size_t longest_at(std::string_view s, size_t i, int32_t* tok) const {
    if (!first_[static_cast<unsigned char>(s[i])]) return 0;
    int cur = 0;
    size_t best = 0;
    for (size_t j = i; j < s.size(); ++j) {
      cur = child(cur, static_cast<unsigned char>(s[j]));
      if (cur < 0) break;
      if (nodes_[cur].tok >= 0) {
        best = j + 1;
        *tok = nodes_[cur].tok;
      }
    }
    return best;
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int>> kids;
    int32_t tok = -1;
  };
  int child(int node, unsigned char c) const {
    for (auto& [k, v] : nodes_[node].kids)
      if (k == c) return v;
    return -1;
  }
  std::vector<Node> nodes_ = std::vector<Node>(1);
  std::array<bool, 256> first_{};
};

enum class DecodeStep { ByteLevel, ByteFallback, Fuse };

struct PreTok {
  enum Kind { Split, ByteLevel } kind;
  std::unique_ptr<Regex> re;  // Split pattern, or the GPT-2 pattern for ByteLevel with use_regex
  bool removed = false;       // Split behavior Removed (else Isolated)
  bool add_prefix_space = false;
};

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

}  // namespace

// ---------------------------------------------------------------------------------------------

struct TokenizerImpl {
  // model
  StrMap vocab;
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (a, b) -> (rank, merged id)
  bool ignore_merges = false, byte_fallback = false, fuse_unk = false;
  int32_t unk_id = -1;
  std::string prefix, suffix;           // continuing_subword_prefix, end_of_word_suffix
  std::array<int32_t, 256> byte_ids{};  // <0xXX> tokens (byte_fallback), -1 when absent
  std::vector<int32_t> small_cp_id;     // vocab id of single code points < 512 (-1 absent)

  // pipeline
  bool nfc = false;
  std::vector<PreTok> pretoks;
  std::vector<AddedToken> added;
  TokenTrie raw_trie, norm_trie;
  StrMap added_by_content;

  // ids
  std::vector<std::string> id_tok;    // token string per id
  std::vector<std::string> id_bytes;  // decoded bytes per id
  std::vector<uint8_t> id_kind;       // 0 absent, 1 model, 2 added, 3 added special

  std::string chat_template, eos, bos, pad;

  // word cache
  mutable std::mutex cache_mu;
  mutable std::unordered_map<std::string, std::vector<int32_t>, SvHash, std::equal_to<>> cache;

  void check_id(int32_t id) const {
    if (id < 0 || static_cast<size_t>(id) >= id_kind.size() || id_kind[id] == 0)
      throw std::out_of_range("tokenizer: invalid token id " + std::to_string(id));
  }

  int32_t lookup(std::string_view s) const {
    auto it = vocab.find(s);
    return it == vocab.end() ? -1 : it->second;
  }

  void bpe(std::string_view word, std::vector<int32_t>& out) const;
  void bpe_cached(std::string_view word, std::vector<int32_t>& out) const;
  void pretokenize(size_t level, std::string_view piece, std::vector<int32_t>& out) const;
  void split_added(std::string_view text, const TokenTrie& trie, bool parse_special,
                   const std::function<void(std::string_view)>& on_text, std::vector<int32_t>& out) const;
  std::string decode_bytes(std::span<const int32_t> ids, bool skip_special) const;
};

void TokenizerImpl::bpe(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges) {
    int32_t id = lookup(word);
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }
  struct Sym {
    int32_t id, prev, next, len;
  };
  std::vector<Sym> syms;
  syms.reserve(word.size());
  auto push = [&](int32_t id) {
    int32_t idx = static_cast<int32_t>(syms.size());
    syms.push_back({id, idx - 1, -1, 1});
    if (idx > 0) syms[idx - 1].next = idx;
  };
  bool last_unk = false;
  std::string tmp;
  size_t i = 0;
  while (i < word.size()) {
    size_t start = i;
    uint32_t cp = next_cp(word, i);
    std::string_view ch = word.substr(start, i - start);
    bool first = start == 0, last = i == word.size();
    int32_t id;
    if (cp < small_cp_id.size() && (first || prefix.empty()) && (!last || suffix.empty())) {
      id = small_cp_id[cp];
    } else {
      tmp.clear();
      if (!first) tmp += prefix;
      tmp += ch;
      if (last) tmp += suffix;
      id = lookup(tmp);
    }
    if (id >= 0) {
      push(id);
      last_unk = false;
      continue;
    }
    if (byte_fallback) {
      bool all = true;
      for (unsigned char b : ch) all = all && byte_ids[b] >= 0;
      if (all) {
        for (unsigned char b : ch) push(byte_ids[b]);
        last_unk = false;
        continue;
      }
    }
    if (unk_id >= 0) {
      if (!(fuse_unk && last_unk)) push(unk_id);
      last_unk = true;
    }
  }

  struct Cand {
    int32_t rank, pos, new_id;
  };
  auto worse = [](const Cand& a, const Cand& b) { return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos; };
  std::vector<Cand> heap;
  auto consider = [&](int32_t pos) {
    int32_t nx = syms[pos].next;
    if (nx < 0) return;
    auto it = merges.find(pair_key(syms[pos].id, syms[nx].id));
    if (it == merges.end()) return;
    heap.push_back({it->second.first, pos, it->second.second});
    std::push_heap(heap.begin(), heap.end(), worse);
  };
  for (int32_t p = 0; p + 1 < static_cast<int32_t>(syms.size()); ++p) consider(p);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), worse);
    Cand top = heap.back();
    heap.pop_back();
    Sym& s = syms[top.pos];
    if (s.len == 0 || s.next < 0) continue;
    int32_t nx = s.next;
    auto it = merges.find(pair_key(s.id, syms[nx].id));
    if (it == merges.end() || it->second.second != top.new_id) continue;
    s.id = top.new_id;
    s.len += syms[nx].len;
    syms[nx].len = 0;
    s.next = syms[nx].next;
    if (s.next >= 0) syms[s.next].prev = top.pos;
    if (s.prev >= 0) consider(s.prev);
    consider(top.pos);
  }
  for (const Sym& s : syms)
    if (s.len > 0) out.push_back(s.id);
}

void TokenizerImpl::bpe_cached(std::string_view word, std::vector<int32_t>& out) const {
  constexpr size_t kMaxCachedWord = 256, kMaxEntries = 200000;
  if (word.size() > kMaxCachedWord) return bpe(word, out);
  {
    std::lock_guard<std::mutex> lk(cache_mu);
    auto it = cache.find(word);
    if (it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  size_t before = out.size();
  bpe(word, out);
  std::vector<int32_t> ids(out.begin() + static_cast<std::ptrdiff_t>(before), out.end());
  std::lock_guard<std::mutex> lk(cache_mu);
  if (cache.size() >= kMaxEntries) cache.clear();
  cache.emplace(std::string(word), std::move(ids));
}

void TokenizerImpl::pretokenize(size_t level, std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.empty()) return;
  if (level == pretoks.size()) return bpe_cached(piece, out);
  const PreTok& pt = pretoks[level];
  std::vector<std::pair<size_t, size_t>> ranges;
  std::vector<bool> is_match;
  if (pt.kind == PreTok::Split) {
    pt.re->split(piece, ranges, is_match);
    for (size_t k = 0; k < ranges.size(); ++k) {
      if (pt.removed && is_match[k]) continue;
      pretokenize(level + 1, piece.substr(ranges[k].first, ranges[k].second - ranges[k].first), out);
    }
    return;
  }
  // ByteLevel: optional prefix space, optional GPT-2 split, then bytes -> printable code points.
  std::string with_space;
  if (pt.add_prefix_space && piece[0] != ' ') {
    with_space = " ";
    with_space += piece;
    piece = with_space;
  }
  if (pt.re) {
    pt.re->split(piece, ranges, is_match);
  } else {
    ranges.emplace_back(0, piece.size());
  }
  const ByteLevelTable& bt = byte_table();
  std::string mapped;
  for (auto [b, e] : ranges) {
    mapped.clear();
    for (size_t k = b; k < e; ++k) mapped += bt.byte_to_str[static_cast<unsigned char>(piece[k])];
    pretokenize(level + 1, mapped, out);
  }
}

// HF AddedVocabulary::find_matches over one trie; non-token text goes to on_text.
void TokenizerImpl::split_added(std::string_view text, const TokenTrie& trie, bool parse_special,
                                const std::function<void(std::string_view)>& on_text, std::vector<int32_t>& out) const {
  if (trie.empty()) return on_text(text);
  size_t start_offset = 0, i = 0, n = text.size();
  while (i < n) {
    int32_t ti = -1;
    size_t stop = trie.longest_at(text, i, &ti);
    if (stop == 0) {
      ++i;
      continue;
    }
    size_t start = i;
    i = stop;  // non-overlapping iteration continues after this match whatever happens to it
    const AddedToken& at = added[ti];
    if (!parse_special && at.special) continue;
    if (at.single_word) {
      bool start_space = start == 0 || !is_alnum(last_cp(text.substr(0, start)));
      size_t j = stop;
      bool stop_space = stop == n || !is_alnum(next_cp(text, j));
      if (!start_space || !stop_space) continue;
    }
    if (at.lstrip) {
      size_t ns = start;
      while (ns > 0) {
        size_t k = ns - 1;
        while (k > 0 && (static_cast<unsigned char>(text[k]) & 0xC0) == 0x80) --k;
        size_t kk = k;
        if (!is_white_space(next_cp(text, kk))) break;
        ns = k;
      }
      start = std::max(ns, start_offset);
    }
    if (at.rstrip) {
      while (stop < n) {
        size_t k = stop;
        if (!is_white_space(next_cp(text, k))) break;
        stop = k;
      }
      i = std::max(i, stop);
    }
    if (start > start_offset) on_text(text.substr(start_offset, start - start_offset));
    out.push_back(at.id);
    start_offset = stop;
  }
  if (start_offset < n) on_text(text.substr(start_offset));
}

std::string TokenizerImpl::decode_bytes(std::span<const int32_t> ids, bool skip_special) const {
  std::string out;
  for (int32_t id : ids) {
    // Ids the tokenizer has no entry for (padded embedding rows: Qwen3.5 has 248,320 rows for fewer
    // tokens) are model outputs all the same; they decode to no text rather than failing a request.
    if (id >= 0 && (static_cast<size_t>(id) >= id_kind.size() || id_kind[id] == 0)) continue;
    check_id(id);
    if (skip_special && id_kind[id] == 3) continue;
    out += id_bytes[id];
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Loading

namespace {

json read_json(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("tokenizer: cannot open '" + path + "'");
  std::stringstream ss;
  ss << f.rdbuf();
  try {
    return json::parse(ss.str());
  } catch (const json::exception& e) {
    throw std::runtime_error("tokenizer: malformed JSON in '" + path + "': " + e.what());
  }
}

std::string token_field(const json& cfg, const char* key) {
  auto it = cfg.find(key);
  if (it == cfg.end() || it->is_null()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content")) return (*it)["content"].get<std::string>();
  return "";
}

[[noreturn]] void unsupported(const std::string& path, const std::string& what) {
  throw std::runtime_error("tokenizer: '" + path + "': unsupported " + what);
}

void load_normalizer(TokenizerImpl& t, const json& n, const std::string& path) {
  if (n.is_null()) return;
  std::string type = n.at("type").get<std::string>();
  if (type == "NFC") {
    t.nfc = true;
  } else if (type == "Sequence") {
    for (const json& s : n.at("normalizers")) load_normalizer(t, s, path);
  } else {
    unsupported(path, "normalizer type '" + type + "'");
  }
}

void load_pretokenizer(TokenizerImpl& t, const json& p, const std::string& path) {
  if (p.is_null()) return;
  std::string type = p.at("type").get<std::string>();
  if (type == "Sequence") {
    for (const json& s : p.at("pretokenizers")) load_pretokenizer(t, s, path);
    return;
  }
  PreTok pt;
  if (type == "Split") {
    pt.kind = PreTok::Split;
    const json& pat = p.at("pattern");
    bool literal = pat.contains("String");
    std::string re = literal ? pat.at("String").get<std::string>() : pat.at("Regex").get<std::string>();
    std::string behavior = p.value("behavior", std::string("Isolated"));
    if (behavior == "Removed")
      pt.removed = true;
    else if (behavior != "Isolated")
      unsupported(path, "Split behavior '" + behavior + "'");
    if (p.value("invert", false)) unsupported(path, "Split with invert true");
    try {
      pt.re = std::make_unique<Regex>(re, literal);
    } catch (const std::runtime_error& e) {
      throw std::runtime_error("tokenizer: '" + path + "': " + e.what());
    }
  } else if (type == "ByteLevel") {
    pt.kind = PreTok::ByteLevel;
    pt.add_prefix_space = p.value("add_prefix_space", false);
    if (p.value("use_regex", true)) pt.re = std::make_unique<Regex>(kGpt2Pattern, false);
  } else {
    unsupported(path, "pre_tokenizer type '" + type + "'");
  }
  t.pretoks.push_back(std::move(pt));
}

void load_decoder(std::vector<DecodeStep>& steps, const json& d, const std::string& path) {
  if (d.is_null()) return;
  std::string type = d.at("type").get<std::string>();
  if (type == "ByteLevel")
    steps.push_back(DecodeStep::ByteLevel);
  else if (type == "ByteFallback")
    steps.push_back(DecodeStep::ByteFallback);
  else if (type == "Fuse")
    steps.push_back(DecodeStep::Fuse);
  else if (type == "Sequence")
    for (const json& s : d.at("decoders")) load_decoder(steps, s, path);
  else
    unsupported(path, "decoder type '" + type + "'");
}

int byte_fallback_value(std::string_view tok) {
  if (tok.size() != 6 || tok.substr(0, 3) != "<0x" || tok[5] != '>') return -1;
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  int hi = hex(tok[3]), lo = hex(tok[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

std::string decode_token(std::string_view tok, const std::vector<DecodeStep>& steps) {
  std::string cur(tok);
  for (DecodeStep s : steps) {
    if (s == DecodeStep::ByteFallback) {
      int v = byte_fallback_value(cur);
      if (v >= 0) cur = std::string(1, static_cast<char>(v));
    } else if (s == DecodeStep::ByteLevel) {
      const ByteLevelTable& bt = byte_table();
      std::string out;
      size_t i = 0;
      while (i < cur.size()) {
        size_t st = i;
        uint32_t cp = next_cp(cur, i);
        if (cp < bt.cp_to_byte.size() && bt.cp_to_byte[cp] >= 0)
          out += static_cast<char>(bt.cp_to_byte[cp]);
        else
          out.append(cur, st, i - st);
      }
      cur = std::move(out);
    }
  }
  return cur;
}

void load_tokenizer_json(TokenizerImpl& t, const json& j, const std::string& path) {
  if (!j.is_object()) throw std::runtime_error("tokenizer: '" + path + "': top level is not a JSON object");
  if (!j.contains("model")) throw std::runtime_error("tokenizer: '" + path + "': no \"model\" section");
  const json& m = j.at("model");
  std::string mtype = m.value("type", std::string("BPE"));
  if (mtype != "BPE") unsupported(path, "model type '" + mtype + "' (only BPE)");
  if (!m.contains("vocab") || !m.at("vocab").is_object())
    throw std::runtime_error("tokenizer: '" + path + "': model.vocab is missing or not an object");

  int32_t max_id = -1;
  t.vocab.reserve(m.at("vocab").size());
  for (auto it = m.at("vocab").begin(); it != m.at("vocab").end(); ++it) {
    int32_t id = it.value().get<int32_t>();
    if (id < 0) throw std::runtime_error("tokenizer: '" + path + "': negative id for token '" + it.key() + "'");
    t.vocab.emplace(it.key(), id);
    max_id = std::max(max_id, id);
  }
  auto str_or_empty = [&](const char* k) {
    auto it = m.find(k);
    return it == m.end() || it->is_null() ? std::string() : it->get<std::string>();
  };
  t.prefix = str_or_empty("continuing_subword_prefix");
  t.suffix = str_or_empty("end_of_word_suffix");
  t.ignore_merges = m.value("ignore_merges", false);
  t.byte_fallback = m.value("byte_fallback", false);
  t.fuse_unk = m.value("fuse_unk", false);
  if (auto it = m.find("dropout"); it != m.end() && !it->is_null() && it->get<double>() > 0.0)
    unsupported(path, "BPE dropout");
  std::string unk = str_or_empty("unk_token");
  if (!unk.empty()) t.unk_id = t.lookup(unk);

  // merges: ["a b", ...] or [["a", "b"], ...]
  if (m.contains("merges") && !m.at("merges").is_null()) {
    const json& ms = m.at("merges");
    t.merges.reserve(ms.size());
    int32_t rank = 0;
    for (const json& e : ms) {
      std::string a, b;
      if (e.is_string()) {
        const std::string& s = e.get_ref<const std::string&>();
        size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          throw std::runtime_error("tokenizer: '" + path + "': merge #" + std::to_string(rank) + " '" + s +
                                   "' is not two tokens separated by one space");
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (e.is_array() && e.size() == 2) {
        a = e[0].get<std::string>();
        b = e[1].get<std::string>();
      } else {
        throw std::runtime_error("tokenizer: '" + path + "': merge #" + std::to_string(rank) + " is malformed");
      }
      int32_t ia = t.lookup(a), ib = t.lookup(b);
      std::string merged = a + b.substr(std::min(t.prefix.size(), b.size()));
      int32_t im = t.lookup(merged);
      if (ia < 0 || ib < 0 || im < 0)
        throw std::runtime_error("tokenizer: '" + path + "': merge #" + std::to_string(rank) + " (" + a + ", " + b +
                                 ") uses a token missing from the vocab");
      t.merges.emplace(pair_key(ia, ib), std::make_pair(rank, im));
      ++rank;
    }
  }

  t.byte_ids.fill(-1);
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "<0x%02X>", b);
    t.byte_ids[b] = t.lookup(buf);
  }
  t.small_cp_id.assign(512, -1);
  for (uint32_t cp = 0; cp < 512; ++cp) {
    std::string s;
    append_utf8(s, cp);
    t.small_cp_id[cp] = t.lookup(s);
  }

  load_normalizer(t, j.value("normalizer", json()), path);
  load_pretokenizer(t, j.value("pre_tokenizer", json()), path);
  std::vector<DecodeStep> steps;
  load_decoder(steps, j.value("decoder", json()), path);

  // added tokens
  if (j.contains("added_tokens") && j.at("added_tokens").is_array()) {
    for (const json& a : j.at("added_tokens")) {
      AddedToken at;
      at.id = a.at("id").get<int32_t>();
      at.content = a.at("content").get<std::string>();
      at.special = a.value("special", false);
      at.single_word = a.value("single_word", false);
      at.lstrip = a.value("lstrip", false);
      at.rstrip = a.value("rstrip", false);
      at.normalized = a.value("normalized", !at.special);
      max_id = std::max(max_id, at.id);
      t.added.push_back(std::move(at));
    }
  }

  size_t n = static_cast<size_t>(max_id + 1);
  t.id_tok.assign(n, "");
  t.id_bytes.assign(n, "");
  t.id_kind.assign(n, 0);
  for (const auto& [tok, id] : t.vocab) {
    t.id_tok[id] = tok;
    t.id_bytes[id] = decode_token(tok, steps);
    t.id_kind[id] = 1;
  }
  for (size_t k = 0; k < t.added.size(); ++k) {
    AddedToken& at = t.added[k];
    t.id_tok[at.id] = at.content;
    t.id_bytes[at.id] = at.content;
    t.id_kind[at.id] = at.special ? 3 : 2;
    t.added_by_content[at.content] = at.id;
    if (at.normalized) {
      if (t.nfc) at.content = nfc(at.content);
      t.norm_trie.add(at.content, static_cast<int32_t>(k));
    } else {
      t.raw_trie.add(at.content, static_cast<int32_t>(k));
    }
  }
}

void load_config(TokenizerImpl& t, const json& c, const std::string& path) {
  if (!c.is_object()) throw std::runtime_error("tokenizer: '" + path + "': top level is not a JSON object");
  try {
    if (auto it = c.find("chat_template"); it != c.end() && !it->is_null()) {
      if (it->is_string()) {
        t.chat_template = it->get<std::string>();
      } else if (it->is_array()) {  // [{"name": ..., "template": ...}]
        for (const json& e : *it)
          if (e.value("name", std::string()) == "default" || t.chat_template.empty())
            t.chat_template = e.value("template", std::string());
      }
    }
    t.eos = token_field(c, "eos_token");
    t.bos = token_field(c, "bos_token");
    t.pad = token_field(c, "pad_token");
  } catch (const json::exception& e) {
    throw std::runtime_error("tokenizer: '" + path + "': " + e.what());
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------

Tokenizer Tokenizer::load(const std::string& tokenizer_json_path, const std::string& tokenizer_config_path) {
  auto impl = std::make_shared<TokenizerImpl>();
  try {
    load_tokenizer_json(*impl, read_json(tokenizer_json_path), tokenizer_json_path);
  } catch (const json::exception& e) {
    throw std::runtime_error("tokenizer: '" + tokenizer_json_path + "': " + e.what());
  }
  if (!tokenizer_config_path.empty()) load_config(*impl, read_json(tokenizer_config_path), tokenizer_config_path);
  Tokenizer t;
  t.impl_ = std::move(impl);
  return t;
}

Tokenizer Tokenizer::from_json_text(const std::string& tokenizer_json, const std::string& config_json,
                                    const std::string& name) {
  auto impl = std::make_shared<TokenizerImpl>();
  try {
    load_tokenizer_json(*impl, json::parse(tokenizer_json), name);
    if (!config_json.empty()) load_config(*impl, json::parse(config_json), name);
  } catch (const json::exception& e) {
    throw std::runtime_error("tokenizer: '" + name + "': " + e.what());
  }
  Tokenizer t;
  t.impl_ = std::move(impl);
  return t;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  const TokenizerImpl& t = *impl_;
  std::string repaired;
  if (!is_valid_utf8(text)) {
    repaired = sanitize(text);
    text = repaired;
  }
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  std::function<void(std::string_view)> after_norm = [&](std::string_view p) { t.pretokenize(0, p, out); };
  std::function<void(std::string_view)> on_raw = [&](std::string_view piece) {
    if (!t.nfc) return t.split_added(piece, t.norm_trie, parse_special, after_norm, out);
    std::string normed = nfc(piece);
    t.split_added(normed, t.norm_trie, parse_special, after_norm, out);
  };
  t.split_added(text, t.raw_trie, parse_special, on_raw, out);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  std::string raw = impl_->decode_bytes(ids, skip_special);
  return is_valid_utf8(raw) ? raw : sanitize(raw);
}

std::string Tokenizer::id_to_token(int32_t id) const {
  impl_->check_id(id);
  return impl_->id_tok[id];
}

int32_t Tokenizer::token_to_id(std::string_view tok) const {
  auto it = impl_->added_by_content.find(tok);
  if (it != impl_->added_by_content.end()) return it->second;
  return impl_->lookup(tok);
}

size_t Tokenizer::vocab_size() const {
  return impl_->id_kind.size();
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->id_kind.size() && impl_->id_kind[id] == 3;
}

bool Tokenizer::has_entry(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->id_kind.size() && impl_->id_kind[id] != 0;
}

std::vector<int32_t> Tokenizer::ids_without_entry(int64_t rows) const {
  std::vector<int32_t> out;
  for (int64_t id = 0; id < rows; ++id)
    if (!has_entry(static_cast<int32_t>(id))) out.push_back(static_cast<int32_t>(id));
  return out;
}

const std::string& Tokenizer::chat_template() const {
  return impl_->chat_template;
}
const std::string& Tokenizer::eos_token() const {
  return impl_->eos;
}
const std::string& Tokenizer::bos_token() const {
  return impl_->bos;
}
const std::string& Tokenizer::pad_token() const {
  return impl_->pad;
}

std::string Tokenizer::sanitize_utf8(std::string_view s) {
  return sanitize(s);
}

Tokenizer::StreamDecoder::StreamDecoder(const Tokenizer& tok, bool skip_special)
    : impl_(tok.impl_), skip_special_(skip_special) {}

std::string Tokenizer::StreamDecoder::push(int32_t id) {
  int32_t one[1] = {id};
  pending_ += impl_->decode_bytes(one, skip_special_);
  // Hold back a trailing well-formed prefix of a multi-byte sequence; everything before it is final.
  const auto* p = reinterpret_cast<const unsigned char*>(pending_.data());
  size_t i = 0, n = pending_.size(), cut = n;
  while (i < n) {
    uint32_t cp;
    Utf8Seq q = utf8_seq(p + i, n - i, &cp);
    if (q.truncated) {
      cut = i;
      break;
    }
    i += q.len;
  }
  std::string ready = sanitize(std::string_view(pending_).substr(0, cut));
  pending_.erase(0, cut);
  return ready;
}

std::string Tokenizer::StreamDecoder::flush() {
  std::string rest = sanitize(pending_);
  pending_.clear();
  return rest;
}

}  // namespace hypic
