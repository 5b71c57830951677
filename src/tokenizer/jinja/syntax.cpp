// Lexer and recursive-descent parser for the Jinja subset of chat templates. Written from the
// Jinja2 template designer documentation (syntax, operator precedence, whitespace control).
#include "tokenizer/jinja/syntax.h"

#include <cstdlib>
#include <cstring>

namespace hypic::jinja {

std::pair<size_t, size_t> line_col(const std::string& source, size_t pos) {
  size_t line = 1, col = 1;
  for (size_t i = 0; i < pos && i < source.size(); ++i) {
    if (source[i] == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  return {line, col};
}

namespace {

enum class Tok { Text, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, Eof };

struct Token {
  Tok type;
  std::string text;  // Text content, name, decoded string, operator
  size_t pos;
  int64_t ival = 0;
  double fval = 0;
};

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
bool is_ident_start(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
bool is_ident(char c) {
  return is_ident_start(c) || (c >= '0' && c <= '9');
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

std::string normalize_newlines(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\r') {
      out += '\n';
      if (i + 1 < s.size() && s[i + 1] == '\n') ++i;
    } else {
      out += s[i];
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(const std::string& src) : s_(src) {}

  std::vector<Token> run() {
    // Jinja drops one trailing newline of the template (keep_trailing_newline=False).
    size_t end = s_.size();
    if (end > 0 && s_[end - 1] == '\n') {
      --end;
      if (end > 0 && s_[end - 1] == '\r') --end;
    } else if (end > 0 && s_[end - 1] == '\r') {
      --end;
    }
    end_ = end;
    size_t pos = 0;
    char prev_kind = 0;   // kind of the previous tag: '{', '%', '#'
    char prev_right = 0;  // '-' / '+' / 0 modifier before the previous tag's close
    while (pos < end_) {
      size_t tag = find_tag(pos);
      std::string text = s_.substr(pos, (tag == std::string::npos ? end_ : tag) - pos);
      // Left side: effects of the previous tag's close.
      if (prev_right == '-') {
        size_t k = 0;
        while (k < text.size() && is_space(text[k])) ++k;
        text.erase(0, k);
      } else if ((prev_kind == '%' || prev_kind == '#') && prev_right != '+') {
        if (text.size() >= 2 && text[0] == '\r' && text[1] == '\n')
          text.erase(0, 2);
        else if (!text.empty() && (text[0] == '\n' || text[0] == '\r'))
          text.erase(0, 1);
      }
      if (tag == std::string::npos) {
        emit_text(text, pos);
        break;
      }
      char kind = s_[tag + 1];
      char left = tag + 2 < end_ ? s_[tag + 2] : 0;
      if (left == '-') {
        while (!text.empty() && is_space(text.back())) text.pop_back();
      } else if ((kind == '%' || kind == '#') && left != '+') {
        // lstrip_blocks: spaces/tabs between the start of the line and the tag.
        size_t k = tag;
        while (k > pos && (s_[k - 1] == ' ' || s_[k - 1] == '\t')) --k;
        if (k == 0 || s_[k - 1] == '\n' || s_[k - 1] == '\r') {
          size_t n = tag - k;
          text.erase(text.size() - std::min(n, text.size()));
        }
      }
      emit_text(text, pos);
      size_t p = tag + 2;
      if (left == '-' || left == '+') ++p;
      if (kind == '#') {
        size_t close = s_.find("#}", p);
        if (close == std::string::npos || close + 2 > end_) throw PosError(tag, "unterminated comment");
        prev_right = (close > p && (s_[close - 1] == '-' || s_[close - 1] == '+')) ? s_[close - 1] : 0;
        pos = close + 2;
      } else {
        toks_.push_back({kind == '{' ? Tok::VarBegin : Tok::BlockBegin, "", tag});
        size_t first = toks_.size();
        pos = lex_tag(p, kind, tag, prev_right);
        if (kind == '%' && toks_.size() == first + 2 && toks_[first].type == Tok::Name && toks_[first].text == "raw") {
          pos = lex_raw(pos, prev_right, tag);
          kind = '%';
        }
      }
      prev_kind = kind;
    }
    toks_.push_back({Tok::Eof, "", end_});
    return std::move(toks_);
  }

 private:
  void emit_text(const std::string& text, size_t pos) {
    if (!text.empty()) toks_.push_back({Tok::Text, normalize_newlines(text), pos});
  }

  size_t find_tag(size_t from) const {
    for (size_t i = from; i + 1 < end_; ++i)
      if (s_[i] == '{' && (s_[i + 1] == '{' || s_[i + 1] == '%' || s_[i + 1] == '#')) return i;
    return std::string::npos;
  }

  // {% raw %}...{% endraw %}: the text in between is literal. Called after the raw tag's close.
  size_t lex_raw(size_t pos, char& right, size_t tag_pos) {
    size_t search = pos;
    while (true) {
      size_t t = s_.find("{%", search);
      if (t == std::string::npos || t >= end_) throw PosError(tag_pos, "missing endraw for raw block");
      size_t p = t + 2;
      char left = 0;
      if (p < end_ && (s_[p] == '-' || s_[p] == '+')) left = s_[p++];
      while (p < end_ && is_space(s_[p])) ++p;
      if (s_.compare(p, 6, "endraw") == 0) {
        size_t q = p + 6;
        while (q < end_ && is_space(s_[q])) ++q;
        char r = 0;
        if (q < end_ && (s_[q] == '-' || s_[q] == '+')) r = s_[q++];
        if (s_.compare(q, 2, "%}") == 0) {
          // Remove the raw tag's BlockBegin/Name/BlockEnd tokens and emit the literal text.
          toks_.resize(toks_.size() - 3);
          std::string text = s_.substr(pos, t - pos);
          if (right == '-') {
            size_t k = 0;
            while (k < text.size() && is_space(text[k])) ++k;
            text.erase(0, k);
          } else if (right != '+' && !text.empty() && text[0] == '\n') {
            text.erase(0, 1);
          }
          if (left == '-')
            while (!text.empty() && is_space(text.back())) text.pop_back();
          emit_text(text, pos);
          right = r;
          return q + 2;
        }
      }
      search = t + 2;
    }
  }

  size_t lex_tag(size_t p, char kind, size_t tag_pos, char& right) {
    const char* close = kind == '{' ? "}}" : "%}";
    while (true) {
      while (p < end_ && is_space(s_[p])) ++p;
      if (p >= end_) throw PosError(tag_pos, kind == '{' ? "unterminated '{{'" : "unterminated '{%'");
      char c = s_[p];
      if ((c == '-' || c == '+') && s_.compare(p + 1, 2, close) == 0 && p + 3 <= end_) {
        right = c;
        toks_.push_back({kind == '{' ? Tok::VarEnd : Tok::BlockEnd, "", p});
        return p + 3;
      }
      if (s_.compare(p, 2, close) == 0 && p + 2 <= end_) {
        right = 0;
        toks_.push_back({kind == '{' ? Tok::VarEnd : Tok::BlockEnd, "", p});
        return p + 2;
      }
      if (is_ident_start(c)) {
        size_t q = p;
        while (q < end_ && is_ident(s_[q])) ++q;
        toks_.push_back({Tok::Name, s_.substr(p, q - p), p});
        p = q;
      } else if (c >= '0' && c <= '9') {
        p = lex_number(p);
      } else if (c == '\'' || c == '"') {
        p = lex_string(p);
      } else {
        static const char* ops[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<",
                                    ">",  "=",  "(",  ")",  "[",  "]",  "{", "}", ",", ".", ":", "|"};
        bool found = false;
        for (const char* op : ops) {
          size_t n = std::strlen(op);
          if (s_.compare(p, n, op) == 0) {
            toks_.push_back({Tok::Op, op, p});
            p += n;
            found = true;
            break;
          }
        }
        if (!found) throw PosError(p, std::string("unexpected character '") + c + "'");
      }
    }
  }

  size_t lex_number(size_t p) {
    size_t q = p;
    while (q < end_ && (std::isdigit(uint8_t(s_[q])) || s_[q] == '_')) ++q;
    bool is_float = false;
    if (q + 1 < end_ && s_[q] == '.' && std::isdigit(uint8_t(s_[q + 1]))) {
      is_float = true;
      ++q;
      while (q < end_ && (std::isdigit(uint8_t(s_[q])) || s_[q] == '_')) ++q;
    }
    if (q < end_ && (s_[q] == 'e' || s_[q] == 'E')) {
      size_t r = q + 1;
      if (r < end_ && (s_[r] == '+' || s_[r] == '-')) ++r;
      if (r < end_ && std::isdigit(uint8_t(s_[r]))) {
        is_float = true;
        q = r;
        while (q < end_ && std::isdigit(uint8_t(s_[q]))) ++q;
      }
    }
    std::string digits;
    for (size_t i = p; i < q; ++i)
      if (s_[i] != '_') digits += s_[i];
    Token t{is_float ? Tok::Float : Tok::Int, digits, p};
    if (is_float) {
      t.fval = std::strtod(digits.c_str(), nullptr);
    } else {
      errno = 0;
      char* endp = nullptr;
      long long v = std::strtoll(digits.c_str(), &endp, 10);
      if (errno == ERANGE) throw PosError(p, "integer literal too large");
      t.ival = v;
    }
    toks_.push_back(t);
    return q;
  }

  static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }

  size_t lex_string(size_t p) {
    char q = s_[p];
    std::string out;
    size_t i = p + 1;
    while (true) {
      if (i >= end_) throw PosError(p, "unterminated string literal");
      char c = s_[i];
      if (c == q) break;
      if (c != '\\') {
        out += c;
        ++i;
        continue;
      }
      if (i + 1 >= end_) throw PosError(p, "unterminated string literal");
      char e = s_[i + 1];
      i += 2;
      switch (e) {
        case 'n':
          out += '\n';
          break;
        case 't':
          out += '\t';
          break;
        case 'r':
          out += '\r';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'v':
          out += '\v';
          break;
        case 'a':
          out += '\a';
          break;
        case '0':
          out += '\0';
          break;
        case '\\':
          out += '\\';
          break;
        case '\'':
          out += '\'';
          break;
        case '"':
          out += '"';
          break;
        case '\n':
          break;  // line continuation
        case 'x':
        case 'u':
        case 'U': {
          size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          uint32_t cp = 0;
          for (size_t k = 0; k < n; ++k) {
            int h = i + k < end_ ? hexval(s_[i + k]) : -1;
            if (h < 0) throw PosError(i - 2, std::string("bad \\") + e + " escape in string literal");
            cp = cp * 16 + uint32_t(h);
          }
          if (cp > 0x10FFFF) throw PosError(i - 2, "escape out of Unicode range");
          i += n;
          append_utf8(out, cp);
          break;
        }
        default:
          out += '\\';
          out += e;
      }
    }
    toks_.push_back({Tok::String, out, p});
    return i + 1;
  }

  const std::string& s_;
  size_t end_ = 0;
  std::vector<Token> toks_;
};

class Parser {
 public:
  Parser(std::vector<Token> toks, const ParseLimits& lim) : t_(std::move(toks)), lim_(lim) {}

  Body parse_all() {
    std::string end_tag;
    Body body = parse_body({}, end_tag);
    return body;
  }

 private:
  struct DepthGuard {
    Parser& p;
    explicit DepthGuard(Parser& pp, size_t pos) : p(pp) {
      if (++p.depth_ > p.lim_.max_nesting)
        throw PosError(pos, "template nested too deeply (limit " + std::to_string(p.lim_.max_nesting) + ")");
    }
    ~DepthGuard() { --p.depth_; }
  };

  const Token& peek(size_t k = 0) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  const Token& next() {
    const Token& t = t_[i_];
    if (i_ + 1 < t_.size()) ++i_;
    return t;
  }
  bool is_op(const char* op, size_t k = 0) const { return peek(k).type == Tok::Op && peek(k).text == op; }
  bool is_name(const char* n, size_t k = 0) const { return peek(k).type == Tok::Name && peek(k).text == n; }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case Tok::Text:
        return "template text";
      case Tok::VarBegin:
        return "'{{'";
      case Tok::VarEnd:
        return "'}}'";
      case Tok::BlockBegin:
        return "'{%'";
      case Tok::BlockEnd:
        return "'%}'";
      case Tok::Name:
        return "'" + t.text + "'";
      case Tok::String:
        return "string literal";
      case Tok::Int:
      case Tok::Float:
        return "number " + t.text;
      case Tok::Op:
        return "'" + t.text + "'";
      case Tok::Eof:
        return "end of template";
    }
    return "?";
  }
  [[noreturn]] void fail(const std::string& what) { throw PosError(peek().pos, what + ", got " + describe(peek())); }
  void expect_op(const char* op) {
    if (!is_op(op)) fail(std::string("expected '") + op + "'");
    next();
  }
  void expect_block_end() {
    if (peek().type != Tok::BlockEnd) fail("expected '%}'");
    next();
  }
  std::string expect_name(const char* what) {
    if (peek().type != Tok::Name) fail(std::string("expected ") + what);
    return next().text;
  }

  // Parses nodes until a block tag whose name is in `ends` (consumed up to and including the name;
  // its name stored in end_tag) or end of input (only when ends is empty).
  Body parse_body(const std::vector<std::string>& ends, std::string& end_tag, size_t open_pos = 0,
                  const char* open_name = nullptr) {
    DepthGuard g(*this, peek().pos);
    Body body;
    while (true) {
      const Token& t = peek();
      if (t.type == Tok::Eof) {
        if (!ends.empty())
          throw PosError(open_pos, std::string("unclosed '") + open_name + "' block (expected '{% " + ends.back() +
                                       " %}' before end of template)");
        return body;
      }
      if (t.type == Tok::Text) {
        auto n = std::make_unique<Node>();
        n->kind = Node::Text;
        n->pos = t.pos;
        n->text = t.text;
        body.push_back(std::move(n));
        next();
      } else if (t.type == Tok::VarBegin) {
        next();
        auto n = std::make_unique<Node>();
        n->kind = Node::Output;
        n->pos = peek().pos;
        n->expr = parse_tuple(true);
        if (peek().type != Tok::VarEnd) fail("expected '}}'");
        next();
        body.push_back(std::move(n));
      } else if (t.type == Tok::BlockBegin) {
        size_t tag_pos = next().pos;
        if (peek().type != Tok::Name) fail("expected a statement name after '{%'");
        const std::string& name = peek().text;
        for (const std::string& e : ends) {
          if (name == e) {
            end_tag = name;
            next();
            return body;
          }
        }
        body.push_back(parse_statement(tag_pos));
      } else {
        fail("unexpected token");
      }
    }
  }

  // `pos` is the offset of the statement's '{%'.
  NodeP parse_statement(size_t pos) {
    const Token& t = peek();
    const size_t name_pos = t.pos;
    std::string name = t.text;
    next();
    auto n = std::make_unique<Node>();
    n->pos = pos;
    if (name == "if") {
      n->kind = Node::If;
      ExprP cond = parse_tuple(true);
      expect_block_end();
      while (true) {
        std::string end;
        Body b = parse_body({"elif", "else", "endif"}, end, pos, "if");
        n->branches.emplace_back(std::move(cond), std::move(b));
        if (end == "endif") {
          expect_block_end();
          break;
        }
        if (end == "else") {
          expect_block_end();
          std::string end2;
          Body eb = parse_body({"endif"}, end2, pos, "if");
          expect_block_end();
          n->branches.emplace_back(nullptr, std::move(eb));
          break;
        }
        cond = parse_tuple(true);
        expect_block_end();
      }
    } else if (name == "for") {
      n->kind = Node::For;
      parse_targets(*n);
      if (!is_name("in")) fail("expected 'in' in for loop");
      next();
      n->expr = parse_tuple(false);
      if (is_name("if")) {
        next();
        n->cond = parse_expression(true);
      }
      if (is_name("recursive")) throw PosError(peek().pos, "recursive loops are not supported");
      expect_block_end();
      std::string end;
      n->body = parse_body({"else", "endfor"}, end, pos, "for");
      expect_block_end();
      if (end == "else") {
        std::string end2;
        n->else_body = parse_body({"endfor"}, end2, pos, "for");
        expect_block_end();
      }
    } else if (name == "set") {
      if (peek().type == Tok::Name && is_op(".", 1)) {
        n->kind = Node::SetAttr;
        auto obj = std::make_unique<Expr>();
        obj->kind = Expr::Name;
        obj->pos = peek().pos;
        obj->name = next().text;
        n->expr = std::move(obj);
        next();  // '.'
        n->text = expect_name("an attribute name");
        expect_op("=");
        n->value = parse_tuple(true);
        expect_block_end();
      } else {
        parse_targets(*n);
        if (is_op("=")) {
          next();
          n->kind = Node::Set;
          n->expr = parse_tuple(true);
          expect_block_end();
        } else {
          if (n->unpack) fail("expected '='");
          if (is_op("|")) throw PosError(peek().pos, "filters on block set are not supported");
          n->kind = Node::SetBlock;
          expect_block_end();
          std::string end;
          n->body = parse_body({"endset"}, end, pos, "set");
          expect_block_end();
        }
      }
    } else if (name == "macro") {
      n->kind = Node::Macro;
      n->text = expect_name("a macro name");
      expect_op("(");
      while (!is_op(")")) {
        std::string p = expect_name("a parameter name");
        ExprP def;
        if (is_op("=")) {
          next();
          def = parse_expression(true);
        }
        n->params.emplace_back(p, std::move(def));
        if (!is_op(",")) break;
        next();
      }
      expect_op(")");
      expect_block_end();
      std::string end;
      n->body = parse_body({"endmacro"}, end, pos, "macro");
      if (peek().type == Tok::Name) next();  // optional macro name after endmacro
      expect_block_end();
    } else if (name == "break" || name == "continue") {
      if (loop_depth_ == 0) throw PosError(pos, "'" + name + "' outside of a loop");
      n->kind = name == "break" ? Node::Break : Node::Continue;
      expect_block_end();
    } else if (name == "generation") {
      n->kind = Node::Scope;
      expect_block_end();
      std::string end;
      n->body = parse_body({"endgeneration"}, end, pos, "generation");
      expect_block_end();
    } else {
      throw PosError(name_pos, "unknown or unsupported statement '" + name + "'");
    }
    return n;
  }

  void parse_targets(Node& n) {
    bool paren = is_op("(");
    if (paren) next();
    n.targets.push_back(expect_name("a variable name"));
    while (is_op(",")) {
      n.unpack = true;
      next();
      if (peek().type != Tok::Name) break;
      n.targets.push_back(next().text);
    }
    if (paren) {
      n.unpack = true;
      expect_op(")");
    }
    for (const std::string& t : n.targets)
      if (t == "true" || t == "false" || t == "none" || t == "True" || t == "False" || t == "None")
        throw PosError(n.pos, "cannot assign to '" + t + "'");
  }

  ExprP make(Expr::Kind k, size_t pos) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->pos = pos;
    return e;
  }

  // expression [',' expression ...] -> tuple when a comma is present.
  ExprP parse_tuple(bool with_cond) {
    size_t pos = peek().pos;
    ExprP first = parse_expression(with_cond);
    if (!is_op(",")) return first;
    auto t = make(Expr::List, pos);
    t->flag = true;
    t->args.push_back(std::move(first));
    while (is_op(",")) {
      next();
      if (peek().type == Tok::VarEnd || peek().type == Tok::BlockEnd || is_op(")") || is_name("if")) break;
      t->args.push_back(parse_expression(with_cond));
    }
    return t;
  }

  ExprP parse_expression(bool with_cond) {
    DepthGuard g(*this, peek().pos);
    size_t pos = peek().pos;
    ExprP e = parse_or();
    if (!with_cond) return e;
    while (is_name("if")) {
      next();
      auto c = make(Expr::Cond, pos);
      c->a = parse_or();
      c->b = std::move(e);
      if (is_name("else")) {
        next();
        c->c = parse_expression(true);
      }
      e = std::move(c);
    }
    return e;
  }

  ExprP binary(const std::string& op, ExprP l, ExprP r, size_t pos) {
    auto e = make(Expr::Binary, pos);
    e->name = op;
    e->a = std::move(l);
    e->b = std::move(r);
    return e;
  }

  ExprP parse_or() {
    ExprP l = parse_and();
    while (is_name("or")) {
      size_t pos = next().pos;
      l = binary("or", std::move(l), parse_and(), pos);
    }
    return l;
  }
  ExprP parse_and() {
    ExprP l = parse_not();
    while (is_name("and")) {
      size_t pos = next().pos;
      l = binary("and", std::move(l), parse_not(), pos);
    }
    return l;
  }
  ExprP parse_not() {
    if (is_name("not")) {
      DepthGuard g(*this, peek().pos);
      auto e = make(Expr::Unary, next().pos);
      e->name = "not";
      e->a = parse_not();
      return e;
    }
    return parse_compare();
  }
  ExprP parse_compare() {
    ExprP l = parse_math1();
    while (true) {
      size_t pos = peek().pos;
      std::string op;
      if (peek().type == Tok::Op && (peek().text == "==" || peek().text == "!=" || peek().text == "<" ||
                                     peek().text == "<=" || peek().text == ">" || peek().text == ">=")) {
        op = next().text;
      } else if (is_name("in")) {
        next();
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        next();
        next();
        op = "not in";
      } else {
        return l;
      }
      l = binary(op, std::move(l), parse_math1(), pos);
    }
  }
  ExprP parse_math1() {
    ExprP l = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token& t = next();
      std::string op = t.text;
      l = binary(op, std::move(l), parse_concat(), t.pos);
    }
    return l;
  }
  ExprP parse_concat() {
    ExprP l = parse_math2();
    while (is_op("~")) {
      size_t pos = next().pos;
      l = binary("~", std::move(l), parse_math2(), pos);
    }
    return l;
  }
  ExprP parse_math2() {
    ExprP l = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& t = next();
      std::string op = t.text;
      l = binary(op, std::move(l), parse_pow(), t.pos);
    }
    return l;
  }
  ExprP parse_pow() {
    ExprP l = parse_unary(true);
    while (is_op("**")) {
      size_t pos = next().pos;
      l = binary("**", std::move(l), parse_unary(true), pos);
    }
    return l;
  }
  ExprP parse_unary(bool with_filter) {
    DepthGuard g(*this, peek().pos);
    ExprP e;
    if (is_op("-") || is_op("+")) {
      const Token& t = next();
      e = make(Expr::Unary, t.pos);
      e->name = t.text;
      e->a = parse_unary(false);
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filters(std::move(e));
    return e;
  }

  ExprP parse_primary() {
    const Token& t = peek();
    switch (t.type) {
      case Tok::Name: {
        next();
        auto e = make(Expr::Literal, t.pos);
        if (t.text == "true" || t.text == "True") {
          e->lit = Value(true);
        } else if (t.text == "false" || t.text == "False") {
          e->lit = Value(false);
        } else if (t.text == "none" || t.text == "None") {
          e->lit = Value(None{});
        } else {
          e->kind = Expr::Name;
          e->name = t.text;
        }
        return e;
      }
      case Tok::String: {
        auto e = make(Expr::Literal, t.pos);
        std::string s;
        while (peek().type == Tok::String) s += next().text;  // adjacent literals concatenate
        e->lit = Value(std::move(s));
        return e;
      }
      case Tok::Int: {
        next();
        auto e = make(Expr::Literal, t.pos);
        e->lit = Value(t.ival);
        return e;
      }
      case Tok::Float: {
        next();
        auto e = make(Expr::Literal, t.pos);
        e->lit = Value(t.fval);
        return e;
      }
      case Tok::Op:
        if (t.text == "(") {
          size_t pos = next().pos;
          if (is_op(")")) {
            next();
            auto e = make(Expr::List, pos);
            e->flag = true;
            return e;
          }
          ExprP e = parse_tuple(true);
          expect_op(")");
          return e;
        }
        if (t.text == "[") {
          auto e = make(Expr::List, next().pos);
          while (!is_op("]")) {
            e->args.push_back(parse_expression(true));
            if (!is_op(",")) break;
            next();
          }
          expect_op("]");
          return e;
        }
        if (t.text == "{") {
          auto e = make(Expr::Dict, next().pos);
          while (!is_op("}")) {
            e->args.push_back(parse_expression(true));
            expect_op(":");
            e->args.push_back(parse_expression(true));
            if (!is_op(",")) break;
            next();
          }
          expect_op("}");
          return e;
        }
        break;
      default:
        break;
    }
    fail("expected an expression");
  }

  ExprP parse_postfix(ExprP e) {
    while (true) {
      if (is_op(".")) {
        size_t pos = next().pos;
        auto g = make(Expr::GetAttr, pos);
        if (peek().type == Tok::Name) {
          g->name = next().text;
        } else if (peek().type == Tok::Int) {
          g->kind = Expr::GetItem;
          auto idx = make(Expr::Literal, peek().pos);
          idx->lit = Value(next().ival);
          g->b = std::move(idx);
        } else {
          fail("expected an attribute name after '.'");
        }
        g->a = std::move(e);
        e = std::move(g);
      } else if (is_op("[")) {
        size_t pos = next().pos;
        ExprP parts[3];
        int n = 0;
        bool slice = false;
        while (true) {
          if (!is_op(":") && !is_op("]")) parts[n] = parse_expression(true);
          if (is_op(":")) {
            if (n == 2) fail("expected ']'");
            slice = true;
            next();
            ++n;
            continue;
          }
          break;
        }
        expect_op("]");
        if (!slice) {
          if (!parts[0]) throw PosError(pos, "empty subscript");
          auto g = make(Expr::GetItem, pos);
          g->a = std::move(e);
          g->b = std::move(parts[0]);
          e = std::move(g);
        } else {
          auto s = make(Expr::Slice, pos);
          s->a = std::move(e);
          s->b = std::move(parts[0]);
          s->c = std::move(parts[1]);
          s->d = std::move(parts[2]);
          e = std::move(s);
        }
      } else if (is_op("(")) {
        auto c = make(Expr::Call, peek().pos);
        c->a = std::move(e);
        parse_call_args(*c);
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  void parse_call_args(Expr& e) {
    expect_op("(");
    while (!is_op(")")) {
      if (peek().type == Tok::Name && is_op("=", 1)) {
        std::string k = next().text;
        next();
        e.kwargs.emplace_back(k, parse_expression(true));
      } else {
        if (!e.kwargs.empty()) fail("positional argument after keyword argument");
        e.args.push_back(parse_expression(true));
      }
      if (!is_op(",")) break;
      next();
    }
    expect_op(")");
  }

  ExprP parse_filters(ExprP e) {
    while (true) {
      if (is_op("|")) {
        next();
        auto f = make(Expr::Filter, peek().pos);
        f->name = expect_name("a filter name");
        while (is_op(".")) {  // dotted filter names are not used, but parse them for clear errors
          next();
          f->name += "." + expect_name("a filter name");
        }
        f->a = std::move(e);
        if (is_op("(")) parse_call_args(*f);
        e = std::move(f);
      } else if (is_name("is")) {
        next();
        auto t = make(Expr::Test, peek().pos);
        if (is_name("not")) {
          next();
          t->flag = true;
        }
        t->name = expect_name("a test name");
        t->a = std::move(e);
        if (is_op("(")) {
          parse_call_args(*t);
        } else if (peek().type == Tok::String || peek().type == Tok::Int || peek().type == Tok::Float ||
                   (peek().type == Tok::Name && !is_name("and") && !is_name("or") && !is_name("if") &&
                    !is_name("else") && !is_name("is") && !is_name("in") && !is_name("not")) ||
                   is_op("[") || is_op("{")) {
          // One argument without parentheses: `x is sameas false`, `x is divisibleby 3`.
          t->args.push_back(parse_unary(false));
        }
        e = std::move(t);
      } else if (is_op("(")) {
        auto c = make(Expr::Call, peek().pos);
        c->a = std::move(e);
        parse_call_args(*c);
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  friend struct DepthGuard;
  std::vector<Token> t_;
  size_t i_ = 0;
  const ParseLimits& lim_;
  size_t depth_ = 0;

 public:
  size_t loop_depth_ = 0;
};

}  // namespace

std::shared_ptr<Program> parse_template(const std::string& source, const ParseLimits& limits) {
  auto prog = std::make_shared<Program>();
  prog->source = source;
  Lexer lx(prog->source);
  std::vector<Token> toks = lx.run();
  Parser p(std::move(toks), limits);
  p.loop_depth_ = 1;  // break/continue placement is checked at render time
  prog->body = p.parse_all();
  return prog;
}

}  // namespace hypic::jinja
