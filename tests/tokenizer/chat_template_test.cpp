// Unit tests of the chat-template renderer (tokenizer/chat_template.h): one construct at a time,
// with expected output worked out by hand from the Jinja2 / Python semantics (and cross-checked
// with Python's jinja2 configured as transformers does: trim_blocks, lstrip_blocks, loopcontrols).
#include "tokenizer/chat_template.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

namespace hypic {
namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;
using testing::HasSubstr;

std::string R(const std::string& tmpl, const json& ctx = json::object()) {
  return ChatTemplate(tmpl).render(ctx);
}
std::string RO(const std::string& tmpl, const ojson& ctx) {
  return ChatTemplate(tmpl).render(ctx);
}

// Message of the exception thrown by f(), or "" when none is thrown.
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(ChatTemplate, TextAndOutput) {
  EXPECT_EQ(R("plain text"), "plain text");
  EXPECT_EQ(R("{{ 'a' }}{{ \"b\" }}{{ 1 }}{{ 2.5 }}"), "ab12.5");
  EXPECT_EQ(R("{# a comment #}x"), "x");
  EXPECT_EQ(R("{{ name }}!", {{"name", "Ann"}}), "Ann!");
  EXPECT_EQ(R(""), "");
  EXPECT_EQ(R("a\n"), "a");  // one trailing newline of the template is dropped (keep_trailing_newline=False)
  EXPECT_EQ(R("a\n\n"), "a\n");
}

TEST(ChatTemplate, WhitespaceControl) {
  EXPECT_EQ(R("a  {{- 'b' -}}  \n c"), "abc");
  EXPECT_EQ(R("a \n {%- if true -%} \n b {%- endif %}"), "ab");
  // trim_blocks: the newline right after a block tag goes; lstrip_blocks: indentation before it goes.
  EXPECT_EQ(R("a\n  {% if true %}\n  x\n  {% endif %}\nb"), "a\n  x\nb");
  EXPECT_EQ(R("a\n  {# c #}\nb"), "a\nb");
  // Neither applies to {{ }}, nor to a block tag that is not alone at the start of its line.
  EXPECT_EQ(R("a\n  {{ 1 }}\nb"), "a\n  1\nb");
  EXPECT_EQ(R("a  {% if true %}x{% endif %}  \nb"), "a  x  \nb");
  // {%+ and +%} switch lstrip/trim off for that tag.
  EXPECT_EQ(R("  {%+ if true %}x{% endif +%}\nb"), "  x\nb");
  EXPECT_EQ(R("{% if true %}\r\nx{% endif %}"), "x");  // \r\n in template text counts as one newline
}

TEST(ChatTemplate, Literals) {
  EXPECT_EQ(R("{{ 'it\\'s' }}|{{ \"a\\tb\\n\" }}|{{ '\\u00e9\\x41' }}|{{ 'a' 'b' }}"),
            "it's|a\tb\n|\xC3\xA9"
            "A|ab");
  EXPECT_EQ(R("{{ true }} {{ false }} {{ none }} {{ True }} {{ None }}"), "True False None True None");
  EXPECT_EQ(R("{{ [1, 'a', none, true, [2.0]] }}"), "[1, 'a', None, True, [2.0]]");
  EXPECT_EQ(R("{{ {'k': 'v', 'n': 1} }}"), "{'k': 'v', 'n': 1}");
  EXPECT_EQ(R("{{ (1, 2) }}{{ (1,) }}"), "(1, 2)(1,)");
  EXPECT_EQ(R("{{ [\"it's\", 'say \"x\"'] }}"), "[\"it's\", 'say \"x\"']");
  EXPECT_EQ(R("{{ 1e3 }} {{ 0.1 }} {{ 1e16 }} {{ 0.00001 }} {{ 1_000 }}"), "1000.0 0.1 1e+16 1e-05 1000");
}

TEST(ChatTemplate, Arithmetic) {
  EXPECT_EQ(R("{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 7 / 2 }} {{ 4 / 2 }} {{ 7 // 2 }} {{ -7 // 2 }}"),
            "7 9 3.5 2.0 3 -4");
  EXPECT_EQ(R("{{ 7 % 3 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 1 + 2.5 }} {{ -(3) }} {{ 1 - 2 - 3 }}"), "1 2 1024 3.5 -3 -4");
  EXPECT_EQ(R("{{ 'ab' + 'cd' }} {{ 'ab' * 3 }} {{ [1] + [2] }} {{ 'a' ~ 1 ~ none ~ undefined_var }}"),
            "abcd ababab [1, 2] a1None");
  EXPECT_EQ(R("{{ x|length - 1 }}", {{"x", {1, 2, 3}}}), "2");  // filters bind tighter than arithmetic
}

TEST(ChatTemplate, ComparisonsAndLogic) {
  EXPECT_EQ(R("{{ 1 == 1.0 }} {{ 'a' != 'b' }} {{ 2 < 3 <= 3 }} {{ 'b' > 'a' }} {{ [1, 2] == [1, 2] }}"),
            "True True True True True");
  EXPECT_EQ(R("{{ 'ell' in 'hello' }} {{ 3 not in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 'x' in {'k': 1} }}"),
            "True True True False");
  EXPECT_EQ(R("{{ true and 'x' }}|{{ 0 or 'y' }}|{{ not '' }}|{{ not 1 == 2 }}|{{ none or [] }}"), "x|y|True|True|[]");
  EXPECT_EQ(R("{{ 'yes' if 1 > 0 else 'no' }}|{{ 'yes' if 0 else 'no' }}|{{ 'only' if false }}|"), "yes|no||");
  // short-circuit: the right side is not evaluated
  EXPECT_EQ(R("{{ false and raise_exception('no') }}{{ true or raise_exception('no') }}"), "FalseTrue");
}

TEST(ChatTemplate, AttributeItemAndSlice) {
  json ctx = {{"m", {{"role", "user"}, {"content", "hi"}, {"list", {10, 20, 30, 40}}}}, {"s", "h\xC3\xA9llo"}};
  EXPECT_EQ(R("{{ m.role }} {{ m['content'] }} {{ m.list[1] }} {{ m.list[-1] }} {{ m.list.0 }}", ctx),
            "user hi 20 40 10");
  EXPECT_EQ(R("{{ m.list[1:3] }} {{ m.list[::-1] }} {{ m.list[::2] }} {{ m.list[-2:] }} {{ m.list[:-3] }}", ctx),
            "[20, 30] [40, 30, 20, 10] [10, 30] [30, 40] [10]");
  // strings index by code point
  EXPECT_EQ(R("{{ s[1] }} {{ s[::-1] }} {{ s[1:3] }} {{ s|length }}", ctx), "\xC3\xA9 oll\xC3\xA9h \xC3\xA9l 5");
  // missing keys, out-of-range indices and anything on undefined give undefined
  EXPECT_EQ(R("[{{ m.nope }}{{ m.list[9] }}{{ nope.a.b }}{{ nope['x'][0] }}{{ m.nope is defined }}]", ctx), "[False]");
}

TEST(ChatTemplate, Tests) {
  json ctx = {{"s", "x"},  {"n", nullptr}, {"d", {{"a", 1}}}, {"l", {1}},
              {"t", true}, {"f", false},   {"i", 4},          {"x", 1.5}};
  EXPECT_EQ(R("{{ s is defined }}{{ u is undefined }}{{ n is none }}{{ s is string }}{{ d is mapping }}"
              "{{ l is iterable }}{{ s is sequence }}{{ i is number }}{{ x is number }}",
              ctx),
            "TrueTrueTrueTrueTrueTrueTrueTrueTrue");
  EXPECT_EQ(
      R("{{ t is true }}{{ f is false }}{{ 1 is true }}{{ n is not none }}{{ d is string }}{{ l is mapping }}", ctx),
      "TrueTrueFalseFalseFalseFalse");
  EXPECT_EQ(R("{{ i is even }}{{ i is odd }}{{ i is divisibleby(2) }}{{ i is eq 4 }}{{ 'a' is in 'cat' }}", ctx),
            "TrueFalseTrueTrueTrue");
}

TEST(ChatTemplate, IfElifElse) {
  const std::string t = "{% if x == 1 %}one{% elif x == 2 %}two{% else %}many{% endif %}";
  EXPECT_EQ(R(t, {{"x", 1}}), "one");
  EXPECT_EQ(R(t, {{"x", 2}}), "two");
  EXPECT_EQ(R(t, {{"x", 3}}), "many");
  EXPECT_EQ(R("{% if undefined_thing %}a{% else %}b{% endif %}"), "b");
  EXPECT_EQ(R("{% if [] %}a{% elif {} %}b{% elif '' %}c{% elif 0.0 %}d{% else %}e{% endif %}"), "e");
}

TEST(ChatTemplate, ForLoops) {
  EXPECT_EQ(R("{% for x in [1, 2, 3] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}"
              "{{ loop.first }}{{ loop.last }}{{ loop.length }};{% endfor %}"),
            "1032TrueFalse3;2121FalseFalse3;3210FalseTrue3;");
  EXPECT_EQ(R("{% for x in 'ab' %}[{{ loop.previtem }}|{{ x }}|{{ loop.nextitem }}]{% endfor %}"), "[|a|b][a|b|]");
  EXPECT_EQ(R("{% for x in [] %}x{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(R("{% for x in undefined_list %}x{% else %}empty{% endfor %}"), "empty");
  // the inline `if` filters before numbering
  EXPECT_EQ(R("{% for a in [1, 2, 3, 4] if a is even %}{{ loop.index }}/{{ loop.length }}:{{ a }} {% endfor %}"),
            "1/2:2 2/2:4 ");
  EXPECT_EQ(R("{% for a in [1, 3] if a > 5 %}x{% else %}none{% endfor %}"), "none");
  ojson d = ojson::parse(R"({"d": {"z": 1, "a": 2}})");  // insertion order is kept
  EXPECT_EQ(RO("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k in d %}{{ k }}{% endfor %}", d),
            "z=1;a=2;za");
  EXPECT_EQ(R("{% for a, b in [[1, 2], [3, 4]] %}{{ a + b }} {% endfor %}"), "3 7 ");
  EXPECT_EQ(R("{% for x in range(3) %}{{ x }}{% endfor %}|{% for x in range(1, 7, 2) %}{{ x }}{% endfor %}|"
              "{% for x in range(3, 0, -1) %}{{ x }}{% endfor %}"),
            "012|135|321");
  EXPECT_EQ(R("{% for x in range(6) %}{% if x == 1 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}"
              "{{ x }}{% endfor %}"),
            "023");
  EXPECT_EQ(
      R("{% for x in [1, 2] %}{% for y in 'ab' %}{{ loop.index }}{{ y }}{% endfor %}{{ loop.index }} {% endfor %}"),
      "1a2b1 1a2b2 ");
  EXPECT_EQ(R("{% for x in range(4) %}{{ loop.cycle('o', 'e') }}{% endfor %}"), "oeoe");
}

TEST(ChatTemplate, SetAndScoping) {
  EXPECT_EQ(R("{% set x = 1 %}{% set a, b = [2, 3] %}{{ x + a + b }}"), "6");
  EXPECT_EQ(R("{% if true %}{% set y = 3 %}{% endif %}{{ y }}"), "3");  // if is not a scope
  // assignments inside a loop body do not leak out of the iteration
  EXPECT_EQ(R("{% set x = 1 %}{% for i in range(2) %}{{ x }}{% set x = 5 %}{{ x }}{% endfor %}{{ x }}"), "15151");
  EXPECT_EQ(R("{% set ns = namespace(count=0, last=none) %}{% for i in range(3) %}{% set ns.count = ns.count + 1 %}"
              "{% set ns.last = i %}{% endfor %}{{ ns.count }} {{ ns.last }}"),
            "3 2");
  EXPECT_EQ(R("{% set block %}a{{ 1 + 1 }}b{% endset %}[{{ block }}]"), "[a2b]");
  EXPECT_THAT(error_of([] { R("{% set d = {} %}{% set d.x = 1 %}"); }), HasSubstr("namespace"));
}

TEST(ChatTemplate, Macros) {
  EXPECT_EQ(R("{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}"
              "{{ greet('Ann') }} {{ greet('Bob', punct='?') }} {{ greet(name='Cy', punct='.') }}"),
            "Hi Ann! Hi Bob? Hi Cy.");
  EXPECT_EQ(R("{% set g = 'G' %}{% macro m(x) %}{{ g }}{{ x }}{% set g = 'L' %}{{ g }}{% endmacro %}{{ m(1) }}{{ g }}"),
            "G1LG");
  EXPECT_EQ(R("{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(3) }}"), "321");
}

TEST(ChatTemplate, Filters) {
  json ctx = {{"msgs",
               {{{"role", "system"}, {"content", "S"}},
                {{"role", "user"}, {"content", "U1"}},
                {{"role", "user"}, {"content", "U2"}, {"x", 1}}}},
              {"e", ""},
              {"n", nullptr}};
  EXPECT_EQ(R("{{ 'abc'|length }} {{ [1, 2]|count }} {{ {'a': 1}|length }} {{ nope|length }}"), "3 2 1 0");
  EXPECT_EQ(
      R("[{{ '  a b  '|trim }}] [{{ 'xxaxx'|trim('x') }}] {{ 'Ab'|upper }} {{ 'Ab'|lower }} {{ 'hello wORLD'|title }}"),
      "[a b] [a] AB ab Hello World");
  EXPECT_EQ(
      R("{{ nope|default('d') }} {{ e|default('d') }} {{ e|default('d', true) }} {{ n|default('d') }} {{ 'v'|d('x') }}",
        ctx),
      "d  d None v");
  EXPECT_EQ(R("{{ [1, 2, 3]|join('-') }} {{ ['a', 'b']|join }} {{ msgs|join(', ', attribute='role') }}", ctx),
            "1-2-3 ab system, user, user");
  EXPECT_EQ(R("{{ [1, 2, 3]|first }} {{ [1, 2, 3]|last }} {{ 'xyz'|first }} {{ 'xyz'|list }} {{ {'k': 1}|list }}"),
            "1 3 x ['x', 'y', 'z'] ['k']");
  EXPECT_EQ(
      R("{{ 3|string ~ 4 }} {{ 1.9|int }} {{ '12'|int }} {{ '3.7'|int }} {{ 'x'|int }} {{ 'x'|int(7) }} {{ 2|float }}"),
      "34 1 12 3 0 7 2.0");
  EXPECT_EQ(R("{{ 'a-b-c'|replace('-', '+') }} {{ 'a-b-c'|replace('-', '', 1) }}"), "a+b+c ab-c");
  EXPECT_EQ(R("{% for k, v in {'a': 1, 'b': 2}|items %}{{ k }}{{ v }}{% endfor %}"), "a1b2");
  EXPECT_EQ(R("{{ msgs|selectattr('role', 'equalto', 'user')|map(attribute='content')|list }}", ctx), "['U1', 'U2']");
  EXPECT_EQ(R("{{ msgs|rejectattr('role', 'equalto', 'user')|map(attribute='content')|join }}", ctx), "S");
  EXPECT_EQ(R("{{ msgs|selectattr('x')|list|length }} {{ msgs|selectattr('x', 'defined')|list|length }}", ctx), "1 1");
  EXPECT_EQ(R("{{ [1, 2, 3, 4]|select('odd')|list }} {{ [1, 2, 3, 4]|reject('odd')|list }} {{ ['a', "
              "'b']|map('upper')|list }}"),
            "[1, 3] [2, 4] ['A', 'B']");
  EXPECT_EQ(R("{{ '<b>'|safe }} {{ [3, 1, 2]|sort }} {{ [3, 1, 2]|sort(reverse=true) }} {{ [1, 2]|reverse|list }} {{ "
              "'ab'|reverse }}"),
            "<b> [1, 2, 3] [3, 2, 1] [2, 1] ba");
  EXPECT_EQ(
      R("{{ ['b', 'A', 'a']|unique|list }} {{ [1, 2, 3]|sum }} {{ [4, 1, 9]|min }} {{ [4, 1, 9]|max }} {{ -3|abs }}"),
      "['b', 'A'] 6 1 9 3");
  EXPECT_EQ(R("{{ 'a\\nb\\n\\nc'|indent(2) }}|{{ 'a\\nb'|indent(2, true) }}"), "a\n  b\n\n  c|  a\n  b");
  EXPECT_EQ(R("{{ 3.14159|round(2) }} {{ 2.5|round }} {{ 2.7|round(method='floor') }}"), "3.14 2.0 2.0");
}

TEST(ChatTemplate, ToJson) {
  ojson ctx = ojson::parse(R"({"x": {"b": [1, 2.5, "\u00e9\n\"\\", null, true], "a": {}, "c": []}})");
  EXPECT_EQ(RO("{{ x|tojson }}", ctx), "{\"b\": [1, 2.5, \"\xC3\xA9\\n\\\"\\\\\", null, true], \"a\": {}, \"c\": []}");
  EXPECT_EQ(RO("{{ x|tojson(indent=2) }}", ctx),
            "{\n  \"b\": [\n    1,\n    2.5,\n    \"\xC3\xA9\\n\\\"\\\\\",\n    null,\n    true\n  ],\n  \"a\": {},\n  "
            "\"c\": []\n}");
  EXPECT_EQ(RO("{{ x.b|tojson(ensure_ascii=true) }}", ctx), "[1, 2.5, \"\\u00e9\\n\\\"\\\\\", null, true]");
  EXPECT_EQ(RO("{{ x|tojson(sort_keys=true, separators=(',', ':')) }}", ctx),
            "{\"a\":{},\"b\":[1,2.5,\"\xC3\xA9\\n\\\"\\\\\",null,true],\"c\":[]}");
  EXPECT_EQ(R("{{ '\\x01\\U0001F600'|tojson }} {{ '\\U0001F600'|tojson(ensure_ascii=true) }} {{ 1.0|tojson }}"),
            "\"\\u0001\xF0\x9F\x98\x80\" \"\\ud83d\\ude00\" 1.0");
}

TEST(ChatTemplate, StringMethods) {
  EXPECT_EQ(R("{{ 'hello'.startswith('he') }} {{ 'hello'.endswith('lo') }} {{ 'hello'.startswith(('x', 'h')) }}"),
            "True True True");
  EXPECT_EQ(
      R("[{{ '  a  '.strip() }}][{{ '\\n a \\n'.lstrip() }}][{{ 'xxaxx'.rstrip('x') }}][{{ '--a--'.strip('-') }}]"),
      "[a][a \n][xxa][a]");
  EXPECT_EQ(
      R("{{ 'a b  c'.split() }} {{ 'a,b,,c'.split(',') }} {{ 'a,b,c'.split(',', 1) }} {{ 'a,b,c'.rsplit(',', 1) }}"),
      "['a', 'b', 'c'] ['a', 'b', '', 'c'] ['a', 'b,c'] ['a,b', 'c']");
  EXPECT_EQ(R("{{ 'x</think>y</think>z'.split('</think>')[-1] }} {{ 'Ab'.upper() }} {{ 'Ab'.lower() }} {{ 'a-b "
              "c'.title() }}"),
            "z AB ab A-B C");
  EXPECT_EQ(R("{{ 'aXbX'.replace('X', '_') }} {{ 'aXbX'.replace('X', '_', 1) }} {{ 'hello'.find('l') }} {{ ', "
              "'.join(['a', 'b']) }}"),
            "a_b_ a_bX 2 a, b");
  EXPECT_EQ(R("{{ '\xC3\xA9t\xC3\xA9'.upper() }} {{ '\xC3\x89T\xC3\x89'.lower() }}"),
            "\xC3\x89T\xC3\x89 \xC3\xA9t\xC3\xA9");
}

TEST(ChatTemplate, DictAndListMethods) {
  ojson ctx = ojson::parse(R"({"d": {"b": 1, "a": 2}})");
  EXPECT_EQ(RO("{{ d.keys()|list }} {{ d.values()|list }} {{ d.items()|list }}", ctx),
            "['b', 'a'] [1, 2] [('b', 1), ('a', 2)]");
  EXPECT_EQ(RO("{{ d.get('a') }} {{ d.get('zz') }} {{ d.get('zz', 0) }}", ctx), "2 None 0");
  EXPECT_EQ(R("{% set l = [] %}{% set _ = l.append(1) %}{% set _ = l.append(2) %}{{ l }}"), "[1, 2]");
}

TEST(ChatTemplate, RaiseException) {
  const std::string t =
      "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}"
      "{% endif %}ok";
  EXPECT_EQ(R(t, {{"messages", {{{"role", "user"}}}}}), "ok");
  EXPECT_EQ(error_of([&] { R(t, {{"messages", {{{"role", "system"}}}}}); }), "Conversation must start with user");
}

TEST(ChatTemplate, SyntaxErrorsHavePositions) {
  EXPECT_EQ(error_of([] { ChatTemplate("ab\n  {{ 1 + }}"); }),
            "chat template syntax error at line 2, column 10: expected an expression, got '}}'");
  EXPECT_EQ(error_of([] { ChatTemplate("{% if x %}\nyes"); }),
            "chat template syntax error at line 1, column 1: unclosed 'if' block (expected '{% endif %}' before end of "
            "template)");
  EXPECT_EQ(error_of([] { ChatTemplate("x {% frobnicate %}"); }),
            "chat template syntax error at line 1, column 6: unknown or unsupported statement 'frobnicate'");
  EXPECT_EQ(error_of([] { ChatTemplate("{{ 'abc }}"); }),
            "chat template syntax error at line 1, column 4: unterminated string literal");
  EXPECT_EQ(error_of([] { ChatTemplate("\n\n{{ foo"); }),
            "chat template syntax error at line 3, column 1: unterminated '{{'");
  EXPECT_EQ(error_of([] { ChatTemplate("{% for x in y %}{% endif %}"); }),
            "chat template syntax error at line 1, column 20: unknown or unsupported statement 'endif'");
  EXPECT_EQ(error_of([] { ChatTemplate("{{ a $ b }}"); }),
            "chat template syntax error at line 1, column 6: unexpected character '$'");
}

TEST(ChatTemplate, RuntimeErrorsHavePositions) {
  EXPECT_EQ(error_of([] { R("line1\n{{ 'a' + 1 }}"); }),
            "chat template error at line 2, column 8: unsupported operand type(s) for +: 'str' and 'int'");
  EXPECT_EQ(error_of([] { R("{{ x|frobnicate }}"); }),
            "chat template error at line 1, column 6: unknown filter 'frobnicate'");
  EXPECT_EQ(error_of([] { R("{{ nothing() }}"); }), "chat template error at line 1, column 11: 'nothing' is undefined");
  EXPECT_EQ(error_of([] { R("{{ 'abc'.nomethod() }}"); }),
            "chat template error at line 1, column 18: 'str' object has no method 'nomethod'");
  EXPECT_EQ(error_of([] { R("{{ 1 // 0 }}"); }),
            "chat template error at line 1, column 6: integer division or modulo by zero");
  EXPECT_EQ(error_of([] { R("{% for x in 5 %}{% endfor %}"); }),
            "chat template error at line 1, column 13: 'int' object is not iterable");
}

TEST(ChatTemplate, HostileTemplatesHitLimits) {
  ChatTemplate::Limits lim;
  lim.max_output_bytes = 1000;
  EXPECT_THAT(
      error_of([&] { ChatTemplate("{% for i in range(100) %}0123456789ab{% endfor %}", lim).render(json::object()); }),
      HasSubstr("larger than the limit of 1000 bytes"));
  EXPECT_THAT(error_of([&] { ChatTemplate("{{ 'x' * 5000 }}", lim).render(json::object()); }), HasSubstr("limit"));
  EXPECT_THAT(error_of([] { R("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"); }), HasSubstr("nested deeper than"));
  EXPECT_THAT(error_of([] { ChatTemplate("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}"); }),
              HasSubstr("nested too deeply"));
  lim = {};
  lim.max_iterations = 1000;
  EXPECT_THAT(error_of([&] {
                ChatTemplate("{% for i in range(100) %}{% for j in range(100) %}{% endfor %}{% endfor %}", lim)
                    .render(json::object());
              }),
              HasSubstr("more than 1000 loop iterations"));
  EXPECT_THAT(error_of([] { R("{% for i in range(9223372036854775807) %}{% endfor %}"); }),
              HasSubstr("range() of more than 1000000 items"));
  std::string deep;
  for (int i = 0; i < 300; ++i) deep += "{% if true %}";
  for (int i = 0; i < 300; ++i) deep += "{% endif %}";
  EXPECT_THAT(error_of([&] { ChatTemplate{deep}; }), HasSubstr("nested too deeply"));
}

TEST(ChatTemplate, ApplyChatTemplateBuildsTheContext) {
  const std::string t =
      "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}"
      "{% if tools is defined %}T{{ tools|length }}{% endif %}{% if add_generation_prompt %}<assistant>{% endif %}"
      "{{ enable_thinking }}";
  json msgs = {{{"role", "user"}, {"content", "hi"}}};
  EXPECT_EQ(apply_chat_template(t, msgs, true, {{"bos_token", "<s>"}, {"eos_token", "</s>"}}),
            "<s><user>hi</s><assistant>");
  EXPECT_EQ(apply_chat_template(t, msgs, false), "<user>hi");
  EXPECT_EQ(apply_chat_template(t, msgs, false, {{"tools", json::array({1, 2})}, {"enable_thinking", false}}),
            "<user>hiT2False");
  EXPECT_EQ(apply_chat_template(t, msgs, false, {{"tools", json::array()}}), "<user>hi");  // empty tools are left out
  EXPECT_THAT(error_of([] { apply_chat_template("x", json::object(), false); }),
              HasSubstr("messages must be a JSON array"));
}

TEST(ChatTemplate, CopiesShareTheParsedProgram) {
  ChatTemplate a("{{ x }}");
  ChatTemplate b = a;
  EXPECT_EQ(b.render(json{{"x", 1}}), "1");
  EXPECT_EQ(a.source(), "{{ x }}");
}

}  // namespace
}  // namespace hypic
