// A mixture of experts as llama.cpp's converter writes it into GGUF (Qwen2MoeModel.modify_tensors
// for Qwen3-MoE, LlamaModel.modify_tensors for Mixtral): each sparse layer's experts stacked, one
// 3-D tensor [experts, rows, cols] per projection (blk.N.ffn_{gate,up,down}_exps), the router kept
// as it is (blk.N.ffn_gate_inp, F32), and what llama.cpp's loaders require of such a model.
#pragma once
#include <string>
#include <vector>

#include "keel/checkpoint/gguf_export.h"
#include "keel/model/config.h"

namespace keel::checkpoint {

// `tensors` (a checkpoint's or a decoder's, in any order) in the order convert_hf_to_gguf.py writes
// them: sorted by name (the order it reads a checkpoint in), with each sparse layer's experts
// replaced, where they sort, by three stacks named model.layers.N.mlp.experts.{gate,up,down}_proj.weight
// (gguf_names.h names them) in the order the converter merges them: Qwen3-MoE down, gate, up;
// Mixtral gate, down, up (its w1, w2, w3). The experts are read from the published per-expert layout
// (mlp.experts.E.{gate,up,down}_proj.weight; Mixtral's block_sparse_moe.experts.E.{w1,w3,w2}.weight)
// or transformers 5's fused one (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I],
// Mixtral's router as mlp.gate): the same file either way (the converter reads Mixtral's published
// layout only). A stack is read a piece at a time, each piece from the experts it spans (fused gate_up:
// from each expert's half), so the export holds a piece, not a stack. A missing,
// misshapen or unexpected expert tensor is an error naming it.
std::vector<HfTensorSource> gguf_converter_order(const model::ModelConfig& config, std::vector<HfTensorSource> tensors);

// What llama.cpp's qwen3moe and llama (Mixtral) graphs do that a model must have been trained with,
// else a keel::Error saying why: every layer a mixture (their loaders want experts in each layer, and
// no key says which are dense: Qwen3-MoE's mlp_only_layers or decoder_sparse_step would not load),
// and the top-k weights renormalised to sum to 1 (build_moe_ffn's norm_w, always on: Qwen3-MoE's
// norm_topk_prob false would route every token otherwise than in training).
void require_llama_cpp_runs_experts(const model::ModelConfig& config, const std::string& arch);

}  // namespace keel::checkpoint
