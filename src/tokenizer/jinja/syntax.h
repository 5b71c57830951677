// Lexer and parser of the chat-template Jinja subset (see tokenizer/chat_template.h).
#pragma once
#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "tokenizer/jinja/value.h"

namespace hypic::jinja {

// An error tied to a byte offset in the template source; converted to line/column for what().
struct PosError : std::runtime_error {
  size_t pos;
  PosError(size_t p, const std::string& msg) : std::runtime_error(msg), pos(p) {}
};

struct Expr;
struct Node;
using ExprP = std::unique_ptr<Expr>;
using NodeP = std::unique_ptr<Node>;
using Body = std::vector<NodeP>;

struct Expr {
  enum Kind {
    Literal,  // lit
    Name,     // name
    List,     // args (tuple when flag)
    Dict,     // kwargs-like: keys in args[2k], values in args[2k+1]
    GetAttr,  // a.name
    GetItem,  // a[b]
    Slice,    // a[b:c:d] (each of b, c, d may be null)
    Call,     // a(args, kwargs)
    Filter,   // a | name(args, kwargs); a null for the map(filter) form is not used
    Test,     // a is [not] name(args); flag = negated
    Unary,    // op a  (op: "-", "+", "not")
    Binary,   // a op b
    Cond,     // b if a else c (c may be null)
  };
  Kind kind;
  size_t pos = 0;
  Value lit;
  std::string name;  // variable, attribute, filter/test name or operator
  bool flag = false;
  ExprP a, b, c, d;
  std::vector<ExprP> args;
  std::vector<std::pair<std::string, ExprP>> kwargs;
};

struct Node {
  enum Kind { Text, Output, If, For, Set, SetAttr, SetBlock, Macro, Break, Continue, Scope };
  Kind kind;
  size_t pos = 0;
  std::string text;                                   // Text; Macro name; SetAttr attribute
  ExprP expr;                                         // Output; For iterable; Set value; SetAttr object
  ExprP value;                                        // SetAttr value
  ExprP cond;                                         // For `if` filter
  std::vector<std::pair<ExprP, Body>> branches;       // If: (condition, body); else has null condition
  Body body, else_body;                               // For, SetBlock, Macro, Scope
  std::vector<std::string> targets;                   // For/Set/SetBlock names (tuple unpacking)
  bool unpack = false;                                // targets came as a tuple
  std::vector<std::pair<std::string, ExprP>> params;  // Macro parameters (default may be null)
};

struct Program {
  std::string source;
  Body body;
};

struct ParseLimits {
  size_t max_nesting = 200;
};

std::shared_ptr<Program> parse_template(const std::string& source, const ParseLimits& limits);

// 1-based line and column (bytes) of an offset.
std::pair<size_t, size_t> line_col(const std::string& source, size_t pos);

}  // namespace hypic::jinja
