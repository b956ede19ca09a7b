"""Jinja conformance: keel's template engine (src/keel/data/jinja) against Python's jinja2 exactly as
transformers configures it for chat templates, case by case on small templates that each exercise
one corner of the language.

What it compares (keel's CLI: `keel chat-template --template FILE.jinja`, no tokenizer, so text only):
  * each case is a template text and its variables (messages, tools, add_generation_prompt and any
    other template variables, sent to keel as "kwargs"). The reference renders it with
    transformers.utils.chat_template_utils.render_jinja_template(conversations=[messages],
    tools=..., chat_template=TEXT, add_generation_prompt=..., **kwargs): transformers' own cached
    ImmutableSandboxedEnvironment (trim_blocks, lstrip_blocks, loopcontrols, its `tojson`,
    `raise_exception`, `strftime_now`, `namespace`, `dict`, the {% generation %} tag), the messages
    normalized as apply_chat_template normalizes them (_normalize_chat_messages: keys whose value is
    None dropped) and aliased as render_jinja_template aliases them (reasoning_content, thinking).
    Both sides get the variables through the same JSON text, so both see the same values.
  * the cases are grouped by feature (whitespace control, literals, operators, Python str()
    printing, attribute and item access, statements, string methods, filters, tests, errors,
    Unicode, sandbox, real chat-template shapes). All the cases of one template text run in one keel
    process, one JSONL line each; the template file holds the text byte for byte (so "\\r\\n" line
    endings and the trailing newline reach keel as they reach jinja2).

Policy: a case passes when both render the identical text, or both fail (a syntax error, an unknown
filter or test, an undefined value used, a Python exception, raise_exception(...)): keel's error is
a template error line ({"error": ...}) or, for a template it cannot compile, a nonzero exit naming
the problem. The messages of the two errors are not compared. Anything else is a mismatch and fails
the test (exit 1): a different text, text on one side and an error on the other, keel crashing (a
signal), hanging (30 s per template), stopping on a record or writing the wrong number of lines.
The summary prints per group the cases and the identical ones, the mismatches by kind (a different
text is the worst: nothing tells the user), then up to 20 mismatches in full (template, variables,
both outputs as repr; --verbose prints them all).

Cases whose jinja2 output depends on the Python process (object addresses, `<built-in method ...>`)
are not written: nothing in keel could reproduce them. strftime_now is compared only through what
cannot change between the two renders (the length of the year, the number of words of a date).

usage: python jinja_conformance.py --keel BUILD/keel [--group NAME]... [--verbose] [--list]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from transformers.utils.chat_template_utils import (  # noqa: E402
    _normalize_chat_messages,
    render_jinja_template,
)

SHOWN = 20          # mismatches printed in full
TIMEOUT_S = 30      # per keel process (one template, all its cases)

USER = [{"role": "user", "content": "Hello"}]
CHAT = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is 2+2?"},
]
USERS = [{"name": "ann", "age": 31, "admin": True}, {"name": "Bob", "age": 25, "admin": False},
         {"name": "cid", "age": 40}]


@dataclass
class Case:
    group: str
    template: str
    variables: dict = field(default_factory=dict)


CASES: list[Case] = []


def add(group: str, template: str, *variable_sets: dict):
    """One case per variable set (one with no extra variables when none is given)."""
    for variables in variable_sets or ({},):
        CASES.append(Case(group, template, variables))


def adds(group: str, templates, variables: dict | None = None):
    """One case per template, all with the same variables."""
    for t in templates:
        add(group, t, variables or {})


# ---------------------------------------------------------------------------------------------------
# a macro that reassigns and grows a namespace while an expression holds what it read from it: keel
# reads values in place, and the left operand, the subscripted object, the filtered subject and a
# method's object must stay the values read before the macro ran (and stay alive)
GROW = ("{% set ns = namespace(n=0, a='v0', l=['l0']) %}{% macro grow() %}{% set ns.n = ns.n + 1 %}"
        "{% set ns.a = 'v' ~ ns.n %}{% set ns.l = ['l' ~ ns.n] %}{% set ns.z1 = 1 %}{% set ns.z2 = 2 %}"
        "{% set ns.z3 = 3 %}{% set ns.z4 = 4 %}{% set ns.z5 = 5 %}{% set ns.z6 = 6 %}{% endmacro %}")
adds("namespace mutation", [GROW + t for t in [
    "{{ ns.a == grow() ~ 'v0' }}", "{{ ns.a != grow() }}|{{ ns.a }}", "{{ ns.a[grow() | length] }}",
    "{{ ns.l[grow() | length] }}", "{{ ns.a | replace('v', grow() ~ 'w') }}", "{{ ns.a.startswith(grow() ~ 'v0') }}",
    "{{ ns.l[0] ~ grow() ~ ns.l[0] }}", "{{ ns.a + grow() + ns.a }}", "{{ ns.l[0] < grow() ~ 'l1' < ns.l[0] ~ 'z' }}",
    "{{ ns.a if grow() == '' else 'no' }}", "{{ [ns.a, grow(), ns.a] }}", "{{ ns.l | join(grow()) }}",
    "{% for x in ns.l %}{{ x }}{{ grow() }}{{ ns.l[0] }}{% endfor %}",
]])

# ---------------------------------------------------------------------------------------------------
# whitespace control: trim_blocks, lstrip_blocks, -, +, comments, raw, trailing newline, \r\n
G = "whitespace"
adds(G, [
    "a\n{% if true %}\nb\n{% endif %}\nc",
    "  {% if true %}\n  x\n  {% endif %}\n",
    "a {% if true %}b{% endif %} c",
    "a  {%- if true %} b {%- endif %}  c",
    "a  {% if true -%}  \n  b  {%- endif %}  c",
    "a \n {{- 'x' -}} \n b",
    "a \n {{- 'x' }} \n b",
    "a \n {{ 'x' -}} \n b",
    "  {%+ if true %}x{% endif %}",
    "  {%+ if true %}\nx\n  {%+ endif %}\ny",
    "{% if true +%}\nx{% endif %}",
    "{% if true %}\n\nx{% endif %}",
    "{% if true %}   \nx{% endif %}",
    "{% if true %}\r\nx{% endif %}",
    "a\n  {# a comment #}\nb",
    "a\n{# a comment #}\nb",
    "a {# mid-line #} b",
    "a\n  {#- trimmed -#}  \nb",
    "a\n{#\n multi\n line\n#}\nb",
    "{% raw %}{{ x }}{% if %}{% endraw %}",
    "  {% raw %}\n{{ a }}\n  {% endraw %}\nz",
    "{%- raw -%}  {{ a }}  {%- endraw -%}",
    "x\n",
    "x\n\n",
    "x\n\n\n",
    "{{ 'a' }}\n",
    "{% if true %}x{% endif %}\n",
    "{% if true %}x{% endif %}\n\n",
    "\n",
    "",
    "a\r\n{% if true %}\r\nb\r\n{% endif %}\r\nc\r\n",
    "line1\r\nline2\r\n\r\n",
    "a\rb",
    "{{ 'a' }}  \n  {{ 'b' }}",
    "  {{ 'a' }}\n",
    "\t{% if true %}\n\tx\n\t{% endif %}\n",
    "line1\n    {% for i in [1, 2] %}\n    {{ i }}\n    {% endfor %}\nend",
    "{%- for i in [1, 2] -%}\n  {{ i }}\n{%- endfor -%}\n",
    "{% for i in [1, 2] %}{{ i }}\n{% endfor %}",
    "{% set x = 1 %}\n{{ x }}",
    "{%- set x = 1 -%}\n\n  {{ x }}",
    "{{ 'a' -}}\n\n   {{ 'b' }}",
    "x {%- if true -%} \n\n y {%- endif -%}",
    "{{- 'start' }}",
    "  text  {%- if false %}x{% endif -%}  \n  more",
    "{% macro m() %}\n  body\n{% endmacro %}\n[{{ m() }}]",
    "{% macro m() -%}\n  body\n{%- endmacro %}\n[{{ m() }}]",
    "a\n    {% set x = 1 %}    \nb",
    "   \n{% if true %}x{% endif %}",
    "{% if true %}a{% else %}\nb{% endif %}",
    "{% if false %}a{% else %}\nb{% endif %}",
    "{% generation %}\ngen\n{% endgeneration %}\n",
    "  {%- generation -%}  g  {%- endgeneration -%}  ",
    "{{ 'a\nb' }}",
    "{%\nif\ntrue\n%}x{%\nendif\n%}",
    "{{\n'multi'\n~\n'line'\n}}",
    "{{ 'a' -}}  b", "{{ 'a' -}}\nb", "{{ 'a' -}}\n{{ 'b' }}", "{{ 'a' -}}\n{% if true %}b{% endif %}",
    "a  {{- 'b' }}", "a\n  {{- 'b' }}",
    "{% raw %}\nx{% endraw %}", "a\n  {% raw %}x\n  {% endraw %}\nb",
])
add(G, "{{ x }}\n{{ y }}", {"x": "a\r\nb", "y": "  c  "})
add(G, "[{{ s }}]\n", {"s": "\n"}, {"s": "x\n"})

# ---------------------------------------------------------------------------------------------------
G = "literals"
adds(G, [
    r"{{ 'a\nb' }}",
    r'{{ "t\tt" }}',
    r"{{ '\u00e9' }}",
    r"{{ '\x41' }}",
    r"{{ '\\' }}",
    r"{{ 'it\'s' }}",
    r'{{ "say \"hi\"" }}',
    r"{{ '\U0001F600' }}",
    r"{{ 'a\rb' | length }}",
    r"{{ '\0' | length }}",
    r"{{ 'a\/b' }}",
    r"{{ 'a\qb' }}",
    r"{{ '\N{BULLET}' }}",
    r"{{ 'a' 'b' }}",
    r"""{{ 'a' "b" 'c' }}""",
    r"{{ 'x' ~ 'a' 'b' }}",
    r"{{ 42 }}",
    r"{{ -7 }}",
    r"{{ 1_000_000 }}",
    r"{{ 0x1F }}",
    r"{{ 0o17 }}",
    r"{{ 0b101 }}",
    r"{{ 007 }}",
    r"{{ 12345678901234567890 }}",
    r"{{ 1.0 }}",
    r"{{ 0.1 }}",
    r"{{ 1e-05 }}",
    r"{{ 1e-5 }}",
    r"{{ 1e16 }}",
    r"{{ 1.5e16 }}",
    r"{{ 1e15 }}",
    r"{{ 1.0e2 }}",
    r"{{ -0.0 }}",
    r"{{ 3.14 }}",
    r"{{ 0.1 + 0.2 }}",
    r"{{ 1 / 3 }}",
    r"{{ 2.5e-3 }}",
    r"{{ 123456789.123 }}",
    r"{{ 1e300 * 1e300 }}",
    r"{{ -(1e300 * 1e300) }}",
    r"{{ 1_0.5 }}",
    r"{{ [1, 'a', none, 2.0] }}",
    r"{{ (1, 2) }}",
    r"{{ (1,) }}",
    r"{{ () }}",
    r"{{ [] }}",
    r"{{ {} }}",
    r"{{ {'a': 1, 'b': [2, 3]} }}",
    r"{{ {'a': 1, 'a': 2} }}",
    r"{{ [1, 2,] }}",
    r"{{ true }} {{ True }} {{ false }} {{ False }}",
    r"{{ none }} {{ None }}",
    r"{{ TRUE }}|{{ NONE }}",
    r"{{ [true, none, false] }}",
    r"{{ {'a': 1}}}", r"{{ {'a': {'b': 1}} }}", r"{% set x = {'a': {'b': 1}} %}{{ x }}", r"{{ [{'a': 1}] }}",
    r"{{ 2 / 3 }} {{ 1e22 }} {{ 10.0 ** 15 }} {{ 10.0 ** 16 }} {{ 3 * 1.1 }}",
])

# ---------------------------------------------------------------------------------------------------
G = "operators"
adds(G, [
    "{{ 7 + 3 }}", "{{ 7 - 10 }}", "{{ 7 * 3 }}", "{{ 7 / 2 }}", "{{ 6 / 2 }}", "{{ 7 // 2 }}",
    "{{ -7 // 2 }}", "{{ 7 % 3 }}", "{{ -7 % 3 }}", "{{ 7 % -3 }}", "{{ 2 ** 10 }}", "{{ 2 ** -1 }}",
    "{{ 2 ** 3 ** 2 }}", "{{ -2 ** 2 }}", "{{ 1 + 2 * 3 }}", "{{ (1 + 2) * 3 }}", "{{ 10 - 2 - 3 }}",
    "{{ 2 * 3 | string }}", "{{ -1 | abs }}", "{{ 5 // 2.0 }}", "{{ 5.5 % 2 }}", "{{ -7.5 // 2 }}",
    "{{ 1 + 1.5 }}", "{{ 0.5 * 4 }}", "{{ true + 1 }}", "{{ 10 / 4 }}", "{{ 2 ** 0.5 }}",
    "{{ 2 ** 64 }}", "{{ 9223372036854775807 + 1 }}",
    "{{ 'a' ~ 1 ~ none ~ true }}", "{{ 'a' ~ 1.0 }}", "{{ 'a' ~ [1] }}", "{{ 1 ~ 2 }}",
    "{{ 'ab' * 3 }}", "{{ 3 * 'ab' }}", "{{ 'ab' * 0 }}", "{{ 'ab' * -1 }}", "{{ [1] + [2, 3] }}",
    "{{ [1, 2] * 2 }}", "{{ 'a' + 'b' }}", "{{ 1 + 2 ~ 3 }}", "{{ 'a' ~ 1 + 2 }}",
    "{{ 'a' + 1 }}", "{{ [1] + 'a' }}", "{{ {} + {} }}",
    # chains of + and ~ (keel builds them in one string, or straight into the output when printed):
    # a non-string mid-chain, Markup at either end, numbers then strings, a macro called inside
    "{{ 'a' + 'b' + 1 }}", "{{ 'a' + 'b' + 'c' + none }}", "{{ 1 + 2 + 'a' }}", "{{ 1 + 2 + 3 + 4.5 }}",
    "{{ [1] + [2] + [3] }}", "{{ 'x' + 'y' + ('<b>' | safe) + '<i>' }}", "{{ ('<b>' | safe) + 'x' + '<i>' }}",
    "{{ 'a' + 'b' ~ 1 ~ 'c' + 'd' }}", "{{ 'a' ~ ('<b>' | safe) ~ '<i>' }}", "{{ 'a' + 'b' - 1 }}",
    "{% macro m(x) %}[{{ x + '!' + x }}]{% endmacro %}{{ 'a' + m('b') + 'c' + m('d' + 'e') }}",
    "{% macro m() %}{{ 'in' + 'ner' }}{% endmacro %}{{ 'out' + m() + m() }}|{{ 'x' ~ m() ~ 'y' }}",
    "{% set s = 'a' + 'b' + 'c' %}{{ s }}{{ s + s }}|{{ (s + 'd') | upper }}|{{ (s + s) | length }}",
    "{% set ns = namespace(t='') %}{% for c in 'xyz' %}{% set ns.t = ns.t + c + '-' %}{% endfor %}{{ ns.t }}",
    "{{ 'a' + undefined_var + 'b' }}", "{{ 'a' + 'b' + undefined_var }}", "{{ undefined_var ~ 'a' ~ 'b' }}",
    "{% for m in [{'r': 'u', 'c': 'hi'}, {'r': 'a', 'c': 'yo'}] %}{{ '<' + m.r + '>' + m['c'] + '</' + m.r + '>' }}{% endfor %}",
    "{% set l = [['a', 'b'], ['c']] %}{{ l[0][1] + l[-1][0] + l[0][-2] }}|{{ l[0][5] is defined }}|{{ l[1][0] == 'c' }}",
    "{% set d = {'items': 1, 'a': {'b': 'x'}} %}{{ d.a.b + d['a']['b'] }}|{{ d.items is callable }}|{{ d['items'] }}",
    "{{ 1 / 0 }}", "{{ 1 // 0 }}", "{{ 1 % 0 }}", "{{ 1.0 / 0 }}",
    "{{ 1 < 2 }}", "{{ 1 < 2 < 3 }}", "{{ 3 > 2 > 2 }}", "{{ 1 < 3 > 2 }}", "{{ 1 == 1.0 }}",
    "{{ 1 == true }}", "{{ 0 == false }}", "{{ 'a' < 'b' }}", "{{ 'B' < 'a' }}", "{{ [1, 2] == [1, 2] }}",
    "{{ [1, 2] < [1, 3] }}", "{{ none == none }}", "{{ none == 0 }}", "{{ 1 != 2 }}", "{{ 'a' == 'a' }}",
    "{{ 1 < 'a' }}", "{{ none < 1 }}", "{{ 2 >= 2 }}", "{{ 2 <= 1 }}", "{{ {'a': 1} == {'a': 1} }}",
    "{{ (1, 2) == [1, 2] }}",
    "{{ 'ell' in 'hello' }}", "{{ '' in 'abc' }}", "{{ 2 in [1, 2] }}", "{{ 'a' in {'a': 1} }}",
    "{{ 1 in {'a': 1} }}", "{{ 'z' not in 'abc' }}", "{{ not 'a' in 'abc' }}", "{{ 1 in 'abc' }}",
    "{{ [1] in [[1], 2] }}", "{{ 'a' in none }}",
    "{{ 0 or 'x' }}", "{{ 'a' and 'b' }}", "{{ '' and 'b' }}", "{{ none or [] }}", "{{ [] or {} }}",
    "{{ 1 and 0 }}", "{{ 0.0 or 'z' }}", "{{ not none }}", "{{ not [] }}", "{{ not 'x' }}",
    "{{ not 0 }}", "{{ not not 1 }}", "{{ true and none }}", "{{ false or false }}",
    "{{ 1 or undefined_thing.attr }}", "{{ 0 and undefined_thing.attr }}",
    "{{ not 1 == 2 }}", "{{ not 1 and 0 }}", "{{ 1 or 0 and 0 }}",
    "{{ 'y' if true else 'n' }}", "{{ 'y' if false }}", "{{ ('y' if false) is defined }}",
    "{{ 1 if 0 else 2 if 1 else 3 }}", "{{ 'a' if [] else 'b' }}", "{{ ('a' if false) ~ 'b' }}",
    "{{ - -3 }}", "{{ +3 }}", "{{ -(2 + 3) }}", "{{ -'a' }}", "{{ 'abc' is string and 1 }}",
    "{{ [1, 2][0] + [3][0] }}",
    "{{ 7 // -2 }}|{{ -7 % -3 }}|{{ 7.5 % -2 }}|{{ 2 ** 62 }}|{{ -2 ** 63 }}",
])
add(G, "{{ -x }}|{{ x * 2 }}|{{ x / 2 }}|{{ x // 2 }}", {"x": 5}, {"x": 2.5}, {"x": -4})

# ---------------------------------------------------------------------------------------------------
# Python str() of values: None, True, containers (repr of their items), floats
G = "python str"
adds(G, [
    "{{ none }}", "{{ true }}", "{{ [1, 'a'] }}", "{{ {'k': 'v', 'n': 1} }}",
    """{{ ["it's"] }}""", """{{ ['say "hi"'] }}""", r"""{{ ['both \' and "'] }}""",
    r"{{ ['a\nb', '\t', '\r'] }}", r"{{ ['\\'] }}", "{{ ['é', '日本'] }}", r"{{ ['\x00', '\x7f', '\x1b'] }}",
    r"{{ ['\u200b', '\u00a0', '\u2028'] }}", r"{{ ['\U0001F600', '👍🏽'] }}", r"{{ ['\ud800'] | length }}",
    "{{ [1.0, 2.5, 1e16, 1e-05, -0.0, none, true, false] }}",
    "{{ {'a': {'b': [1, (2, 3)]}} }}", "{{ [[]] }}", "{{ [{}] }}", "{{ {1: 'a', none: 2, true: 3} }}",
    "{{ [(1,)] }}", "{{ ('a', ['b']) }}", "{{ {'k': none} }}", "{{ [none] | string }}",
    "{{ [''] }}", "{{ [\"'\"] }}", "{{ ['\"'] }}", "{{ [1, [2, [3, [4]]]] }}",
    "{{ range(3) }}", "{{ namespace(a=1).a }}",
])
add(G, "{{ messages }}", {"messages": [{"role": "user", "content": "it's \"q\"\n"}]})
add(G, "{{ messages[0] }}|{{ messages[0].content }}", {"messages": CHAT})
add(G, "{{ [a, b, c, d, e, f, g] }}|{{ [a, b, c, d, e, f, g] | tojson }}|{{ a }}",
    {"a": 123456789012345678.0, "b": 5e-324, "c": 1.7976931348623157e308, "d": 0.000123, "e": 0.0001, "f": 1e21,
     "g": 12345.6789e-20})
add(G, "{{ x }}|{{ [x] }}", {"x": 1e100}, {"x": 1.0}, {"x": -0.0}, {"x": 123456789012}, {"x": 0.1},
    {"x": 1e-7}, {"x": 123456.789e3}, {"x": 2.5e-308}, {"x": 9007199254740993}, {"x": "str"},
    {"x": None}, {"x": True}, {"x": [1, "two", None, {"k": [False]}]}, {"x": 9223372036854775807},
    {"x": 9223372036854775808}, {"x": 18446744073709551615}, {"x": 10 ** 23})

# ---------------------------------------------------------------------------------------------------
G = "access"
D = {"d": {"a": 1, "items": "I", "get": "G", "keys": "K", "content": "C", "nested": {"x": [10, 20, {"y": "deep"}]}}}
adds(G, [
    "{{ d.a }}|{{ d['a'] }}", "{{ d['items'] }}", "{{ d['get'] }}", "{{ d['keys'] }}", "{{ d.content }}",
    "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}", "{{ d.get('items') }}",
    "{{ d.missing }}|{{ d['missing'] }}", "{{ d.missing is defined }}", "{{ d.missing | default('dflt') }}",
    "{{ d.nested.x[2].y }}", "{{ d['nested']['x'][-1]['y'] }}", "{{ d.nested.x.1 }}", "{{ d.nested.x.5 }}",
    "{{ d.missing.attr }}", "{{ d.missing['k'] }}", "{{ d.a.b }}", "{{ d.a.b is defined }}",
    "{{ d.nested.x[2].y.z }}", "{{ d['a']['b'] }}",
], D)
L = {"l": [1, 2, 3, 4, 5], "s": "héllo wörld", "cjk": "日本語テキスト"}
adds(G, [
    "{{ l[0] }}|{{ l[-1] }}|{{ l[-5] }}", "{{ l[10] }}|{{ l[-10] }}", "{{ l[10] is defined }}",
    "{{ l[1.0] }}", "{{ l[2.0] }}", "{{ l[true] }}", "{{ l['0'] }}", "{{ l.0 }}", "{{ l.first }}",
    "{{ s[0] }}|{{ s[1] }}|{{ s[-1] }}", "{{ cjk[1] }}|{{ cjk[-2] }}", "{{ s[100] }}",
    "{{ l[::-1] }}", "{{ l[1:] }}", "{{ l[:-1] }}", "{{ l[::2] }}", "{{ l[1:3] }}", "{{ l[-2:] }}",
    "{{ l[5:] }}", "{{ l[::-2] }}", "{{ l[3:1] }}", "{{ l[3:1:-1] }}", "{{ l[-100:100] }}", "{{ l[:] }}",
    "{{ l[::0] }}", "{{ l[none:2] }}", "{{ l[::3] }}", "{{ l[4:0:-3] }}", "{{ l[::9999999999] }}",
    "{{ l[-1::-9999999999] }}", "{{ l[1:4:-1] }}", "{{ s[::-3] }}", "{{ s[7:1:-2] }}",
    "{{ s[::-1] }}", "{{ s[1:] }}", "{{ s[:-1] }}", "{{ s[::2] }}", "{{ s[:0] }}", "{{ s[2:5] }}",
    "{{ cjk[1:3] }}", "{{ cjk[::-1] }}", "{{ cjk[-3:] }}",
    "{{ (1, 2, 3)[1] }}", "{{ (1, 2, 3)[1:] }}", "{{ 'abc'.length }}", "{{ none.x }}",
], L)
add(G, "{{ x.y }}|{{ x['y'] }}", {"x": None}, {"x": 5}, {"x": "str"}, {"x": [1]})
add(G, "{{ x.y.z }}", {"x": None})
adds(G, ["{{ undefined_var }}", "{{ undefined_var.attr }}", "{{ undefined_var['k'] }}",
         "{{ undefined_var is defined }}", "{{ undefined_var[0] }}"])
add(G, "{{ messages[0]['content'] }}|{{ messages[-1].role }}|{{ messages | length }}", {"messages": CHAT})
add(G, "{{ messages[0].tool_calls[0].function.name }}({{ messages[0].tool_calls[0].function.arguments.city }})",
    {"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "weather", "arguments": {"city": "Paris"}}}]}]})
add(G, "{% set d = {1: 'one', 'k': 'v'} %}{{ d[1] }}|{{ d.k }}|{{ d[2] }}")

# ---------------------------------------------------------------------------------------------------
G = "statements"
add(G, "{% if x > 1 %}big{% elif x == 1 %}one{% elif x < 0 %}neg{% else %}zero{% endif %}",
    {"x": 5}, {"x": 1}, {"x": -3}, {"x": 0})
add(G, "{% if x %}T{% else %}F{% endif %}", {"x": ""}, {"x": " "}, {"x": []}, {"x": [0]}, {"x": {}},
    {"x": 0}, {"x": 0.0}, {"x": None}, {"x": "0"}, {})
adds(G, [
    "{% for x in l %}{{ loop.index }}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}"
    "{{ loop.revindex }}{{ loop.revindex0 }}|{% endfor %}",
    "{% for x in l %}{{ loop.previtem }}-{{ loop.nextitem }};{% endfor %}",
    "{% for x in l %}{{ loop.previtem is defined }}{{ loop.nextitem is defined }};{% endfor %}",
    "{% for x in l %}{{ loop.cycle('a', 'b') }}{% endfor %}",
    "{% for x in l %}{{ loop.depth }}{{ loop.depth0 }}{% endfor %}",
    "{% for x in l %}{{ loop.changed(x > 2) }}{% endfor %}",
    "{% for x in [] %}x{% else %}empty{% endfor %}",
    "{% for x in l %}{{ x }}{% else %}empty{% endfor %}",
    "{% for x in l if x > 2 %}{{ x }}{{ loop.index }}{{ loop.last }}{{ loop.length }};{% endfor %}",
    "{% for x in l if x > 10 %}{{ x }}{% else %}none left{% endfor %}",
    "{% for a, b in [[1, 2], [3, 4]] %}{{ a }}{{ b }};{% endfor %}",
    "{% for a, b in [(1, 2), (3, 4)] %}{{ a + b }};{% endfor %}",
    "{% for (a, b) in [(1, 2)] %}{{ a }}{{ b }}{% endfor %}",
    "{% for a, b in [[1, 2, 3]] %}{{ a }}{% endfor %}",
    "{% for k in {'b': 1, 'a': 2} %}{{ k }}{% endfor %}",
    "{% for c in 'héllo' %}{{ c }}|{% endfor %}",
    "{% for x in none %}{{ x }}{% endfor %}",
    "{% for x in 42 %}{{ x }}{% endfor %}",
    "{% for x in undefined_list %}{{ x }}{% else %}nothing{% endfor %}",
    "{% for x in l %}{% if x == 3 %}{% break %}{% endif %}{{ x }}{% endfor %}",
    "{% for x in l %}{% if x is even %}{% continue %}{% endif %}{{ x }}{% endfor %}",
    "{% for x in l %}{% for y in [1, 2] %}{% if y == 2 %}{% break %}{% endif %}{{ x }}{{ y }};{% endfor %}"
    "{% endfor %}",
    "{% for x in l %}{% for y in 'ab' %}{{ loop.index }}{% endfor %}{{ loop.index }}|{% endfor %}",
    "{% for i in range(3) %}{% for j in range(i) %}{{ i }}{{ j }} {% endfor %}{% endfor %}",
    "{% for i in range(3) %}{{ i }}{% endfor %}{{ i }}",
    "{% set x = 1 %}{{ x }}", "{% set a, b = 1, 2 %}{{ a }}{{ b }}", "{% set a, b = [3, 4] %}{{ a }}{{ b }}",
    "{% set a, b = 'xy' %}{{ a }}{{ b }}", "{% set a, b = [1] %}{{ a }}",
    "{% set x %}block {{ 1 + 1 }}{% endset %}[{{ x }}]", "{% set x | upper %}block{% endset %}{{ x }}",
    "{% set x %}\n  indented\n{% endset %}[{{ x }}]",
    "{% set x = 1 %}{% for i in [1, 2] %}{% set x = i %}{{ x }}{% endfor %}{{ x }}",
    "{% set ns = namespace(x=1) %}{% for i in [1, 2] %}{% set ns.x = ns.x + i %}{% endfor %}{{ ns.x }}",
    "{% set ns = namespace() %}{% set ns.a = 'v' %}{{ ns.a }}|{{ ns.b }}",
    "{% set ns = namespace({'a': 1}, b=2) %}{{ ns.a }}{{ ns.b }}",
    "{% set ns = namespace(items=[]) %}{% for i in range(3) %}{% set ns.items = ns.items + [i] %}{% endfor %}"
    "{{ ns.items }}",
    "{% set ns = namespace(found=false) %}{% for x in l %}{% if x == 3 %}{% set ns.found = true %}{% endif %}"
    "{% endfor %}{{ ns.found }}",
    "{% set ns = namespace(a=1) %}{% set ns.a, ns.b = 5, 6 %}{{ ns.a }}{{ ns.b }}",
    "{% set ns = namespace(x=1) %}{% set ns.x += 1 %}{{ ns.x }}",
    "{% set d = {'a': 1} %}{% set d.a = 2 %}{{ d.a }}",
    "{% if true %}{% set x = 5 %}{% endif %}{{ x }}",
    "{% set x = 1 %}{% if true %}{% set x = 2 %}{% endif %}{{ x }}",
    "{% set l = l + [6] %}{{ l }}",
    "{% for x in l %}{% set l = [] %}{{ x }}{% endfor %}",
    "{% with x = 1, y = 2 %}{{ x + y }}{% endwith %}[{{ x }}]",
    "{% macro greet(name, greeting='Hi') %}{{ greeting }}, {{ name }}!{% endmacro %}"
    "{{ greet('Bob') }}|{{ greet('Al', greeting='Yo') }}|{{ greet(name='Z') }}|{{ greet('A', 'B') }}",
    "{% macro m(a, b) %}[{{ a }}|{{ b }}|{{ b is defined }}]{% endmacro %}{{ m(1) }}",
    "{% macro m(a) %}{{ a }}{% endmacro %}{{ m(1, 2) }}",
    "{% macro m(a) %}{{ a }}{% endmacro %}{{ m(b=2) }}",
    "{% macro m() %}{{ varargs }}|{{ kwargs }}{% endmacro %}{{ m(1, 2, k=3) }}",
    "{% set g = 'G' %}{% macro m() %}{{ g }}{% endmacro %}{{ m() }}",
    "{% macro m() %}{{ g }}{% endmacro %}{% set g = 'late' %}{{ m() }}",
    "{% macro m(x) %}{% set x = x * 2 %}{{ x }}{% endmacro %}{% set x = 1 %}{{ m(5) }}{{ x }}",
    "{% macro m() %}ab{% endmacro %}{{ m() | length }}|{{ m() ~ 'c' }}|{% set r = m() %}{{ r | upper }}",
    "{% macro m(n) %}{% if n > 0 %}{{ m(n - 1) }}{% endif %}{{ n }}{% endmacro %}{{ m(20) }}",
    "{{ m() }}{% macro m() %}x{% endmacro %}",
    # scopes by symbol: a top-level set over a global's name, a macro reading the template's x
    # while a loop has its own, `loop` not visible inside a macro, a with block's name gone after it
    "{% set namespace = 5 %}{{ namespace }}",
    "{% set x = 1 %}{% macro m() %}{{ x }}{% endmacro %}{% for i in [1] %}{% set x = 2 %}{{ m() }}{{ x }}"
    "{% endfor %}{{ x }}",
    "{% macro m() %}{{ loop is defined }}{% endmacro %}{% for i in [1] %}{{ m() }}{% endfor %}",
    "{% for i in [1, 2] %}{% with y = i * 10 %}{{ y }}{% endwith %}{{ y is defined }}{% endfor %}",
    "{% macro m() %}{{ caller() }}{% endmacro %}{{ m() }}",
    "{% macro wrap() %}<{{ caller() }}>{% endmacro %}{% call wrap() %}inner{% endcall %}",
    "{% macro each(l) %}{% for x in l %}{{ caller(x) }}{% endfor %}{% endmacro %}"
    "{% call(x) each([1, 2]) %}[{{ x }}]{% endcall %}",
    "{% macro wrap(tag) %}<{{ tag }}>{{ caller() | trim }}</{{ tag }}>{% endmacro %}{% call wrap('b') %}"
    "\n  bold\n{% endcall %}",
    "{% filter upper %}abc {{ 'def' }}{% endfilter %}", "{% filter trim %}  x  {% endfilter %}|",
    "{% filter replace('a', 'o') | upper %}banana{% endfilter %}",
    "{% generation %}abc{% endgeneration %}",
    "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %};{% endfor %}",
    "{% generation %}{% generation %}in{% endgeneration %}{% endgeneration %}",
    "{% do l.append(1) %}",
    "{% include 'other.jinja' %}",
    "{% for item in tree recursive %}{{ item.name }}{% if item.children %}[{{ loop(item.children) }}]{% endif %}"
    "{% endfor %}",
    "{% autoescape true %}{{ '<b>' }}{% endautoescape %}",
    "{% set x = 0 %}{% for i in l %}{% set x = x + i %}{{ x }},{% endfor %}{{ x }}",
    "{% for i in [1, 2] %}{% set outer = loop %}{% for j in [1, 2] %}{{ outer.index }}{{ loop.index }}"
    " {% endfor %}{% endfor %}",
    "{% macro m() %}{% set y = 5 %}{{ y }}{% endmacro %}{{ m() }}[{{ y }}]",
    "{% for i in l %}{% if i > 1 %}{% set z = i %}{% endif %}{{ z }}{% endfor %}",
    "{% set ns = namespace(a=[]) %}{% macro add(x) %}{% set ns.a = ns.a + [x] %}{% endmacro %}{{ add(1) }}"
    "{{ add(2) }}{{ ns.a }}",
    "{% for x in l %}{{ loop.index }}{% set l = [9] %}{% endfor %}{{ l }}",
    "{% for m in messages if m.role != 'system' %}{{ loop.index0 }}{{ m.role }}{% endfor %}",
    # keel reuses a finished loop's scope and `loop` object for the next loop at its depth, unless
    # something kept them: a kept loop or loop.cycle must still describe its own loop.
    "{% set ns = namespace(l=none) %}{% for x in [1, 2] %}{% set ns.l = loop %}{% endfor %}"
    "{% for y in [5, 6, 7] %}{{ loop.index }}{% endfor %}|{{ ns.l.index }}/{{ ns.l.length }}/{{ ns.l.last }}"
    "/{{ ns.l.previtem }}/{{ ns.l.nextitem is defined }}",
    "{% set ns = namespace(c=none) %}{% for x in [1, 2] %}{% set ns.c = loop.cycle %}{% endfor %}"
    "{% for y in [5, 6, 7] %}{{ loop.cycle('p', 'q') }}{% endfor %}|{{ ns.c('a', 'b', 'c') }}",
    "{% set ns = namespace(k=[]) %}{% for x in [1, 2] %}{% set ns.k = ns.k + [loop] %}{% endfor %}"
    "{% for y in 'abc' %}{% endfor %}{% for k in ns.k %}{{ k.index }}{{ k.length }};{% endfor %}",
    "{% macro m(xs) %}{% for x in xs %}{{ loop.index }}{{ x }}{{ loop.length }}{% endfor %}{% endmacro %}"
    "{% for a in [1, 2, 3] %}[{{ m('pq') }}{{ loop.index }}{{ loop.length }}{{ loop.previtem }}]{% endfor %}"
    "{{ m('xyz') }}",
    "{% for a in [1, 2, 3] %}{% if a == 2 %}{% break %}{% endif %}{{ a }}{% endfor %}"
    "{% for b in [7] %}{{ loop.previtem is defined }}{{ loop.nextitem is defined }}{{ loop.length }}"
    "{{ loop.last }}{% endfor %}{% for c in [] %}{{ c }}{% else %}none{% endfor %}",
    "{% macro n(x) %}{% for y in [x, x] %}{{ y }}{% endfor %}{% endmacro %}"
    "{% for x in [1, 2, 3] if n(x) != '22' %}{{ x }}{{ loop.length }}{% endfor %}",
    "{% macro m(a, b=a) %}{{ b }}{% endmacro %}{{ m(3) }}",
    "{% macro m(x) %}{{ caller(x * 2) }}{% endmacro %}{% call(y) m(4) %}got {{ y }}{% endcall %}",
], dict(L, tree=[{"name": "a", "children": [{"name": "b"}, {"name": "c", "children": [{"name": "d"}]}]},
                 {"name": "e"}]))
# a rendering's variable shadows a global of the same name
add(G, "{{ range }}|{{ namespace(a=1).a }}", {"range": 3})

# ---------------------------------------------------------------------------------------------------
G = "string methods"
S = {"s": "  Hello, World  \n", "w": "xxhixyy", "t": "hello world"}
adds(G, [
    "[{{ s.strip() }}]", "[{{ s.lstrip() }}]", "[{{ s.rstrip() }}]", "[{{ w.strip('xy') }}]",
    "[{{ w.lstrip('x') }}]", "[{{ w.rstrip('y') }}]", "[{{ s.rstrip('\\n') }}]", "[{{ s.strip(none) }}]",
    "{{ 'a b  c'.split() }}", "{{ ' a\tb\n c '.split() }}", "{{ 'a,b,,c'.split(',') }}",
    "{{ 'a,b,c'.split(',', 1) }}", "{{ 'a b c d'.split(none, 2) }}", "{{ 'a,b'.split(sep=',') }}",
    "{{ 'a b c'.rsplit(' ', 1) }}", "{{ 'a b c'.rsplit(none, 1) }}", "{{ 'a b c'.rsplit() }}",
    "{{ ''.split(',') }}", "{{ ''.split() }}", "{{ 'abc'.split('') }}",
    "{{ 'a</think>b</think>c'.split('</think>')[-1] }}", "{{ 'abab'.split('ab') }}",
    "{{ 'a\\nb\\r\\nc\\n'.splitlines() }}", "{{ 'a\\nb'.splitlines(true) }}",
    "{{ t.startswith('he') }}{{ t.startswith('x') }}{{ t.endswith('ld') }}{{ t.endswith('') }}",
    "{{ t.startswith(('x', 'he')) }}{{ t.endswith(('a', 'b')) }}", "{{ t.startswith('wor', 6) }}",
    "{{ t.rfind('o', 0, 5) }}|{{ t.count('o', 5) }}|{{ t.endswith('hello', 0, 5) }}|{{ t.split(' ', -1) }}"
    "|{{ t.replace('l', 'L', 0) }}|{{ t.strip('dh') }}",
    "{{ 'aaa'.replace('a', 'b') }}", "{{ 'aaa'.replace('a', 'b', 2) }}", "{{ 'abc'.replace('', '-') }}",
    "{{ t.upper() }}|{{ 'HeLLo'.lower() }}|{{ 'hello wORLD'.title() }}|{{ 'hELLO wORLD'.capitalize() }}",
    "{{ \"they're bill's\".title() }}", "{{ 'a1b2 c_d'.title() }}", "{{ 'hello'.swapcase() }}",
    "{{ t.find('l') }}|{{ t.rfind('l') }}|{{ t.find('z') }}|{{ t.count('l') }}|{{ t.count('') }}",
    "{{ 'héllo'.find('l') }}|{{ '日本語'.find('語') }}|{{ t.find('o', 5) }}",
    "{{ t.index('w') }}", "{{ t.index('z') }}",
    "{{ ', '.join(['a', 'b']) }}", "{{ ''.join(['x', 'y']) }}", "{{ '-'.join('abc') }}", "{{ ','.join([1, 2]) }}",
    "{{ t.removeprefix('hello ') }}|{{ t.removesuffix(' world') }}|{{ t.removeprefix('x') }}",
    "{{ '123'.isdigit() }}{{ ''.isdigit() }}{{ '1.5'.isdigit() }}{{ 'abc'.isalpha() }}{{ 'ab1'.isalpha() }}",
    "{{ ' \\n\\t'.isspace() }}{{ ''.isspace() }}{{ 'abc'.islower() }}{{ 'ABC'.isupper() }}{{ 'ab1'.isalnum() }}",
    "{{ '{} is {}'.format('a', 1) }}", "{{ '{0}{0}{name}'.format('x', name='y') }}", "{{ '%s-%d' % ('a', 3) }}",
    "{{ '%d items' % 3 }}", "{{ 'x%sy' % 'a' }}",
    "{{ 'ab'.center(6, '*') }}", "{{ '7'.zfill(3) }}", "{{ 'a-b-c'.partition('-') }}",
    "{{ 'a-b-c'.rpartition('-') }}",
    "{{ 'x'.ljust(3) }}|", "{{ 'Hello'.casefold() }}", "{{ 'tab\\there'.expandtabs(4) }}",
], S)
add(G, "{{ d.keys() | list }}|{{ d.values() | list }}|{{ d.items() | list }}", {"d": {"a": 1, "b": [2]}})
add(G, "{{ d.get('a') }}|{{ d.get('z', 'dflt') }}|{{ d.get('z') }}|{{ d.get('z') is none }}", {"d": {"a": 1}})
add(G, "{{ 'a' in d.keys() }}|{{ d.keys() | length }}|{% for k in d.keys() %}{{ k }}{% endfor %}",
    {"d": {"a": 1, "b": 2}})
add(G, "{{ l.index(2) }}|{{ l.count(1) }}|{{ l.index(9) }}", {"l": [1, 2, 1]})
add(G, "{{ l.count(1) }}|{{ l.index(1) }}", {"l": [1, 2, 1]})
add(G, "{{ d.update({'b': 2}) }}{{ d }}", {"d": {"a": 1}})
add(G, "{{ l.pop() }}{{ l }}", {"l": [1, 2]})
add(G, "{{ d.setdefault('b', 2) }}", {"d": {"a": 1}})
add(G, "{{ d.copy() }}", {"d": {"a": 1}})

# ---------------------------------------------------------------------------------------------------
G = "filter tojson"
J = {"d": {"b": 1, "a": [1.0, 0.1, 1e-05, 1e16, -0.0, 1.5e300], "é": "naïve ☃ 😀", "n": None, "t": True,
           "nest": {"x": {"y": []}, "z": {}}, "q": "a\"b\\c</s>\n\t\u0001\u2028/"}}
adds(G, [
    "{{ d | tojson }}", "{{ d | tojson(indent=2) }}", "{{ d | tojson(indent=4) }}",
    "{{ d | tojson(sort_keys=true) }}",
    "{{ d | tojson(separators=(',', ':')) }}", "{{ d | tojson(ensure_ascii=true) }}",
    "{{ d | tojson(indent=2, sort_keys=true, ensure_ascii=true) }}", "{{ d.nest | tojson(indent=2) }}",
    "{{ d.a | tojson }}", "{{ d.q | tojson }}", "{{ d['é'] | tojson }}", "{{ d['é'] | tojson(ensure_ascii=true) }}",
    "{{ none | tojson }}", "{{ true | tojson }}", "{{ 'x' | tojson }}", "{{ 1 | tojson }}", "{{ 1.0 | tojson }}",
    "{{ [] | tojson(indent=2) }}", "{{ {} | tojson(indent=2) }}", "{{ (1, 2) | tojson }}",
    "{{ [[1, [2]], {}] | tojson(indent=1) }}",
    "{{ undefined_thing | tojson }}", "{{ (1e300 * 1e300) | tojson }}", "{{ (0.1 + 0.2) | tojson }}",
    "{{ (2 ** 70) | tojson }}",
    "{{ {1: 'int key'} | tojson }}", "{{ {'b': 1, 'a': 2} | tojson(sort_keys=true, indent=2) }}",
    "{{ d | tojson(indent='  ') }}", "{{ d | tojson(indent=0) }}",
    "{{ d.nest | tojson(separators=(',', ': '), indent=2) }}",
    "{{ 'a' | tojson(2) }}", "{{ tools | tojson }}", "{{ d | tojson | length }}", "{{ namespace(a=1) | tojson }}",
    "{{ range(3) | tojson }}", "{{ d.items() | list | tojson }}", "{{ '<>&\\'' | tojson }}",
], J)
add(G, "{{ x | tojson }}", {"x": "\U0001F600\u00e9\u0301\u200b\ufeff"}, {"x": 12345678901234}, {"x": 1e-7},
    {"x": 0.1}, {"x": 100.0}, {"x": 1e22}, {"x": [None, False]})
add(G, "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}", {"tools": [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "enum": ["Paris", "Zürich"]},
                                          "days": {"type": "integer", "minimum": 1.5}},
                                          "required": ["city"]}}}]})

# ---------------------------------------------------------------------------------------------------
G = "filters"
F = {"l": [3, 1, 2], "words": ["b", "A", "a", "C"], "users": USERS, "s": "  hello world  ",
     "d": {"b": 2, "a": 1, "C": 3}, "txt": "a\nb\n\nc"}
adds(G, [
    "[{{ s | trim }}]", "[{{ 'xxhixx' | trim('x') }}]", "[{{ ' \\t\\n x \\u3000' | trim }}]",
    "{{ 'héllo' | length }}|{{ l | count }}|{{ d | length }}|{{ undefined_thing | length }}",
    "{{ l | first }}|{{ l | last }}|{{ 'abc' | first }}|{{ 'abc' | last }}|{{ [] | first }}|{{ [] | last }}",
    "{{ d | first }}",
    "{{ l | join }}|{{ l | join(', ') }}|{{ users | join(', ', attribute='name') }}|{{ [none, true] | join(',') }}",
    "{{ 'abc' | join('-') }}|{{ undefined_thing | join(',') }}",
    "{{ undefined_thing | default('d') }}|{{ '' | default('d') }}|{{ '' | default('d', true) }}"
    "|{{ none | default('d') }}",
    "{{ undefined_thing | d('z') }}|{{ false | default('d', boolean=true) }}|{{ 0 | d('x', true) }}"
    "|{{ undefined_thing | default }}",
    "{{ 'hello world' | title }}|{{ \"they're\" | title }}|{{ 'hELLO wORLD' | capitalize }}|{{ 'a-b c(d' | title }}",
    "{{ 'x' | upper }}{{ 'X' | lower }}{{ undefined_thing | upper }}|",
    "{{ 'aaa' | replace('a', 'b') }}|{{ 'aaa' | replace('a', 'b', 2) }}|{{ 'a.b' | replace('.', '') }}",
    "{{ 1 | string }}|{{ [1] | string }}|{{ none | string }}|{{ 1.5 | string }}|{{ 'x' | string }}",
    "{{ '42' | int }}|{{ '4.7' | int }}|{{ 'x' | int }}|{{ 'x' | int(7) }}|{{ 3.9 | int }}|{{ -3.9 | int }}"
    "|{{ ' 12 ' | int }}",
    "{{ '0x1A' | int(0, 16) }}|{{ '1_000' | int }}|{{ none | int }}|{{ true | int }}|{{ '1e3' | int }}",
    "{{ '3.5' | float }}|{{ 'x' | float }}|{{ 2 | float }}|{{ 'x' | float(1.5) }}|{{ '1e3' | float }}"
    "|{{ ' 2 ' | float }}",
    "{{ 'abc' | list }}|{{ d | list }}|{{ (1, 2) | list }}|{{ undefined_thing | list }}",
    "{{ d | items | list }}|{% for k, v in d | items %}{{ k }}{{ v }}{% endfor %}"
    "|{{ undefined_thing | items | list }}",
    "{{ l | reverse | list }}|{{ 'abc' | reverse }}|{% for x in l | reverse %}{{ x }}{% endfor %}",
    "{{ [1, 2, 1, 3] | unique | list }}|{{ ['a', 'A', 'b'] | unique | list }}"
    "|{{ ['a', 'A'] | unique(case_sensitive=true) | list }}",
    "{{ users | unique(attribute='admin') | map(attribute='name') | list }}",
    "{{ l | sort }}|{{ l | sort(reverse=true) }}|{{ words | sort }}|{{ words | sort(case_sensitive=true) }}",
    "{{ users | sort(attribute='age') | map(attribute='name') | join(',') }}"
    "|{{ users | sort(attribute='name') | map(attribute='name') | join(',') }}",
    "{{ users | sort(attribute='age', reverse=true) | map(attribute='name') | join(',') }}",
    "{{ [3, 'a'] | sort }}",
    "{{ d | dictsort }}|{{ d | dictsort(true) }}|{{ d | dictsort(by='value') }}|{{ d | dictsort(reverse=true) }}",
    "{% for k, v in d | dictsort %}{{ k }}={{ v }};{% endfor %}",
    "{{ [1, 2, 3] | sum }}|{{ users | sum(attribute='age') }}|{{ [0.1, 0.2] | sum }}|{{ [] | sum }}"
    "|{{ [1] | sum(start=10) }}",
    "{{ l | min }}|{{ l | max }}|{{ words | min }}|{{ words | max }}|{{ words | max(case_sensitive=true) }}"
    "|{{ [] | max }}",
    "{{ users | max(attribute='age') }}|{{ users | min(attribute='age') }}",
    "{{ users | map(attribute='name') | list }}|{{ ['a', 'b'] | map('upper') | join }}",
    "{{ users | map(attribute='admin', default='x') | list }}|{{ users | map(attribute='admin') | list }}",
    "{{ ['1', '2'] | map('int') | sum }}|{{ [' a ', 'b '] | map('trim') | list }}"
    "|{{ ['a'] | map('replace', 'a', 'b') | list }}",
    "{{ [[1, 2], [3]] | map('length') | list }}|{{ users | map(attribute='name') | map('upper') | join(' ') }}",
    "{{ [1, 2, 3, 4] | select('odd') | list }}|{{ [1, 2, 3] | reject('odd') | list }}"
    "|{{ [0, 1, '', 'a', none, []] | select | list }}",
    "{{ [1, 5, 10] | select('gt', 3) | list }}|{{ ['a', 1, none] | select('string') | list }}"
    "|{{ [1, 5] | select('equalto', 5) | list }}",
    "{{ [1, 5, 10] | select('>', 3) | list }}|{{ [1, 5, 10] | reject('==', 5) | list }}"
    "|{{ ['a', 'bb'] | select('in', ['a']) | list }}",
    "{{ users | selectattr('admin') | map(attribute='name') | list }}"
    "|{{ users | rejectattr('admin') | map(attribute='name') | list }}",
    "{{ users | selectattr('admin', 'defined') | list | length }}"
    "|{{ users | selectattr('admin', 'undefined') | map(attribute='name') | list }}",
    "{{ users | selectattr('age', 'gt', 30) | map(attribute='name') | join(',') }}"
    "|{{ users | selectattr('name', 'equalto', 'Bob') | list }}",
    "{{ users | selectattr('missing', 'none') | list | length }}"
    "|{{ users | rejectattr('admin', 'none') | list | length }}",
    "{{ d | attr('a') }}|{{ d | attr('items') is callable }}|{{ namespace(a=1) | attr('a') }}",
    "{{ txt | indent }}|{{ txt | indent(2, true) }}|{{ txt | indent(2, blank=true) }}|{{ txt | indent(first=true) }}",
    "[{{ 'a\\nb\\n' | indent(2) }}]|[{{ 'x\\ny' | indent('> ') }}]|[{{ '' | indent(2, true) }}"
    "]|[{{ 'a\\r\\nb' | indent(1) }}]",
    "{{ 0.5 | round }}|{{ -0.5 | round }}|{{ 1.5 | round }}", "{{ 'abc def' | truncate(5) }}",
    "{{ -3 | abs }}|{{ -2.5 | abs }}|{{ 2.5 | round }}|{{ 3.5 | round }}|{{ 3.14159 | round(2) }}|{{ 7 | round }}"
    "|{{ 0.125 | round(2) }}",
    "{{ 3.5 | round(method='floor') }}|{{ 3.2 | round(method='ceil') }}|{{ -3.5 | round }}"
    "|{{ 1234.5678 | round(-2) }}|{{ 2.675 | round(2) }}",
    "{{ 'a b  c\\nd' | wordcount }}|{{ '' | wordcount }}|{{ 'well-known fact' | wordcount }}",
    "{{ [1, 2, 3, 4, 5] | batch(2) | list }}|{{ [1, 2, 3] | batch(2, 'x') | list }}",
    "{{ [1, 2, 3, 4, 5] | slice(2) | list }}|{{ [1, 2, 3, 4] | slice(3, 0) | list }}",
    "{{ '<b>' | safe }}|{{ '<a & \"b\" \\'c\\'>' | e }}|{{ '<x>' | escape }}|{{ '<x>' | e | e }}|{{ 1 | e }}",
    "{{ '<x>' | forceescape }}|{{ ('<b>' | safe) ~ '<i>' }}|{{ ('<b>' | e) ~ '<i>' }}|{{ ('<b>' | e) + '<i>' }}",
    "{{ '%s=%d' | format('a', 1) }}|{{ 'abc' | center(9) }}|{{ 'abc def' | truncate(5) }}|{{ 'a b' | urlencode }}",
    "{{ 'a\\nb' | striptags }}|{{ 'hello world foo' | wordwrap(5) }}|{{ 1234567 | filesizeformat }}",
    "{{ [1, [2]] | pprint }}|{{ 'x' | list | first }}|{{ 'abc' | length > 2 }}|{{ 'Abc' | upper | lower }}",
    "{{ l | map('string') | join('+') }}|{{ l | sort | first }}|{{ (l | sort)[-1] }}",
    "{{ x | nosuchfilter }}",
    "{% if false %}{{ x | nosuchfilter }}{% endif %}ok",
    "{% if 'nosuchfilter' is filter %}{{ x | nosuchfilter }}{% endif %}ok",
    "{{ 'upper' is filter }}|{{ 'nosuch' is filter }}|{{ 'odd' is test }}|{{ 'nosuch' is test }}",
], F)

# ---------------------------------------------------------------------------------------------------
G = "tests"
T = {"d": {"a": 1}, "l": [1], "s": "abc", "n": None, "f": 1.5, "i": 3, "b": True}
adds(G, [
    "{{ x is defined }}{{ d is defined }}{{ n is defined }}{{ d.z is defined }}",
    "{{ x is undefined }}{{ d is undefined }}{{ d.a is undefined }}",
    "{{ n is none }}{{ x is none }}{{ 0 is none }}{{ none is none }}",
    "{{ s is string }}{{ x is string }}{{ 1 is string }}{{ l is string }}",
    "{{ 1 is number }}{{ f is number }}{{ b is number }}{{ s is number }}{{ n is number }}",
    "{{ i is integer }}{{ b is integer }}{{ f is integer }}{{ f is float }}{{ i is float }}",
    "{{ b is boolean }}{{ 1 is boolean }}{{ false is boolean }}{{ n is boolean }}",
    "{{ d is mapping }}{{ l is mapping }}{{ namespace() is mapping }}",
    "{{ l is iterable }}{{ s is iterable }}{{ d is iterable }}{{ 1 is iterable }}{{ n is iterable }}"
    "{{ x is iterable }}",
    "{{ l is sequence }}{{ s is sequence }}{{ d is sequence }}{{ 1 is sequence }}{{ (1,) is sequence }}",
    "{{ range is callable }}{{ raise_exception is callable }}{{ s is callable }}{{ s.upper is callable }}"
    "{{ namespace is callable }}",
    "{{ 1 is eq 1 }}{{ 1 is equalto 1 }}{{ 'a' is eq('b') }}{{ 1 is ne 2 }}{{ 1 is ne 1 }}",
    "{{ 1 is lt 2 }}{{ 2 is gt 1 }}{{ 1 is le 1 }}{{ 1 is ge 2 }}{{ 1 is lessthan 2 }}{{ 1 is greaterthan 2 }}",
    "{{ 'a' is in 'abc' }}{{ 2 is in [1, 2] }}{{ 'k' is in {'k': 1} }}",
    "{{ 3 is odd }}{{ 4 is odd }}{{ 4 is even }}{{ 9 is divisibleby 3 }}{{ 9 is divisibleby(4) }}",
    "{{ 'abc' is lower }}{{ 'ABC' is upper }}{{ 'aBc' is lower }}{{ '123' is lower }}",
    "{{ '123' is upper }}{{ 'A1' is upper }}{{ '123'.islower() }}{{ '123'.isupper() }}",
    "{{ true is true }}{{ 1 is true }}{{ false is false }}{{ 0 is false }}{{ n is true }}",
    "{{ none is sameas none }}{{ l is sameas l }}{{ [] is sameas [] }}{{ true is sameas true }}",
    "{{ x is not none }}{{ x is not defined }}{{ s is not string }}{{ not s is string }}",
    "{{ 'x' is escaped }}{{ ('x' | e) is escaped }}",
    "{{ s is string and s }}|{{ n is none or 'x' }}|{{ (s is string) | string }}",
    "{{ 1 is odd is true }}",
    "{% if s is string and s | length > 2 %}long{% endif %}",
    "{{ 2.0 is odd }}", "{{ 'a' is odd }}",
    "{{ x is nosuchtest }}",
    "{% if false %}{{ x is nosuchtest }}{% endif %}ok",
], T)

# ---------------------------------------------------------------------------------------------------
G = "errors"
adds(G, [
    "{{ raise_exception('boom') }}",
    "before{% if true %}{{ raise_exception('inside') }}{% endif %}",
    "{% if false %}{{ raise_exception('not raised') }}{% endif %}ok",
    "{{ raise_exception() }}",
    "{{ foo() }}", "{{ foo.bar() }}", "{{ 'abc'.nosuchmethod() }}", "{{ [1].nosuchmethod() }}",
    "{{ undefined_var.attr }}", "{{ undefined_var + 1 }}", "{{ undefined_var ~ 'x' }}", "{{ 1 + undefined_var }}",
    "{{ undefined_var == none }}", "{% if undefined_var %}t{% else %}f{% endif %}", "{{ undefined_var | string }}",
    "{{ undefined_var[0] }}", "{% for x in undefined_var %}{% endfor %}ok", "{{ undefined_var() }}",
    "{% if true %}x", "{{ 'abc }}", "{{ x ", "{% for %}{% endfor %}", "{% endif %}", "{{ }}",
    "{% if true %}{% endfor %}", "{{ 1 + }}", "{% set %}", "{{ x[ }}", "{% unknown_tag %}",
    "{% break %}", "{% for x in [1] %}{% endfor %}{% continue %}", "{# unclosed comment", "{% raw %}unclosed",
    "{{ 1 2 }}", "{% if %}x{% endif %}", "{% else %}", "{% macro %}{% endmacro %}", "{% set x = %}",
    "{{ 'a' | }}", "{{ x is }}", "}}", "%}", "{{ (1 }}", "{{ [1, 2 }}", "{{ {'a' 1} }}",
    "{% endfor %}", "{% for x in [1] %}x", "{% macro m() %}x", "{% set x %}x",
    "{{ 'a' if }}", "{% elif true %}", "{{ x.1a }}", "{{ 1.e5 }}",
    "{% for i in range(100000) %}{% endfor %}ok",
    "{% for i in range(100000) %}{% if i == 99999 %}{{ i }}{% endif %}{% endfor %}",
    "{{ range(5) | list }}|{{ range(1, 10, 3) | list }}|{{ range(5) | sum }}|{{ range(10, 0, -3) | list }}",
    "{{ range(100001) | length }}", "{{ range(0) | list }}", "{{ range(1, 2, 0) | list }}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    # an unknown filter or test fails at compile time, except inside an if (or a conditional
    # expression), where jinja2 defers it to the render; a for or macro body inside the if is strict again
    "{% for x in [] %}{{ x | nosuch }}{% endfor %}ok", "{% macro m() %}{{ x | nosuch }}{% endmacro %}ok",
    "{% if true %}ok{% else %}{{ x | nosuch }}{% endif %}", "{{ (x | nosuch) if false else 1 }}",
    "{% for x in [] %}{{ x is nosuch }}{% endfor %}ok", "{{ (1 is nosuch) if false else 1 }}",
    "{% if false %}{% for x in [] %}{{ x | nosuch }}{% endfor %}{% endif %}ok",
    "{% if true %}{{ x | nosuch }}{% endif %}",
    "{% for x in [] %}{{ x.foo(1) }}{% endfor %}ok",
    "{{ [1, 2].append(3) }}", "{% set l = [1] %}{{ l.append(2) }}", "{% set d = {} %}{{ d.update({'a': 1}) }}",
])

# ---------------------------------------------------------------------------------------------------
G = "unicode"
U = {"cjk": "你好，世界！日本語", "emoji": "😀👍🏽👨‍👩‍👧", "comb": "e\u0301a\u0308",
     "ws": "\u3000 x\u00a0\u2003y \u3000", "mix": "Straße İstanbul ﬁ ǅ ΣΑΣ",
     "rtl": "שלום עולם", "sep": "a\x1cb\x1dc\x85d\u2028e"}
adds(G, [
    "{{ cjk | upper }}|{{ cjk | length }}|{{ cjk[2:5] }}|{{ cjk | tojson }}|{{ cjk | tojson(ensure_ascii=true) }}",
    "{{ emoji | length }}|{{ emoji[1] }}|{{ emoji[::-1] }}|{{ emoji | tojson(ensure_ascii=true) }}"
    "|{{ emoji | list }}",
    "{{ comb | length }}|{{ comb | upper }}|{{ comb[1] | tojson }}|{{ comb[::-1] }}|{{ [comb] }}",
    "[{{ ws | trim }}]|[{{ ws.strip() }}]|{{ ws.split() }}|{{ ws | wordcount }}|{{ ws.isspace() }}",
    "{{ mix | upper }}|{{ mix | lower }}|{{ mix | title }}|{{ mix.title() }}|{{ mix | capitalize }}",
    "{{ 'ß'.upper() }}|{{ 'İ'.lower() | length }}|{{ 'ﬁ'.upper() }}|{{ 'ǅ'.lower() }}{{ 'ǆ'.upper() }}"
    "{{ 'ǆ'.title() }}",
    "{{ 'ǆx' | capitalize }}|{{ 'ǆx'.capitalize() }}|{{ 'ﬁx'.capitalize() }}",
    "{{ rtl[::-1] }}|{{ rtl.split() }}|{{ rtl | length }}",
    "{{ sep.split() }}|{{ sep.splitlines() }}|{{ sep | tojson }}",
    "{{ '日本' < '本' }}|{{ 'é' > 'z' }}|{{ ['é', 'z', 'a'] | sort }}|{{ ['É', 'e'] | sort }}",
    "{{ 'ÀÉ' | lower }}|{{ 'àé' is lower }}|{{ 'ÀÉ' is upper }}|{{ '日本' is lower }}|{{ '١٢٣'.isdigit() }}",
    "{{ '日本語' ~ 1 }}|{{ '日' * 3 }}|{{ '日本語'.replace('本', 'X') }}",
    "{{ cjk.find('世') }}|{{ cjk.split('，') }}|{{ cjk.startswith('你') }}|{{ emoji.count('👍') }}",
    "{{ 'İ' | lower | length }}|{{ 'ΣΑΣ' | lower }}|{{ 'ﬃ' | length }}|{{ 'ﬃ' | upper | length }}",
    "{{ cjk | center(15) }}|{{ cjk | truncate(4, true, '…', 0) }}",
], U)
add(G, "{% for m in messages %}{{ m.content | trim }}|{{ m.content | length }}|{{ m.content[:3] }}|"
       "{{ m.content | tojson }}\n{% endfor %}",
    {"messages": [{"role": "user", "content": "  日本語のテキスト  "},
                  {"role": "assistant", "content": "\u00e9\u0301 🎉 end\n"},
                  {"role": "user", "content": "\u200b\ufeffzero-width"}]})

# ---------------------------------------------------------------------------------------------------
G = "sandbox and globals"
adds(G, [
    "{{ ''.__class__ }}", "{{ messages.__class__.__name__ }}", "{{ messages[0].__len__ }}",
    "{{ ''.__class__.__mro__ }}", "{{ cycler is defined }}", "{{ joiner is defined }}", "{{ lipsum is defined }}",
    "{{ dict(a=1, b='x') }}", "{{ dict(a=1).a }}", "{{ dict([('a', 1)]) }}", "{{ dict.fromkeys(['a', 'b'], 0) }}",
    "{{ dict() | length }}", "{{ namespace(_x=1) }}", "{% set ns = namespace() %}{% set ns._y = 1 %}{{ ns._y }}",
    "{{ strftime_now('%Y') | length }}", "{{ strftime_now('%Y') | int > 2000 }}",
    "{{ strftime_now('%d %B %Y').split() | length }}",
    "{{ messages is defined }}|{{ tools is none }}|{{ documents is none }}|{{ add_generation_prompt }}",
    "{{ bos_token }}|{{ eos_token is defined }}",
    "{{ range(3) | map('string') | join }}",
    "{{ loop }}", "{{ varargs }}", "{{ caller }}",
])
add(G, "{{ add_generation_prompt }}|{{ tools }}|{{ enable_thinking }}",
    {"add_generation_prompt": True}, {"add_generation_prompt": False, "tools": [], "enable_thinking": False},
    {"tools": [{"type": "function", "function": {"name": "f"}}], "enable_thinking": True})
add(G, "{{ messages | tojson }}",
    {"messages": [{"role": "user", "content": "x", "name": None, "tool_calls": None}]},
    {"messages": [{"role": "assistant", "content": "a", "reasoning": "thought"}]},
    {"messages": [{"role": "assistant", "content": "a", "thinking": "t1"}]},
    {"messages": [{"role": "assistant", "content": "a", "reasoning_content": "r", "thinking": "t"}]},
    {"messages": [{"role": "assistant", "content": None, "reasoning_content": None, "reasoning": "late"}]})

# ---------------------------------------------------------------------------------------------------
# the shapes real chat templates have: whole small templates, each with a few conversations
G = "chat templates"
CHATML = ("{% for message in messages %}"
          "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
add(G, CHATML, {"messages": CHAT}, {"messages": CHAT, "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": ""}]}, {"messages": [{"role": "user"}]})
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}"
          "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
          "+ message['content'] | trim + '<|eot_id|>' %}"
          "{% if loop.index0 == 0 %}"
          "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
add(G, LLAMA3, {"messages": CHAT, "bos_token": "<|begin_of_text|>"},
    {"messages": CHAT, "bos_token": "<s>", "add_generation_prompt": True}, {"messages": CHAT})
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
           "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
add(G, MISTRAL, {"messages": CHAT[1:3], "bos_token": "<s>", "eos_token": "</s>"},
    {"messages": CHAT, "bos_token": "<s>", "eos_token": "</s>"},
    {"messages": [{"role": "assistant", "content": "x"}], "bos_token": "<s>", "eos_token": "</s>"})
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
         "{{ raise_exception('System role not supported') }}{% endif %}"
         "{% for message in messages %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}"
         "{% set role = message['role'] %}{% endif %}"
         "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + "
         "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
add(G, GEMMA, {"messages": CHAT[1:], "bos_token": "<bos>", "add_generation_prompt": True},
    {"messages": CHAT, "bos_token": ""})
QWEN = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                                                "required": ["city"]}}}]
TOOL_CHAT = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Paris and Zürich?"},
    {"role": "assistant", "content": "<think>\nneed tools\n</think>\n\nChecking.", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}},
        {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\"}"}}]},
    {"role": "tool", "content": "{\"temp\": 21.5}"},
    {"role": "tool", "content": "{\"temp\": 18}"},
    {"role": "assistant", "content": "Paris 21.5°C, Zürich 18°C.", "reasoning_content": "both answered"},
    {"role": "user", "content": "Thanks!"},
]
add(G, QWEN, {"messages": CHAT}, {"messages": CHAT, "add_generation_prompt": True, "enable_thinking": False},
    {"messages": TOOL_CHAT, "tools": TOOLS}, {"messages": TOOL_CHAT[:-1], "tools": TOOLS},
    {"messages": TOOL_CHAT, "tools": TOOLS, "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "list content"}]}]})
PARTS = ("{% for message in messages %}<{{ message.role }}>{% if message.content is string %}{{ message.content }}"
         "{% else %}{% for c in message.content %}{% if c.type == 'text' %}{{ c.text }}"
         "{% elif c.type == 'image' %}<image>"
         "{% endif %}{% endfor %}{% endif %}\n{% endfor %}")
add(G, PARTS, {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
                            {"role": "assistant", "content": "A cat."}]})
GENERATION = """{% for m in messages %}
{% if m.role == 'assistant' %}
<|assistant|>
{% generation %}
{{ m.content }}<|end|>
{% endgeneration %}
{% else %}
<|{{ m.role }}|>
{{ m.content }}<|end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>
{% endif %}"""
add(G, GENERATION, {"messages": CHAT}, {"messages": CHAT, "add_generation_prompt": True})
DATE = """{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{%- for message in messages %}
    {{- '\\n' + message['role'] + ': ' + message['content'] | trim }}
{%- endfor %}
"""
add(G, DATE, {"messages": CHAT}, {"messages": CHAT[1:], "date_string": "01 Jan 2025"})
DEEPSEEK = ("{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
            "{% set ns = namespace(is_first=false, is_tool=false, system_prompt='', is_first_sp=true) %}"
            "{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}"
            "{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}"
            "{%- else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}"
            "{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}"
            "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}"
            "{{'<｜User｜>' + message['content']}}{%- endif %}"
            "{%- if message['role'] == 'assistant' and message['content'] is none %}{{ '<｜Assistant｜>' }}"
            "{%- for tool in message['tool_calls'] %}"
            "{{ tool['function']['name'] + '\\n' + tool['function']['arguments'] | tojson }}"
            "{%- endfor %}{%- endif %}"
            "{%- if message['role'] == 'assistant' and message['content'] is not none %}"
            "{% set content = message['content'] %}{% if '</think>' in content %}"
            "{% set content = content.split('</think>')[-1] %}{% endif %}"
            "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor -%}"
            "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}")
add(G, DEEPSEEK, {"messages": CHAT, "bos_token": "<｜begin▁of▁sentence｜>", "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>hm</think>answer"}],
     "bos_token": "<s>"})
GPTOSS = """{%- macro render_typescript_type(param_spec, required_params, is_nullable=false) -%}
    {%- if param_spec.type == "array" -%}
        {{- render_typescript_type(param_spec['items'], required_params) + "[]" -}}
    {%- elif param_spec.type == "string" -%}
        {%- if param_spec.enum -%}
            {{- '"' + param_spec.enum|join('" | "') + '"' -}}
        {%- else -%}
            {{- "string" }}
        {%- endif -%}
    {%- elif param_spec.type == "object" -%}
        {{- "{\\n" }}
        {%- for prop_name, prop_spec in param_spec.properties | dictsort -%}
            {{- prop_name + ("" if prop_name in required_params else "?") + ": " }}
            {{- render_typescript_type(prop_spec, param_spec.required or []) }}
            {%- if not loop.last %}{{- ",\\n" }}{% endif -%}
        {%- endfor -%}
        {{- "\\n}" }}
    {%- else -%}
        {{- "any" -}}
    {%- endif -%}
{%- endmacro -%}
{%- for tool in tools %}
// {{ tool.function.description }}
type {{ tool.function.name }} = (_: {{ render_typescript_type(tool.function.parameters, tool.function.parameters.required) }}) => any;
{% endfor %}
{{- messages | map(attribute='role') | join(',') }}
"""
add(G, GPTOSS, {"tools": [{"type": "function", "function": {
    "name": "search", "description": "Search the web", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}},
        "limit": {"type": "integer"}}, "required": ["query"]}}}]})
add(G, "{%- for message in messages -%}\n    {%- if loop.first and message.role != 'system' -%}\n"
       "        {{- 'SYS\\n' -}}\n    {%- endif -%}\n"
       "    {{- message.role | upper }}: {{ message.content }}\n{% endfor -%}",
    {"messages": CHAT}, {"messages": CHAT[1:]})


# ---------------------------------------------------------------------------------------------------
# running

def reference(case: Case) -> tuple[str, str]:
    """('text', rendered) or ('error', message) from transformers' renderer."""
    variables = json.loads(json.dumps(case.variables))  # the values keel reads from the same JSON
    messages = variables.pop("messages", USER)
    tools = variables.pop("tools", None)
    add_generation_prompt = variables.pop("add_generation_prompt", False)
    try:
        rendered, _ = render_jinja_template(conversations=[_normalize_chat_messages(messages)], tools=tools,
                                            chat_template=case.template, add_generation_prompt=add_generation_prompt,
                                            **variables)
        return "text", rendered[0]
    except Exception as e:  # noqa: BLE001 -- any failure of jinja2 is an "error" outcome
        return "error", f"{type(e).__name__}: {e}"


def keel_line(case: Case) -> str:
    variables = dict(case.variables)
    record = {"messages": variables.pop("messages", USER)}
    if "tools" in variables:
        record["tools"] = variables.pop("tools")
    record["add_generation_prompt"] = variables.pop("add_generation_prompt", False)
    record["kwargs"] = variables
    return json.dumps(record, ensure_ascii=False)


def run_keel(binary: str, path: Path, cases: list[Case]) -> list[tuple[str, str]]:
    """keel's outcome per case, all of them in one process; ('crash', why) where keel did not answer."""
    lines = "".join(keel_line(c) + "\n" for c in cases).encode()
    try:
        proc = subprocess.run([binary, "chat-template", "--template", str(path), "--threads", "1"],
                              input=lines, capture_output=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [("crash", f"no answer in {TIMEOUT_S} s")] * len(cases)
    stderr = proc.stderr.decode(errors="replace").strip()
    if proc.returncode < 0:
        return [("crash", f"killed by signal {-proc.returncode}: {stderr[-300:]}")] * len(cases)
    # split("\n"), not splitlines(): the JSON strings may hold U+2028, U+0085 and the like raw.
    out = [line for line in proc.stdout.decode(errors="replace").split("\n") if line.strip()]
    if proc.returncode != 0 and not out:
        # keel compiles the template before reading stdin: when it accepts it with no input, the
        # failure came from a record (keel stops on input it cannot read), which is no template error
        empty = subprocess.run([binary, "chat-template", "--template", str(path)], input=b"", capture_output=True,
                               timeout=TIMEOUT_S)
        if empty.returncode != 0:  # the template did not compile: an error for every case
            return [("error", stderr or f"exit {proc.returncode}")] * len(cases)
    if proc.returncode != 0 or len(out) != len(cases):
        if len(cases) > 1:  # find the case that broke the process: one process each
            return [run_keel(binary, path, [c])[0] for c in cases]
        return [("crash", f"exit {proc.returncode}, {len(out)} lines: {stderr[-300:]}")]
    results = []
    for line in out:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            results.append(("crash", f"not JSON: {line[:200]!r}"))
            continue
        if "error" in obj:
            results.append(("error", obj["error"]))
        elif "text" in obj:
            results.append(("text", obj["text"]))
        else:
            results.append(("crash", f"neither text nor error: {line[:200]!r}"))
    return results


# Documented differences (docs/chat-templates.md): what keel's engine does not do, each case named
# by its template text. keel must refuse these cleanly (an error, never a crash or another text)
# unless the entry says "text": then the difference is in the text, and the reason says which.
KNOWN = {
    # keel's integers are 64-bit; Python's are unbounded: keel refuses rather than wrap
    "{{ 12345678901234567890 }}": ("error", "integers beyond 64 bits"),
    "{{ 2 ** 64 }}": ("error", "integers beyond 64 bits"),
    "{{ 9223372036854775807 + 1 }}": ("error", "integers beyond 64 bits"),
    "{{ (2 ** 70) | tojson }}": ("error", "integers beyond 64 bits"),
    "{{ x }}|{{ [x] }}": ("error-or-text", "a JSON integer beyond 64 bits: refused, or (beyond 2^64) read as the "
                                           "nearest double, as keel's JSON reader reads it"),
    # statements and features no chat template seen uses
    "{% for x in l %}{{ loop.changed(x > 2) }}{% endfor %}": ("error", "loop.changed"),
    "{% set ns = namespace(a=1) %}{% set ns.a, ns.b = 5, 6 %}{{ ns.a }}{{ ns.b }}": ("error", "tuple of attributes in set"),
    "{% macro m() %}{{ varargs }}|{{ kwargs }}{% endmacro %}{{ m(1, 2, k=3) }}": ("error", "macro varargs/kwargs"),
    "{% macro each(l) %}{% for x in l %}{{ caller(x) }}{% endfor %}{% endmacro %}{% call(x) each([1, 2]) %}[{{ x }}]{% endcall %}": ("error", "call blocks with arguments"),
    "{% macro m(x) %}{{ caller(x * 2) }}{% endmacro %}{% call(y) m(4) %}got {{ y }}{% endcall %}": ("error", "call blocks with arguments"),
    "{% for item in tree recursive %}{{ item.name }}{% if item.children %}[{{ loop(item.children) }}]{% endif %}{% endfor %}": ("error", "recursive loops"),
    "{% autoescape true %}{{ '<b>' }}{% endautoescape %}": ("error", "autoescape"),
    "{{ 'tab\\there'.expandtabs(4) }}": ("error", "str.expandtabs"),
    "{{ d | tojson(indent='  ') }}": ("error", "a string indent for tojson"),
    "{{ '%s=%d' | format('a', 1) }}|{{ 'abc' | center(9) }}|{{ 'abc def' | truncate(5) }}|{{ 'a b' | urlencode }}": ("error", "urlencode"),
    "{{ 'a\\nb' | striptags }}|{{ 'hello world foo' | wordwrap(5) }}|{{ 1234567 | filesizeformat }}": ("error", "HTML and formatting filters"),
    "{{ dict.fromkeys(['a', 'b'], 0) }}": ("error", "dict.fromkeys"),
    # range is a list in keel
    "{{ range(3) }}": ("text", "range() is a list: printed [0, 1, 2], not range(0, 3)"),
    "{{ range(3) | tojson }}": ("text", "range() is a list, so JSON has it"),
    # the final sigma of str.title(): ICU maps characters one by one
    "{{ mix | upper }}|{{ mix | lower }}|{{ mix | title }}|{{ mix.title() }}|{{ mix | capitalize }}": ("text", "str.title() keeps σ where Python writes a final ς"),
    # Jinja's other globals
    "{{ cycler is defined }}": ("text", "no cycler"),
    "{{ joiner is defined }}": ("text", "no joiner"),
    "{{ lipsum is defined }}": ("text", "no lipsum"),
}


def agree(expected: tuple[str, str], actual: tuple[str, str]) -> bool:
    if expected[0] == "error":
        return actual[0] == "error"
    return actual == expected


def known(case, actual: tuple[str, str]) -> bool:
    """A documented difference, behaving as documented (never a crash)."""
    entry = KNOWN.get(case.template)
    if entry is None or actual[0] == "crash":
        return False
    return actual[0] == "error" if entry[0] == "error" else True


def kind(expected: tuple[str, str], actual: tuple[str, str]) -> str:
    """What sort of mismatch: a wrong text is the worst (nothing tells the user)."""
    if actual[0] == "crash":
        return "keel crashed or hung"
    if expected[0] == "error":
        return "keel renders, jinja2 fails"
    if actual[0] == "error":
        return "keel fails, jinja2 renders"
    return "different text"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keel", required=True, help="the keel binary")
    parser.add_argument("--group", action="append", help="run only this feature group (repeatable)")
    parser.add_argument("--verbose", action="store_true", help="print every mismatch, not only the first 20")
    parser.add_argument("--list", action="store_true", help="print every case and jinja2's output, run nothing")
    args = parser.parse_args()

    cases = [c for c in CASES if not args.group or c.group in args.group]
    if args.list:
        for c in cases:
            variables = json.dumps(c.variables, ensure_ascii=False)[:200]
            print(f"[{c.group}] {c.template!r} {variables}\n    -> {reference(c)!r}")
        return 0
    started = time.monotonic()
    by_template: OrderedDict[str, list[int]] = OrderedDict()
    for i, c in enumerate(cases):
        by_template.setdefault(c.template, []).append(i)
    print(f"{len(cases)} cases, {len(by_template)} templates, "
          f"{len(OrderedDict.fromkeys(c.group for c in cases))} groups")

    expected = [reference(c) for c in cases]
    actual: list = [None] * len(cases)
    with tempfile.TemporaryDirectory(prefix="jinja-conformance-") as tmp:
        for n, (template, indices) in enumerate(by_template.items()):
            path = Path(tmp) / f"t{n}.jinja"
            path.write_bytes(template.encode("utf-8", errors="surrogatepass"))
            for i, outcome in zip(indices, run_keel(args.keel, path, [cases[i] for i in indices])):
                actual[i] = outcome

    groups: OrderedDict[str, list[int]] = OrderedDict()
    for i, c in enumerate(cases):
        groups.setdefault(c.group, []).append(i)
    documented = [i for i in range(len(cases)) if not agree(expected[i], actual[i]) and known(cases[i], actual[i])]
    bad = [i for i in range(len(cases)) if not agree(expected[i], actual[i]) and i not in documented]
    width = max(len(g) for g in groups)
    print(f"\n{'group'.ljust(width)}  cases  identical")
    for g, indices in groups.items():
        ok = sum(1 for i in indices if agree(expected[i], actual[i]))
        doc = sum(1 for i in indices if i in documented)
        flag = "" if ok + doc == len(indices) else "  MISMATCH"
        print(f"{g.ljust(width)}  {len(indices):5d}  {ok:9d}{f'  ({doc} documented differences)' if doc else ''}{flag}")
    if documented:
        print(f"\n{len(documented)} documented differences (KNOWN, docs/chat-templates.md):")
        for reason in OrderedDict.fromkeys(KNOWN[cases[i].template][1] for i in documented):
            print(f"  {reason}")
    stale = [t for t in KNOWN if not any(c.template == t and not agree(expected[i], actual[i])
                                         for i, c in enumerate(cases))]
    if stale and not args.group:
        print(f"\n{len(stale)} KNOWN entries no longer differ (remove them): {stale}")

    if bad:
        kinds = OrderedDict()
        for i in bad:
            kinds.setdefault(kind(expected[i], actual[i]), []).append(i)
        print("\nmismatches by kind: " + ", ".join(f"{k}: {len(v)}" for k, v in kinds.items()))

    shown = bad if args.verbose else bad[:SHOWN]
    for i in shown:
        c = cases[i]
        print(f"\nMISMATCH [{c.group}] case {i} ({kind(expected[i], actual[i])})")
        print(f"  template:  {c.template!r}")
        print(f"  variables: {json.dumps(c.variables, ensure_ascii=False)}")
        print(f"  jinja2:    {expected[i][0]} {expected[i][1]!r}")
        print(f"  keel:      {actual[i][0]} {actual[i][1]!r}")
    if len(bad) > len(shown):
        print(f"\n... and {len(bad) - len(shown)} more mismatches (--verbose prints them all)")
    print(f"\n{len(cases)} cases: {len(cases) - len(bad) - len(documented)} identical, {len(documented)} documented "
          f"differences, {len(bad)} mismatched ({time.monotonic() - started:.1f} s)")
    return 1 if bad or (stale and not args.group) else 0


if __name__ == "__main__":
    sys.exit(main())
