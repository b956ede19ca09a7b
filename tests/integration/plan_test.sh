#!/usr/bin/env bash
# keel plan on the reference article's GLM-4-9B recipe (a model directory holding only
# config.json): the per-rank breakdown for dp 4 with and without ZeRO-1 and with gradient
# checkpointing, a verdict against 64 GB cards with what to change, a [model_config] recipe, and
# bad input rejected with exit status 2.
source "$(dirname "$0")/cli_test_lib.sh"
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"  # the recipe's model_name is relative to the repository root

# run NAME ARGS...: keel plan must exit 0, or 3 when the plan does not fit the given device memory
# (the output then says "fits: NO"); its output goes to $work/NAME.out
run() {
  local name=$1
  shift
  "$keel" plan "$@" >"$work/$name.out" 2>&1
  local status=$?
  if [ "$status" -eq 3 ] && ! grep -qF "fits: NO" "$work/$name.out"; then
    fail "$name: exit status 3 without 'fits: NO' for keel plan $*"
    return 1
  fi
  if [ "$status" -eq 0 ] && grep -qF "fits: NO" "$work/$name.out"; then
    fail "$name: 'fits: NO' but exit status 0 for keel plan $*"
    return 1
  fi
  if [ "$status" -ne 0 ] && [ "$status" -ne 3 ]; then
    fail "$name: exit status $status for keel plan $*: $(cat "$work/$name.out")"
    return 1
  fi
  echo "---- keel plan $*"
  cat "$work/$name.out"
}

expect() {  # expect NAME TEXT: the output of NAME contains TEXT
  grep -qF -- "$2" "$work/$1.out" || fail "$1: output lacks '$2'"
}

# The "total" line's value in GiB.
total_gib() {
  awk '$1 == "total" { v = $2; u = $3; if (u == "TiB") v *= 1024; if (u == "MiB") v /= 1024; print v }' "$work/$1.out"
}

recipe=recipes/glm4-9b.toml
run dp4 "$recipe" --dp 4 --device-memory 64GB
run dp4_zero1 "$recipe" --dp 4 --zero 1 --device-memory 64GB
run dp4_ckpt "$recipe" --dp 4 --device-memory 64GB --set use_gradient_checkpointing=true
run dp4_zero1_ckpt "$recipe" --dp 4 --zero 1 --device-memory 64GB --set use_gradient_checkpointing=true
run dp4_zero2 "$recipe" --dp 4 --zero 2 --device-memory 64GB

for name in dp4 dp4_zero1 dp4_ckpt dp4_zero1_ckpt dp4_zero2; do
  for line in "ChatGLMModel (glm_original), 40 layers, hidden 4096, 32 heads (2 kv), intermediate 13696, vocab 151552" \
              "master weights" "compute weights" "gradients" "optimizer state" "activations" "workspace" \
              "communication" "checkpoint staging" "packing waste" "total" "fits: NO" "what to change"; do
    expect $name "$line"
  done
done
expect dp4 "dp 4, ZeRO-0, gradient checkpointing off"
expect dp4_zero1 "1/4 shard (ZeRO-1)"
expect dp4_zero1 "dp 4, ZeRO-1"
expect dp4_ckpt "gradient checkpointing on"
expect dp4_ckpt "block inputs + one recomputed block"
expect dp4_zero2 "dp 4, ZeRO-2"
expect dp4_zero2 "1/4 shard accumulated"
expect dp4_zero2 "1/4 shard (ZeRO-2)"
expect dp4 "--zero 3"   # no ZeRO stage fits alone: the knob's strongest setting is shown
# The article's run on 4 x 64 GB: ZeRO-3 with the sequences whole (the final save streams the
# shards to rank 0, so no rank holds the whole model); a shorter max_seq_len, which would fit with
# fewer changes, is not what keel recommends.
# Checkpointing is turned on for as few blocks as fit (the first 34 of 40 recompute). The recipe's
# async_save stays on: each rank stages at most checkpoint_staging_mb of its own shard (no rank 0
# snapshot of every rank's state, 105 GiB before sharded checkpoints).
expect dp4 "recommended: --zero 3 + use_gradient_checkpointing = true, gradient_checkpointing_layers = 34 + batch_size = 1 (accumulation 16)"
run dp4_zero3_async "$recipe" --dp 4 --zero 3 --device-memory 64GB --set use_gradient_checkpointing=true \
  --set async_save=true --set batch_size=1
expect dp4_zero3_async "fits: yes"
expect dp4_zero3_async "this rank's part of an async sharded save, at most checkpoint_staging_mb"
# The staging is exactly checkpoint_staging_mb (512 MiB by default) more than a synchronous save's
# plan while training, and checkpoint_staging_mb sets it.
training_bytes() { "$keel" plan "$recipe" --dp 4 --zero 3 --set use_gradient_checkpointing=true --set batch_size=1 \
  "$@" --json | python3 -c 'import json, sys; print(json.load(sys.stdin)["training_bytes"])'; }
sync_bytes=$(training_bytes --set async_save=false)
[ $(( $(training_bytes --set async_save=true) - sync_bytes )) -eq $((512 << 20)) ] ||
  fail "an async sharded save does not plan 512 MiB of staging per rank"
[ $(( $(training_bytes --set async_save=true --set checkpoint_staging_mb=64) - sync_bytes )) -eq $((64 << 20)) ] ||
  fail "checkpoint_staging_mb = 64 does not plan 64 MiB of staging per rank"
run dp4_zero3 "$recipe" --dp 4 --zero 3 --device-memory 64GB --set use_gradient_checkpointing=true \
  --set async_save=false --set batch_size=1
expect dp4_zero3 "fits: yes"
expect dp4_zero3 "1/4 shard (ZeRO-3)"
expect dp4_zero3 "fits with fewer blocks recomputed too: gradient_checkpointing_layers = 34 (34 of 40 blocks recompute)"
# That count is the boundary: 34 fits, 33 does not.
run dp4_zero3_34 "$recipe" --dp 4 --zero 3 --device-memory 64GB --set use_gradient_checkpointing=true \
  --set async_save=false --set batch_size=1 --set gradient_checkpointing_layers=34
expect dp4_zero3_34 "gradient checkpointing on for the first 34 blocks"
expect dp4_zero3_34 "fits: yes"
run dp4_zero3_33 "$recipe" --dp 4 --zero 3 --device-memory 64GB --set use_gradient_checkpointing=true \
  --set async_save=false --set batch_size=1 --set gradient_checkpointing_layers=33
expect dp4_zero3_33 "fits: NO"
awk -v all="$(total_gib dp4_zero3)" -v some="$(total_gib dp4_zero3_34)" 'BEGIN { exit !(some > all) }' ||
  fail "keeping 6 blocks' activations does not grow the plan: $(total_gib dp4_zero3) vs $(total_gib dp4_zero3_34) GiB"
# Nothing fits 16 GB cards at dp 4: the report splits what more ranks shrink from what they do not.
run dp4_zero3_16gb "$recipe" --dp 4 --zero 3 --device-memory 16GB
expect dp4_zero3_16gb "the model state sharded over 4 ranks (35.02 GiB)"
expect dp4_zero3_16gb "More ranks, more memory per rank or a smaller model are needed"

# LoRA on GLM-4-9B with checkpointing: under ZeRO-2 the frozen bf16 base is whole on every rank;
# recomputing every block, that is over the recipe's 56 GiB memory_pool_size, and keel's own choice
# (the last block keeps its intermediates, 0.5 GiB less here) fits just under it. ZeRO-3 shards
# the base and the run fits 64 GB cards with room.
lora=(--set finetuning_type=lora --set lora_rank=16 --set use_gradient_checkpointing=true --device-memory 64GB)
run lora_zero2 "$recipe" --dp 4 --zero 2 "${lora[@]}" --set gradient_checkpointing_layers=40
expect lora_zero2 "fits: NO"
expect lora_zero2 "frozen matrices in bf16 alone"
run lora_zero2_default "$recipe" --dp 4 --zero 2 "${lora[@]}"
expect lora_zero2_default "fits: yes"
awk -v all="$(total_gib lora_zero2)" -v chosen="$(total_gib lora_zero2_default)" 'BEGIN { exit !(chosen < all) }' ||
  fail "keel's choice of recomputed blocks plans more than every block: $(total_gib lora_zero2_default) vs $(total_gib lora_zero2) GiB"
run lora_zero3 "$recipe" --dp 4 --zero 3 "${lora[@]}"
expect lora_zero3 "fits: yes"
expect lora_zero3 "the frozen bf16 matrices, 1/4 shard (ZeRO-3)"
expect lora_zero3 "fp32: the frozen norms and biases, 1/4 shard (ZeRO-3), the adapter whole"
awk -v two="$(total_gib lora_zero2)" -v three="$(total_gib lora_zero3)" 'BEGIN { exit !(three < two - 10) }' ||
  fail "LoRA's ZeRO-3 plan does not shed the base's three quarters: ZeRO-2 $(total_gib lora_zero2), ZeRO-3 $(total_gib lora_zero3) GiB"
# QLoRA: the NF4 codes and absmax values are sharded too.
run qlora_zero3 "$recipe" --dp 4 --zero 3 "${lora[@]}" --set quantization_bit=4
expect qlora_zero3 "fits: yes"
expect qlora_zero3 "frozen projections in NF4 (4-bit codes + absmax), 1/4 shard (ZeRO-3)"
# modules_to_save: the trained copy of the LM head (fp32, whole) is adapter state, its moments sharded.
run saved_zero3 "$recipe" --dp 4 --zero 3 "${lora[@]}" --set additional_target=output_layer
expect saved_zero3 "fits: yes"
expect saved_zero3 "AdamW m and v of the adapter, fp32, 1/4 shard (ZeRO-3)"

# ZeRO-1 and checkpointing each shrink the plan.
t_dp4=$(total_gib dp4)
t_zero1=$(total_gib dp4_zero1)
t_ckpt=$(total_gib dp4_ckpt)
t_both=$(total_gib dp4_zero1_ckpt)
t_zero2=$(total_gib dp4_zero2)
awk -v a="$t_dp4" -v z="$t_zero1" -v c="$t_ckpt" -v b="$t_both" -v z2="$t_zero2" \
  'BEGIN { exit !(z < a && c < a && b < z && b < c && z2 < z) }' ||
  fail "totals do not shrink: dp4 $t_dp4, zero1 $t_zero1, zero2 $t_zero2, checkpointing $t_ckpt, both $t_both GiB"

# A small [model_config] recipe fits, and a generous device says so.
cat >"$work/small.toml" <<TOML
data_path = "none.jsonl"
max_steps = 1
batch_size = 2
max_seq_len = 128
[model_config]
vocab_size = 1000
hidden_size = 64
intermediate_size = 128
num_layers = 2
num_heads = 4
TOML
run small "$work/small.toml" --device-memory 1GB
expect small "fits: yes"
run small_unchecked "$work/small.toml"
expect small_unchecked "fits: not checked"

# LoRA and QLoRA on the article's GLM-4-9B: frozen weights without gradients or moments, and
# QLoRA's NF4 projections; one 64 GB card holds either (LoRA with one 8192-token sequence per micro-batch).
run glm_lora "$recipe" --dp 1 --device-memory 64GB --set finetuning_type=lora --set use_gradient_checkpointing=true \
  --set batch_size=1
expect glm_lora "fp32, the adapter's only (frozen weights have none)"
expect glm_lora "frozen matrices in bf16 alone"
expect glm_lora "fits: yes"
run glm_qlora "$recipe" --dp 1 --device-memory 64GB --set finetuning_type=lora --set quantization_bit=4 \
  --set use_gradient_checkpointing=true
expect glm_qlora "frozen projections in NF4"
expect glm_qlora "fits: yes"

# ZeRO-3 on one rank: nothing to shard, but no whole bf16 copy of the weights (17.51 GiB for
# GLM-4-9B): each position casts its own, two positions' worth alive at once.
run dp1 "$recipe" --dp 1 --set use_gradient_checkpointing=true --set async_save=false
run dp1_zero3 "$recipe" --dp 1 --zero 3 --set use_gradient_checkpointing=true --set async_save=false
expect dp1 "bf16 copy the GEMMs read"
expect dp1_zero3 "note: ZeRO-3 with dp 1 shards nothing, but keeps no whole bf16 copy of the weights"
expect dp1_zero3 "the GEMMs' bf16 cast from the masters for this position and the next (ZeRO-3, one rank)"
saved=$(awk -v a="$(total_gib dp1)" -v b="$(total_gib dp1_zero3)" 'BEGIN { printf "%.1f", a - b }')
awk -v s="$saved" 'BEGIN { exit !(s >= 16.0 && s <= 17.51) }' ||
  fail "ZeRO-3 on one rank saves $saved GiB, expected the 17.51 GiB copy less two positions' casts"
# keel plan offers it at dp 1 where it is what fits.
run dp1_limit "$recipe" --dp 1 --set use_gradient_checkpointing=true --set async_save=false --set memory_pool_size=0 \
  --device-memory "$(awk -v t="$(total_gib dp1)" 'BEGIN { printf "%.2fGiB", t - 5 }')"
expect dp1_limit "recommended: --zero 3 -> $(total_gib dp1_zero3) GiB per rank"
# And where the run fits as it is, that the memory the casts free buys fewer recomputed blocks.
run dp1_fits "$recipe" --dp 1 --set use_gradient_checkpointing=true --set async_save=false --set memory_pool_size=0 \
  --device-memory "$(awk -v t="$(total_gib dp1)" 'BEGIN { printf "%.2fGiB", t + 0.25 }')"
expect dp1_fits "fits: yes"
expect dp1_fits "with --zero 3 (one rank: the bf16 weights cast per position) fewer still: gradient_checkpointing_layers = 37 (37 of 40 blocks recompute)"

# QLoRA on a 30B mixture of experts (issue 59): the experts and the attention's projections in NF4,
# and, its model directory holding config.json alone, what keel train's random initialisation
# peaks at (no weight file mapped: the plan's total less the largest tensor's pages).
run qwen3_moe_qlora recipes/qwen3-30b-a3b-qlora.toml
expect qwen3_moe_qlora "Qwen3MoeForCausalLM (qwen3_moe), 48 layers, hidden 2048, 32 heads (4 kv)"
expect qwen3_moe_qlora "compute weights        16.86 GiB   frozen projections and experts in NF4"
expect qwen3_moe_qlora "total                  18.52 GiB"
expect qwen3_moe_qlora "model_name holds no weights: keel train initialises it at random and maps no weight file, 593.50 MiB less during the setup; that run peaks at 17.94 GiB"

# GLM-4.5-Air (106B, issue 59): QLoRA fits one 64 GiB host, its shared experts and dense layer in
# the 4-bit weights too; full fine-tuning under ZeRO-3 over 4 hosts holds a quarter of the masters,
# gradients and moments and two positions' gathered weights a rank.
run glm45_air_qlora recipes/glm-4.5-air-qlora.toml --device-memory 64GB
grep -v -E '^(finetuning_type|lora_|quantization_|double_quantization)' recipes/glm-4.5-air-qlora.toml |
  sed "s|\"\.\./|\"$PWD/|" >"$work/glm45_air_full.toml"
run glm45_air_full_zero3 "$work/glm45_air_full.toml" --dp 4 --zero 3 --device-memory 512GB
expect glm45_air_full_zero3 "master weights         99.51 GiB   fp32 master, 1/4 shard (ZeRO-3)"
expect glm45_air_full_zero3 "optimizer state       199.03 GiB   AdamW m and v, fp32, 1/4 shard (ZeRO-3)"
expect glm45_air_full_zero3 "total                 432.70 GiB"
expect glm45_air_qlora "Glm4MoeForCausalLM (glm4_moe), 46 layers, hidden 4096, 96 heads (8 kv)"
expect glm45_air_qlora "106.85B parameters"
expect glm45_air_qlora "compute weights        57.70 GiB   frozen projections and experts in NF4"
expect glm45_air_qlora "total                  61.12 GiB"
expect glm45_air_qlora "fits: yes, within 64.00 GiB of device memory per rank (2.88 GiB to spare)"

# Bad input: exit status 2 and a message naming the problem.
out=$("$keel" plan "$recipe" --device-memory 64XB 2>&1)
status=$?
[ "$status" -eq 2 ] && grep -qF "memory size '64XB'" <<<"$out" || fail "bad --device-memory: status $status: $out"
out=$("$keel" plan "$recipe" --set gradient_checkpointing_layers=41 --set use_gradient_checkpointing=true 2>&1)
status=$?
[ "$status" -eq 2 ] && grep -qF "the model has 40 blocks" <<<"$out" || fail "41 of 40 blocks: status $status: $out"
out=$("$keel" plan "$recipe" --set gradient_checkpointing_layers=4 2>&1)
status=$?
[ "$status" -eq 2 ] && grep -qF "it needs use_gradient_checkpointing = true" <<<"$out" ||
  fail "blocks without checkpointing: status $status: $out"
out=$("$keel" plan "$recipe" --set model_name=tests/data/no-such-model 2>&1)
status=$?
[ "$status" -eq 2 ] && grep -qF "no-such-model" <<<"$out" || fail "missing model dir: status $status: $out"

finish "keel plan: all checks passed"
