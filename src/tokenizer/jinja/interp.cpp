// Interpreter for the chat-template Jinja subset. Semantics follow the Jinja2 template designer
// documentation and Python's built-in types (str/list/dict methods, repr, json.dumps).
#include "tokenizer/jinja/interp.h"

#include <utf8proc.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <ctime>
#include <unordered_map>

namespace hypic::jinja {

namespace {

using Frame = std::unordered_map<std::string, Value>;
constexpr size_t kMaxEvalDepth = 3000;   // nested eval/exec calls (stack guard), macros included
constexpr size_t kMaxRange = 1'000'000;  // items of one range() (it builds a list)

// ---------------------------------------------------------------------------------------------
// UTF-8 helpers. Strings index, slice and count by code point as in Python; bytes that are not
// valid UTF-8 count as one character each and are kept as they are.

struct Char {
  int32_t cp;  // -1 for an invalid byte
  size_t off, len;
};

std::vector<Char> chars_of(const std::string& s) {
  std::vector<Char> out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    int32_t cp = -1;
    utf8proc_ssize_t n =
        utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + i), utf8proc_ssize_t(s.size() - i), &cp);
    if (n <= 0) {
      out.push_back({-1, i, 1});
      ++i;
    } else {
      out.push_back({cp, i, size_t(n)});
      i += size_t(n);
    }
  }
  return out;
}

size_t char_count(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  // Stray continuation bytes are rare; fall back to the exact count when present.
  return n == 0 && !s.empty() ? chars_of(s).size() : n;
}

void put_cp(std::string& out, int32_t cp) {
  utf8proc_uint8_t buf[4];
  utf8proc_ssize_t n = utf8proc_encode_char(cp, buf);
  out.append(reinterpret_cast<char*>(buf), size_t(n));
}

bool py_isspace(int32_t c) {
  return (c >= 9 && c <= 13) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

bool is_cased(int32_t c) {
  if (c < 0) return false;
  auto cat = utf8proc_category(c);
  return cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT;
}

template <class F>
std::string map_chars(const std::string& s, F f) {
  std::string out;
  out.reserve(s.size());
  std::vector<Char> cs = chars_of(s);
  for (size_t i = 0; i < cs.size(); ++i) {
    if (cs[i].cp < 0)
      out.append(s, cs[i].off, 1);
    else
      put_cp(out, f(i, cs[i].cp, cs));
  }
  return out;
}

std::string str_upper(const std::string& s) {
  return map_chars(s, [](size_t, int32_t c, auto&) { return utf8proc_toupper(c); });
}
std::string str_lower(const std::string& s) {
  return map_chars(s, [](size_t, int32_t c, auto&) { return utf8proc_tolower(c); });
}
std::string str_title(const std::string& s) {
  return map_chars(s, [](size_t i, int32_t c, const std::vector<Char>& cs) {
    bool prev_cased = i > 0 && is_cased(cs[i - 1].cp);
    return prev_cased ? utf8proc_tolower(c) : utf8proc_totitle(c);
  });
}
std::string str_capitalize(const std::string& s) {
  return map_chars(s, [](size_t i, int32_t c, auto&) { return i == 0 ? utf8proc_totitle(c) : utf8proc_tolower(c); });
}

// strip/lstrip/rstrip: chars == nullptr strips whitespace.
std::string str_strip(const std::string& s, const std::string* chars, bool left, bool right) {
  std::vector<Char> cs = chars_of(s);
  std::vector<int32_t> set;
  if (chars)
    for (const Char& c : chars_of(*chars)) set.push_back(c.cp);
  auto strip_it = [&](const Char& c) {
    if (!chars) return py_isspace(c.cp);
    return c.cp >= 0 && std::find(set.begin(), set.end(), c.cp) != set.end();
  };
  size_t b = 0, e = cs.size();
  if (left)
    while (b < e && strip_it(cs[b])) ++b;
  if (right)
    while (e > b && strip_it(cs[e - 1])) --e;
  if (b == e) return "";
  return s.substr(cs[b].off, cs[e - 1].off + cs[e - 1].len - cs[b].off);
}

std::vector<std::string> split_ws(const std::string& s, int64_t maxsplit, bool from_right) {
  std::vector<Char> cs = chars_of(s);
  std::vector<std::pair<size_t, size_t>> words;  // char ranges
  size_t i = 0;
  while (i < cs.size()) {
    while (i < cs.size() && py_isspace(cs[i].cp)) ++i;
    if (i == cs.size()) break;
    size_t j = i;
    while (j < cs.size() && !py_isspace(cs[j].cp)) ++j;
    words.emplace_back(i, j);
    i = j;
  }
  auto text = [&](size_t a, size_t b) { return s.substr(cs[a].off, cs[b - 1].off + cs[b - 1].len - cs[a].off); };
  std::vector<std::string> out;
  if (maxsplit < 0 || size_t(maxsplit) + 1 >= words.size()) {
    for (auto& w : words) out.push_back(text(w.first, w.second));
    return out;
  }
  size_t k = size_t(maxsplit);
  if (!from_right) {
    for (size_t w = 0; w < k; ++w) out.push_back(text(words[w].first, words[w].second));
    // Remainder: from the k-th word to the end, trailing whitespace stripped.
    out.push_back(str_strip(s.substr(cs[words[k].first].off), nullptr, false, true));
  } else {
    size_t first = words.size() - k;
    out.push_back(str_strip(s.substr(0, cs[words[first - 1].second - 1].off + cs[words[first - 1].second - 1].len),
                            nullptr, true, false));
    for (size_t w = first; w < words.size(); ++w) out.push_back(text(words[w].first, words[w].second));
  }
  return out;
}

std::vector<std::string> split_sep(const std::string& s, const std::string& sep, int64_t maxsplit, bool from_right) {
  std::vector<std::string> out;
  if (!from_right) {
    size_t pos = 0;
    while (maxsplit < 0 || int64_t(out.size()) < maxsplit) {
      size_t f = s.find(sep, pos);
      if (f == std::string::npos) break;
      out.push_back(s.substr(pos, f - pos));
      pos = f + sep.size();
    }
    out.push_back(s.substr(pos));
  } else {
    size_t end = s.size();
    std::vector<std::string> rev;
    while (maxsplit < 0 || int64_t(rev.size()) < maxsplit) {
      if (end < sep.size()) break;
      size_t f = s.rfind(sep, end - sep.size());
      if (f == std::string::npos) break;
      rev.push_back(s.substr(f + sep.size(), end - f - sep.size()));
      end = f;
    }
    rev.push_back(s.substr(0, end));
    out.assign(rev.rbegin(), rev.rend());
  }
  return out;
}

std::string replace_all(const std::string& s, const std::string& from, const std::string& to, int64_t count,
                        size_t max_bytes) {
  std::string out;
  if (from.empty()) {
    // Python inserts `to` between characters (and at both ends).
    std::vector<Char> cs = chars_of(s);
    int64_t n = 0;
    for (size_t i = 0; i <= cs.size(); ++i) {
      if (count < 0 || n < count) {
        out += to;
        ++n;
      }
      if (i < cs.size()) out.append(s, cs[i].off, cs[i].len);
      if (out.size() > max_bytes) throw std::runtime_error("string too large");
    }
    return out;
  }
  size_t pos = 0;
  int64_t n = 0;
  while (count < 0 || n < count) {
    size_t f = s.find(from, pos);
    if (f == std::string::npos) break;
    out.append(s, pos, f - pos);
    out += to;
    pos = f + from.size();
    ++n;
    if (out.size() > max_bytes) throw std::runtime_error("string too large");
  }
  out.append(s, pos);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Printing.

std::string py_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, r.ptr);
  bool neg = sci[0] == '-';
  if (neg) sci.erase(0, 1);
  size_t epos = sci.find('e');
  std::string mant = sci.substr(0, epos);
  int exp = std::atoi(sci.c_str() + epos + 1);
  std::string digits;
  for (char c : mant)
    if (c != '.') digits += c;
  int decpt = exp + 1;
  std::string out = neg ? "-" : "";
  int n = int(digits.size());
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out += "0." + std::string(size_t(-decpt), '0') + digits;
    } else if (decpt >= n) {
      out += digits + std::string(size_t(decpt - n), '0') + ".0";
    } else {
      out += digits.substr(0, size_t(decpt)) + "." + digits.substr(size_t(decpt));
    }
  } else {
    out += digits.substr(0, 1);
    if (n > 1) out += "." + digits.substr(1);
    int e = decpt - 1;
    out += e < 0 ? "e-" : "e+";
    std::string es = std::to_string(std::abs(e));
    if (es.size() < 2) es = "0" + es;
    out += es;
  }
  return out;
}

std::string py_repr_str(const std::string& s) {
  bool has_sq = s.find('\'') != std::string::npos, has_dq = s.find('"') != std::string::npos;
  char q = (has_sq && !has_dq) ? '"' : '\'';
  std::string out(1, q);
  for (unsigned char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == uint8_t(q)) {
      out += '\\';
      out += char(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", c);
      out += b;
    } else {
      out += char(c);
    }
  }
  out += q;
  return out;
}

std::string repr(const Value& v);

std::string container_str(const Value& v) {
  std::string out;
  if (v.is_list()) {
    const ListObj& l = v.list();
    out += l.tuple ? "(" : "[";
    for (size_t i = 0; i < l.items.size(); ++i) {
      if (i) out += ", ";
      out += repr(l.items[i]);
    }
    if (l.tuple && l.items.size() == 1) out += ",";
    out += l.tuple ? ")" : "]";
  } else {
    const DictObj& d = v.dict();
    if (d.ns) out += "<Namespace ";
    out += "{";
    for (size_t i = 0; i < d.items.size(); ++i) {
      if (i) out += ", ";
      out += py_repr_str(d.items[i].first) + ": " + repr(d.items[i].second);
    }
    out += "}";
    if (d.ns) out += ">";
  }
  return out;
}

std::string repr(const Value& v) {
  if (v.is_string()) return py_repr_str(v.s());
  if (v.is_undefined()) return "Undefined";
  return to_str(v);
}

const char* type_name(const Value& v) {
  if (v.is_undefined()) return "undefined";
  if (v.is_none()) return "NoneType";
  if (v.is_bool()) return "bool";
  if (v.is_int()) return "int";
  if (v.is_float()) return "float";
  if (v.is_string()) return "str";
  if (v.is_list()) return v.list().tuple ? "tuple" : "list";
  if (v.is_dict()) return v.dict().ns ? "Namespace" : "dict";
  return "function";
}

void json_escape(const std::string& s, bool ensure_ascii, std::string& out) {
  out += '"';
  std::vector<Char> cs;
  auto hex4 = [&](uint32_t u) {
    char b[16];
    std::snprintf(b, sizeof b, "\\u%04x", u);
    out += b;
  };
  for (const Char& c : chars_of(s)) {
    int32_t cp = c.cp;
    switch (cp) {
      case '"':
        out += "\\\"";
        continue;
      case '\\':
        out += "\\\\";
        continue;
      case '\n':
        out += "\\n";
        continue;
      case '\r':
        out += "\\r";
        continue;
      case '\t':
        out += "\\t";
        continue;
      case '\b':
        out += "\\b";
        continue;
      case '\f':
        out += "\\f";
        continue;
      default:
        break;
    }
    if (cp >= 0 && cp < 0x20) {
      hex4(uint32_t(cp));
    } else if (ensure_ascii && (cp < 0 || cp > 0x7E)) {
      if (cp < 0) cp = 0xFFFD;
      if (cp >= 0x10000) {
        uint32_t u = uint32_t(cp) - 0x10000;
        hex4(0xD800 + (u >> 10));
        hex4(0xDC00 + (u & 0x3FF));
      } else {
        hex4(uint32_t(cp));
      }
    } else {
      out.append(s, c.off, c.len);
    }
  }
  out += '"';
}

struct JsonOpts {
  bool ensure_ascii;
  int indent;
  std::string item_sep, key_sep;
  bool sort_keys;
};

void dump_json(const Value& v, const JsonOpts& o, int level, std::string& out) {
  auto newline = [&](int lvl) {
    if (o.indent >= 0) {
      out += '\n';
      out.append(size_t(o.indent) * size_t(lvl), ' ');
    }
  };
  if (level > 500) throw std::runtime_error("tojson: value nested too deeply");
  if (v.is_none()) {
    out += "null";
  } else if (v.is_bool()) {
    out += v.b() ? "true" : "false";
  } else if (v.is_int()) {
    out += std::to_string(v.i());
  } else if (v.is_float()) {
    double d = v.f();
    out += std::isnan(d) ? "NaN" : std::isinf(d) ? (d < 0 ? "-Infinity" : "Infinity") : py_float(d);
  } else if (v.is_string()) {
    json_escape(v.s(), o.ensure_ascii, out);
  } else if (v.is_list()) {
    const auto& items = v.list().items;
    if (items.empty()) {
      out += "[]";
      return;
    }
    out += '[';
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) out += o.item_sep;
      newline(level + 1);
      dump_json(items[i], o, level + 1, out);
    }
    newline(level);
    out += ']';
  } else if (v.is_dict()) {
    std::vector<const std::pair<std::string, Value>*> items;
    for (const auto& kv : v.dict().items) items.push_back(&kv);
    if (o.sort_keys) std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
    if (items.empty()) {
      out += "{}";
      return;
    }
    out += '{';
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) out += o.item_sep;
      newline(level + 1);
      json_escape(items[i]->first, o.ensure_ascii, out);
      out += o.key_sep;
      dump_json(items[i]->second, o, level + 1, out);
    }
    newline(level);
    out += '}';
  } else {
    throw std::runtime_error(std::string("Object of type ") + type_name(v) + " is not JSON serializable");
  }
}

// ---------------------------------------------------------------------------------------------

bool truthy(const Value& v) {
  if (v.is_undefined() || v.is_none()) return false;
  if (v.is_bool()) return v.b();
  if (v.is_int()) return v.i() != 0;
  if (v.is_float()) return v.f() != 0;
  if (v.is_string()) return !v.s().empty();
  if (v.is_list()) return !v.list().items.empty();
  if (v.is_dict()) return !v.dict().items.empty();
  return true;
}

bool is_intlike(const Value& v) {
  return v.is_int() || v.is_bool();
}
int64_t as_int(const Value& v) {
  return v.is_bool() ? int64_t(v.b()) : v.i();
}
double as_double(const Value& v) {
  return v.is_float() ? v.f() : double(as_int(v));
}

bool equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (is_intlike(a) && is_intlike(b)) return as_int(a) == as_int(b);
    return as_double(a) == as_double(b);
  }
  if (a.v.index() != b.v.index()) return false;
  if (a.is_undefined() || a.is_none()) return true;
  if (a.is_string()) return a.s() == b.s();
  if (a.is_list()) {
    const auto &x = a.list().items, &y = b.list().items;
    if (x.size() != y.size()) return false;
    for (size_t i = 0; i < x.size(); ++i)
      if (!equal(x[i], y[i])) return false;
    return true;
  }
  if (a.is_dict()) {
    const DictObj &x = a.dict(), &y = b.dict();
    if (x.items.size() != y.items.size()) return false;
    for (const auto& kv : x.items) {
      const Value* o = y.find(kv.first);
      if (!o || !equal(kv.second, *o)) return false;
    }
    return true;
  }
  return &a.func() == &b.func();
}

// <0, 0, >0; throws on types Python cannot order.
int compare(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (is_intlike(a) && is_intlike(b)) return as_int(a) < as_int(b) ? -1 : as_int(a) > as_int(b);
    double x = as_double(a), y = as_double(b);
    return x < y ? -1 : x > y;
  }
  if (a.is_string() && b.is_string()) return a.s().compare(b.s()) < 0 ? -1 : a.s() == b.s() ? 0 : 1;
  if (a.is_list() && b.is_list()) {
    const auto &x = a.list().items, &y = b.list().items;
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      int c = compare(x[i], y[i]);
      if (c) return c;
    }
    return x.size() < y.size() ? -1 : x.size() > y.size();
  }
  throw std::runtime_error(std::string("'<' not supported between instances of '") + type_name(a) + "' and '" +
                           type_name(b) + "'");
}

std::string lower_ascii(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = char(c - 'A' + 'a');
  return s;
}

}  // namespace

std::string to_str(const Value& v) {
  if (v.is_undefined()) return "";
  if (v.is_none()) return "None";
  if (v.is_bool()) return v.b() ? "True" : "False";
  if (v.is_int()) return std::to_string(v.i());
  if (v.is_float()) return py_float(v.f());
  if (v.is_string()) return v.s();
  if (v.is_list() || v.is_dict()) return container_str(v);
  return "<function " + v.func().name + ">";
}

std::string to_json(const Value& v, bool ensure_ascii, int indent, const std::string& item_sep,
                    const std::string& key_sep, bool sort_keys) {
  std::string out;
  dump_json(v, JsonOpts{ensure_ascii, indent, item_sep, key_sep, sort_keys}, 0, out);
  return out;
}

// ---------------------------------------------------------------------------------------------

struct Interp {
  enum Flow { Normal, Break, Continue };

  const Program& prog;
  RenderLimits lim;
  std::vector<std::shared_ptr<Frame>> scopes;
  std::string* out = nullptr;
  size_t call_depth = 0, eval_depth = 0, iterations = 0, loop_depth = 0;

  Interp(const Program& p, const RenderLimits& l) : prog(p), lim(l) {}

  struct Depth {
    Interp& in;
    Depth(Interp& i, size_t pos) : in(i) {
      if (++in.eval_depth > kMaxEvalDepth) throw PosError(pos, "template evaluation nested too deeply");
    }
    ~Depth() { --in.eval_depth; }
  };

  [[noreturn]] static void fail(size_t pos, const std::string& msg) { throw PosError(pos, msg); }

  void check_size(size_t n, size_t pos) const {
    if (n > lim.max_output_bytes)
      fail(pos, "output or string larger than the limit of " + std::to_string(lim.max_output_bytes) + " bytes");
  }
  void count_iteration(size_t pos) {
    if (++iterations > lim.max_iterations)
      fail(pos, "more than " + std::to_string(lim.max_iterations) + " loop iterations");
  }

  Value lookup(const std::string& name) const {
    for (size_t i = scopes.size(); i-- > 0;) {
      auto it = scopes[i]->find(name);
      if (it != scopes[i]->end()) return it->second;
    }
    return Value();
  }
  void assign(const std::string& name, Value v) { (*scopes.back())[name] = std::move(v); }

  void emit(const std::string& s, size_t pos) {
    out->append(s);
    check_size(out->size(), pos);
  }

  // ---- statements ----
  Flow exec(const Body& body) {
    for (const NodeP& n : body) {
      Flow f = exec(*n);
      if (f != Normal) return f;
    }
    return Normal;
  }

  std::string capture(const Body& body) {
    std::string buf;
    std::string* saved = out;
    out = &buf;
    try {
      Flow f = exec(body);
      (void)f;
    } catch (...) {
      out = saved;
      throw;
    }
    out = saved;
    return buf;
  }

  void bind_targets(const Node& n, const Value& v) {
    if (!n.unpack) {
      assign(n.targets[0], v);
      return;
    }
    std::vector<Value> items = iterate(v, n.pos);
    if (items.size() != n.targets.size())
      fail(n.pos, "cannot unpack " + std::to_string(items.size()) + " values into " + std::to_string(n.targets.size()) +
                      " names");
    for (size_t i = 0; i < items.size(); ++i) assign(n.targets[i], items[i]);
  }

  Flow exec(const Node& n) {
    Depth d(*this, n.pos);
    switch (n.kind) {
      case Node::Text:
        emit(n.text, n.pos);
        return Normal;
      case Node::Output:
        emit(to_str(eval(*n.expr)), n.pos);
        return Normal;
      case Node::If:
        for (const auto& br : n.branches)
          if (!br.first || truthy(eval(*br.first))) return exec(br.second);
        return Normal;
      case Node::For:
        return exec_for(n);
      case Node::Set:
        bind_targets(n, eval(*n.expr));
        return Normal;
      case Node::SetAttr: {
        Value obj = lookup(n.expr->name);
        if (!obj.is_dict() || !obj.dict().ns)
          fail(n.pos, "cannot assign attribute '" + n.text + "' on '" + n.expr->name +
                          "': only namespace() objects support attribute assignment");
        obj.dict().set(n.text, eval(*n.value));
        return Normal;
      }
      case Node::SetBlock:
        bind_targets(n, Value(capture(n.body)));
        return Normal;
      case Node::Macro:
        assign(n.text, make_macro(n));
        return Normal;
      case Node::Break:
      case Node::Continue:
        if (loop_depth == 0)
          fail(n.pos, std::string("'") + (n.kind == Node::Break ? "break" : "continue") + "' outside of a loop");
        return n.kind == Node::Break ? Break : Continue;
      case Node::Scope:
        return exec(n.body);
    }
    return Normal;
  }

  Flow exec_for(const Node& n) {
    std::vector<Value> items = iterate(eval(*n.expr), n.expr->pos);
    if (n.cond) {
      std::vector<Value> kept;
      for (Value& it : items) {
        count_iteration(n.pos);
        scopes.push_back(std::make_shared<Frame>());
        try {
          bind_targets(n, it);
          bool keep = truthy(eval(*n.cond));
          scopes.pop_back();
          if (keep) kept.push_back(std::move(it));
        } catch (...) {
          scopes.pop_back();
          throw;
        }
      }
      items = std::move(kept);
    }
    if (items.empty()) return exec(n.else_body);
    const size_t len = items.size();
    ++loop_depth;
    struct LoopGuard {
      size_t& d;
      ~LoopGuard() { --d; }
    } lg{loop_depth};
    for (size_t i = 0; i < len; ++i) {
      count_iteration(n.pos);
      Value loop = make_dict();
      DictObj& L = loop.dict();
      L.set("index", Value(int64_t(i + 1)));
      L.set("index0", Value(int64_t(i)));
      L.set("revindex", Value(int64_t(len - i)));
      L.set("revindex0", Value(int64_t(len - i - 1)));
      L.set("first", Value(i == 0));
      L.set("last", Value(i + 1 == len));
      L.set("length", Value(int64_t(len)));
      L.set("depth", Value(int64_t(1)));
      L.set("depth0", Value(int64_t(0)));
      if (i > 0) L.set("previtem", items[i - 1]);
      if (i + 1 < len) L.set("nextitem", items[i + 1]);
      auto cyc = std::make_shared<FuncObj>();
      cyc->name = "cycle";
      cyc->fn = [i](Interp&, std::vector<Value>& args, Kwargs&) -> Value {
        if (args.empty()) throw std::runtime_error("loop.cycle() needs at least one argument");
        return args[i % args.size()];
      };
      L.set("cycle", Value(std::move(cyc)));
      scopes.push_back(std::make_shared<Frame>());
      Flow f;
      try {
        assign("loop", loop);
        bind_targets(n, items[i]);
        f = exec(n.body);
      } catch (...) {
        scopes.pop_back();
        throw;
      }
      scopes.pop_back();
      if (f == Break) break;
    }
    return Normal;
  }

  Value make_macro(const Node& n) {
    auto f = std::make_shared<FuncObj>();
    f->name = n.text;
    const Node* node = &n;
    f->fn = [node](Interp& in, std::vector<Value>& args, Kwargs& kwargs) -> Value {
      if (args.size() > node->params.size())
        throw std::runtime_error("macro '" + node->text + "' takes " + std::to_string(node->params.size()) +
                                 " arguments, got " + std::to_string(args.size()));
      if (++in.call_depth > in.lim.max_call_depth) {
        --in.call_depth;
        throw std::runtime_error("macro calls nested deeper than " + std::to_string(in.lim.max_call_depth));
      }
      auto frame = std::make_shared<Frame>();
      for (size_t i = 0; i < node->params.size(); ++i) {
        const auto& p = node->params[i];
        if (i < args.size()) {
          (*frame)[p.first] = args[i];
        } else {
          auto it = std::find_if(kwargs.begin(), kwargs.end(), [&](auto& kv) { return kv.first == p.first; });
          if (it != kwargs.end())
            (*frame)[p.first] = it->second;
          else if (p.second)
            (*frame)[p.first] = in.eval(*p.second);
          else
            (*frame)[p.first] = Value();
        }
      }
      for (const auto& kv : kwargs)
        if (std::none_of(node->params.begin(), node->params.end(), [&](auto& p) { return p.first == kv.first; }))
          throw std::runtime_error("macro '" + node->text + "' has no parameter '" + kv.first + "'");
      std::vector<std::shared_ptr<Frame>> saved = {in.scopes[0], in.scopes[1], frame};
      std::swap(saved, in.scopes);
      size_t saved_loops = in.loop_depth;
      in.loop_depth = 0;
      std::string text;
      try {
        text = in.capture(node->body);
      } catch (...) {
        std::swap(saved, in.scopes);
        in.loop_depth = saved_loops;
        --in.call_depth;
        throw;
      }
      std::swap(saved, in.scopes);
      in.loop_depth = saved_loops;
      --in.call_depth;
      return Value(std::move(text));
    };
    return Value(std::move(f));
  }

  // ---- expressions ----
  std::vector<Value> iterate(const Value& v, size_t pos) {
    if (v.is_list()) return v.list().items;
    if (v.is_dict()) {
      std::vector<Value> keys;
      for (const auto& kv : v.dict().items) keys.emplace_back(kv.first);
      return keys;
    }
    if (v.is_string()) {
      std::vector<Value> out;
      for (const Char& c : chars_of(v.s())) out.emplace_back(v.s().substr(c.off, c.len));
      return out;
    }
    if (v.is_undefined()) return {};
    fail(pos, std::string("'") + type_name(v) + "' object is not iterable");
  }

  Value get_attr(const Value& obj, const std::string& name) {
    if (obj.is_dict()) {
      const Value* f = obj.dict().find(name);
      return f ? *f : Value();
    }
    return Value();
  }

  static int64_t norm_index(int64_t i, size_t n) { return i < 0 ? i + int64_t(n) : i; }

  Value get_item(const Value& obj, const Value& key, size_t pos) {
    if (obj.is_dict()) {
      if (!key.is_string()) return Value();
      const Value* f = obj.dict().find(key.s());
      return f ? *f : Value();
    }
    if (obj.is_list() && is_intlike(key)) {
      const auto& items = obj.list().items;
      int64_t i = norm_index(as_int(key), items.size());
      if (i < 0 || i >= int64_t(items.size())) return Value();
      return items[size_t(i)];
    }
    if (obj.is_string() && is_intlike(key)) {
      std::vector<Char> cs = chars_of(obj.s());
      int64_t i = norm_index(as_int(key), cs.size());
      if (i < 0 || i >= int64_t(cs.size())) return Value();
      return Value(obj.s().substr(cs[size_t(i)].off, cs[size_t(i)].len));
    }
    return Value();
  }

  Value slice(const Value& obj, const Expr& e) {
    auto opt = [&](const ExprP& x, bool& has) -> int64_t {
      has = false;
      if (!x) return 0;
      Value v = eval(*x);
      if (v.is_none()) return 0;
      if (!is_intlike(v)) fail(x->pos, "slice indices must be integers or None");
      has = true;
      return as_int(v);
    };
    bool hs, he, hst;
    int64_t start = opt(e.b, hs), stop = opt(e.c, he), step = opt(e.d, hst);
    if (!hst) step = 1;
    if (step == 0) fail(e.pos, "slice step cannot be zero");
    size_t n;
    std::vector<Char> cs;
    if (obj.is_list()) {
      n = obj.list().items.size();
    } else if (obj.is_string()) {
      cs = chars_of(obj.s());
      n = cs.size();
    } else if (obj.is_undefined()) {
      return Value();
    } else {
      fail(e.pos, std::string("'") + type_name(obj) + "' object is not subscriptable");
    }
    int64_t len = int64_t(n);
    auto clampi = [&](int64_t i, bool has, int64_t def) {
      if (!has) return def;
      if (i < 0) i += len;
      if (step > 0) return std::clamp<int64_t>(i, 0, len);
      return std::clamp<int64_t>(i, -1, len - 1);
    };
    int64_t a = clampi(start, hs, step > 0 ? 0 : len - 1);
    int64_t b = clampi(stop, he, step > 0 ? len : -1);
    std::vector<size_t> idx;
    for (int64_t i = a; step > 0 ? i < b : i > b; i += step) idx.push_back(size_t(i));
    if (obj.is_list()) {
      std::vector<Value> out;
      for (size_t i : idx) out.push_back(obj.list().items[i]);
      return make_list(std::move(out), obj.list().tuple);
    }
    std::string out;
    for (size_t i : idx) out.append(obj.s(), cs[i].off, cs[i].len);
    return Value(std::move(out));
  }

  struct Args {
    std::vector<Value> pos;
    Kwargs kw;
  };
  Args eval_args(const Expr& e) {
    Args a;
    for (const ExprP& x : e.args) a.pos.push_back(eval(*x));
    for (const auto& kv : e.kwargs) a.kw.emplace_back(kv.first, eval(*kv.second));
    return a;
  }
  // Argument i (positional) or named `name`; nullptr when absent.
  static const Value* arg(const Args& a, size_t i, const char* name) {
    if (i < a.pos.size()) return &a.pos[i];
    for (const auto& kv : a.kw)
      if (kv.first == name) return &kv.second;
    return nullptr;
  }

  Value call_value(const Value& f, Args& a, size_t pos, const std::string& what) {
    if (!f.is_func()) {
      if (f.is_undefined()) fail(pos, "'" + what + "' is undefined");
      fail(pos, "'" + what + "' (" + type_name(f) + ") is not callable");
    }
    try {
      return f.func().fn(*this, a.pos, a.kw);
    } catch (const PosError&) {
      throw;
    } catch (const TemplateException&) {
      throw;
    } catch (const std::exception& ex) {
      fail(pos, ex.what());
    }
  }

  static std::string describe(const Expr& e) {
    if (e.kind == Expr::Name) return e.name;
    if (e.kind == Expr::GetAttr) return describe(*e.a) + "." + e.name;
    return "expression";
  }

  Value eval(const Expr& e) {
    Depth d(*this, e.pos);
    switch (e.kind) {
      case Expr::Literal:
        return e.lit;
      case Expr::Name:
        return lookup(e.name);
      case Expr::List: {
        std::vector<Value> items;
        for (const ExprP& x : e.args) items.push_back(eval(*x));
        return make_list(std::move(items), e.flag);
      }
      case Expr::Dict: {
        Value d = make_dict();
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
          Value k = eval(*e.args[i]);
          if (!k.is_string()) fail(e.args[i]->pos, "dict keys must be strings");
          d.dict().set(k.s(), eval(*e.args[i + 1]));
        }
        return d;
      }
      case Expr::GetAttr:
        return get_attr(eval(*e.a), e.name);
      case Expr::GetItem: {
        Value obj = eval(*e.a);
        return get_item(obj, eval(*e.b), e.pos);
      }
      case Expr::Slice:
        return slice(eval(*e.a), e);
      case Expr::Call: {
        if (e.a->kind == Expr::GetAttr) {
          Value obj = eval(*e.a->a);
          if (has_method(obj, e.a->name)) {
            Args a = eval_args(e);
            try {
              return call_method(obj, e.a->name, a, e.pos);
            } catch (const PosError&) {
              throw;
            } catch (const TemplateException&) {
              throw;
            } catch (const std::exception& ex) {
              fail(e.pos, ex.what());
            }
          }
          Value f = get_attr(obj, e.a->name);
          if (!f.is_func() && !obj.is_dict() && !obj.is_undefined())
            fail(e.pos, std::string("'") + type_name(obj) + "' object has no method '" + e.a->name + "'");
          Args a = eval_args(e);
          return call_value(f, a, e.pos, describe(*e.a));
        }
        Value f = eval(*e.a);
        Args a = eval_args(e);
        return call_value(f, a, e.pos, describe(*e.a));
      }
      case Expr::Filter: {
        Value in = eval(*e.a);
        Args a = eval_args(e);
        try {
          return apply_filter(e.name, in, a, e.pos);
        } catch (const PosError&) {
          throw;
        } catch (const TemplateException&) {
          throw;
        } catch (const std::exception& ex) {
          fail(e.pos, std::string("filter '") + e.name + "': " + ex.what());
        }
      }
      case Expr::Test: {
        Value in = eval(*e.a);
        Args a = eval_args(e);
        bool r;
        try {
          r = apply_test(e.name, in, a.pos, e.pos);
        } catch (const PosError&) {
          throw;
        } catch (const std::exception& ex) {
          fail(e.pos, std::string("test '") + e.name + "': " + ex.what());
        }
        return Value(e.flag ? !r : r);
      }
      case Expr::Unary: {
        Value v = eval(*e.a);
        if (e.name == "not") return Value(!truthy(v));
        if (v.is_bool() || v.is_int()) {
          if (e.name == "+") return Value(as_int(v));
          if (as_int(v) == INT64_MIN) fail(e.pos, "integer overflow");
          return Value(-as_int(v));
        }
        if (v.is_float()) return Value(e.name == "-" ? -v.f() : v.f());
        fail(e.pos, std::string("bad operand type for unary ") + e.name + ": '" + type_name(v) + "'");
      }
      case Expr::Binary:
        return binary(e);
      case Expr::Cond:
        if (truthy(eval(*e.a))) return eval(*e.b);
        return e.c ? eval(*e.c) : Value();
    }
    return Value();
  }

  bool contains(const Value& container, const Value& item, size_t pos) {
    if (container.is_string()) {
      if (!item.is_string())
        fail(pos, std::string("'in <string>' requires string as left operand, not ") + type_name(item));
      return container.s().find(item.s()) != std::string::npos;
    }
    if (container.is_list()) {
      for (const Value& v : container.list().items)
        if (equal(v, item)) return true;
      return false;
    }
    if (container.is_dict()) return item.is_string() && container.dict().find(item.s()) != nullptr;
    if (container.is_undefined()) return false;
    fail(pos, std::string("argument of type '") + type_name(container) + "' is not iterable");
  }

  [[noreturn]] void bad_operands(const std::string& op, const Value& a, const Value& b, size_t pos) {
    fail(pos, "unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
  }

  Value binary(const Expr& e) {
    const std::string& op = e.name;
    if (op == "and") {
      Value a = eval(*e.a);
      return truthy(a) ? eval(*e.b) : a;
    }
    if (op == "or") {
      Value a = eval(*e.a);
      return truthy(a) ? a : eval(*e.b);
    }
    Value a = eval(*e.a);
    Value b = eval(*e.b);
    size_t pos = e.pos;
    if (op == "~") {
      std::string s = to_str(a) + to_str(b);
      check_size(s.size(), pos);
      return Value(std::move(s));
    }
    if (op == "==") return Value(equal(a, b));
    if (op == "!=") return Value(!equal(a, b));
    if (op == "in") return Value(contains(b, a, pos));
    if (op == "not in") return Value(!contains(b, a, pos));
    if (op == "<" || op == "<=" || op == ">" || op == ">=") {
      int c;
      try {
        c = compare(a, b);
      } catch (const std::exception& ex) {
        fail(pos, ex.what());
      }
      if (op == "<") return Value(c < 0);
      if (op == "<=") return Value(c <= 0);
      if (op == ">") return Value(c > 0);
      return Value(c >= 0);
    }
    if (op == "+") {
      if (a.is_string() && b.is_string()) {
        check_size(a.s().size() + b.s().size(), pos);
        return Value(a.s() + b.s());
      }
      if (a.is_list() && b.is_list()) {
        std::vector<Value> items = a.list().items;
        items.insert(items.end(), b.list().items.begin(), b.list().items.end());
        return make_list(std::move(items));
      }
    }
    if (op == "*") {
      const Value* seq = a.is_string() || a.is_list() ? &a : b.is_string() || b.is_list() ? &b : nullptr;
      const Value* cnt = seq == &a ? &b : &a;
      if (seq && is_intlike(*cnt)) {
        int64_t k = std::max<int64_t>(0, as_int(*cnt));
        if (seq->is_string()) {
          if (k > 0) check_size(seq->s().size() * size_t(k), pos);
          std::string s;
          for (int64_t i = 0; i < k; ++i) s += seq->s();
          return Value(std::move(s));
        }
        if (k > 0) check_size(seq->list().items.size() * size_t(k), pos);
        std::vector<Value> items;
        for (int64_t i = 0; i < k; ++i) items.insert(items.end(), seq->list().items.begin(), seq->list().items.end());
        return make_list(std::move(items));
      }
    }
    if (!a.is_number() || !b.is_number()) bad_operands(op, a, b, pos);
    bool ints = is_intlike(a) && is_intlike(b);
    if (op == "/") {
      double y = as_double(b);
      if (y == 0) fail(pos, "division by zero");
      return Value(as_double(a) / y);
    }
    if (ints) {
      int64_t x = as_int(a), y = as_int(b), r;
      if (op == "+") {
        if (__builtin_add_overflow(x, y, &r)) fail(pos, "integer overflow");
        return Value(r);
      }
      if (op == "-") {
        if (__builtin_sub_overflow(x, y, &r)) fail(pos, "integer overflow");
        return Value(r);
      }
      if (op == "*") {
        if (__builtin_mul_overflow(x, y, &r)) fail(pos, "integer overflow");
        return Value(r);
      }
      if (op == "//" || op == "%") {
        if (y == 0) fail(pos, "integer division or modulo by zero");
        if (x == INT64_MIN && y == -1) fail(pos, "integer overflow");
        int64_t q = x / y, m = x % y;
        if (m != 0 && ((m < 0) != (y < 0))) {
          --q;
          m += y;
        }
        return Value(op == "//" ? q : m);
      }
      if (op == "**") {
        if (y >= 0) {
          int64_t res = 1;
          for (int64_t i = 0; i < y; ++i) {
            if (__builtin_mul_overflow(res, x, &res)) fail(pos, "integer overflow");
            if (res == 0 || res == 1) break;
          }
          if (res == 1 && x == -1 && (y % 2)) res = -1;
          return Value(res);
        }
        return Value(std::pow(double(x), double(y)));
      }
    }
    double x = as_double(a), y = as_double(b);
    if (op == "+") return Value(x + y);
    if (op == "-") return Value(x - y);
    if (op == "*") return Value(x * y);
    if (op == "**") return Value(std::pow(x, y));
    if (op == "//" || op == "%") {
      if (y == 0) fail(pos, "float division or modulo by zero");
      double m = std::fmod(x, y);
      if (m != 0 && ((m < 0) != (y < 0))) m += y;
      if (op == "%") return Value(m);
      return Value(std::floor(x / y));
    }
    bad_operands(op, a, b, pos);
  }

  // ---- methods of str, dict and list ----
  static bool has_method(const Value& obj, const std::string& m) {
    static const char* str_m[] = {"startswith", "endswith",   "strip",   "lstrip",     "rstrip",  "split",   "rsplit",
                                  "upper",      "lower",      "title",   "capitalize", "replace", "find",    "count",
                                  "join",       "splitlines", "isdigit", "isalpha",    "isspace", "islower", "isupper"};
    static const char* dict_m[] = {"items", "keys", "values", "get"};
    static const char* list_m[] = {"append", "extend", "pop", "index", "count", "insert"};
    auto in = [&](auto& arr) { return std::find(std::begin(arr), std::end(arr), m) != std::end(arr); };
    if (obj.is_string()) return in(str_m);
    if (obj.is_dict() && !obj.dict().ns) return in(dict_m);
    if (obj.is_list()) return in(list_m);
    return false;
  }

  static const std::string& str_arg(const Value* v, const char* what) {
    if (!v || !v->is_string()) throw std::runtime_error(std::string(what) + " must be a string");
    return v->s();
  }

  Value call_method(const Value& obj, const std::string& m, Args& a, size_t pos) {
    if (obj.is_string()) {
      const std::string& s = obj.s();
      if (m == "startswith" || m == "endswith") {
        const Value* p = arg(a, 0, "prefix");
        if (!p) throw std::runtime_error(m + "() takes at least 1 argument");
        std::vector<std::string> cands;
        if (p->is_string()) {
          cands.push_back(p->s());
        } else if (p->is_list()) {
          for (const Value& v : p->list().items) cands.push_back(str_arg(&v, "tuple item"));
        } else {
          throw std::runtime_error(m + "() argument must be str or a tuple of str");
        }
        for (const std::string& c : cands) {
          if (c.size() > s.size()) continue;
          if (m == "startswith" ? s.compare(0, c.size(), c) == 0 : s.compare(s.size() - c.size(), c.size(), c) == 0)
            return Value(true);
        }
        return Value(false);
      }
      if (m == "strip" || m == "lstrip" || m == "rstrip") {
        const Value* c = arg(a, 0, "chars");
        const std::string* chars = (c && !c->is_none()) ? &str_arg(c, "strip chars") : nullptr;
        return Value(str_strip(s, chars, m != "rstrip", m != "lstrip"));
      }
      if (m == "split" || m == "rsplit") {
        const Value* sep = arg(a, 0, "sep");
        const Value* mx = arg(a, 1, "maxsplit");
        int64_t maxsplit = mx ? as_int(*mx) : -1;
        std::vector<std::string> parts;
        if (!sep || sep->is_none()) {
          parts = split_ws(s, maxsplit, m == "rsplit");
        } else {
          if (str_arg(sep, "separator").empty()) throw std::runtime_error("empty separator");
          parts = split_sep(s, sep->s(), maxsplit, m == "rsplit");
        }
        std::vector<Value> out(parts.begin(), parts.end());
        return make_list(std::move(out));
      }
      if (m == "upper") return Value(str_upper(s));
      if (m == "lower") return Value(str_lower(s));
      if (m == "title") return Value(str_title(s));
      if (m == "capitalize") return Value(str_capitalize(s));
      if (m == "replace") {
        const Value* c = arg(a, 2, "count");
        return Value(replace_all(s, str_arg(arg(a, 0, "old"), "old"), str_arg(arg(a, 1, "new"), "new"),
                                 c ? as_int(*c) : -1, lim.max_output_bytes));
      }
      if (m == "find") {
        size_t f = s.find(str_arg(arg(a, 0, "sub"), "sub"));
        if (f == std::string::npos) return Value(int64_t(-1));
        return Value(int64_t(char_count(s.substr(0, f))));
      }
      if (m == "count") {
        const std::string& sub = str_arg(arg(a, 0, "sub"), "sub");
        if (sub.empty()) return Value(int64_t(chars_of(s).size() + 1));
        int64_t n = 0;
        for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
        return Value(n);
      }
      if (m == "join") {
        const Value* it = arg(a, 0, "iterable");
        if (!it) throw std::runtime_error("join() takes exactly one argument");
        std::string out;
        bool first = true;
        for (const Value& v : iterate(*it, pos)) {
          if (!first) out += s;
          first = false;
          out += str_arg(&v, "join item");
          check_size(out.size(), pos);
        }
        return Value(std::move(out));
      }
      if (m == "splitlines") {
        std::vector<Value> out;
        size_t p = 0;
        while (p < s.size()) {
          size_t e = s.find_first_of("\r\n", p);
          if (e == std::string::npos) {
            out.emplace_back(s.substr(p));
            break;
          }
          out.emplace_back(s.substr(p, e - p));
          p = e + ((s[e] == '\r' && e + 1 < s.size() && s[e + 1] == '\n') ? 2 : 1);
        }
        return make_list(std::move(out));
      }
      std::vector<Char> cs = chars_of(s);
      auto all = [&](auto pred) {
        if (cs.empty()) return Value(false);
        for (const Char& c : cs)
          if (c.cp < 0 || !pred(c.cp)) return Value(false);
        return Value(true);
      };
      if (m == "isspace") return all(py_isspace);
      if (m == "isdigit") return all([](int32_t c) { return utf8proc_category(c) == UTF8PROC_CATEGORY_ND; });
      if (m == "isalpha")
        return all([](int32_t c) {
          auto k = utf8proc_category(c);
          return k >= UTF8PROC_CATEGORY_LU && k <= UTF8PROC_CATEGORY_LO;
        });
      if (m == "islower" || m == "isupper") {
        bool any = false;
        for (const Char& c : cs) {
          if (!is_cased(c.cp)) continue;
          any = true;
          bool low = utf8proc_category(c.cp) == UTF8PROC_CATEGORY_LL;
          if (low != (m == "islower")) return Value(false);
        }
        return Value(any);
      }
    } else if (obj.is_dict()) {
      const DictObj& d = obj.dict();
      if (m == "items") {
        std::vector<Value> out;
        for (const auto& kv : d.items) out.push_back(make_list({Value(kv.first), kv.second}, true));
        return make_list(std::move(out));
      }
      if (m == "keys") {
        std::vector<Value> out;
        for (const auto& kv : d.items) out.emplace_back(kv.first);
        return make_list(std::move(out));
      }
      if (m == "values") {
        std::vector<Value> out;
        for (const auto& kv : d.items) out.push_back(kv.second);
        return make_list(std::move(out));
      }
      if (m == "get") {
        const Value* k = arg(a, 0, "key");
        const Value* def = arg(a, 1, "default");
        if (!k) throw std::runtime_error("get() takes at least 1 argument");
        const Value* f = k->is_string() ? d.find(k->s()) : nullptr;
        return f ? *f : def ? *def : Value(None{});
      }
    } else if (obj.is_list()) {
      ListObj& l = obj.list();
      if (m == "append") {
        if (a.pos.size() != 1) throw std::runtime_error("append() takes exactly one argument");
        check_size(l.items.size() + 1, pos);
        l.items.push_back(a.pos[0]);
        return Value(None{});
      }
      if (m == "extend") {
        if (a.pos.size() != 1) throw std::runtime_error("extend() takes exactly one argument");
        for (const Value& v : iterate(a.pos[0], pos)) l.items.push_back(v);
        check_size(l.items.size(), pos);
        return Value(None{});
      }
      if (m == "insert") {
        if (a.pos.size() != 2 || !is_intlike(a.pos[0])) throw std::runtime_error("insert() takes (index, object)");
        int64_t i = std::clamp<int64_t>(norm_index(as_int(a.pos[0]), l.items.size()), 0, int64_t(l.items.size()));
        l.items.insert(l.items.begin() + i, a.pos[1]);
        return Value(None{});
      }
      if (m == "pop") {
        if (l.items.empty()) throw std::runtime_error("pop from empty list");
        int64_t i = a.pos.empty() ? int64_t(l.items.size()) - 1 : norm_index(as_int(a.pos[0]), l.items.size());
        if (i < 0 || i >= int64_t(l.items.size())) throw std::runtime_error("pop index out of range");
        Value v = l.items[size_t(i)];
        l.items.erase(l.items.begin() + i);
        return v;
      }
      if (m == "index" || m == "count") {
        if (a.pos.size() != 1) throw std::runtime_error(m + "() takes exactly one argument");
        int64_t n = 0;
        for (size_t i = 0; i < l.items.size(); ++i) {
          if (equal(l.items[i], a.pos[0])) {
            if (m == "index") return Value(int64_t(i));
            ++n;
          }
        }
        if (m == "index") throw std::runtime_error("value is not in list");
        return Value(n);
      }
    }
    throw std::runtime_error(std::string("'") + type_name(obj) + "' object has no method '" + m + "'");
  }

  // ---- tests ----
  bool apply_test(const std::string& name, const Value& v, const std::vector<Value>& args, size_t pos) {
    auto need = [&](size_t n) {
      if (args.size() < n) throw std::runtime_error("needs " + std::to_string(n) + " argument(s)");
    };
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.is_none();
    if (name == "string") return v.is_string();
    if (name == "mapping") return v.is_dict();
    if (name == "iterable") return v.is_list() || v.is_dict() || v.is_string();
    if (name == "sequence") return v.is_list() || v.is_dict() || v.is_string();
    if (name == "number") return v.is_number();
    if (name == "integer") return v.is_int();
    if (name == "float") return v.is_float();
    if (name == "boolean") return v.is_bool();
    if (name == "true") return v.is_bool() && v.b();
    if (name == "false") return v.is_bool() && !v.b();
    if (name == "callable") return v.is_func();
    if (name == "lower" || name == "upper") {
      Args a;
      return v.is_string() && truthy(call_method(v, name == "lower" ? "islower" : "isupper", a, pos));
    }
    if (name == "odd" || name == "even") {
      if (!is_intlike(v)) throw std::runtime_error("needs an integer");
      return (as_int(v) % 2 != 0) == (name == "odd");
    }
    if (name == "divisibleby") {
      need(1);
      if (!is_intlike(v) || !is_intlike(args[0]) || as_int(args[0]) == 0)
        throw std::runtime_error("needs non-zero integers");
      return as_int(v) % as_int(args[0]) == 0;
    }
    if (name == "eq" || name == "equalto" || name == "==") return need(1), equal(v, args[0]);
    if (name == "ne" || name == "!=") return need(1), !equal(v, args[0]);
    if (name == "sameas") {
      need(1);
      if (v.is_list() || v.is_dict() || v.is_func()) return v.v == args[0].v;
      return v.v.index() == args[0].v.index() && equal(v, args[0]);
    }
    if (name == "lt" || name == "lessthan" || name == "<") return need(1), compare(v, args[0]) < 0;
    if (name == "le" || name == "<=") return need(1), compare(v, args[0]) <= 0;
    if (name == "gt" || name == "greaterthan" || name == ">") return need(1), compare(v, args[0]) > 0;
    if (name == "ge" || name == ">=") return need(1), compare(v, args[0]) >= 0;
    if (name == "in") return need(1), contains(args[0], v, pos);
    fail(pos, "unknown test '" + name + "'");
  }

  // ---- filters ----
  Value attr_path(const Value& v, const std::string& path) {
    Value cur = v;
    size_t p = 0;
    while (true) {
      size_t dot = path.find('.', p);
      std::string part = path.substr(p, dot == std::string::npos ? std::string::npos : dot - p);
      bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
      cur = digits && cur.is_list() ? get_item(cur, Value(int64_t(std::stoll(part))), 0) : get_attr(cur, part);
      if (dot == std::string::npos) return cur;
      p = dot + 1;
    }
  }

  Value apply_filter(const std::string& name, const Value& v, Args& a, size_t pos) {
    if (name == "safe" || name == "e" || name == "escape") {
      if (name == "safe") return v;
      std::string out;
      for (char c : to_str(v)) {
        switch (c) {
          case '&':
            out += "&amp;";
            break;
          case '<':
            out += "&lt;";
            break;
          case '>':
            out += "&gt;";
            break;
          case '"':
            out += "&#34;";
            break;
          case '\'':
            out += "&#39;";
            break;
          default:
            out += c;
        }
      }
      return Value(std::move(out));
    }
    if (name == "length" || name == "count") {
      if (v.is_string()) return Value(int64_t(chars_of(v.s()).size()));
      if (v.is_list()) return Value(int64_t(v.list().items.size()));
      if (v.is_dict()) return Value(int64_t(v.dict().items.size()));
      if (v.is_undefined()) return Value(int64_t(0));
      throw std::runtime_error(std::string("object of type '") + type_name(v) + "' has no len()");
    }
    if (name == "tojson") {
      const Value* ind = arg(a, 0, "indent");
      const Value* ea = nullptr;
      const Value* seps = nullptr;
      const Value* sk = nullptr;
      for (const auto& kv : a.kw) {
        if (kv.first == "ensure_ascii")
          ea = &kv.second;
        else if (kv.first == "separators")
          seps = &kv.second;
        else if (kv.first == "sort_keys")
          sk = &kv.second;
        else if (kv.first != "indent")
          throw std::runtime_error("unexpected keyword argument '" + kv.first + "'");
      }
      int indent = (ind && !ind->is_none()) ? int(std::clamp<int64_t>(as_int(*ind), 0, 64)) : -1;
      std::string item_sep = indent >= 0 ? "," : ", ", key_sep = ": ";
      if (seps && !seps->is_none()) {
        if (!seps->is_list() || seps->list().items.size() != 2)
          throw std::runtime_error("separators must be a pair of strings");
        item_sep = str_arg(&seps->list().items[0], "separator");
        key_sep = str_arg(&seps->list().items[1], "separator");
      }
      std::string out = to_json(v, ea && truthy(*ea), indent, item_sep, key_sep, sk && truthy(*sk));
      check_size(out.size(), pos);
      return Value(std::move(out));
    }
    if (name == "string") return Value(to_str(v));
    if (name == "trim") {
      const Value* c = arg(a, 0, "chars");
      const std::string* chars = (c && !c->is_none()) ? &str_arg(c, "chars") : nullptr;
      return Value(str_strip(to_str(v), chars, true, true));
    }
    if (name == "upper") return Value(str_upper(to_str(v)));
    if (name == "lower") return Value(str_lower(to_str(v)));
    if (name == "title") return Value(str_title(to_str(v)));
    if (name == "capitalize") return Value(str_capitalize(to_str(v)));
    if (name == "default" || name == "d") {
      const Value* def = arg(a, 0, "default_value");
      const Value* boolean = arg(a, 1, "boolean");
      bool use = boolean && truthy(*boolean) ? !truthy(v) : v.is_undefined();
      if (use) return def ? *def : Value("");
      return v;
    }
    if (name == "join") {
      const Value* sep = arg(a, 0, "d");
      const Value* attr = arg(a, 1, "attribute");
      std::string s = sep ? to_str(*sep) : "", out;
      bool first = true;
      for (const Value& it : iterate(v, pos)) {
        if (!first) out += s;
        first = false;
        out += to_str(attr ? attr_path(it, to_str(*attr)) : it);
        check_size(out.size(), pos);
      }
      return Value(std::move(out));
    }
    if (name == "first" || name == "last") {
      std::vector<Value> items = iterate(v, pos);
      if (items.empty()) return Value();
      return name == "first" ? items.front() : items.back();
    }
    if (name == "list") return make_list(iterate(v, pos));
    if (name == "int") {
      const Value* def = arg(a, 0, "default");
      Value d = def ? *def : Value(int64_t(0));
      if (is_intlike(v)) return Value(as_int(v));
      if (v.is_float()) {
        if (!std::isfinite(v.f()) || std::fabs(v.f()) >= 9.2e18) return d;
        return Value(int64_t(v.f()));
      }
      if (v.is_string()) {
        std::string t = str_strip(v.s(), nullptr, true, true);
        std::string digits;
        for (char c : t)
          if (c != '_') digits += c;
        int64_t r;
        auto [p, ec] =
            std::from_chars(digits.data() + (digits.size() && digits[0] == '+'), digits.data() + digits.size(), r);
        if (ec == std::errc() && p == digits.data() + digits.size() && !digits.empty()) return Value(r);
        char* endp = nullptr;
        double f = std::strtod(t.c_str(), &endp);
        if (!t.empty() && endp == t.c_str() + t.size() && std::isfinite(f) && std::fabs(f) < 9.2e18)
          return Value(int64_t(f));
      }
      return d;
    }
    if (name == "float") {
      const Value* def = arg(a, 0, "default");
      Value d = def ? *def : Value(0.0);
      if (v.is_number()) return Value(as_double(v));
      if (v.is_string()) {
        std::string t = str_strip(v.s(), nullptr, true, true);
        char* endp = nullptr;
        double f = std::strtod(t.c_str(), &endp);
        if (!t.empty() && endp == t.c_str() + t.size()) return Value(f);
      }
      return d;
    }
    if (name == "abs") {
      if (v.is_float()) return Value(std::fabs(v.f()));
      if (is_intlike(v)) return Value(as_int(v) < 0 ? -as_int(v) : as_int(v));
      throw std::runtime_error(std::string("bad operand type for abs(): '") + type_name(v) + "'");
    }
    if (name == "round") {
      const Value* pr = arg(a, 0, "precision");
      const Value* method = arg(a, 1, "method");
      std::string mth = method ? to_str(*method) : "common";
      int64_t p = pr ? as_int(*pr) : 0;
      double x = as_double(v), scale = std::pow(10.0, double(p)), y = x * scale;
      if (mth == "common")
        y = std::nearbyint(y);
      else if (mth == "ceil")
        y = std::ceil(y);
      else if (mth == "floor")
        y = std::floor(y);
      else
        throw std::runtime_error("method must be common, ceil or floor");
      return Value(y / scale);
    }
    if (name == "replace") {
      const Value* c = arg(a, 2, "count");
      return Value(replace_all(to_str(v), to_str(*arg(a, 0, "old")), to_str(*arg(a, 1, "new")),
                               c && !c->is_none() ? as_int(*c) : -1, lim.max_output_bytes));
    }
    if (name == "items") {
      if (v.is_undefined()) return make_list();
      if (!v.is_dict()) throw std::runtime_error("can only get item pairs from a mapping");
      Args none;
      return call_method(v, "items", none, pos);
    }
    if (name == "dictsort") {
      if (!v.is_dict()) throw std::runtime_error("dictsort needs a mapping");
      std::vector<std::pair<std::string, Value>> items = v.dict().items;
      std::stable_sort(items.begin(), items.end(),
                       [](auto& x, auto& y) { return lower_ascii(x.first) < lower_ascii(y.first); });
      std::vector<Value> out;
      for (auto& kv : items) out.push_back(make_list({Value(kv.first), kv.second}, true));
      return make_list(std::move(out));
    }
    if (name == "reverse") {
      if (v.is_string()) {
        std::vector<Char> cs = chars_of(v.s());
        std::string out;
        for (size_t i = cs.size(); i-- > 0;) out.append(v.s(), cs[i].off, cs[i].len);
        return Value(std::move(out));
      }
      std::vector<Value> items = iterate(v, pos);
      std::reverse(items.begin(), items.end());
      return make_list(std::move(items));
    }
    if (name == "selectattr" || name == "rejectattr" || name == "select" || name == "reject") {
      bool attr = name.back() == 'r';
      bool keep_if = name[0] == 's';
      size_t k = 0;
      std::string path;
      if (attr) {
        if (a.pos.empty() || !a.pos[0].is_string()) throw std::runtime_error("needs an attribute name");
        path = a.pos[0].s();
        k = 1;
      }
      std::string test = k < a.pos.size() ? to_str(a.pos[k]) : "";
      std::vector<Value> targs(a.pos.begin() + std::min(a.pos.size(), k + 1), a.pos.end());
      std::vector<Value> out;
      for (const Value& it : iterate(v, pos)) {
        Value x = attr ? attr_path(it, path) : it;
        bool r = test.empty() ? truthy(x) : apply_test(test, x, targs, pos);
        if (r == keep_if) out.push_back(it);
      }
      return make_list(std::move(out));
    }
    if (name == "map") {
      std::vector<Value> out;
      const Value* attr = nullptr;
      const Value* def = nullptr;
      for (const auto& kv : a.kw) {
        if (kv.first == "attribute")
          attr = &kv.second;
        else if (kv.first == "default")
          def = &kv.second;
      }
      if (attr) {
        for (const Value& it : iterate(v, pos)) {
          Value x = attr_path(it, to_str(*attr));
          out.push_back(x.is_undefined() && def ? *def : x);
        }
        return make_list(std::move(out));
      }
      if (a.pos.empty() || !a.pos[0].is_string()) throw std::runtime_error("map needs a filter name or attribute=");
      std::string f = a.pos[0].s();
      Args fa;
      fa.pos.assign(a.pos.begin() + 1, a.pos.end());
      fa.kw = a.kw;
      for (const Value& it : iterate(v, pos)) out.push_back(apply_filter(f, it, fa, pos));
      return make_list(std::move(out));
    }
    if (name == "sort" || name == "unique" || name == "min" || name == "max") {
      const Value* rev = nullptr;
      const Value* cs = nullptr;
      const Value* attr = nullptr;
      size_t i = 0;
      if (name == "sort") rev = arg(a, i++, "reverse");
      cs = arg(a, i++, "case_sensitive");
      attr = arg(a, i++, "attribute");
      bool case_sensitive = cs && truthy(*cs);
      auto key = [&](const Value& x) {
        Value k = attr && !attr->is_none() ? attr_path(x, to_str(*attr)) : x;
        if (!case_sensitive && k.is_string()) return Value(str_lower(k.s()));
        return k;
      };
      std::vector<Value> items = iterate(v, pos);
      if (name == "unique") {
        std::vector<Value> out, keys;
        for (const Value& it : items) {
          Value kk = key(it);
          if (std::none_of(keys.begin(), keys.end(), [&](const Value& y) { return equal(y, kk); })) {
            keys.push_back(kk);
            out.push_back(it);
          }
        }
        return make_list(std::move(out));
      }
      if (name == "min" || name == "max") {
        if (items.empty()) return Value();
        size_t best = 0;
        for (size_t j = 1; j < items.size(); ++j) {
          int c = compare(key(items[j]), key(items[best]));
          if (name == "min" ? c < 0 : c > 0) best = j;
        }
        return items[best];
      }
      bool reverse = rev && truthy(*rev);
      std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
        int c = compare(key(x), key(y));
        return reverse ? c > 0 : c < 0;
      });
      return make_list(std::move(items));
    }
    if (name == "sum") {
      const Value* attr = arg(a, 0, "attribute");
      const Value* start = arg(a, 1, "start");
      Value acc = start ? *start : Value(int64_t(0));
      for (const Value& it : iterate(v, pos)) {
        Value x = attr && !attr->is_none() ? attr_path(it, to_str(*attr)) : it;
        if (!acc.is_number() || !x.is_number()) bad_operands("+", acc, x, pos);
        if (is_intlike(acc) && is_intlike(x)) {
          int64_t r;
          if (__builtin_add_overflow(as_int(acc), as_int(x), &r)) fail(pos, "integer overflow");
          acc = Value(r);
        } else {
          acc = Value(as_double(acc) + as_double(x));
        }
      }
      return acc;
    }
    if (name == "indent") {
      const Value* w = arg(a, 0, "width");
      const Value* first = arg(a, 1, "first");
      const Value* blank = arg(a, 2, "blank");
      std::string pad =
          w ? (w->is_string() ? w->s() : std::string(size_t(std::clamp<int64_t>(as_int(*w), 0, 256)), ' '))
            : std::string(4, ' ');
      std::string s = to_str(v), out;
      std::vector<std::string> lines = split_sep(s, "\n", -1, false);
      for (size_t i = 0; i < lines.size(); ++i) {
        if (i) out += '\n';
        bool indent_it = (i > 0 || (first && truthy(*first))) && (!lines[i].empty() || (blank && truthy(*blank)));
        if (indent_it) out += pad;
        out += lines[i];
        check_size(out.size(), pos);
      }
      return Value(std::move(out));
    }
    fail(pos, "unknown filter '" + name + "'");
  }
};

namespace {

void add_builtin(Frame& f, const std::string& name, std::function<Value(Interp&, std::vector<Value>&, Kwargs&)> fn) {
  auto obj = std::make_shared<FuncObj>();
  obj->name = name;
  obj->fn = std::move(fn);
  f[name] = Value(std::move(obj));
}

std::shared_ptr<Frame> builtins() {
  auto f = std::make_shared<Frame>();
  add_builtin(*f, "range", [](Interp& in, std::vector<Value>& a, Kwargs&) -> Value {
    if (a.empty() || a.size() > 3) throw std::runtime_error("range expected 1 to 3 arguments");
    for (const Value& v : a)
      if (!is_intlike(v)) throw std::runtime_error("range() arguments must be integers");
    int64_t start = 0, stop, step = 1;
    if (a.size() == 1) {
      stop = as_int(a[0]);
    } else {
      start = as_int(a[0]);
      stop = as_int(a[1]);
      if (a.size() == 3) step = as_int(a[2]);
    }
    if (step == 0) throw std::runtime_error("range() arg 3 must not be zero");
    // Number of items, computed without overflow; the list is materialized, so it is capped.
    unsigned __int128 span = step > 0 ? (stop > start ? (unsigned __int128)((__int128)stop - start) : 0)
                                      : (start > stop ? (unsigned __int128)((__int128)start - stop) : 0);
    unsigned __int128 mag = step > 0 ? (unsigned __int128)step : (unsigned __int128)(-(__int128)step);
    unsigned __int128 count = (span + mag - 1) / mag;
    if (count > kMaxRange) throw std::runtime_error("range() of more than " + std::to_string(kMaxRange) + " items");
    std::vector<Value> out;
    out.reserve(size_t(count));
    for (size_t k = 0; k < size_t(count); ++k) out.emplace_back(int64_t((__int128)start + (__int128)k * step));
    return make_list(std::move(out));
  });
  add_builtin(*f, "namespace", [](Interp&, std::vector<Value>& a, Kwargs& kw) -> Value {
    Value ns = make_dict();
    ns.dict().ns = true;
    for (const Value& v : a) {
      if (!v.is_dict()) throw std::runtime_error("namespace() positional arguments must be mappings");
      for (const auto& kv : v.dict().items) ns.dict().set(kv.first, kv.second);
    }
    for (const auto& kv : kw) ns.dict().set(kv.first, kv.second);
    return ns;
  });
  add_builtin(*f, "dict", [](Interp&, std::vector<Value>& a, Kwargs& kw) -> Value {
    Value d = make_dict();
    for (const Value& v : a) {
      if (!v.is_dict()) throw std::runtime_error("dict() positional arguments must be mappings");
      for (const auto& kv : v.dict().items) d.dict().set(kv.first, kv.second);
    }
    for (const auto& kv : kw) d.dict().set(kv.first, kv.second);
    return d;
  });
  add_builtin(*f, "raise_exception", [](Interp&, std::vector<Value>& a, Kwargs&) -> Value {
    throw TemplateException(a.empty() ? std::string() : to_str(a[0]));
  });
  add_builtin(*f, "strftime_now", [](Interp&, std::vector<Value>& a, Kwargs&) -> Value {
    if (a.size() != 1 || !a[0].is_string()) throw std::runtime_error("strftime_now(format) needs a format string");
    std::time_t t = std::time(nullptr);
    std::tm tm{};
    localtime_r(&t, &tm);
    char buf[512];
    size_t n = std::strftime(buf, sizeof buf, a[0].s().c_str(), &tm);
    return Value(std::string(buf, n));
  });
  return f;
}

}  // namespace

std::string render_program(const Program& prog, const Value& globals, const RenderLimits& limits) {
  Interp in(prog, limits);
  static const std::shared_ptr<Frame> kBuiltins = builtins();
  in.scopes.push_back(std::make_shared<Frame>(*kBuiltins));
  auto g = std::make_shared<Frame>();
  if (globals.is_dict())
    for (const auto& kv : globals.dict().items) (*g)[kv.first] = kv.second;
  in.scopes.push_back(g);
  std::string out;
  in.out = &out;
  in.exec(prog.body);
  return out;
}

}  // namespace hypic::jinja
