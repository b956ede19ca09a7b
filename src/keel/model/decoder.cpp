#include "keel/model/decoder.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <random>

#include <fmt/format.h>

#include "keel/core/dropout_mask.h"
#include "keel/core/error.h"
#include "keel/core/process_memory.h"
#include "keel/core/threads.h"
#include "keel/kernels/bf16_widening.h"
#include "keel/model/decoder_buffers.h"
#include "keel/model/decoder_plan.h"
#include "keel/model/experts.h"
#include "keel/model/hf_weights.h"

namespace keel::model {

using kernels::Trans;

// Attention reads q and k from the qkv projection's output, or with q/k norms from their own
// normalised [tokens, q | k] buffer (the projection's output stays as the norms' backward needs it).
kernels::AttentionShape attention_shape(const ModelConfig& c, int64_t layer, int64_t batch, int64_t seq) {
  const int64_t Q = c.q_size(), QK = Q + c.kv_size(), QKV = QK + c.kv_size();
  const int64_t ldqk = c.qk_norm ? QK : QKV;
  // Gemma: query_pre_attn_scalar**-0.5 as Python computes it (pow); else 1/sqrt(head_dim).
  const double scale =
      c.query_pre_attn_scalar > 0 ? std::pow(c.query_pre_attn_scalar, -0.5) : 1.0 / std::sqrt(double(c.head_dim));
  return {batch, seq, c.num_heads, c.num_kv_heads, c.head_dim, ldqk,  ldqk, QKV, Q, scale, c.window_of(layer),
          c.attn_logit_softcap};
}

kernels::RmsNormShape hidden_norm_shape(const ModelConfig& c, int64_t rows) {
  return kernels::packed_rmsnorm(rows, c.hidden_size, c.rms_norm_eps, c.norm_weight_offset);
}

kernels::RmsNormShape head_norm_shape(const ModelConfig& c, int64_t tokens, int64_t heads, int64_t ldx, int64_t ldy) {
  return {tokens, heads, c.head_dim, ldx, ldy, ldx, c.rms_norm_eps, c.norm_weight_offset};
}

// torch.tensor(hidden_size**0.5, dtype=float32): Gemma's normalizer.
float embedding_scale(const ModelConfig& c) { return float(std::sqrt(double(c.hidden_size))); }

// MemoryPlanning::PerTensor: allocates every transient buffer on entry to a forward_backward /
// forward_loss / logits_at call, each with its own malloc, and frees them all on exit. Nothing
// in MemoryPlanning::Planned.
struct Decoder::TransientScope {
  Buffers& b;
  const MemoryPlan& plan;
  TransientScope(Buffers& buffers, const MemoryPlan& memory_plan) : b(buffers), plan(memory_plan) {
    if (b.transient_ids.empty()) return;
    try {
      for (int id : b.transient_ids) {
        const size_t bytes = std::max<size_t>(plan.buffer(id).aligned_bytes, MemoryPlan::kCacheLine);
        void* p = std::aligned_alloc(MemoryPlan::kCacheLine, bytes);
        require(p != nullptr, "memory_planning = per_tensor: cannot allocate {} for {}", format_bytes(double(bytes)),
                plan.buffer(id).name);
        b.at[size_t(id)] = static_cast<std::byte*>(p);
      }
    } catch (...) {
      release();
      throw;
    }
    b.bind(plan);
  }
  ~TransientScope() {
    if (b.transient_ids.empty()) return;
    release();
    b.bind(plan);  // null pointers: nothing outside a call may use the freed memory
  }
  void release() {
    for (int id : b.transient_ids) {
      std::free(b.at[size_t(id)]);
      b.at[size_t(id)] = nullptr;
    }
  }
  TransientScope(const TransientScope&) = delete;
  TransientScope& operator=(const TransientScope&) = delete;
};

Decoder::Decoder(const ModelConfig& config, Precision precision, int64_t max_batch, int64_t max_seq,
                 const DecoderOptions& options)
    : config_(config),
      precision_(precision),
      max_batch_(max_batch),
      max_seq_(max_seq),
      options_(resolve_checkpointing_layers(config, precision, max_batch, max_seq, options)),
      backend_(backend_of(options)) {
  const auto& c = config_;
  params_.set_four_bit_type(options_.four_bit_type);
  declare_params(c, params_, ids_, base_storage(options_, precision_));
  {
    AdapterLayout layout = declare_adapter(c, ids_, options_.lora, adapter_);
    if (options_.shard_gradients)
      grad_groups_ = gradient_groups(c, ids_, layout.modules.empty() ? params_ : adapter_, layout);
    weight_gathers_ = weight_gathers_for(c, ids_, params_, precision_, options_);
    lora_ = std::move(layout.modules);
    saved_ = std::move(layout.saved);
    trained_embed_ = layout.embed;
    trained_lm_head_ = layout.lm_head;
  }
  lora_by_slot_.resize(size_t(c.num_layers));
  for (size_t i = 0; i < lora_.size(); ++i)
    lora_by_slot_[size_t(lora_[i].layer)][size_t(lora_[i].slot)].push_back(int(i));
  buf_ = std::make_unique<Buffers>();
  auto& b = *buf_;
  const DecoderLayout& d = b.layout =
      describe_memory(c, params_, adapter_shape(c, lora_, adapter_, options_.lora), grad_groups_, weight_gathers_,
                      precision_, max_batch_, max_seq_, options_, plan_);
  plan_.require_fits(options_.memory_cap_bytes, "memory_pool_size");
  // The arena is touched up front: a plan beyond the machine's memory would end in the kernel's
  // out-of-memory killer, so say so here, with the breakdown.
  plan_.require_fits(physical_memory_bytes(), "this machine's physical memory");

  const auto& buffers = plan_.buffers();
  b.at.assign(buffers.size(), nullptr);
  if (options_.memory_planning == MemoryPlanning::Planned) {
    arena_ = backend_.allocate(plan_.arena_bytes());
    for (size_t id = 0; id < buffers.size(); ++id)
      if (buffers[id].in_arena) b.at[id] = arena_.at<std::byte>(buffers[id].offset);
  } else {
    // What lives across steps gets an arena of its own, back to back; the rest is per call. ZeRO-2's
    // staging is kept too: the gradients' addresses are bound once.
    std::vector<int> persistent = {d.weights,         d.weights_bf16,    d.grads,      d.adam_m,
                                   d.adam_v,          d.lora_weights,    d.lora_grads, d.lora_weights_bf16,
                                   d.four_bit_packed, d.four_bit_absmax, d.grad_shard};
    persistent.insert(persistent.end(), d.grad_staging.begin(), d.grad_staging.end());
    persistent.insert(persistent.end(), d.gathered.begin(), d.gathered.end());
    persistent.insert(persistent.end(), d.gathered_b.begin(), d.gathered_b.end());
    persistent.insert(persistent.end(), d.gathered_c.begin(), d.gathered_c.end());
    persistent.insert(persistent.end(), d.gathered_4bit.begin(), d.gathered_4bit.end());
    persistent.insert(persistent.end(), d.gathered_4bit_absmax.begin(), d.gathered_4bit_absmax.end());
    persistent.push_back(d.compute_only_shard);
    persistent.push_back(d.expert_load);  // gathered over a step's calls
    MemoryPlan kept(plan_.alignment());
    std::vector<std::pair<int, int>> kept_ids;  // plan id, id in `kept`
    for (int id : persistent)
      if (id >= 0)
        kept_ids.push_back(
            {id, kept.add(buffers[size_t(id)].name, buffers[size_t(id)].category, buffers[size_t(id)].bytes, 0, 0)});
    arena_ = backend_.allocate(kept.arena_bytes());
    for (auto [id, kept_id] : kept_ids) b.at[size_t(id)] = arena_.at<std::byte>(kept.offset(kept_id));
    for (size_t id = 0; id < buffers.size(); ++id)
      if (buffers[id].in_arena && !b.at[id]) b.transient_ids.push_back(int(id));
  }

  auto f32 = [&](int id) { return id < 0 ? nullptr : reinterpret_cast<float*>(b.at[size_t(id)]); };
  auto b16 = [&](int id) { return id < 0 ? nullptr : reinterpret_cast<bf16*>(b.at[size_t(id)]); };
  ParamStore& trained = trainable();
  if (options_.optimizer_state && options_.optimizer_shards > 1)
    trained.set_optimizer_range(shard_ranges(trained.total(), options_.optimizer_shards)[options_.optimizer_shard]);
  if (options_.shard_gradients) {  // ZeRO-2: each tensor's gradient at its place in its group's staging
    std::vector<float*> grad_at(trained.params().size(), nullptr);
    for (size_t g = 0; g < grad_groups_.size(); ++g) {
      GradGroup& group = grad_groups_[g];
      group.staging = f32(d.grad_staging[g]);
      for (int i = group.first_param; i <= group.last_param; ++i)
        grad_at[size_t(i)] = group.staging + (trained.param(i).offset - group.range.begin);
    }
    trained.bind_staged_grads(std::move(grad_at), f32(d.grad_shard));
  }
  if (options_.shard_weights || options_.shard_masters) {  // a shard of the model's masters
    const int shards = options_.optimizer_shards, shard = options_.optimizer_shard;
    const WeightShards all = weight_shards(params_, shards);
    params_.shard_weights(all.masters[size_t(shard)], all.compute_only[size_t(shard)], all.four_bit[size_t(shard)]);
  }
  for (size_t g = 0; g < weight_gathers_.size(); ++g) {  // each gather's buffers
    weight_gathers_[g].weights = f32(d.gathered[g]);
    weight_gathers_[g].weights_bf16 = b16(d.gathered_b[g]);
    weight_gathers_[g].compute_only_weights = b16(d.gathered_c[g]);
    if (d.gathered_4bit[g] >= 0)
      weight_gathers_[g].four_bit_packed = reinterpret_cast<uint8_t*>(b.at[size_t(d.gathered_4bit[g])]);
    weight_gathers_[g].four_bit_absmax = f32(d.gathered_4bit_absmax[g]);
  }
  if (lora_.empty()) {
    params_.bind(f32(d.weights), f32(d.grads), b16(d.weights_bf16), f32(d.adam_m), f32(d.adam_v));
    // Each tensor's first gradient write of a step overwrites (backward(): grad_beta, fresh_grad),
    // so the step needs no zeroing pass over the gradients (ParamStore::begin_gradient_step).
    params_.overwrite_first_gradient_writes(true);
    if (casts_per_position()) params_.cast_bf16_per_position();
  } else {
    params_.bind(f32(d.weights), nullptr, b16(options_.shard_weights ? d.compute_only_shard : d.weights_bf16), nullptr,
                 nullptr);
    if (d.four_bit_packed >= 0)
      params_.bind_four_bit(reinterpret_cast<uint8_t*>(b.at[size_t(d.four_bit_packed)]), f32(d.four_bit_absmax));
    adapter_.bind(f32(d.lora_weights), f32(d.lora_grads), b16(d.lora_weights_bf16), f32(d.adam_m), f32(d.adam_v));
  }
  // Sharded masters: the step's weights are the resident buffers, for good (the optimizer step
  // writes its bf16 casts there too). refresh_resident_weights() fills them.
  if (resident_gathers()) {
    for (const WeightGather& g : weight_gathers_) point_at_gather(g, true);
    resident_wait_ = weight_gathers_.size();
  }

  rope_ = kernels::RopeTable::build(c.rotary_dim, c.rope_interleaved, c.rope_theta, max_seq_);
  if (c.rope_local_theta > 0)
    rope_local_ = kernels::RopeTable::build(c.rotary_dim, c.rope_interleaved, c.rope_local_theta, max_seq_);
  b.bind(plan_);
  if (b.expert_load) clear_expert_load();
  // Every attention GEMM plan a step can need, on every thread, now: packed documents change the
  // shapes from step to step, and a plan built inside the step loop would allocate there.
  backend_.prepare_attention(attention_shape(c, 0, 1, max_seq_), attention_matmul(precision_));
  // Every product of the experts' row blocks (experts.h), whose row counts change every step.
  if (c.has_experts()) {
    const bool adapted = std::any_of(lora_.begin(), lora_.end(), [](const LoraModule& m) { return m.on_experts(); });
    prepare_experts(backend_, experts_shape(c, max_batch_ * max_seq_), precision_ == Precision::BF16,
                    adapted ? options_.lora.rank : 0);
  }
}

Decoder::~Decoder() = default;

size_t Decoder::activation_bytes() const {
  return plan_.category_bytes_at_peak(MemoryCategory::Activations) +
         plan_.category_bytes_at_peak(MemoryCategory::Workspace);
}

namespace {

// Draws numel values in order, `piece` at a time, and hands each piece to write(first, values, n).
template <typename T, typename Draw, typename Write>
void draw_in_pieces(int64_t numel, Draw&& draw, Write&& write) {
  std::vector<T> piece(size_t(std::min(numel, kInitPieceElements)));
  for (int64_t first = 0; first < numel; first += kInitPieceElements) {
    const int64_t n = std::min(kInitPieceElements, numel - first);
    for (int64_t k = 0; k < n; ++k) piece[size_t(k)] = draw();
    write(first, piece.data(), n);
  }
}

}  // namespace

void Decoder::init_random(uint64_t seed, double std) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, float(std));
  const float unit_norm = float(1.0 - config_.norm_weight_offset);  // Gemma's (1 + w): w = 0
  for (const auto& p : params_.params()) {
    const int i = int(&p - params_.params().data());
    const bool is_norm = p.name.find("norm") != std::string::npos;
    const bool is_bias = p.name.find(".bias") != std::string::npos;
    // The padding row starts at zero, as transformers' _init_weights leaves an
    // nn.Embedding(padding_idx) (its draws are still made, so every other value is the same).
    const int64_t pad_row = i == ids_.embed ? config_.embedding_padding_idx() : -1;
    const int64_t pad_begin = pad_row * config_.hidden_size, pad_end = pad_begin + config_.hidden_size;
    int64_t drawn = 0;
    auto value = [&] {
      const float v = is_norm ? unit_norm : is_bias ? 0.0f : normal(rng);
      const int64_t k = drawn++;
      return pad_row >= 0 && k >= pad_begin && k < pad_end ? 0.0f : v;
    };
    auto write = [&](int64_t first, const auto* values, int64_t n) { write_weights(i, first, values, n); };
    if (p.master() && params_.sharded_weights()) {  // ZeRO-3: every draw, this rank's part kept
      draw_in_pieces<float>(p.numel, value, write);
    } else if (p.master()) {
      float* w = params_.weight(i);
      for (int64_t k = 0; k < p.numel; ++k) w[k] = value();
    } else if (p.storage == ParamStorage::Bf16) {  // the same draws, rounded as a master's bf16 copy
      draw_in_pieces<bf16>(
          p.numel, [&] { return float_to_bf16(value()); }, write);  // ZeRO-3: this rank's part
    } else if (params_.sharded_weights()) {  // 4-bit under ZeRO-3: the same draws, the tensor quantized whole
      std::vector<float> w(size_t(p.numel));
      for (float& v : w) v = value();
      params_.store_four_bit(i, 0, w.data(), p.numel, options_.double_quantization);
    } else {  // 4-bit: the same draws, quantized a piece of whole blocks at a time (no fp32 tensor: a
              // 30B MoE's experts are 1.6 GB each in fp32), then the tensor's absmax values together
      draw_in_pieces<float>(p.numel, value, [&](int64_t first, const float* values, int64_t n) {
        params_.store_four_bit(i, first, values, n, false);
      });
      if (options_.double_quantization) params_.double_quantize_four_bit(i);
    }
  }
  params_.refresh_bf16_copy();
}

void Decoder::init_adapter(uint64_t seed) {
  if (lora_.empty()) return;
  init_lora(lora_, adapter_, seed);
  copy_saved_modules_from_model();
}

void Decoder::write_weights(int param, int64_t first, const float* values, int64_t n) {
  params_.write_master(param, first, values, n);
  if (float* copy = sharded_saved_copy(param)) std::copy_n(values, n, copy + first);
}

void Decoder::write_weights(int param, int64_t first, const bf16* values, int64_t n) {
  params_.write_compute_only(param, first, values, n);
  if (float* copy = sharded_saved_copy(param)) convert_bf16_to_f32(values, copy + first, size_t(n));
}

float* Decoder::sharded_saved_copy(int param) {
  if (!params_.sharded_weights()) return nullptr;
  if (param == ids_.embed && trained_embed_ >= 0) return adapter_.weight(trained_embed_);
  if (param == ids_.lm_head && trained_lm_head_ >= 0) return adapter_.weight(trained_lm_head_);
  return nullptr;
}

void Decoder::copy_saved_modules_from_model() {
  // PEFT's ModulesToSaveWrapper starts its trained copy from the original weights.
  for (auto [copy, original] : {std::pair{trained_embed_, ids_.embed}, std::pair{trained_lm_head_, ids_.lm_head}}) {
    if (params_.sharded_weights()) break;  // written by loading / initialisation (write_weights)
    if (copy < 0) continue;
    const int64_t n = adapter_.param(copy).numel;
    if (params_.param(original).master())
      std::copy_n(params_.weight(original), n, adapter_.weight(copy));
    else
      convert_bf16_to_f32(params_.weight_bf16(original), adapter_.weight(copy), size_t(n));
  }
  adapter_.refresh_bf16_copy();
}

void Decoder::validate(const MicroBatch& mb) const {
  require(mb.batch > 0 && mb.batch <= max_batch_ && mb.seq > 0 && mb.seq <= max_seq_,
          "micro-batch {}x{} exceeds the planned {}x{}", mb.batch, mb.seq, max_batch_, max_seq_);
  const int64_t n = mb.batch * mb.seq;
  for (int64_t i = 0; i < n; ++i) {
    require(mb.input_ids[i] >= 0 && mb.input_ids[i] < config_.vocab_size,
            "token id {} at position {} is outside the vocabulary (size {})", mb.input_ids[i], i, config_.vocab_size);
    require(mb.targets[i] == kernels::kIgnoreIndex || (mb.targets[i] >= 0 && mb.targets[i] < config_.vocab_size),
            "label {} at position {} is outside the vocabulary (size {}) and is not -100", mb.targets[i], i,
            config_.vocab_size);
    require(mb.positions[i] >= 0 && mb.positions[i] < max_seq_, "position id {} at {} is out of range [0, {})",
            mb.positions[i], i, max_seq_);
  }
}

// ---- linear layers: y = x W^T, in fp32 or with bf16 inputs and fp32 accumulation ----
namespace {

// A weight as a GEMM reads it: fp32 (and its bf16 copy), or 4-bit (QLoRA).
struct Weight {
  const float* f32 = nullptr;
  const bf16* b16 = nullptr;
  FourBitWeight four_bit;
};

struct Linear {
  kernels::Backend& backend;
  bool bf;
  int64_t rows;  // tokens
  // QLoRA: 4-bit weights are dequantized here, four_bit_tile_rows at a time (fp32 or bf16 by precision).
  float* tile = nullptr;
  bf16* tile_b = nullptr;
  int64_t tile_elements = 0;

  void forward(const float* x, const bf16* xb, const Weight& w, int64_t in, int64_t out, float* y, float beta) const {
    if (!w.four_bit) return forward(x, xb, w.f32, w.b16, in, out, y, beta);
    const int64_t step = four_bit_tile_rows(out, in, tile_elements);
    for (int64_t r0 = 0; r0 < out; r0 += step) {  // y[:, r0 : r0 + n] (+)= x W[r0 : r0 + n]^T
      const int64_t n = std::min(step, out - r0);
      dequantize_rows(w.four_bit, r0, n, in);
      product({Trans::N, Trans::T, rows, n, in, in, in, out}, x, xb, tile, tile_b, y + r0, beta);
    }
  }
  void backward_input(const float* dy, const bf16* dyb, const Weight& w, int64_t in, int64_t out, float* dx) const {
    if (!w.four_bit) return backward_input(dy, dyb, w.f32, w.b16, in, out, dx);
    const int64_t step = four_bit_tile_rows(out, in, tile_elements);
    for (int64_t r0 = 0; r0 < out; r0 += step) {  // dx (+)= dy[:, r0 : r0 + n] W[r0 : r0 + n]
      const int64_t n = std::min(step, out - r0);
      dequantize_rows(w.four_bit, r0, n, in);
      product({Trans::N, Trans::N, rows, in, n, out, in, in}, dy + r0, dyb ? dyb + r0 : nullptr, tile, tile_b, dx,
              r0 == 0 ? 0.0f : 1.0f);
    }
  }
  void dequantize_rows(const FourBitWeight& w, int64_t first_row, int64_t n, int64_t in) const {
    require(n * in <= tile_elements, "decoder: a 4-bit tile of {} x {} exceeds the planned {}", n, in, tile_elements);
    const uint8_t* packed = w.packed + first_row * in / 2;
    const float* absmax = w.absmax + first_row * in / kFourBitBlockSize;
    if (bf)
      backend.dequantize_4bit_bf16(w.type, packed, absmax, n * in, tile_b);
    else
      backend.dequantize_4bit(w.type, packed, absmax, n * in, tile);
  }

  // y[rows, out] (+)= x[rows, in] W[out, in]^T
  void forward(const float* x, const bf16* xb, const float* w, const bf16* wb, int64_t in, int64_t out, float* y,
               float beta) const {
    product(kernels::packed_gemm(Trans::N, Trans::T, rows, out, in), x, xb, w, wb, y, beta);
  }
  // dx[rows, in] = dy[rows, out] W[out, in]
  void backward_input(const float* dy, const bf16* dyb, const float* w, const bf16* wb, int64_t in, int64_t out,
                      float* dx) const {
    product(kernels::packed_gemm(Trans::N, Trans::N, rows, in, out), dy, dyb, w, wb, dx, 0.0f);
  }
  // dW[out, in] (+)= dy[rows, out]^T x[rows, in]: beta 1 accumulates, 0 overwrites (a step's first
  // write of the gradient, ParamStore::first_gradient_write).
  void backward_weight(const float* dy, const bf16* dyb, const float* x, const bf16* xb, int64_t in, int64_t out,
                       float* dw, float beta = 1.0f) const {
    product(kernels::packed_gemm(Trans::T, Trans::N, out, in, rows), dy, dyb, x, xb, dw, beta);
  }
  // In bf16 the products read the operands' bf16 copies, in fp32 the operands themselves.
  void product(const kernels::GemmShape& s, const float* a, const bf16* ab, const float* b, const bf16* bb, float* c,
               float beta) const {
    if (bf)
      backend.gemm_bf16(s, ab, bb, c, beta);
    else
      backend.gemm(s, a, b, c, beta);
  }
};

// kernels::Bf16Widening::hold for the length of a scope: x [rows, cols] (leading dimension ld)
// widened once into `copy` for the products inside it. Nothing when x or `copy` is null (the
// copies are planned only in bf16 on a backend whose products widen).
class HeldWidened {
 public:
  HeldWidened(kernels::Backend& backend, int slot, const bf16* x, int64_t rows, int64_t cols, int64_t ld, float* copy)
      : widening_(x && copy ? kernels::bf16_widening(backend) : nullptr), slot_(slot) {
    if (widening_) widening_->hold(slot_, x, rows, cols, ld, copy);
  }
  ~HeldWidened() {
    if (widening_) widening_->release(slot_);
  }
  HeldWidened(const HeldWidened&) = delete;
  HeldWidened& operator=(const HeldWidened&) = delete;

 private:
  kernels::Bf16Widening* widening_;
  int slot_;
};

}  // namespace

void Decoder::to_bf16(const float* src, bf16* dst, int64_t n) {
  if (dst) backend_.cast_to_bf16(src, dst, n);
}

void Decoder::forward_block(const MicroBatch& mb, int64_t l, const float* x, const BlockActivations& a, float* x_out) {
  const auto& c = config_;
  // I: the dense MLP's width, or a sparse layer's shared experts' (0: the routed experts alone).
  const int64_t N = mb.batch * mb.seq, H = c.hidden_size, I = c.mlp_width(l);
  const int64_t Q = c.q_size(), KV = c.kv_size(), QKV = Q + 2 * KV;
  Linear lin{backend_,
             precision_ == Precision::BF16,
             N,
             buf_->four_bit_tile,
             buf_->four_bit_tile_b,
             buf_->four_bit_tile_elements};
  auto W = [&](int id) { return Weight{params_.weight(id), params_.weight_bf16(id), params_.four_bit(id)}; };
  auto& P = params_;
  const auto& p = ids_.layers[l];
  const kernels::AttentionShape as = attention_shape(c, l, mb.batch, mb.seq);

  const kernels::RmsNormShape norm = hidden_norm_shape(c, N);
  const kernels::RopeTable& rope = rope_of(l);
  // y (+)= x W^T and the adapters' part of it, x's bf16 copy widened once for all of them where
  // products widen bf16 (the input's hold is planned then).
  auto project = [&](LinearSlot slot, const float* in, const bf16* in_b, const Weight& w, int64_t cols, int64_t out,
                     float* y, float beta) {
    const HeldWidened held(backend_, 0, held_lora_input(mb, l, slot, in_b, cols), N, cols, cols, buf_->lora_held_input);
    lin.forward(in, in_b, w, cols, out, y, beta);
    lora_forward(mb, l, slot, in, in_b, y, out, a, true);
  };
  // In bf16 the norms and the GLU write the next product's bf16 input themselves (a.xn1_b, ...;
  // null in fp32), and cast_to_bf16 copies only what no kernel produces (attention's output, dy).
  backend_.rmsnorm_forward(norm, x, P.weight(p.input_norm), a.xn1, a.rstd1, a.xn1_b);
  project(LinearSlot::Qkv, a.xn1, a.xn1_b, W(p.qkv_weight), H, QKV, a.qkv, 0.0f);
  if (p.qkv_bias >= 0) backend_.add_bias_rows(a.qkv, P.weight(p.qkv_bias), N, QKV);
  // q and k as attention reads them (ld as.ldq): rotated in place, or first normalised head by
  // head into their own buffer (Qwen3), which keeps the projection's output for the backward pass.
  float* qk = a.qkv;
  if (c.qk_norm) {
    qk = a.qk;
    backend_.rmsnorm_forward(head_norm_shape(c, N, c.num_heads, QKV, as.ldq), a.qkv, P.weight(p.q_norm), qk,
                             a.rstd_qk, nullptr);
    backend_.rmsnorm_forward(head_norm_shape(c, N, c.num_kv_heads, QKV, as.ldk), a.qkv + Q, P.weight(p.k_norm), qk + Q,
                             a.rstd_qk + N * c.num_heads, nullptr);
  }
  backend_.rope_forward(qk, as.ldq, mb.positions, N, c.num_heads, c.head_dim, rope);
  backend_.rope_forward(qk + Q, as.ldk, mb.positions, N, c.num_kv_heads, c.head_dim, rope);
  backend_.attention_forward(as, attention_matmul(precision_), qk, qk + Q, a.qkv + Q + KV, mb.segments, a.attn,
                             a.lse, buf_->attention_workspace, buf_->attention_workspace_bytes);
  to_bf16(a.attn, a.attn_b, N * Q);
  if (c.sandwich_norms) {  // xmid = x + norm(o(attn)): the projection's output kept for the norm's backward
    project(LinearSlot::O, a.attn, a.attn_b, W(p.o_weight), Q, H, a.ao, 0.0f);
    backend_.rmsnorm_forward(norm, a.ao, P.weight(p.attn_out_norm), a.xmid, a.rstd_ao, nullptr);
    backend_.add(a.xmid, a.xmid, x, N * H);
  } else {  // xmid = x + o(attn)
    backend_.copy_on_device(a.xmid, x, sizeof(float) * N * H);
    project(LinearSlot::O, a.attn, a.attn_b, W(p.o_weight), Q, H, a.xmid, 1.0f);
  }

  backend_.rmsnorm_forward(norm, a.xmid, P.weight(p.post_norm), a.xn2, a.rstd2, a.xn2_b);
  // A sparse layer: x_out = xmid + the routed experts' output, then (GLM-4.5) + its shared
  // experts', the dense MLP below on the same input, as Glm4MoeMoE adds shared_experts(residuals).
  const bool sparse = c.sparse_layer(l);
  if (sparse) {
    experts_forward(mb, l, a, x_out);
    if (I == 0) return;
  }
  project(LinearSlot::GateUp, a.xn2, a.xn2_b, W(p.gate_up_weight), H, 2 * I, a.gate_up, 0.0f);
  backend_.glu_forward(c.mlp_activation, a.gate_up, N, I, a.act, a.act_b);
  if (c.sandwich_norms) {  // x_out = xmid + norm(down(act)); recomputation needs the norm's input again
    project(LinearSlot::Down, a.act, a.act_b, W(p.down_weight), I, H, a.mo, 0.0f);
    // Recomputation (x_out null) wants only rstd: the output goes to gradient scratch not yet in use.
    backend_.rmsnorm_forward(norm, a.mo, P.weight(p.mlp_out_norm), x_out ? x_out : buf_->dtmp, a.rstd_mo, nullptr);
    if (x_out) backend_.add(x_out, x_out, a.xmid, N * H);
    return;
  }
  // Recomputation (x_out null): the down projection's output is already the next block's input;
  // only its LoRA activations are wanted again.
  if (x_out) {
    if (!sparse) backend_.copy_on_device(x_out, a.xmid, sizeof(float) * N * H);
    project(LinearSlot::Down, a.act, a.act_b, W(p.down_weight), I, H, x_out, 1.0f);
    return;
  }
  const HeldWidened held(backend_, 0, held_lora_input(mb, l, LinearSlot::Down, a.act_b, I), N, I, I,
                         buf_->lora_held_input);
  lora_forward(mb, l, LinearSlot::Down, a.act, a.act_b, nullptr, H, a, false);
}

const bf16* Decoder::held_lora_input(const MicroBatch& mb, int64_t layer, LinearSlot slot, const bf16* xb,
                                     int64_t cols) const {
  // With dropout each adapter reads its own dropped-out copy of x instead.
  const bool dropout = options_.lora.dropout > 0 && mb.dropout_key != 0;
  const bool fits = mb.batch * mb.seq * cols <= buf_->lora_held_input_elements;
  return fits && !dropout && !lora_by_slot_[size_t(layer)][size_t(slot)].empty() ? xb : nullptr;
}

const bf16* Decoder::held_output_grad(const MicroBatch& mb, int64_t layer, LinearSlot slot, const bf16* dyb,
                                      int64_t width) const {
  const bool fits = mb.batch * mb.seq * width <= buf_->held_grad_elements;
  const bool shared = !params_.frozen() || !lora_by_slot_[size_t(layer)][size_t(slot)].empty();
  return fits && shared ? dyb : nullptr;
}

std::pair<const float*, const bf16*> Decoder::lora_input(const MicroBatch& mb, int module, int64_t cols,
                                                         const float* x, const bf16* xb) {
  const double p = options_.lora.dropout;
  if (p <= 0 || mb.dropout_key == 0) return {x, xb};
  auto& b = *buf_;
  const int64_t n = mb.batch * mb.seq * cols;
  const uint64_t key = dropout_subkey(mb.dropout_key, uint64_t(module));
  // In bf16 the input's bf16 copy is what survives until the backward pass: drop out from it, so
  // that the backward pass regenerates the very same values.
  if (precision_ == Precision::BF16) {
    backend_.dropout_bf16(xb, b.lora_dropped_b, n, p, key);
    return {nullptr, b.lora_dropped_b};
  }
  backend_.dropout(x, b.lora_dropped, n, p, key);
  return {b.lora_dropped, nullptr};
}

void Decoder::lora_forward(const MicroBatch& mb, int64_t layer, LinearSlot slot, const float* x, const bf16* xb,
                           float* y, int64_t ldy, const BlockActivations& a, bool apply) {
  if (lora_.empty()) return;
  const int64_t N = mb.batch * mb.seq;
  const bool bf = precision_ == Precision::BF16;
  const int64_t r = options_.lora.rank;
  const auto scaling = float(options_.lora.scaling());
  Linear lin{backend_, bf, N};
  for (int i : lora_by_slot_[size_t(layer)][size_t(slot)]) {
    const LoraModule& m = lora_[size_t(i)];
    float* u = a.lora_u + m.index_in_layer * N * r;
    bf16* ub = bf ? a.lora_u_b + m.index_in_layer * N * r : nullptr;
    const auto [in, in_b] = lora_input(mb, i, m.cols, x, xb);
    lin.forward(in, in_b, adapter_.weight(m.a), adapter_.weight_bf16(m.a), m.cols, r, u, 0.0f);
    // PEFT scales B's output; scaling u instead is the same product, and the backward pass's dB
    // then reads u as it is.
    backend_.scale_in_place(u, N * r, scaling);
    to_bf16(u, ub, N * r);
    if (apply)  // y[:, row_begin : row_begin + rows] += u B^T
      lin.product({Trans::N, Trans::T, N, m.rows, r, r, r, ldy}, u, ub, adapter_.weight(m.b),
                  adapter_.weight_bf16(m.b), y + m.row_begin, 1.0f);
  }
}

void Decoder::lora_backward(const MicroBatch& mb, int64_t layer, LinearSlot slot, const float* dy, const bf16* dyb,
                            int64_t ldy, const float* x, const bf16* xb, float* dx, const BlockActivations& a) {
  if (lora_.empty()) return;
  const int64_t N = mb.batch * mb.seq;
  const bool dropout = options_.lora.dropout > 0 && mb.dropout_key != 0;
  auto& b = *buf_;
  const bool bf = precision_ == Precision::BF16;
  const int64_t r = options_.lora.rank;
  const auto scaling = float(options_.lora.scaling());
  Linear lin{backend_, bf, N};
  const auto& modules = lora_by_slot_[size_t(layer)][size_t(slot)];
  if (modules.empty()) return;
  // Where products widen bf16: x widened once for the modules' dA products, and each module's dy
  // once for its dB and du products.
  const int64_t cols = lora_[size_t(modules[0])].cols;  // the slot's input width, every module's
  const HeldWidened input(backend_, 0, held_lora_input(mb, layer, slot, xb, cols), N, cols, cols, b.lora_held_input);
  // Last module first: gradients become final in reverse parameter order (GradReadyHook).
  for (auto it = modules.rbegin(); it != modules.rend(); ++it) {
    const LoraModule& m = lora_[size_t(*it)];
    const float* u = a.lora_u + m.index_in_layer * N * r;
    const bf16* ub = bf ? a.lora_u_b + m.index_in_layer * N * r : nullptr;
    const float* dy_m = dy + m.row_begin;
    const bf16* dyb_m = bf ? dyb + m.row_begin : nullptr;
    // Unless the whole output gradient is held (held_output_grad: backward() holds it then).
    const bool module_held = !held_output_grad(mb, layer, slot, dyb, ldy) && N * m.rows <= b.held_grad_elements;
    const HeldWidened grad(backend_, 1, module_held ? dyb_m : nullptr, N, m.rows, ldy, b.held_grad);
    // dB[rows, r] += dy[:, rows]^T u
    lin.product({Trans::T, Trans::N, m.rows, r, N, ldy, r, r}, dy_m, dyb_m, u, ub, adapter_.grad(m.b), 1.0f);
    // du[N, r] = scaling * dy[:, rows] B
    lin.product({Trans::N, Trans::N, N, r, m.rows, ldy, r, r}, dy_m, dyb_m, adapter_.weight(m.b),
                adapter_.weight_bf16(m.b), b.lora_du, 0.0f);
    backend_.scale_in_place(b.lora_du, N * r, scaling);
    to_bf16(b.lora_du, b.lora_du_b, N * r);
    // dA[r, cols] += du^T x;  dx[N, cols] += du A  (x and dx through the module's dropout mask)
    const auto [in, in_b] = lora_input(mb, *it, m.cols, x, xb);
    lin.backward_weight(b.lora_du, b.lora_du_b, in, in_b, m.cols, r, adapter_.grad(m.a));
    if (dx)
      lin.product({Trans::N, Trans::N, N, m.cols, r, r, m.cols, m.cols}, b.lora_du, b.lora_du_b, adapter_.weight(m.a),
                  adapter_.weight_bf16(m.a), dropout ? b.lora_dx : dx, dropout ? 0.0f : 1.0f);
    if (dx && dropout) {
      const int64_t n = N * m.cols;
      backend_.dropout(b.lora_dx, b.lora_dx, n, options_.lora.dropout, dropout_subkey(mb.dropout_key, uint64_t(*it)));
      backend_.add(dx, dx, b.lora_dx, n);
    }
    grad_ready(m.b);
    grad_ready(m.a);
  }
}

void Decoder::forward(const MicroBatch& mb, double aux_weight) {
  const auto& c = config_;
  auto& b = *buf_;
  const int64_t N = mb.batch * mb.seq, H = c.hidden_size, L = c.num_layers;
  auto& P = params_;
  const StepTimeline t{int32_t(L)};
  if (c.has_experts()) {
    token_mask(mb);
    RouterBalance::over(b.router_balance, c.moe.experts).clear(c.moe.experts);
  }

  enter_position(t.forward(0));
  if (trained_embed_ >= 0)  // modules_to_save: the adapter's trained copy
    backend_.embedding_forward(mb.input_ids, N, adapter_.weight(trained_embed_), H, b.x[0]);
  else if (P.param(ids_.embed).master())
    backend_.embedding_forward(mb.input_ids, N, P.weight(ids_.embed), H, b.x[0]);
  else
    backend_.embedding_forward_bf16(mb.input_ids, N, P.weight_bf16(ids_.embed), H, b.x[0]);
  if (c.scale_embeddings) backend_.scale_in_place(b.x[0], N * H, embedding_scale(c));
  for (int64_t l = 0; l < L; ++l) {
    if (l > 0) enter_position(t.forward(l));
    forward_block(mb, l, b.x[l], b.forward[l], b.x[l + 1]);
  }
  if (c.has_experts()) {
    RouterBalance balance = RouterBalance::over(b.router_balance, c.moe.experts);
    // balance.rows was summed through the struct's copies: the forward calls add to the buffers,
    // and the masked tokens are counted here, once per sparse layer.
    double rows = 0;
    for (int64_t i = 0; i < N; ++i) rows += b.token_mask[i];
    for (int64_t l = 0; l < L; ++l) balance.rows += c.sparse_layer(l) ? rows : 0.0;
    aux_loss_ = balance.finish(c.moe.experts, aux_weight);
  }
  enter_position(t.head());
  backend_.rmsnorm_forward(hidden_norm_shape(c, N), b.x[L], P.weight(ids_.final_norm), b.xn_final, b.rstd_final,
                           b.xn_final_b);
}

int64_t Decoder::lm_head_chunk() const {
  return lm_head_chunk_rows(config_.vocab_size, max_batch_ * max_seq_, options_.lm_head_chunk_tokens);
}

// Fused LM head + cross-entropy over row chunks: logits for `chunk` tokens at a time, turned into
// dlogits in place, then immediately pushed back through the head. Writes d(xn_final) to b.dnorm.
double Decoder::lm_head_loss(const MicroBatch& mb, double grad_scale, bool backward, const TokenScores* scores,
                             const float* token_weights) {
  const auto& c = config_;
  auto& b = *buf_;
  // The LM head: the model's, or the adapter's trained copy (modules_to_save).
  ParamStore& HS = trained_lm_head_ >= 0 ? adapter_ : params_;
  const int head = trained_lm_head_ >= 0 ? trained_lm_head_ : ids_.lm_head;
  const int64_t N = mb.batch * mb.seq, H = c.hidden_size, V = c.vocab_size;
  const bool bf = precision_ == Precision::BF16;
  const int64_t chunk = lm_head_chunk();
  // The head's gradient: overwritten by the first chunk when this is the step's first write of it.
  const bool head_trained = backward && !HS.frozen();
  float head_beta = head_trained && HS.first_gradient_write(head) ? 0.0f : 1.0f;
  double loss = 0.0;
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t rows = std::min(chunk, N - r0);
    Linear lin{backend_, bf, rows};
    const float* xn = b.xn_final + r0 * H;
    const bf16* xnb = bf ? b.xn_final_b + r0 * H : nullptr;
    lin.forward(xn, xnb, HS.weight(head), HS.weight_bf16(head), H, V, b.logits, 0.0f);
    // bf16: the gradient straight into the copy the products read (the fp32 logits are scratch then).
    const kernels::LossRows per_row{token_weights ? token_weights + r0 : nullptr,
                                    scores && scores->nll ? scores->nll + r0 : nullptr,
                                    scores && scores->mean_logit ? scores->mean_logit + r0 : nullptr};
    loss += backend_.cross_entropy_forward_backward(b.logits, V, mb.targets + r0, rows, V, grad_scale,
                                                    c.final_logit_softcap, backward ? b.logits_b : nullptr, per_row);
    if (!backward) continue;
    lin.backward_input(b.logits, b.logits_b, HS.weight(head), HS.weight_bf16(head), H, V,
                       b.dnorm + r0 * H);
    if (head_trained) lin.backward_weight(b.logits, b.logits_b, xn, xnb, H, V, HS.grad(head), head_beta);
    head_beta = 1.0f;
  }
  return loss;
}

void Decoder::backward(const MicroBatch& mb) {
  const auto& c = config_;
  auto& b = *buf_;
  auto& P = params_;
  // The LM head's gradient is final once the head's backward wrote it (tied: the embedding adds
  // to it last, below).
  if (!c.tie_word_embeddings) base_grad_ready(ids_.lm_head);
  if (trained_lm_head_ >= 0) grad_ready(trained_lm_head_);
  const int64_t N = mb.batch * mb.seq, H = c.hidden_size, L = c.num_layers;
  const int64_t Q = c.q_size(), KV = c.kv_size(), QKV = Q + 2 * KV;
  const bool bf = precision_ == Precision::BF16;
  const bool frozen = P.frozen();  // LoRA: no weight-gradient GEMMs for the base weights
  // The gradient of block 0's input feeds only the embedding's: under LoRA, unless the embedding
  // trains (modules_to_save), nothing reads it, so block 0's attention input products and its
  // input norm's backward are skipped (as autograd skips what no trained tensor needs).
  const bool embedding_grad = !frozen || trained_embed_ >= 0;
  Linear lin{backend_, bf, N, b.four_bit_tile, b.four_bit_tile_b, b.four_bit_tile_elements};
  auto W = [&](int id) { return Weight{P.weight(id), P.weight_bf16(id), P.four_bit(id)}; };
  bf16* dyb = bf ? b.dy_b : nullptr;
  const kernels::RmsNormShape hidden = hidden_norm_shape(c, N);
  // In bf16 the gradient a branch's projection (down, o) reads is written in bf16 (dyb) by the
  // norm backward that produces it: with sandwich norms the branch's own output norm
  // (through_output_norm), without them the norm below, which also adds the residual stream's
  // gradient — the final norm, a block's post-attention norm (for o) or the next block's input
  // norm (for down; block 0's feeds only the embedding).
  bf16* residual_dy_b = c.sandwich_norms ? nullptr : dyb;
  // A gradient written for the first time this step is overwritten, not added to
  // (ParamStore::first_gradient_write): a GEMM with beta 0, a small tensor (norm, bias) or the
  // embedding (scattered into) zeroed just before its write.
  auto grad_beta = [&](int id) { return P.first_gradient_write(id) ? 0.0f : 1.0f; };
  auto fresh_grad = [&](int id) {
    float* g = id >= 0 ? P.grad(id) : nullptr;
    if (g && P.first_gradient_write(id)) std::fill_n(g, P.param(id).numel, 0.0f);
    return g;
  };
  // Sandwich norms: the gradient of a branch's output (its projection's) back through the norm on
  // it, into b.dtmp, the norm's weight gradient then final; without them, dy itself.
  auto through_output_norm = [&](const float* dy, const float* branch_out, const float* rstd, int norm) {
    if (!c.sandwich_norms) return dy;
    backend_.rmsnorm_backward(hidden, branch_out, P.weight(norm), rstd, dy, b.dtmp, fresh_grad(norm), nullptr, dyb);
    base_grad_ready(norm);
    return static_cast<const float*>(b.dtmp);
  };

  backend_.rmsnorm_backward(hidden, b.x[L], P.weight(ids_.final_norm), b.rstd_final, b.dnorm, b.dx,
                            fresh_grad(ids_.final_norm), nullptr, residual_dy_b);
  base_grad_ready(ids_.final_norm);
  const StepTimeline t{int32_t(L)};
  for (int64_t l = L - 1; l >= 0; --l) {
    enter_position(t.backward(l));
    const kernels::AttentionShape as = attention_shape(c, l, mb.batch, mb.seq);
    const kernels::RopeTable& rope = rope_of(l);
    const auto& a = b.backward[l];
    const float* x = b.x[l];
    const auto& p = ids_.layers[l];
    const int64_t I = c.mlp_width(l);  // the dense MLP's width, or the shared experts' (0: none)
    // Gradient checkpointing: the forward kept only x; the same code on the same input gives the
    // same intermediates bit for bit, so the gradients equal those of the stored activations.
    if (options_.recomputes(l)) forward_block(mb, l, x, a, nullptr);
    // A projection's products back from dy [N, out]: dx = dy W, its weight's gradient (full
    // fine-tuning), its adapters'; dy's bf16 copy widened once for all of them where products
    // widen bf16 (held_output_grad).
    auto project_backward = [&](LinearSlot slot, const float* dy, int weight, int64_t in, int64_t out,
                                const float* x_in, const bf16* x_in_b, float* dx) {
      const HeldWidened held(backend_, 1, held_output_grad(mb, l, slot, dyb, out), N, out, out, b.held_grad);
      if (dx) lin.backward_input(dy, dyb, W(weight), in, out, dx);  // null: no one reads the input's gradient
      if (!frozen) lin.backward_weight(dy, dyb, x_in, x_in_b, in, out, P.grad(weight), grad_beta(weight));
      lora_backward(mb, l, slot, dy, dyb, out, x_in, x_in_b, dx, a);
    };

    // MLP: x_next = xmid + down(glu(gate_up(rmsnorm(xmid)))), the branch normalised with sandwich norms
    // (In bf16, a.xn1, a.xn2 and a.act hold another block's data by now: only their bf16 copies
    // may be read here. See describe_memory.)
    const float* d_mlp = through_output_norm(b.dx, a.mo, a.rstd_mo, p.mlp_out_norm);  // d down's output (+ dyb)
    // A sparse layer's shared experts (GLM-4.5) run this dense path too, before its routed experts,
    // which then add their input gradient to the shared experts'.
    if (I > 0) {
      project_backward(LinearSlot::Down, d_mlp, p.down_weight, I, H, a.act, a.act_b, b.d_act);
      backend_.glu_backward(c.mlp_activation, a.gate_up, b.d_act, N, I, b.d_gate_up, dyb);
      project_backward(LinearSlot::GateUp, b.d_gate_up, p.gate_up_weight, H, 2 * I, a.xn2, a.xn2_b, b.dnorm);
    }
    if (c.sparse_layer(l)) experts_backward(mb, l, a, d_mlp, b.dnorm, I > 0);
    // dh = dx (past the block's MLP, the residual) + the norm's input gradient, in one pass.
    backend_.rmsnorm_backward(hidden, a.xmid, P.weight(p.post_norm), a.rstd2, b.dnorm, b.dh, fresh_grad(p.post_norm),
                              b.dx, residual_dy_b);
    for (int id :
         {p.down_weight, p.gate_up_weight, p.experts_down, p.experts_gate_up, p.router, p.router_bias, p.post_norm})
      base_grad_ready(id);

    // Attention: xmid = x + o(attn(rope(qkv(rmsnorm(x))))), the branch normalised with sandwich norms
    const float* d_out = through_output_norm(b.dh, a.ao, a.rstd_ao, p.attn_out_norm);  // d o's output (+ dyb)
    project_backward(LinearSlot::O, d_out, p.o_weight, Q, H, a.attn, a.attn_b, b.d_attn);
    // dq | dk land where attention read q | k: in d_qkv, or with q/k norms in d_qk first.
    const float* qk = c.qk_norm ? a.qk : a.qkv;
    float* dqk = c.qk_norm ? b.d_qk : b.d_qkv;
    backend_.attention_backward(as, attention_matmul(precision_), qk, qk + Q, a.qkv + Q + KV, mb.segments, a.attn,
                                a.lse, b.d_attn, dqk, dqk + Q, b.d_qkv + Q + KV, b.attention_workspace,
                                b.attention_workspace_bytes);
    backend_.rope_backward(dqk, as.ldq, mb.positions, N, c.num_heads, c.head_dim, rope);
    backend_.rope_backward(dqk + Q, as.ldk, mb.positions, N, c.num_kv_heads, c.head_dim, rope);
    if (c.qk_norm) {
      backend_.rmsnorm_backward(head_norm_shape(c, N, c.num_heads, QKV, as.ldq), a.qkv, P.weight(p.q_norm), a.rstd_qk,
                                dqk, b.d_qkv, fresh_grad(p.q_norm), nullptr, nullptr);
      backend_.rmsnorm_backward(head_norm_shape(c, N, c.num_kv_heads, QKV, as.ldk), a.qkv + Q, P.weight(p.k_norm),
                                a.rstd_qk + N * c.num_heads, dqk + Q, b.d_qkv + Q, fresh_grad(p.k_norm), nullptr,
                                nullptr);
    }
    if (p.qkv_bias >= 0 && !frozen) backend_.accumulate_bias_grad(b.d_qkv, N, QKV, fresh_grad(p.qkv_bias));
    to_bf16(b.d_qkv, dyb, N * QKV);
    const bool input_grad = l > 0 || embedding_grad;
    project_backward(LinearSlot::Qkv, b.d_qkv, p.qkv_weight, H, QKV, a.xn1, a.xn1_b, input_grad ? b.dnorm : nullptr);
    if (input_grad)
      backend_.rmsnorm_backward(hidden, x, P.weight(p.input_norm), a.rstd1, b.dnorm, b.dx, fresh_grad(p.input_norm),
                                b.dh, l > 0 ? residual_dy_b : nullptr);
    for (int id : {p.o_weight, p.k_norm, p.q_norm, p.qkv_bias, p.qkv_weight, p.input_norm}) base_grad_ready(id);
  }
  if (c.scale_embeddings && embedding_grad) backend_.scale_in_place(b.dx, N * H, embedding_scale(c));
  const int64_t padding_idx = c.embedding_padding_idx();
  if (!frozen)
    backend_.embedding_backward(mb.input_ids, N, b.dx, H, c.vocab_size, padding_idx, fresh_grad(ids_.embed));
  base_grad_ready(ids_.embed);
  if (trained_embed_ >= 0) {  // modules_to_save: the adapter's copy of the embedding trains
    backend_.embedding_backward(mb.input_ids, N, b.dx, H, c.vocab_size, padding_idx, adapter_.grad(trained_embed_));
    grad_ready(trained_embed_);
  }
}

struct Decoder::CallScope {
  Decoder& d;
  CallScope(Decoder& decoder, int32_t last_position) : d(decoder) {
    require(d.weight_gathers_.empty() || d.casts_per_position() || (d.gather_hooks_.start && d.gather_hooks_.wait),
            "decoder: the weights are sharded (ZeRO) but nothing gathers them (set_weight_gather_hooks)");
    require(!d.resident_gathers() || d.resident_filled_,
            "decoder: the masters are sharded (ZeRO-1/2) and the weights the step reads were never gathered "
            "(refresh_resident_weights after loading or initialising)");
    d.last_position_ = last_position;
  }
  ~CallScope() {
    if (!d.weight_gathers_.empty() && !d.resident_gathers()) d.params_.point_nowhere();
  }
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;
};

double Decoder::forward_backward(const MicroBatch& mb, double grad_scale) {
  validate(mb);
  const StepTimeline t{int32_t(config_.num_layers)};
  CallScope call(*this, t.backward(0));
  TransientScope transients(*buf_, plan_);
  forward(mb, config_.aux_loss_weight());
  double loss = lm_head_loss(mb, grad_scale, true);
  backward(mb);
  return loss;
}

double Decoder::forward_score(const MicroBatch& mb, TokenScores scores) {
  validate(mb);
  CallScope call(*this, StepTimeline{int32_t(config_.num_layers)}.head());
  TransientScope transients(*buf_, plan_);
  forward(mb);
  return lm_head_loss(mb, 0.0, false, &scores);
}

void Decoder::forward_backward_weighted(const MicroBatch& mb, TokenScores scores, float* weights,
                                        TokenWeighting& weighting) {
  validate(mb);
  require(scores.nll && scores.mean_logit && weights, "decoder: forward_backward_weighted needs its three buffers");
  const StepTimeline t{int32_t(config_.num_layers)};
  CallScope call(*this, t.backward(0));
  TransientScope transients(*buf_, plan_);
  forward(mb);
  lm_head_loss(mb, 0.0, false, &scores);
  weighting.weigh(scores.nll, scores.mean_logit, weights);
  lm_head_loss(mb, 1.0, true, nullptr, weights);
  backward(mb);
}

double Decoder::forward_loss(const MicroBatch& mb) {
  validate(mb);
  CallScope call(*this, StepTimeline{int32_t(config_.num_layers)}.head());
  TransientScope transients(*buf_, plan_);
  forward(mb);
  return lm_head_loss(mb, 0.0, false);
}

void Decoder::logits_at(const MicroBatch& mb, const int64_t* rows, int64_t count, float* out) {
  validate(mb);
  CallScope call(*this, StepTimeline{int32_t(config_.num_layers)}.head());
  TransientScope transients(*buf_, plan_);
  forward(mb);
  const int64_t H = config_.hidden_size, V = config_.vocab_size;
  const bool bf = precision_ == Precision::BF16;
  Linear lin{backend_, bf, 1};
  const ParamStore& HS = trained_lm_head_ >= 0 ? adapter_ : params_;
  const int head = trained_lm_head_ >= 0 ? trained_lm_head_ : ids_.lm_head;
  for (int64_t i = 0; i < count; ++i) {
    require(rows[i] >= 0 && rows[i] < mb.batch * mb.seq, "logits_at: row {} out of range", rows[i]);
    lin.forward(buf_->xn_final + rows[i] * H, bf ? buf_->xn_final_b + rows[i] * H : nullptr, HS.weight(head),
                HS.weight_bf16(head), H, V, out + i * V, 0.0f);
    if (config_.final_logit_softcap > 0) backend_.soft_cap(out + i * V, V, config_.final_logit_softcap);
  }
}

}  // namespace keel::model
