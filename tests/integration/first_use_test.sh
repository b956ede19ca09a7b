#!/usr/bin/env bash
# The first minutes with keel (issue #60), what a new user trips on:
#   - `keel --help` names every model family the config loader reads (the same table: each name
#     keel's own error for an unknown [model_config] family lists), LoRA/QLoRA, ZeRO and Python;
#   - a mistyped command gets the nearest command and the list of them, exit status 2;
#   - several unknown recipe keys are named in one message, in the file's order, each with its
#     line and suggestion, [model_config]'s too; several bad --set keys likewise;
#   - `keel plan` needs no max_steps or num_epochs (a memory plan does not depend on them), while
#     `keel train` still asks for one;
#   - an adapter_config.json whose target_modules is empty is refused by name, not later;
#   - `keel export --help` says which formats exist, GGUF with the families it writes.
source "$(dirname "$0")/cli_test_lib.sh"
cd "$work"

# run NAME ARGS...: keel ARGS with stdout and stderr in NAME.out, the exit status in $status.
run() {
  local name=$1
  shift
  "$keel" "$@" >"$name.out" 2>&1
  status=$?
  echo "---- keel $* (exit $status)"
  cat "$name.out"
}

expect_status() {  # expect_status NAME STATUS
  [ "$status" -eq "$2" ] || fail "$1: exit status $status, expected $2"
}

expect() {  # expect NAME TEXT: NAME.out contains TEXT
  grep -qF -- "$2" "$1.out" || fail "$1: output lacks '$2'"
}

# expect_in_order NAME TEXT...: NAME.out contains each TEXT, each after the one before it.
expect_in_order() {
  local name=$1
  shift
  local rest
  rest=$(cat "$name.out")
  for text in "$@"; do
    if [[ "$rest" != *"$text"* ]]; then
      fail "$name: '$text' missing, or before the text ahead of it in the list"
      return
    fi
    rest=${rest#*"$text"}
  done
}

printf '{"input_ids": [1, 2, 3]}\n' >data.jsonl
model_config='[model_config]
vocab_size = 16
hidden_size = 16
intermediate_size = 32
num_layers = 1
num_heads = 2'

# --- keel --help: the families from the loader's table --------------------------------------
run help --help
expect_status help 0
printf 'data_path = "data.jsonl"\nmax_steps = 1\n%s\nfamily = "no-such-family"\n' "$model_config" >family.toml
run family plan family.toml
expect_status family 2
families=$(sed -n 's/.*expected one of \(.*\), found "no-such-family".*/\1/p' family.out)
[ -n "$families" ] || fail "family: no list of families in the error"
count=0
for family in ${families//,/}; do
  expect help "($family)"
  count=$((count + 1))
done
[ "$count" -ge 8 ] || fail "help: only $count families listed by the loader's error: $families"
for text in LoRA QLoRA ZeRO-1/2/3 "pip install ." keel.TrainingConfig; do expect help "$text"; done

# --- a mistyped command -----------------------------------------------------------------------
run trian trian recipe.toml
expect_status trian 2
expect trian "unknown command 'trian' (did you mean 'train'?)"
for command in export generate plan prepare train; do expect trian "$command"; done
run nothing_near xyzzy
expect_status nothing_near 2
expect nothing_near "unknown command 'xyzzy'"
grep -qF "did you mean" nothing_near.out && fail "nothing_near: a suggestion for a word near no command"

# --- several unknown keys: one message, in the file's order -----------------------------------
# toml++ iterates a table in key order: 'rope_scaling' (line 2) came after 'neftune_noise_alpha' (line 4).
cat >keys.toml <<EOF
data_path = "data.jsonl"
rope_scaling = 2
max_steps = 1
neftune_noise_alpha = 5
learning_rte = 1e-4
$model_config
hiden_size = 16
EOF
run keys train keys.toml
expect_status keys 2
expect_in_order keys "4 unknown keys" \
  "keys.toml:2: unknown key 'rope_scaling'" \
  "keys.toml:4: unknown key 'neftune_noise_alpha'" \
  "keys.toml:5: unknown key 'learning_rte' (did you mean 'learning_rate'?)" \
  "keys.toml:12: unknown key 'hiden_size' in [model_config] (did you mean 'hidden_size'?)" \
  "\`keel train --print-recipe\` lists every key."
printf 'data_path = "data.jsonl"\nmax_steps = 1\n%s\n' "$model_config" >good.toml
run set train good.toml --set max_stepz=3 --set lerning_rate=1e-3 --set seed=1 --set warmup=2
expect_status set 2
expect_in_order set "3 unknown keys" \
  "--set max_stepz=3: unknown key 'max_stepz' (did you mean 'max_steps'?)" \
  "--set lerning_rate=1e-3: unknown key 'lerning_rate' (did you mean 'learning_rate'?)" \
  "--set warmup=2: unknown key 'warmup'"

# --- keel plan without max_steps or num_epochs -----------------------------------------------
printf 'data_path = "data.jsonl"\n%s\n' "$model_config" >no_steps.toml
run plan_no_steps plan no_steps.toml
expect_status plan_no_steps 0
expect plan_no_steps "per-rank memory"
run plan_with_steps plan good.toml
sed 's/no_steps\.toml/good.toml/' plan_no_steps.out | cmp -s - plan_with_steps.out ||
  fail "plan_no_steps: the plan differs from the same recipe's with max_steps = 1"
run train_no_steps train no_steps.toml
expect_status train_no_steps 2
expect train_no_steps "no_steps.toml: set 'max_steps' or 'num_epochs'"

# --- an adapter that adapts nothing, refused by the parser ----------------------------------
mkdir adapter
printf '{"peft_type": "LORA", "r": 8, "target_modules": [], "base_model_name_or_path": "%s/no-such-model"}\n' \
  "$work" >adapter/adapter_config.json
run adapter generate --model adapter --prompt hi
expect_status adapter 2
expect adapter "adapter/adapter_config.json: key 'target_modules': an empty list adapts nothing"

# --- keel export --help: the formats there are, GGUF among them --------------------------------
run export_help export --help
expect_status export_help 0
for text in "Hugging Face model directory" "PEFT adapter" "GGUF (--format gguf --to FILE.gguf)" "docs/gguf.md"; do
  expect export_help "$text"
done

finish "first use: help, command typos, unknown keys, plan without steps, adapter config, export formats"
