// Rendering by replay (jinja/replay.h): for every conversation, what the cache returns must be
// what the template renders (text, data marks, generation blocks), whether the cache replayed a
// recording, recorded a new one or refused; a template that reads the data in a way no guard
// checks must be refused, never replayed. Each case renders several conversations of one shape
// whose texts differ, so a missing guard or refusal shows as a wrong text.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "keel/data/jinja/replay.h"
#include "keel/data/jinja/template.h"

namespace keel::data::jinja {
namespace {

// A conversation as keel::data::template_variables gives it: roles marked as other data, each
// message's content with its index.
Dict conversation(const std::vector<std::pair<std::string, std::string>>& messages, bool generation_prompt = false) {
  List list;
  for (size_t i = 0; i < messages.size(); ++i) {
    Dict m;
    m.set("role", Value(Str(messages[i].first, kOtherData)));
    m.set("content", Value(Str(messages[i].second, int(i))));
    list.emplace_back(std::move(m));
  }
  Dict vars;
  vars.set("messages", Value(std::move(list)));
  vars.set("add_generation_prompt", Value(generation_prompt));
  return vars;
}

void expect_same(const Rendered& replayed, const Rendered& rendered, const std::string& what) {
  EXPECT_EQ(replayed.text.text, rendered.text.text) << what;
  EXPECT_EQ(replayed.generation, rendered.generation) << what;
  ASSERT_EQ(replayed.text.runs.size(), rendered.text.runs.size()) << what;
  for (size_t i = 0; i < rendered.text.runs.size(); ++i) {
    const Run &a = replayed.text.runs.begin()[i], &b = rendered.text.runs.begin()[i];
    EXPECT_EQ(a.begin, b.begin) << what << " run " << i;
    EXPECT_EQ(a.end, b.end) << what << " run " << i;
    EXPECT_EQ(a.source, b.source) << what << " run " << i;
  }
}

// Texts that flip the guards of the templates below: a think block, newlines at the ends, a tool
// response, surrounding spaces, an exact role name, a special string.
const std::vector<std::string> kTexts = {
    "plain answer with some words",
    "\nleading newline then text",
    "<think>\nreasoning here\n</think>\n\nthe answer",
    "trailing newline\n",
    "<tool_response>{\"x\": 1}</tool_response>",
    "  padded with spaces  ",
    "user",
    "another plain answer, a bit longer than the first one",
    "<|im_end|>\n<|im_start|>assistant\n",
    "x",
};

// Every text in every message of a 4-message conversation, shifted per message so the texts mix.
void check_all(const std::string& source, ReplayCache::Stats* stats = nullptr, bool generation_prompt = false,
               const std::vector<std::string>& texts = kTexts) {
  const Template t(source, "test.jinja");
  ReplayCache cache(ReplayCache::Mode::on);
  const size_t n = texts.size();
  for (size_t k = 0; k < 3 * n; ++k) {
    const Dict vars = conversation({{"system", texts[k % n]},
                                    {"user", texts[(k / 2 + 3) % n]},
                                    {"assistant", texts[(k + 1) % n]},
                                    {"user", texts[(k / 3 + 5) % n]},
                                    {"assistant", texts[(k + 7) % n]}},
                                   generation_prompt);
    expect_same(cache.render(t, vars), t.render(vars), source.substr(0, 60) + " conversation " + std::to_string(k));
  }
  if (stats) *stats = cache.stats();
  if (stats && stats->replayed == 0) ADD_FAILURE() << "refused: " << cache.first_refusal();
}

// Qwen3's template (its message loop, as its tokenizer_config.json has it, without tools).
const char* kQwen3 = R"({%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in message.content %}
            {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
            {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %})";

TEST(TemplateReplay, Qwen3TemplateReplaysWhereItsGuardsHoldAndRendersElsewhere) {
  ReplayCache::Stats s;
  check_all(kQwen3, &s);
  EXPECT_GT(s.replayed, 0);  // the plain texts replay
  EXPECT_GT(s.refused, 0);   // a think block is split: not replayable
}

TEST(TemplateReplay, TrimAndEqualityGuards) {
  ReplayCache::Stats s;
  check_all(R"({{ bos_token }}{% for m in messages %}{% if m.content == 'x' %}[x]{% endif %})"
            R"({% if m.role == 'user' and m.content is string %}<u>{{ m.content }}</u>)"
            R"({% elif m['content'] is defined %}<{{ m['role'] }}>{{ m['content'] }}{% endif %})"
            R"({% if 'answer' in m.content %}!{% endif %}{% if m.content in ['user', 'y'] %}?{% endif %})"
            R"({% if m.content is eq('user') %}={% endif %}{% endfor %})",
            &s);
  ReplayCache::Stats edges;  // the texts without surrounding whitespace replay, trimmed whole
  std::vector<std::string> texts(10, "");
  for (size_t i = 0; i < texts.size(); ++i) texts[i] = "answer number " + std::to_string(i) + " of ten, long enough";
  texts[4] = "  padded answer, long enough  ";
  check_all("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}|{{ m.content.strip() }}{% endfor %}", &edges,
            false, texts);
  EXPECT_GT(edges.replayed, 0);
  EXPECT_GT(edges.refused, 0);
  EXPECT_GT(s.replayed, 0);
  EXPECT_EQ(s.refused, 0);
}

TEST(TemplateReplay, GenerationBlocksAndMacrosAreReplayed) {
  ReplayCache::Stats s;
  check_all(R"({% macro turn(role, text) %}<{{ role }}>{{ text }}</{{ role }}>{% endmacro %})"
            R"({% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ turn(m.role, m.content) }})"
            R"({% endgeneration %}{% else %}{{ turn(m.role, m.content) }}{% endif %}{% endfor %})"
            R"({% if add_generation_prompt %}<assistant>{% endif %})",
            &s, true);
  EXPECT_GT(s.replayed, 0);
}

// Each template reads a message's text in a way no guard checks: every conversation must be
// rendered (a replay would print the first conversation's derived text for all of them).
TEST(TemplateReplay, RefusesWhatNoGuardChecks) {
  const char* templates[] = {
      "{% for m in messages %}{{ m.content | upper }}{% endfor %}",
      "{% for m in messages %}{{ m.content | length }}{% endfor %}",
      "{% for m in messages %}{{ m.content[0] }}{% endfor %}",
      "{% for m in messages %}{{ m.content[1:] }}{% endfor %}",
      "{% for m in messages %}{{ m.content | tojson }}{% endfor %}",
      "{% for m in messages %}{% for c in m.content %}{{ c }}.{% endfor %}{% endfor %}",
      "{% set roles = {'user': 'U', 'assistant': 'A', 'system': 'S'} %}{% for m in messages %}"
      "{{ roles[m.content] }}{% endfor %}",
      "{% for m in messages %}{{ m.content * 2 }}{% endfor %}",
      "{% for m in messages %}{{ '%s|' % m.content }}{% endfor %}",
      "{% for m in messages %}{{ m.content.replace('a', 'b') }}{% endfor %}",
      "{% for m in messages %}{{ m.content.split() | join(',') }}{% endfor %}",
      "{% for m in messages %}{% if m.content < 'm' %}<{% endif %}{{ m.content }}{% endfor %}",
      "{% for m in messages %}{{ m.content ~ m.content }}{% endfor %}",
      "{% for m in messages %}{{ [m.content] }}{% endfor %}",
      "{% for m in messages %}{{ m.content | replace('e', 'E') }}{% endfor %}",
      "{% for m in messages %}{{ (m.content + '!') | trim }}{% endfor %}",
      "{% for m in messages %}{{ m.content.strip('a') }}{% endfor %}",
      "{% for m in messages %}{{ strftime_now('%Y') }}{{ m.content }}{% endfor %}",
      "{% set d = dict([[messages[0].content, 1]]) %}{{ d | tojson }}",
      "{% for m in messages %}{% if m.content is in(['x', 'user']) %}{{ m.content }}{% endif %}{% endfor %}",
      "{% for m in messages %}{{ m.content | wordcount }}{% endfor %}",
      "{% for m in messages %}{{ messages | map(attribute='content') | join('/') }}{% endfor %}",
      "{% for m in messages %}{{ m.content.upper }}{% endfor %}",
      "{% for m in messages %}{{ m.content | safe + '<&>' }}{% endfor %}",
  };
  for (const char* source : templates) check_all(source);
}

TEST(TemplateReplay, OffRendersEverything) {
  const Template t(kQwen3, "qwen3.jinja");
  ReplayCache cache(ReplayCache::Mode::off);
  const Dict vars = conversation({{"user", "hello"}, {"assistant", "hi there"}});
  expect_same(cache.render(t, vars), t.render(vars), "off");
  expect_same(cache.render(t, vars), t.render(vars), "off");
  EXPECT_EQ(cache.stats().replayed, 0);
}

TEST(TemplateReplay, VerifyModeRendersToo) {
  const Template t(kQwen3, "qwen3.jinja");
  ReplayCache cache(ReplayCache::Mode::verify);
  for (const char* answer : {"one answer, long enough", "another answer, long too", "\nleading, long enough"}) {
    const Dict vars = conversation({{"user", "a question, long enough"}, {"assistant", answer}});
    expect_same(cache.render(t, vars), t.render(vars), answer);
  }
  EXPECT_GT(cache.stats().replayed, 0);
}

}  // namespace
}  // namespace keel::data::jinja
