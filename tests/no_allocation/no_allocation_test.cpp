// The steady-state training step allocates nothing: after a first (warm-up) step, further steps of
// forward_backward over accumulated micro-batches, the gradient norm, clipping and the AdamW
// update make no heap allocation in keel's code, and nothing any library allocates during a step
// outlives it.
//
// This executable replaces malloc and its relatives (glibc allows replacing the allocator by
// defining these symbols in the program; shared libraries such as oneDNN and libgomp then call
// these too) with pass-throughs to glibc's own __libc_* entry points that count calls while a
// flag is set, and replaces global operator new/delete on top of them. It is a separate
// executable so the other unit tests keep the plain allocator.
//
// One source is outside keel's control and is counted apart, as transient (each allocation is
// freed before the step ends, from glibc's per-thread cache, with no system call): oneDNN 2.x
// builds an argument map and scratchpad views inside every dnnl_primitive_execute (the call is
// wrapped with -Wl,--wrap to know when a matmul is executing). An allocation is oneDNN's when its
// own thread is inside an execute, or while an execute called outside any parallel region runs
// (oneDNN's OpenMP workers then allocate on other threads; keel runs nothing meanwhile).
//
// libgomp's allocations are told apart too, and must be none: libgomp creates (and frees) a
// one-thread team for every serialized `#pragma omp parallel if(false)` region, as it caches only
// teams of two or more threads, so keel's kernels branch around their parallel regions instead
// (keel/core/threads.h: parallel_for, for_each_task).
#include <dlfcn.h>
#include <dnnl.h>
#include <errno.h>
#include <execinfo.h>
#include <gtest/gtest.h>
#include <link.h>
#include <unistd.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>
#include <span>

#include "keel/distributed/communicator.h"
#include "keel/distributed/grad_buckets.h"
#include "keel/model/decoder.h"
#include "keel/recipe/model_setup.h"
#include "keel/train/grad_sync.h"
#include "keel/train/next_token_loss.h"
#include "keel/train/optimizer.h"
#include "keel/train/training_step.h"
#include "../unit/fake_communicator.h"

extern "C" {
void* __libc_malloc(size_t size);
void* __libc_calloc(size_t count, size_t size);
void* __libc_realloc(void* ptr, size_t size);
void* __libc_memalign(size_t alignment, size_t size);
void __libc_free(void* ptr);
dnnl_status_t __real_dnnl_primitive_execute(const_dnnl_primitive_t primitive, dnnl_stream_t stream, int nargs,
                                            const dnnl_exec_arg_t* args);
}

namespace {

enum Origin { kKeel, kOneDnnExecute, kLibgompTeam, kOrigins };
const char* const kOriginNames[kOrigins] = {"keel", "oneDNN execute", "libgomp one-thread team"};

std::atomic<bool> g_counting{false};
std::atomic<long> g_allocations[kOrigins];
std::atomic<size_t> g_largest{0};  // the largest of keel's counted allocations, in bytes
// Executes in progress: those called outside a parallel region (oneDNN's OpenMP workers allocate
// on other threads), and on this thread (inside one, e.g. attention's tasks, oneDNN runs inline).
std::atomic<int> g_onednn_forking{0};
thread_local int t_in_onednn = 0;
uintptr_t g_libgomp_begin = 0, g_libgomp_end = 0;
// Call stacks of the first few allocations of keel's own code, to name the culprit.
constexpr int kStacks = 4, kFrames = 16;
void* g_stacks[kStacks][kFrames];
int g_stack_depth[kStacks];
thread_local bool t_in_hook = false;
// When set, only allocations of threads that set t_counted are counted (data parallel: the
// training thread, not the communication thread, whose MPI calls allocate inside Open MPI).
std::atomic<bool> g_this_thread_only{false};
thread_local bool t_counted = false;

// Allocations made while counting that are not freed yet: a fixed open-addressing set (no
// allocation of its own), guarded by a spin lock because oneDNN's threads allocate too.
constexpr size_t kSlots = size_t(1) << 16;
std::atomic<uintptr_t> g_live[kSlots];
std::atomic<long> g_live_count{0};
std::atomic_flag g_live_lock = ATOMIC_FLAG_INIT;

size_t slot_of(uintptr_t p) { return (p >> 4) * 0x9E3779B97F4A7C15ull % kSlots; }

void remember(void* ptr) {
  if (!ptr) return;
  while (g_live_lock.test_and_set(std::memory_order_acquire)) {}
  for (size_t i = slot_of(uintptr_t(ptr)), n = 0; n < kSlots; i = (i + 1) % kSlots, ++n)
    if (g_live[i].load() == 0 || g_live[i].load() == 1) {  // empty or deleted
      g_live[i] = uintptr_t(ptr);
      ++g_live_count;
      break;
    }
  g_live_lock.clear(std::memory_order_release);
}

void forget(void* ptr) {
  if (!ptr || g_live_count.load(std::memory_order_relaxed) == 0) return;
  while (g_live_lock.test_and_set(std::memory_order_acquire)) {}
  for (size_t i = slot_of(uintptr_t(ptr)), n = 0; n < kSlots && g_live[i].load() != 0; i = (i + 1) % kSlots, ++n)
    if (g_live[i].load() == uintptr_t(ptr)) {
      g_live[i] = 1;  // deleted marker keeps probe chains intact
      --g_live_count;
      break;
    }
  g_live_lock.clear(std::memory_order_release);
}

// Classifies and counts one allocation of `size` bytes; `caller` is the allocator's return address.
void count_allocation(void* caller, size_t size) {
  if (!g_counting.load(std::memory_order_relaxed) || t_in_hook) return;
  if (g_this_thread_only.load(std::memory_order_relaxed) && !t_counted) return;
  Origin origin = kKeel;
  if (t_in_onednn > 0 || g_onednn_forking.load(std::memory_order_relaxed) > 0)
    origin = kOneDnnExecute;
  else if (uintptr_t(caller) >= g_libgomp_begin && uintptr_t(caller) < g_libgomp_end)
    origin = kLibgompTeam;
  const long n = g_allocations[origin].fetch_add(1);
  if (origin == kKeel)
    for (size_t was = g_largest.load(); size > was && !g_largest.compare_exchange_weak(was, size);) {}
  if (origin == kKeel && n < kStacks) {
    t_in_hook = true;  // backtrace() must not count (or recurse into) itself
    g_stack_depth[n] = backtrace(g_stacks[n], kFrames);
    t_in_hook = false;
  }
}

void* counted(void* ptr, void* caller, size_t size) {
  if (g_counting.load(std::memory_order_relaxed) && !t_in_hook &&
      (!g_this_thread_only.load(std::memory_order_relaxed) || t_counted)) {
    count_allocation(caller, size);
    remember(ptr);
  }
  return ptr;
}

// The executable range of libgomp, to recognise its allocations by their caller.
void find_libgomp() {
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void*) {
        if (!info->dlpi_name || !std::strstr(info->dlpi_name, "libgomp")) return 0;
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          const auto& ph = info->dlpi_phdr[i];
          if (ph.p_type != PT_LOAD || !(ph.p_flags & PF_X)) continue;
          g_libgomp_begin = info->dlpi_addr + ph.p_vaddr;
          g_libgomp_end = g_libgomp_begin + ph.p_memsz;
        }
        return 1;
      },
      nullptr);
}

}  // namespace

extern "C" {
dnnl_status_t __wrap_dnnl_primitive_execute(const_dnnl_primitive_t primitive, dnnl_stream_t stream, int nargs,
                                            const dnnl_exec_arg_t* args) {
#ifdef _OPENMP
  const bool forking = !omp_in_parallel();
#else
  const bool forking = true;
#endif
  ++t_in_onednn;
  if (forking) ++g_onednn_forking;
  const auto status = __real_dnnl_primitive_execute(primitive, stream, nargs, args);
  if (forking) --g_onednn_forking;
  --t_in_onednn;
  return status;
}

void* malloc(size_t size) { return counted(__libc_malloc(size), __builtin_return_address(0), size); }
void* calloc(size_t count, size_t size) {
  return counted(__libc_calloc(count, size), __builtin_return_address(0), count * size);
}
void* realloc(void* ptr, size_t size) {
  forget(ptr);
  return counted(__libc_realloc(ptr, size), __builtin_return_address(0), size);
}
void* memalign(size_t alignment, size_t size) {
  return counted(__libc_memalign(alignment, size), __builtin_return_address(0), size);
}
void* aligned_alloc(size_t alignment, size_t size) {
  return counted(__libc_memalign(alignment, size), __builtin_return_address(0), size);
}
int posix_memalign(void** out, size_t alignment, size_t size) {
  if (alignment % sizeof(void*) != 0 || (alignment & (alignment - 1)) != 0) return EINVAL;
  void* p = counted(__libc_memalign(alignment, size), __builtin_return_address(0), size);
  if (!p) return ENOMEM;
  *out = p;
  return 0;
}
void* valloc(size_t size) {
  return counted(__libc_memalign(size_t(sysconf(_SC_PAGESIZE)), size), __builtin_return_address(0), size);
}
void* pvalloc(size_t size) {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  const size_t rounded = (size + page - 1) / page * page;
  return counted(__libc_memalign(page, rounded), __builtin_return_address(0), rounded);
}
void free(void* ptr) {
  forget(ptr);
  __libc_free(ptr);
}
}

// operator new goes through malloc above (its caller is then operator new itself, which is not
// libgomp, so C++ allocations are never mistaken for libgomp's).
void* operator new(size_t size) {
  if (void* p = malloc(size ? size : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t size) { return operator new(size); }
void* operator new(size_t size, std::align_val_t alignment) {
  if (void* p = aligned_alloc(size_t(alignment), size ? size : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t size, std::align_val_t alignment) { return operator new(size, alignment); }
void* operator new(size_t size, const std::nothrow_t&) noexcept { return malloc(size ? size : 1); }
void* operator new[](size_t size, const std::nothrow_t&) noexcept { return malloc(size ? size : 1); }
void operator delete(void* p) noexcept { free(p); }
void operator delete[](void* p) noexcept { free(p); }
void operator delete(void* p, size_t) noexcept { free(p); }
void operator delete[](void* p, size_t) noexcept { free(p); }
void operator delete(void* p, std::align_val_t) noexcept { free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { free(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { free(p); }
void operator delete[](void* p, size_t, std::align_val_t) noexcept { free(p); }

namespace keel {
namespace {

struct Batch {
  std::vector<int32_t> ids, targets, positions, segments;
};

// Rows packed with documents of random lengths (as keel prepare packs them): positions restart
// and attention stays inside each document, so the attention GEMMs' shapes change from batch to
// batch.
Batch packed_batch(int64_t batch, int64_t seq, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Batch b;
  for (int64_t s = 0; s < batch; ++s) {
    int32_t segment = 0, position = 0;
    int64_t left = 0;
    for (int64_t t = 0; t < seq; ++t) {
      if (left == 0) {
        left = 1 + int64_t(rng() % uint64_t(seq));
        ++segment;
        position = 0;
      }
      --left;
      b.ids.push_back(int32_t(rng() % vocab));
      b.targets.push_back(left > 0 && t + 1 < seq ? int32_t(rng() % vocab) : -100);
      b.positions.push_back(position++);
      b.segments.push_back(segment);
    }
  }
  return b;
}

Batch random_batch(int64_t batch, int64_t seq, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Batch b;
  for (int64_t s = 0; s < batch; ++s)
    for (int64_t t = 0; t < seq; ++t) {
      b.ids.push_back(int32_t(rng() % vocab));
      b.targets.push_back(t + 1 < seq ? int32_t(rng() % vocab) : -100);
      b.positions.push_back(int32_t(t));
    }
  return b;
}

struct AllocationCount {
  long by_origin[kOrigins] = {};
  long outstanding = 0;  // counted allocations not freed when fn returned
  size_t largest = 0;    // bytes of keel's largest allocation
};

// Allocations made while fn runs, by origin; prints the call stacks of keel's first few.
template <typename Fn>
AllocationCount allocations_during(Fn&& fn, bool print_stacks = true) {
  if (g_libgomp_end == 0) find_libgomp();
  for (auto& n : g_allocations) n = 0;
  g_largest = 0;
  for (auto& slot : g_live) slot = 0;  // a failure before must not cascade into this measurement
  g_live_count = 0;
  g_counting = true;
  fn();
  g_counting = false;
  AllocationCount count;
  for (int o = 0; o < kOrigins; ++o) count.by_origin[o] = g_allocations[o].load();
  count.outstanding = g_live_count.load();
  count.largest = g_largest.load();
  for (int i = 0; print_stacks && i < std::min<long>(count.by_origin[kKeel], kStacks); ++i) {
    fprintf(stderr, "keel allocation %d of %ld:\n", i + 1, count.by_origin[kKeel]);
    backtrace_symbols_fd(g_stacks[i], g_stack_depth[i], 2);
  }
  return count;
}

TEST(CountingAllocator, SeesEveryKindOfAllocation) {
  void* kept = nullptr;
  const auto n = allocations_during(
      [&] {
        auto* v = new std::vector<int>(100);
        delete v;
        void* p = nullptr;
        EXPECT_EQ(posix_memalign(&p, 64, 1000), 0);
        free(p);
        free(calloc(3, 7));
        kept = malloc(10);
      },
      false);
  EXPECT_EQ(n.by_origin[kKeel], 5);  // the vector object, its storage, posix_memalign, calloc, malloc
  EXPECT_EQ(n.outstanding, 1);       // `kept`
  free(kept);
  EXPECT_EQ(g_live_count.load(), 0);
}

// Random initialisation writes the tensors it cannot draw in place (LoRA's frozen bf16 matrices,
// ZeRO-3's shards) through a bounded buffer: a whole tensor's copy (a 150k vocabulary's embedding:
// 445 MiB in bf16) would lift the setup's peak above the memory plan, which counts no such copy.
TEST(SetupMemory, RandomInitialisationCopiesNoWholeTensor) {
  recipe::ScratchModel m;
  m.family = "llama";
  m.vocab_size = 100000;  // the embedding and LM head: 6.4M weights each, 12.8 MB in bf16
  m.hidden_size = 64;
  m.intermediate_size = 128;
  m.num_layers = 1;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  model::DecoderOptions options{false, true, 0};
  options.lora.rank = 4;  // bf16 LoRA: the frozen matrices are held in bf16 only
  model::Decoder decoder(recipe::scratch_model_config(m), model::Precision::BF16, 1, 8, options);
  const auto n = allocations_during([&] { decoder.init_random(1); }, false);
  const size_t embedding_bf16 = size_t(m.vocab_size * m.hidden_size) * sizeof(bf16);
  EXPECT_LT(n.largest, embedding_bf16 / 2) << "init_random allocated " << n.largest << " bytes at once";
  EXPECT_EQ(n.outstanding, 0);
}

// QLoRA's random initialisation quantizes its draws a piece at a time (a 30B MoE's experts would
// be 1.6 GB per tensor in fp32), then double-quantizes each tensor's absmax values together: the
// same codes and absmax values as the whole tensor quantized at once, without its fp32 copy.
TEST(SetupMemory, RandomFourBitInitialisationStreamsAndQuantizesAsAWholeTensor) {
  recipe::ScratchModel m;
  m.family = "llama";
  m.vocab_size = 64;
  m.hidden_size = 64;
  m.intermediate_size = 20032;  // gate_up: 2.56M weights, 10 MB in fp32: three pieces of the draws, the last partial
  m.num_layers = 1;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  const model::ModelConfig config = recipe::scratch_model_config(m);
  model::DecoderOptions options{false, true, 0};
  options.lora.rank = 4;
  model::Decoder full(config, model::Precision::F32, 1, 8, options);  // fp32 LoRA: the draws as they are
  full.init_random(1);
  options.four_bit_base = true;
  options.double_quantization = true;
  model::Decoder four_bit(config, model::Precision::F32, 1, 8, options);
  const auto n = allocations_during([&] { four_bit.init_random(1); }, false);
  const model::ParamStore& q = four_bit.params();
  const int gate_up = four_bit.ids().layers[0].gate_up_weight;
  const int64_t numel = q.param(gate_up).numel;
  ASSERT_GT(numel, 2 * model::kInitPieceElements);
  EXPECT_LE(n.largest, size_t(model::kInitPieceElements) * sizeof(float))
      << "init_random allocated " << n.largest << " bytes at once";
  EXPECT_EQ(n.outstanding, 0);
  for (const auto& p : q.params()) {
    if (p.storage != model::ParamStorage::FourBit) continue;
    const int i = int(&p - q.params().data());
    model::ParamStore whole;
    whole.set_four_bit_type(q.four_bit_type());
    const int id = whole.add(p.name, p.shape, true, model::ParamStorage::FourBit);
    whole.allocate(false);
    std::vector<uint8_t> packed(size_t(p.numel / 2));
    std::vector<float> absmax(size_t(p.numel / kFourBitBlockSize));
    whole.bind_four_bit(packed.data(), absmax.data());
    whole.store_four_bit(id, 0, full.params().weight(i), p.numel, true);
    const model::FourBitWeight got = q.four_bit(i);
    ASSERT_TRUE(std::equal(packed.begin(), packed.end(), got.packed)) << p.name;
    ASSERT_TRUE(std::equal(absmax.begin(), absmax.end(), got.absmax)) << p.name;
  }
}

struct StepCase {
  const char* family;
  model::Precision precision;
  bool checkpointing;
  int64_t seq = 32;
  bool packed = false;  // micro-batches of packed documents, different in every step
  bool lora = false;    // LoRA on every linear layer: the adapter trains, the model's weights are frozen
  bool nf4 = false;     // QLoRA: the frozen projections in NF4, dequantized tile by tile
  bool cast_per_position = false;  // ZeRO-3 on one rank: each position casts its bf16 weights
  bool experts_lora = false;       // with lora: the experts adapted too (lora_target "all, experts")
  // Products wide enough (a vocabulary of 1,024; experts of width 256, gate/up 512) for the
  // backend to split them over the threads, one single-threaded product a thread (gemm.cpp).
  bool wide = false;
};

// forward_backward over accumulated micro-batches, the gradient norm, clipping and AdamW: counted
// over `steps` steps after one warm-up step.
// The small model every case trains: 2 layers, hidden 64, vocabulary 500.
model::ModelConfig small_model(const char* family, bool wide = false) {
  recipe::ScratchModel m;
  m.family = family;
  m.vocab_size = wide ? 1024 : 500;
  m.hidden_size = 64;
  m.intermediate_size = 128;
  m.num_layers = 2;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  const std::string f = family;
  if (f == "mistral" || f == "gemma2" || f == "gemma3") m.sliding_window = 7;  // inside the shortest sequence
  if (f == "glm4_moe") {  // GLM-4.5: layer 0 dense, layer 1 8 experts in 4 groups (top 3 of the best 2) + shared
    m.family = "qwen3";
    model::ModelConfig c = recipe::scratch_model_config(m);
    c.family = model::Family::Glm4Moe;
    model::apply_family_traits(c);
    c.qk_norm = true;
    c.qkv_bias = true;
    c.moe.experts = 8;
    c.moe.experts_per_token = 3;
    c.moe.intermediate_size = 32;
    c.moe.shared_intermediate_size = 64;
    c.moe.sigmoid_router = true;
    c.moe.groups = 4;
    c.moe.topk_groups = 2;
    c.moe.routed_scaling_factor = 2.5;
    c.moe.norm_topk_prob = true;
    c.moe.sparse_layers = {false, true};
    c.nextn_predict_layers = 1;
    model::validate(c, "no_allocation test");
    return c;
  }
  if (f != "qwen3_moe") return recipe::scratch_model_config(m);
  // Qwen3-MoE: Qwen3's attention, layer 0's MLP 6 experts (top 2), layer 1's dense.
  m.family = "qwen3";
  model::ModelConfig c = recipe::scratch_model_config(m);
  c.family = model::Family::Qwen3Moe;
  model::apply_family_traits(c);
  c.moe.experts = 6;
  c.moe.experts_per_token = 2;
  c.moe.intermediate_size = wide ? 256 : 32;
  c.moe.sparse_layers = {true, false};
  c.moe.output_router_logits = true;
  model::validate(c, "no_allocation test");
  return c;
}

AllocationCount count_steady_state_steps(const StepCase& param, int64_t steps) {
  const auto config = small_model(param.family, param.wide);
  const int64_t batch = 2, seq = param.seq, accumulation = 2;
  model::DecoderOptions options{param.checkpointing, true, 0};
  if (param.lora) options.lora.rank = 4;
  if (param.experts_lora) options.lora.targets = {"all", "experts"};
  options.four_bit_base = param.nf4;
  options.cast_per_position = param.cast_per_position;
  model::Decoder decoder(config, param.precision, batch, seq, options);
  decoder.init_random(1);
  decoder.init_adapter(2);
  train::AdamW optimizer(decoder.backend(), decoder.trainable(), {0.9, 0.999, 1e-8, 0.01});
  std::vector<Batch> pool;
  const int64_t pool_size = param.packed ? accumulation * (steps + 1) : accumulation;
  for (int64_t i = 0; i < pool_size; ++i)
    pool.push_back(param.packed ? packed_batch(batch, seq, config.vocab_size, 10 + uint64_t(i))
                                : random_batch(batch, seq, config.vocab_size, 10 + uint64_t(i)));

  double loss = 0;
  auto step = [&](int64_t number) {
    decoder.trainable().begin_gradient_step();  // as the trainer: first writes overwrite
    for (int64_t i = 0; i < accumulation; ++i) {
      const Batch& b = pool[size_t(((number - 1) * accumulation + i) % pool_size)];
      model::MicroBatch mb{
          batch, seq, b.ids.data(), b.targets.data(), b.positions.data(), param.packed ? b.segments.data() : nullptr};
      loss += decoder.forward_backward(mb, 1.0 / double(accumulation * batch * (seq - 1)));
    }
    const double norm = train::gradient_norm(decoder.backend(), decoder.trainable());
    optimizer.step(1e-3, number, train::clip_coefficient(norm, 1.0));
  };
  step(1);  // warm-up: GEMM primitives, thread pools and the kernels' scratch appear here
  const auto n = allocations_during([&] {
    for (int64_t s = 2; s < 2 + steps; ++s) step(s);
  });
  EXPECT_TRUE(std::isfinite(loss));
  return n;
}

// Steady-state steps: nothing from keel or libgomp, nothing outliving a step; oneDNN's transient
// allocations per step are reported.
void expect_no_allocation(const StepCase& param, int64_t steps) {
  const auto n = count_steady_state_steps(param, steps);
  EXPECT_EQ(n.by_origin[kKeel], 0) << "keel's own code allocated in the step loop (call stacks above)";
  EXPECT_EQ(n.by_origin[kLibgompTeam], 0)
      << "libgomp allocated a one-thread team: a `#pragma omp parallel if (...)` region ran serialized";
  EXPECT_EQ(n.outstanding, 0) << "an allocation made during a step outlived it";
  for (int o = kOneDnnExecute; o < kOrigins; ++o)
    fprintf(stderr, "  allocations per step, %s: %ld\n", kOriginNames[o], n.by_origin[o] / steps);
  ::testing::Test::RecordProperty("onednn_execute_per_step", int(n.by_origin[kOneDnnExecute] / steps));
}

class NoAllocation : public ::testing::TestWithParam<StepCase> {};

TEST_P(NoAllocation, SteadyStateStepsAllocateNothing) { expect_no_allocation(GetParam(), 3); }

// Sequences of 32 keep attention, and most elementwise kernels, below their parallel thresholds:
// the serial paths (no OpenMP region at all).
INSTANTIATE_TEST_SUITE_P(
    Steps, NoAllocation,
    ::testing::Values(StepCase{"llama", model::Precision::F32, false}, StepCase{"llama", model::Precision::BF16, false},
                      StepCase{"glm", model::Precision::BF16, true}, StepCase{"qwen2", model::Precision::F32, true},
                      StepCase{"qwen3", model::Precision::BF16, true},
                      StepCase{"mistral", model::Precision::BF16, false},
                      StepCase{"gemma2", model::Precision::BF16, true},
                      StepCase{"gemma3", model::Precision::F32, false},
                      StepCase{"qwen3_moe", model::Precision::F32, false},
                      StepCase{"qwen3_moe", model::Precision::F32, true},
                      StepCase{"qwen3_moe", model::Precision::BF16, true},
                      StepCase{"qwen3_moe", model::Precision::BF16, true, 32, false, true},
                      StepCase{"qwen3_moe", model::Precision::BF16, true, 32, false, true, true},
                      StepCase{"qwen3_moe", model::Precision::F32, false, 32, false, true, true},
                      StepCase{"glm4_moe", model::Precision::F32, false},
                      StepCase{"glm4_moe", model::Precision::BF16, true},
                      StepCase{"glm4_moe", model::Precision::BF16, true, 32, false, true, true},
                      // LoRA on the experts too, on packed micro-batches: new data every step, so each
                      // expert's row count (and with it the products' pieces) changes from step to step
                      StepCase{"qwen3_moe", model::Precision::F32, false, 32, true, true, false, false, true},
                      StepCase{"qwen3_moe", model::Precision::BF16, true, 32, true, true, false, false, true},
                      StepCase{"qwen3_moe", model::Precision::BF16, true, 32, true, true, true, false, true},
                      StepCase{"llama", model::Precision::BF16, false, 32, false, true},
                      StepCase{"glm", model::Precision::F32, true, 32, false, true},
                      StepCase{"llama", model::Precision::BF16, true, 32, false, true, true},
                      StepCase{"qwen3", model::Precision::BF16, true, 32, false, false, false, true},
                      StepCase{"gemma3", model::Precision::BF16, false, 32, false, false, false, true},
                      // split products, the experts' with row counts changing from step to step
                      StepCase{"qwen3_moe", model::Precision::BF16, false, 32, true, false, false, false, false, true},
                      StepCase{"llama", model::Precision::BF16, true, 32, false, false, false, false, false, true}),
    [](const auto& info) {
      return std::string(info.param.family) + (info.param.precision == model::Precision::BF16 ? "_bf16" : "_fp32") +
             (info.param.checkpointing ? "_checkpointing" : "") + (info.param.packed ? "_packed" : "") +
             (info.param.lora ? "_lora" : "") +
             (info.param.nf4 ? "_nf4" : "") + (info.param.cast_per_position ? "_cast_per_position" : "") +
             (info.param.experts_lora ? "_experts" : "") + (info.param.wide ? "_wide" : "");
    });

// Sequences of 128 put attention (batch * heads * seq^2 * head_dim = 2^21 multiply-adds) and the
// SwiGLU and cross-entropy kernels above their parallel thresholds: every thread of the team
// runs heads on its slice of the planned attention workspace, with its own (thread_local) GEMM
// plans, which step 1 builds on every thread because for_each_task starts thread t on task t.
TEST(NoAllocationParallelAttention, SteadyStateStepsAllocateNothing) {
  expect_no_allocation({"llama", model::Precision::BF16, false, 128}, 5);
}

// Packed documents: every step's rows hold other document boundaries, so each attention block
// starts at another key block and the GEMM shapes differ from step to step (and from thread to
// thread). The decoder builds every shape's plan on every thread before step 1.
TEST(NoAllocationPackedAttention, SteadyStateStepsAllocateNothing) {
  expect_no_allocation({"llama", model::Precision::BF16, false, 256, true}, 5);
  expect_no_allocation({"qwen2", model::Precision::F32, true, 200, true}, 5);  // a tail block of 8 rows
  expect_no_allocation({"mistral", model::Precision::BF16, false, 200, true}, 5);  // windows start mid-document
  expect_no_allocation({"gemma2", model::Precision::F32, false, 128}, 5);  // soft-capped attention, parallel
}

// The training step as the trainer runs it (train/training_step.h: next-token loss over the
// micro-batches, the gradient norm, the loss, the non-finite check, the schedule and clipped AdamW),
// on packed micro-batches that change every step: nothing either. (On a mixture of experts the
// fresh metrics' expert_load list is filled per step: the record, not the computation.)
TEST(NoAllocationTrainingStep, SteadyStateStepsAllocateNothing) {
  const auto config = small_model("llama");
  const int64_t batch = 2, seq = 64, accumulation = 2, steps = 3;
  model::Decoder decoder(config, model::Precision::BF16, batch, seq, {false, true, 0});
  decoder.init_random(1);
  train::AdamW optimizer(decoder.backend(), decoder.trainable(), {0.9, 0.999, 1e-8, 0.01});
  train::NextTokenLoss objective;
  const train::LrSchedule schedule{recipe::LrScheduler::Cosine, 1e-3, 1, 10};
  distributed::FakeCommunicator comm(/*size=*/1, /*rank=*/0);
  train::TrainingStep step(decoder, objective, optimizer, schedule, comm, nullptr,
                           {.seed = 1, .max_grad_norm = 1.0, .skip_nonfinite_steps = false});
  // Every step's micro-batches, made before counting (the loader's buffers are its own).
  std::vector<data::PackedMicroBatch> pool;
  for (int64_t i = 0; i < accumulation * (steps + 1); ++i) {
    const Batch b = packed_batch(batch, seq, config.vocab_size, 30 + uint64_t(i));
    data::PackedMicroBatch mb = data::make_packed_micro_batch_buffers(batch, seq);
    mb.input_ids = b.ids;
    mb.targets = b.targets;
    mb.positions = b.positions;
    mb.segments = b.segments;
    mb.input_tokens = batch * seq;
    mb.target_tokens = std::count_if(b.targets.begin(), b.targets.end(), [](int32_t t) { return t != -100; });
    pool.push_back(std::move(mb));
  }
  double loss = 0;
  auto run = [&](int64_t number) {
    const std::span<const data::PackedMicroBatch> micro(pool.data() + (number - 1) * accumulation, accumulation);
    train::StepBatch in{number, micro, true, {}};
    for (const auto& mb : micro) {
      in.totals.target_tokens += double(mb.target_tokens);
      in.totals.tokens += double(mb.input_tokens);
    }
    const report::StepMetrics m = step.run(in);
    EXPECT_FALSE(m.skipped);
    loss += m.loss;
  };
  run(1);  // warm-up
  const auto n = allocations_during([&] {
    for (int64_t s = 2; s < 2 + steps; ++s) run(s);
  });
  EXPECT_TRUE(std::isfinite(loss));
  EXPECT_EQ(n.by_origin[kKeel], 0) << "the training step allocated (call stacks above)";
  EXPECT_EQ(n.by_origin[kLibgompTeam], 0) << "libgomp allocated a one-thread team";
  EXPECT_EQ(n.outstanding, 0) << "an allocation made during a step outlived it";
}

// Data parallel (run under mpirun by ctest's mpi.no_allocation; skipped in a single process): the
// training thread's steady-state steps allocate nothing either — queueing each bucket's collective
// as the backward pass finishes it, the step totals, waiting, under ZeRO-1 the reduce-scatter, the
// sharded update and the weight all-gather, and under ZeRO-2 the staged reductions of every
// micro-batch and the waits of the position hook, and under ZeRO-3 the weight gathers. The step is train::GradSync's, as the trainer
// runs it. The communication thread is not counted: its MPI calls allocate inside Open MPI (the
// allreduce's scratch buffer), outside keel's control.
void expect_no_allocation_in_data_parallel_steps(int zero_stage, bool lora = false, bool four_bit = false,
                                                 model::Precision precision = model::Precision::BF16) {
  if (!distributed::launched_by_mpi()) GTEST_SKIP() << "runs under mpirun (ctest -R mpi.no_allocation)";
  static auto comm = distributed::make_communicator(60);  // one MPI session for the whole process
  const int ranks = comm->size();
  const auto config = small_model("llama");
  const int64_t batch = 2, seq = 32;
  model::DecoderOptions options{false, true, 0};
  if (lora) options.lora.rank = 4;
  // As a training run shards them (bf16 full fine-tuning: the fp32 masters from ZeRO-1 on).
  recipe::set_zero_stage(options, zero_stage, ranks, precision);
  options.optimizer_shard = zero_stage >= 1 ? comm->rank() : 0;
  options.four_bit_base = four_bit;
  model::Decoder decoder(config, precision, batch, seq, options);
  decoder.init_random(1);
  decoder.init_adapter(2);
  model::ParamStore& params = decoder.trainable();
  train::AdamW optimizer(decoder.backend(), params, {0.9, 0.999, 1e-8, 0.01});
  // Many small buckets: many collectives.
  train::GradSync sync(decoder, *comm, {.zero_stage = zero_stage, .bucket_bytes = 4096, .overlap = true});
  sync.weights_loaded();  // sharded masters: the weights the step reads, from every rank's shard
  const Batch b = random_batch(batch, seq, config.vocab_size, 7 + uint64_t(comm->rank()));

  auto step = [&](int64_t number) {
    double totals[2] = {double(2 * batch * (seq - 1)), double(2 * batch * seq)};
    comm->allreduce_totals(totals, 2);
    sync.begin_step();
    double loss = 0;
    for (int micro = 0; micro < 2; ++micro) {  // accumulation 2: ZeRO-2 reduces every micro-batch
      sync.before_micro_batch(micro == 1);
      model::MicroBatch mb{batch, seq, b.ids.data(), b.targets.data(), b.positions.data(), nullptr};
      loss += decoder.forward_backward(mb, 1.0 / totals[0]);
      sync.after_micro_batch();
    }
    const train::SyncedStep synced = sync.finish(loss);
    optimizer.step(1e-3, number, train::clip_coefficient(synced.grad_norm, 1.0));
    sync.gather_weights();
  };
  step(1);  // warm-up
  t_counted = true;
  g_this_thread_only = true;
  const auto n = allocations_during([&] {
    for (int64_t s = 2; s < 6; ++s) step(s);
  });
  g_this_thread_only = false;
  t_counted = false;
  EXPECT_EQ(n.by_origin[kKeel], 0) << "the training thread allocated in a data-parallel step (call stacks above)";
  EXPECT_EQ(n.outstanding, 0) << "an allocation made during a step outlived it";
}

TEST(NoAllocationDataParallel, TrainingThreadAllocatesNothing) { expect_no_allocation_in_data_parallel_steps(0); }
// bf16 ZeRO-1/2: the fp32 masters sharded, the resident weights gathered after each step.
TEST(NoAllocationDataParallel, TrainingThreadAllocatesNothingWithZeroOne) {
  expect_no_allocation_in_data_parallel_steps(1);
}
TEST(NoAllocationDataParallel, TrainingThreadAllocatesNothingWithZeroTwo) {
  expect_no_allocation_in_data_parallel_steps(2);
}
// fp32 ZeRO-2: the masters whole, gathered span by span into the next step's forward pass.
TEST(NoAllocationDataParallel, TrainingThreadAllocatesNothingWithZeroTwoInFp32) {
  expect_no_allocation_in_data_parallel_steps(2, false, false, model::Precision::F32);
}
// ZeRO-3: every position's weight gathers, started ahead and waited for, and their bf16 copies.
TEST(NoAllocationDataParallel, TrainingThreadAllocatesNothingWithZeroThree) {
  expect_no_allocation_in_data_parallel_steps(3);
}
// LoRA under ZeRO-3: the frozen base's gathers (bf16 matrices, fp32 norms), the adapter's ZeRO-2 path;
// QLoRA's: 4-bit codes and absmax values.
TEST(NoAllocationDataParallel, TrainingThreadAllocatesNothingWithLoraZeroThree) {
  expect_no_allocation_in_data_parallel_steps(3, true);
  expect_no_allocation_in_data_parallel_steps(3, true, true);
}

}  // namespace
}  // namespace keel
