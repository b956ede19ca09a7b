// Softmax cross-entropy over a block of logits, fused with its gradient: the LM head computes a
// block of rows of logits at a time, and this turns them into loss and dlogits in place, so the
// full [tokens, vocab] logits never exist at once.
#pragma once
#include <cstdint>

#include "keel/core/dtype.h"
#include "keel/kernels/shapes.h"

namespace keel::kernels {

// logits: [rows, vocab] (row stride ld), overwritten by d(loss)/d(logits) * grad_scale
// (softmax - onehot, times grad_scale; rows whose label is kIgnoreIndex get zeros).
// Returns the SUM over non-ignored rows of -log softmax(logits)[label]
// (callers divide by the number of target tokens). labels must be in [0, vocab) or kIgnoreIndex.
// softcap > 0 (Gemma 2's final_logit_softcapping): the loss of softcap * tanh(logits / softcap),
// and its gradient with respect to the logits before the cap. grad_bf16 (float only; same layout):
// the gradient written there in bf16 instead of into logits (which are then scratch). per_row
// (LossRows): a gradient scale per row, and each row's loss and mean logit written out.
template <typename T>
double cross_entropy_forward_backward(T* logits, int64_t ld, const int32_t* labels, int64_t rows, int64_t vocab,
                                      double grad_scale, double softcap = 0.0, bf16* grad_bf16 = nullptr,
                                      const LossRows& per_row = {});

}  // namespace keel::kernels
