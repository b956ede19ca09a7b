#!/usr/bin/env bash
# keel train on bad recipes: each must exit with status 2 and a message naming the problem.
source "$(dirname "$0")/cli_test_lib.sh"

# expect_error NAME EXPECTED_TEXT RECIPE_TEXT [extra args...]
expect_error() {
  local name=$1 expected=$2 text=$3
  shift 3
  printf '%s\n' "$text" > "$work/$name.toml"
  local out status
  out=$("$keel" train "$work/$name.toml" "$@" 2>&1)
  status=$?
  if [ "$status" -ne 2 ]; then
    fail "$name: exit status $status, expected 2; output: $out"
  elif ! grep -qF -- "$expected" <<<"$out"; then
    fail "$name: output lacks '$expected': $out"
  else
    echo "ok   $name: $out"
  fi
}

printf '{"input_ids": [1, 2, 3]}\n' > "$work/data.jsonl"
base="data_path = \"$work/data.jsonl\"
max_steps = 1
output_dir = \"$work/out\""
scratch="$base
[model_config]
vocab_size = 16
hidden_size = 16
intermediate_size = 32
num_layers = 1
num_heads = 2"

expect_error unknown_key "did you mean 'learning_rate'" "learning_rat = 1e-4
$scratch"
expect_error unknown_key_line "unknown_key_line.toml:1" "learning_rat = 1e-4
$scratch"
expect_error wrong_type "'batch_size' expects an integer, found a string" "batch_size = \"two\"
$scratch"
expect_error missing_model_dir "does not exist" "model_name = \"$work/no-such-model\"
$base"
expect_error missing_data "no-such-data.jsonl" "$scratch" --set data_path="$work/no-such-data.jsonl"
expect_error bad_override "did you mean 'max_steps'" "$scratch" --set max_stepz=3
printf '{"input_ids": [1, 2, 99]}\n' > "$work/bad_ids.jsonl"
expect_error token_out_of_vocab "bad_ids.jsonl:1" "$scratch" --set data_path="$work/bad_ids.jsonl"
expect_error bad_toml "invalid TOML" "max_steps = [1"

finish "all bad recipes rejected with clear errors"
