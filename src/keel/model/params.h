// ParamStore: every trainable tensor of the model lives in one contiguous fp32 buffer (and its
// gradient, Adam moments and bf16 compute copy in parallel buffers with the same offsets).
// One flat range makes the optimizer, the global gradient norm, gradient buckets for data
// parallel (contiguous ranges in reverse layer order) and ZeRO shards simple slices.
//
// A frozen tensor that only feeds GEMMs needs no fp32 master: it is declared compute-only and
// lives either in the bf16 buffer alone (LoRA's base matrices in bf16), after the mirror of the
// fp32 buffer: bf16 = [copies of the masters, total() elements | compute-only tensors], or as
// 4-bit (QLoRA: NF4 or FP4, core/four_bit.h), in a buffer of packed codes with one fp32 absmax per
// 64 elements; one 4-bit type per store.
//
// The buffers are either bound to memory planned elsewhere (the decoder's arena: bind()) or owned
// by the store (allocate()), for stores used outside a plan.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "keel/core/dtype.h"
#include "keel/core/flat_range.h"
#include "keel/core/four_bit.h"

namespace keel::model {

enum class ParamStorage : uint8_t {
  Master,   // fp32 master (and its bf16 copy when the store has one)
  Bf16,     // compute-only, bf16 alone
  FourBit,  // compute-only, NF4 or FP4 (packed codes + absmax per 64 elements)
};

struct Param {
  std::string name;            // internal name, e.g. "layers.3.qkv.weight"
  std::vector<int64_t> shape;  // [rows, cols] or [n]
  int64_t offset = 0;          // in elements, into the buffers of its storage (64-byte aligned)
  int64_t numel = 0;
  bool weight_decay = true;  // false for biases and norm weights (HF Trainer's rule)
  ParamStorage storage = ParamStorage::Master;
  bool master() const { return storage == ParamStorage::Master; }
};

// A 4-bit tensor's storage: element i is four_bit_values(type)[code i] * absmax[i / 64], code i in
// the high nibble of packed[i / 2] for even i, the low one for odd i.
// Every tensor starts on a multiple of this many elements of its buffer (64 bytes of fp32); a 4-bit
// tensor on a multiple of kFourBitShardAlign.
constexpr int64_t kParamAlignElements = 16;
// ZeRO-3's shards of the 4-bit elements end on multiples of this: whole 64-element blocks, whose
// codes and absmax values each split into whole 64-byte lines (the stores' tensor alignment).
constexpr int64_t kFourBitShardAlign = kFourBitBlockSize * kParamAlignElements;

struct FourBitWeight {
  const uint8_t* packed = nullptr;
  const float* absmax = nullptr;
  FourBitType type = FourBitType::Nf4;
  explicit operator bool() const { return packed != nullptr; }
};

class ParamStore {
 public:
  // Declares a parameter; returns its index. All declarations come before allocate() or bind().
  int add(std::string name, std::vector<int64_t> shape, bool weight_decay,
          ParamStorage storage = ParamStorage::Master);
  // Allocates zeroed buffers owned by the store (weights, grads; the bf16 copy on request).
  void allocate(bool with_bf16_copy);
  // Points the store at buffers of total() elements planned elsewhere; bf16 copy and Adam moments
  // may be null (not planned), and so may the gradients of a frozen store (LoRA's base weights).
  // Under ZeRO-3 (shard_weights) `weights` and `weights_bf16` are this rank's shards.
  // The caller keeps the memory alive as long as the store.
  void bind(float* weights, float* grads, bf16* weights_bf16, float* adam_m, float* adam_v);
  // Makes the Adam moments available and zeroed: when they were planned and bound this only
  // zeroes them; otherwise owned buffers are allocated here.
  void allocate_optimizer_state();
  // ZeRO-1: this process holds the Adam moments of `range` only (its shard of the flat buffer);
  // set before bind() / allocate_optimizer_state(). Default: all of it.
  void set_optimizer_range(FlatRange range);
  // ZeRO-2: no whole gradient buffer. The backward pass writes tensor i's gradient at grad_at[i]
  // (a staging buffer reused once its part has been reduce-scattered) and this rank's summed
  // gradients of optimizer_range() live in `shard` (shard_grads()). Instead of bind()'s
  // gradients (null there); call before bind(), after set_optimizer_range().
  void bind_staged_grads(std::vector<float*> grad_at, float* shard);
  bool staged_grads() const { return !grad_at_.empty(); }
  FlatRange optimizer_range() const { return optimizer_shard_ ? *optimizer_shard_ : FlatRange{0, total_}; }
  // ZeRO-3: no whole fp32 buffer either. This rank holds the masters of `masters` only (bind()'s
  // `weights` is that shard, and no bf16 mirror is bound) and, of a frozen store's compute-only
  // tensors (LoRA's base matrices), the part `compute_only` of the bf16 ones (bind()'s
  // `weights_bf16` is that shard) and the part `four_bit` of the 4-bit ones (bind_four_bit's
  // buffers are that shard; its bounds whole multiples of kFourBitShardAlign elements). The decoder
  // points each tensor at the buffers its weights are gathered into while a position of the step
  // reads them (point_at); weight(i), weight_bf16(i) and four_bit(i) are null otherwise. A trained
  // store shards its optimizer range; call before bind().
  void shard_weights(FlatRange masters, FlatRange compute_only = {}, FlatRange four_bit = {});
  bool sharded_weights() const { return !weight_at_.empty(); }
  void point_at(int i, float* weights, bf16* weights_bf16) {
    weight_at_[size_t(i)] = weights;
    weight_bf16_at_[size_t(i)] = weights_bf16;
  }
  // ZeRO-3 with one rank (DecoderOptions::cast_per_position): the masters stay whole and bound,
  // but no whole bf16 copy is bound; the decoder points each tensor's bf16 copy at the buffer its
  // position casts into (point_bf16_at), null outside a call (point_nowhere). Call after bind().
  void cast_bf16_per_position();
  void point_bf16_at(int i, bf16* weights_bf16) { weight_bf16_at_[size_t(i)] = weights_bf16; }
  void point_at_four_bit(int i, uint8_t* packed, float* absmax) {
    four_bit_at_[size_t(i)] = {packed, absmax, four_bit_type_};
  }
  // The part of the 4-bit elements this process holds (Param::offset of FourBit tensors).
  FlatRange four_bit_range() const { return sharded_weights() ? four_bit_shard_ : FlatRange{0, four_bit_total_}; }
  // Its codes (range.size() / 2 bytes) and absmax values (range.size() / 64).
  uint8_t* four_bit_packed() { return four_bit_packed_; }
  float* four_bit_absmax() { return four_bit_absmax_; }
  void point_nowhere();  // every tensor's gathered address back to null
  // The part of the flat buffer whose fp32 masters this process holds (all of it, or ZeRO-3's
  // shard), and those masters: element j of the flat buffer is masters()[j - master_range().begin].
  FlatRange master_range() const { return sharded_weights() ? master_shard_ : FlatRange{0, total_}; }
  float* masters() { return weights_; }
  const float* masters() const { return weights_; }
  // The same for the compute-only bf16 tensors: element j of their buffer (Param::offset of a Bf16
  // tensor) is compute_only()[j - compute_only_range().begin].
  FlatRange compute_only_range() const {
    return sharded_weights() ? compute_only_shard_ : FlatRange{0, compute_only_total_};
  }
  bf16* compute_only() { return sharded_weights() ? weights_bf16_ : weights_bf16_ + total_; }
  // Elements [first, first + n) of master tensor i := values, for the part of them this process
  // holds (loading and initialisation, tensor by tensor, whatever the sharding).
  void write_master(int i, int64_t first, const float* values, int64_t n);
  // The same for compute-only bf16 tensor i.
  void write_compute_only(int i, int64_t first, const bf16* values, int64_t n);

  const std::vector<Param>& params() const { return params_; }
  const Param& param(int i) const { return params_[i]; }
  int64_t total() const { return total_; }  // elements with an fp32 master
  int64_t compute_only_total() const { return compute_only_total_; }
  int64_t bf16_total() const { return total_ + compute_only_total_; }  // the bf16 buffer's elements
  int64_t four_bit_total() const { return four_bit_total_; }           // elements stored in 4 bits
  // The 4-bit type of every FourBit tensor (before any store_four_bit). Default NF4.
  void set_four_bit_type(FourBitType type) { four_bit_type_ = type; }
  FourBitType four_bit_type() const { return four_bit_type_; }
  // The 4-bit buffers: four_bit_total() / 2 bytes of codes, four_bit_total() / 64 absmax values.
  void bind_four_bit(uint8_t* packed, float* absmax);
  FourBitWeight four_bit(int i) const;
  // Quantizes n values into 4-bit tensor i from element `first` on (both multiples of 64: HF
  // tensors are quantized one by one, as bitsandbytes quantizes each module), with double
  // quantization's round trip of their absmax values when asked.
  void store_four_bit(int i, int64_t first, const float* values, int64_t n, bool double_quantization);
  // Double quantization of 4-bit tensor i's absmax values, all of them together (its offset is
  // their mean), round-tripped in place: for a tensor stored in pieces without it (a random
  // initialisation streamed a piece at a time). Not under ZeRO-3.
  void double_quantize_four_bit(int i);
  // Where elements [first, first + n) of 4-bit tensor i are stored (whole blocks), for codes read as
  // they are (a checkpoint bitsandbytes saved): n / 2 bytes of codes, n / 64 absmax values. Not
  // under ZeRO-3 (write_four_bit).
  struct FourBitSlot {
    uint8_t* packed;
    float* absmax;
  };
  FourBitSlot four_bit_slot(int i, int64_t first, int64_t n);
  // Elements [first, first + n) of 4-bit tensor i (whole blocks) := n / 2 bytes of codes and n / 64
  // absmax values read as they are (a checkpoint bitsandbytes saved), for the part this process holds.
  void write_four_bit(int i, int64_t first, int64_t n, const uint8_t* packed, const float* absmax);

  bool allocated() const { return weights_ != nullptr; }

  // The fp32 master; null for a compute-only tensor. Under ZeRO-3 where its weights are gathered
  // (null outside the positions that read them).
  float* weight(int i) {
    if (!weight_at_.empty()) return weight_at_[size_t(i)];
    return params_[i].master() ? weights_ + params_[i].offset : nullptr;
  }
  const float* weight(int i) const { return const_cast<ParamStore*>(this)->weight(i); }
  // Where the backward pass adds tensor i's gradient: the whole gradient buffer, or under ZeRO-2
  // its staging buffer.
  float* grad(int i) {
    if (!grad_at_.empty()) return grad_at_[size_t(i)];
    return grads_ ? grads_ + params_[i].offset : nullptr;
  }
  bool frozen() const { return grads_ == nullptr && grad_at_.empty(); }
  // The bf16 copy or compute-only bf16 tensor; null for 4-bit tensors and without a bf16 buffer.
  bf16* weight_bf16(int i) {
    if (!weight_bf16_at_.empty()) return weight_bf16_at_[size_t(i)];
    return has_bf16(params_[i]) ? weights_bf16_ + bf16_offset(params_[i]) : nullptr;
  }
  const bf16* weight_bf16(int i) const { return const_cast<ParamStore*>(this)->weight_bf16(i); }

  // The whole fp32 buffer (every master, flat). Not under ZeRO-3 (masters() holds a shard there).
  float* weights() { return whole_weights(); }
  const float* weights_data() const { return const_cast<ParamStore*>(this)->whole_weights(); }
  // The whole gradient buffer (null under ZeRO-2, which has none).
  float* grads() { return grads_; }
  // The summed gradients the optimizer reads, of optimizer_range(): element i of the flat buffer
  // is shard_grads()[i - range.begin] (the whole buffer's part, or ZeRO-2's shard).
  float* shard_grads() { return grad_shard_ ? grad_shard_ : grads_ ? grads_ + optimizer_range().begin : nullptr; }
  // The Adam moments of optimizer_range(): element i of the flat buffer is adam_m()[i - range.begin].
  float* adam_m() { return adam_m_; }
  float* adam_v() { return adam_v_; }
  bf16* weights_bf16() { return weights_bf16_; }
  bool has_bf16_copy() const { return weights_bf16_ != nullptr; }
  bool has_optimizer_state() const { return adam_m_ != nullptr; }

  // Zeroes what the step accumulates into: the gradient buffer, or ZeRO-2's shard (the staging
  // buffers are zeroed by the decoder as their part of the backward pass begins). Writes then
  // accumulate (first_gradient_write is false until begin_gradient_step).
  void zero_grads();
  // A training step's gradients without a zeroing pass over them (a pass over every gradient,
  // ~2% of the bench model's step): once the owner has enabled it (overwrite_first_gradient_writes:
  // the decoder does for a fully trained model with a whole gradient buffer), begin_gradient_step
  // marks every tensor unwritten and the backward pass's first write of each tensor in the step
  // overwrites (a GEMM with beta 0; a small tensor zeroed just before), told by
  // first_gradient_write. Tensors the previous step did not write at all are zeroed here, so a
  // tensor no pass writes still reads 0 (enabling zeroes the buffer once); this assumes every
  // step writes the same tensors (true of the decoder: nothing is frozen per step), since one
  // written last step but skipped in this one would keep its old gradient. Otherwise
  // begin_gradient_step is zero_grads.
  void overwrite_first_gradient_writes(bool on);
  void begin_gradient_step();
  // True the first time tensor i's gradient is written since begin_gradient_step (and marks it).
  bool first_gradient_write(int i) {
    if (written_.empty() || written_[size_t(i)]) return false;
    written_[size_t(i)] = 1;
    return true;
  }
  void refresh_bf16_copy();                 // after weights change outside the optimizer (load, init)
  void refresh_bf16_copy(FlatRange range);  // of part of the weights (ZeRO-1: the shards other ranks updated)

 private:
  float* whole_weights();
  int64_t bf16_offset(const Param& p) const { return p.master() ? p.offset : total_ + p.offset; }
  bool has_bf16(const Param& p) const { return weights_bf16_ && p.storage != ParamStorage::FourBit; }
  std::vector<Param> params_;
  int64_t total_ = 0, compute_only_total_ = 0, four_bit_total_ = 0;
  FourBitType four_bit_type_ = FourBitType::Nf4;
  uint8_t* four_bit_packed_ = nullptr;
  float* four_bit_absmax_ = nullptr;
  std::optional<FlatRange> optimizer_shard_;  // set by set_optimizer_range (ZeRO-1)
  float *weights_ = nullptr, *grads_ = nullptr, *adam_m_ = nullptr, *adam_v_ = nullptr;
  std::vector<float*> grad_at_;  // ZeRO-2: each tensor's staged gradient
  std::vector<uint8_t> written_;  // per tensor, since begin_gradient_step (empty: writes accumulate)
  float* grad_shard_ = nullptr;  // ZeRO-2: this rank's summed gradients
  FlatRange master_shard_, compute_only_shard_, four_bit_shard_;  // ZeRO-3: what this rank holds
  std::vector<FourBitWeight> four_bit_at_;                        // ZeRO-3: where 4-bit tensors are gathered now
  std::vector<float*> weight_at_;      // ZeRO-3: where each tensor's weights are gathered now
  std::vector<bf16*> weight_bf16_at_;  // and their bf16 copies
  bf16* weights_bf16_ = nullptr;
  // Storage when the store owns its buffers (allocate()); empty when bound to a plan.
  std::vector<float> owned_weights_, owned_grads_, owned_adam_m_, owned_adam_v_;
  std::vector<bf16> owned_weights_bf16_;
};

// ZeRO-3: every rank's shard of a store's three buffers (fp32 masters, compute-only bf16, 4-bit
// elements), in rank order; the decoder holds its rank's and the gathers move every rank's part.
struct WeightShards {
  std::vector<FlatRange> masters, compute_only, four_bit;
};
WeightShards weight_shards(const ParamStore& store, int shards);

}  // namespace keel::model
