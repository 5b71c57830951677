// Values of the chat-template interpreter (see tokenizer/chat_template.h): Python-like dynamic
// values with reference semantics for lists, dicts and namespaces, insertion-ordered dicts.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

namespace hypic::jinja {

struct Value;
struct ListObj;
struct DictObj;
struct FuncObj;
struct Undefined {
  bool operator==(const Undefined&) const = default;
};
struct None {
  bool operator==(const None&) const = default;
};

struct Value {
  using Storage = std::variant<Undefined, None, bool, int64_t, double, std::string, std::shared_ptr<ListObj>,
                               std::shared_ptr<DictObj>, std::shared_ptr<FuncObj>>;
  Storage v;

  Value() = default;
  Value(None n) : v(n) {}
  Value(bool b) : v(b) {}
  Value(int64_t i) : v(i) {}
  Value(int i) : v(int64_t(i)) {}
  Value(double d) : v(d) {}
  Value(std::string s) : v(std::move(s)) {}
  Value(const char* s) : v(std::string(s)) {}
  Value(std::shared_ptr<ListObj> l) : v(std::move(l)) {}
  Value(std::shared_ptr<DictObj> d) : v(std::move(d)) {}
  Value(std::shared_ptr<FuncObj> f) : v(std::move(f)) {}

  bool is_undefined() const { return std::holds_alternative<Undefined>(v); }
  bool is_none() const { return std::holds_alternative<None>(v); }
  bool is_bool() const { return std::holds_alternative<bool>(v); }
  bool is_int() const { return std::holds_alternative<int64_t>(v); }
  bool is_float() const { return std::holds_alternative<double>(v); }
  bool is_number() const { return is_int() || is_float() || is_bool(); }  // Python: bool is an int
  bool is_string() const { return std::holds_alternative<std::string>(v); }
  bool is_list() const { return std::holds_alternative<std::shared_ptr<ListObj>>(v); }
  bool is_dict() const { return std::holds_alternative<std::shared_ptr<DictObj>>(v); }
  bool is_func() const { return std::holds_alternative<std::shared_ptr<FuncObj>>(v); }

  bool b() const { return std::get<bool>(v); }
  int64_t i() const { return std::get<int64_t>(v); }
  double f() const { return std::get<double>(v); }
  const std::string& s() const { return std::get<std::string>(v); }
  ListObj& list() const { return *std::get<std::shared_ptr<ListObj>>(v); }
  DictObj& dict() const { return *std::get<std::shared_ptr<DictObj>>(v); }
  FuncObj& func() const { return *std::get<std::shared_ptr<FuncObj>>(v); }
};

struct ListObj {
  std::vector<Value> items;
  bool tuple = false;  // printed as (a, b)
};

// Insertion-ordered string-keyed map. `ns` marks a namespace() object (attributes assignable).
struct DictObj {
  std::vector<std::pair<std::string, Value>> items;
  std::unordered_map<std::string, size_t> index;
  bool ns = false;

  const Value* find(const std::string& k) const {
    auto it = index.find(k);
    return it == index.end() ? nullptr : &items[it->second].second;
  }
  void set(const std::string& k, Value val) {
    auto it = index.find(k);
    if (it != index.end()) {
      items[it->second].second = std::move(val);
    } else {
      index.emplace(k, items.size());
      items.emplace_back(k, std::move(val));
    }
  }
};

struct Interp;
using Kwargs = std::vector<std::pair<std::string, Value>>;
struct FuncObj {
  std::string name;
  std::function<Value(Interp&, std::vector<Value>&, Kwargs&)> fn;
};

inline Value make_list(std::vector<Value> items = {}, bool tuple = false) {
  auto l = std::make_shared<ListObj>();
  l->items = std::move(items);
  l->tuple = tuple;
  return Value(std::move(l));
}
inline Value make_dict() {
  return Value(std::make_shared<DictObj>());
}

}  // namespace hypic::jinja
