// The value types every backend's operations take: the shapes of products, of norms and of
// attention, the rotary table, AdamW's step constants. Public (model/ and train/ build them); no
// code runs here but RopeTable::build and ProductShares::part's offsets.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

namespace keel::kernels {

// ---- GEMM: C = op(A) * op(B) + beta * C, all matrices row-major; op(X) is X or its transpose.
// A linear layer with HF weight W [out, in] is y = x W^T: packed_gemm(N, T, tokens, out, in).
enum class Trans : uint8_t { N, T };

struct GemmShape {
  Trans trans_a, trans_b;
  int64_t m, n, k;
  int64_t lda, ldb, ldc;  // leading dimensions (row strides in elements) as stored
};

// The common case of tightly packed operands.
inline GemmShape packed_gemm(Trans ta, Trans tb, int64_t m, int64_t n, int64_t k) {
  return {ta, tb, m, n, k, ta == Trans::N ? k : m, tb == Trans::N ? n : k, n};
}

// A product cut into shares of its output, each share a product of its own: columns (N) or, for a
// weight gradient (op(A) = A^T, M = the weight's rows), rows (M); every share `share` wide but the
// last. Part t: share t's shape (the whole product's leading dimensions) and the element offsets of
// its A, B and C in the whole product's operands.
struct ProductShares {
  struct Part {
    GemmShape shape;
    int64_t a = 0, b = 0, c = 0;
  };
  int64_t parts = 1, share = 0;
  bool by_rows = false;

  Part part(const GemmShape& s, int64_t t) const {
    if (parts <= 1) return {s};
    const int64_t first = t * share, extent = by_rows ? s.m : s.n;
    Part p{s};
    if (by_rows) {
      p.shape.m = std::min(share, extent - first);
      p.a = s.trans_a == Trans::N ? first * s.lda : first;
      p.c = first * s.ldc;
    } else {
      p.shape.n = std::min(share, extent - first);
      p.b = s.trans_b == Trans::N ? first : first * s.ldb;
      p.c = first;
    }
    return p;
  }
};

// ---- RMSNorm (rmsnorm.h) on `rows` rows of `heads` vectors of `dim`, each vector normalised on
// its own with the one weight w [dim]: heads 1 for a block's norms, the attention heads for Qwen3's
// q_norm/k_norm. Vector h of row r is at r * ld + h * dim of each buffer, ld that buffer's row
// stride, so a norm reads and writes views of a fused row (q and k of the qkv projection).
struct RmsNormShape {
  int64_t rows, heads, dim;
  int64_t ldx;           // x
  int64_t ldy;           // y, and in the backward pass dy
  int64_t lddx;          // dx and the residual added to it (the backward pass only)
  double eps;            // the forward pass only
  double weight_offset;  // 0, or 1 for Gemma's (1 + w)
};

// The common case: one vector per row of tightly packed [rows, dim] buffers.
inline RmsNormShape packed_rmsnorm(int64_t rows, int64_t dim, double eps, double weight_offset) {
  return {rows, 1, dim, dim, dim, dim, eps, weight_offset};
}

// ---- The MLP's gate activation (glu.h): silu (SwiGLU) or tanh-approximated GELU (GeGLU).
enum class GluActivation : uint8_t { Silu, GeluTanh };

// ---- Causal self-attention with grouped-query heads.
struct AttentionShape {
  int64_t batch, seq;         // sequences in the micro-batch and their (padded) length
  int64_t q_heads, kv_heads;  // q_heads % kv_heads == 0; q head h reads kv head h / (q_heads/kv_heads)
  int64_t head_dim;
  int64_t ldq, ldk, ldv, ldo;  // row strides (elements between consecutive tokens)
  double scale;                // usually 1/sqrt(head_dim)
  // Sliding-window attention (Mistral; Gemma's local layers): query i sees keys j with
  // i - window < j <= i, itself included, as transformers' sliding_window_overlay. 0: every
  // earlier key.
  int64_t window = 0;
  // Attention-logit soft-capping (Gemma 2): each scaled score s becomes softcap * tanh(s /
  // softcap) before the mask and the softmax. 0: none.
  double softcap = 0.0;
};

// Key j is inside query i's window (causality and documents are checked separately).
inline bool in_window(int64_t window, int64_t i, int64_t j) { return window <= 0 || j > i - window; }

// Element type of attention's products. BF16 rounds q, k, v, the probabilities and the incoming
// gradients to bf16 before each product (accumulating in fp32), as bf16 autocast does in
// PyTorch; F32 keeps everything in fp32.
enum class AttentionMatmul : uint8_t { F32, BF16 };

// ---- Rotary position embedding (Su et al. 2021, RoFormer), full or partial, in the two layouts HF
// uses: half (Llama/Qwen2, "rotate_half"): pairs (i, i + rotary_dim/2); interleaved (GLM-4):
// pairs (2i, 2i+1). Only the first rotary_dim channels of each head rotate.
struct RopeTable {
  int64_t rotary_dim = 0;  // even, <= head_dim
  bool interleaved = false;
  int64_t max_positions = 0;
  // cos/sin [max_positions, rotary_dim/2], computed exactly as HF does: inv_freq in fp32,
  // theta^(-2i/rotary_dim), angle = float(position) * inv_freq (fp32 product), then cos/sin.
  std::vector<float> cos, sin;
  static RopeTable build(int64_t rotary_dim, bool interleaved, double theta, int64_t max_positions);
};

// ---- AdamW (Loshchilov & Hutter 2019) with exactly torch.optim.AdamW's fp32 arithmetic:
//   w *= 1 - lr*wd;  m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g;
//   denom = sqrt(v) / sqrt(1 - b2^t) + eps;  w -= lr / (1 - b1^t) * m / denom.
// Hyper-parameters are doubles because torch keeps them as Python floats: 1 - beta1,
// 1 - lr * weight_decay, beta2^t, ... are formed in double and only then rounded to fp32.
struct AdamWStep {
  double lr, beta1, beta2, eps;
  int64_t step;  // counts from 1
  // clip_grad_norm_'s coefficient (1: not clipped). Each gradient is first rounded to fp32 as
  // float(g * float(grad_scale)), which is what torch's in-place g.mul_(coef) leaves for AdamW to
  // read; applied here, in the update's one pass, instead of in a pass of its own over the gradients.
  double grad_scale = 1.0;
};

// Label value that contributes neither loss nor gradient (torch's ignore_index).
constexpr int32_t kIgnoreIndex = -100;

// Per-row inputs and outputs of the fused LM-head cross-entropy beyond the summed loss, for
// objectives over whole sequences (preference losses: each sequence's summed log-probability, then
// a gradient weight per sequence). Each pointer is optional; rows are the call's rows.
struct LossRows {
  const float* grad_scale = nullptr;  // [rows] row r's gradient is scaled by grad_scale * this[r]
  double* loss = nullptr;             // [rows] -log softmax(logits)[label] (0 for an ignored row)
  double* mean_logit = nullptr;       // [rows] the mean over the vocabulary of the (capped) logits
};

}  // namespace keel::kernels
