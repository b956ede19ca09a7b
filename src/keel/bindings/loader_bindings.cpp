// keel.DataLoader's engine: data::ShardLoader (the trainer's prefetching loader over prepared
// shards) handing out one micro-batch per call as numpy arrays the caller owns.
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <algorithm>
#include <memory>

#include "keel/data/shard_loader.h"
#include "keel/bindings/bindings.h"

namespace nb = nanobind;

namespace keel::bindings {
namespace {

using Rows = nb::ndarray<nb::numpy, int32_t, nb::ndim<2>>;

// A [batch, seq] int32 array owning a copy of `values` (the loader's buffers are reused).
Rows rows(const std::vector<int32_t>& values, int64_t batch, int64_t seq) {
  auto* data = new int32_t[values.size()];
  std::copy(values.begin(), values.end(), data);
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<int32_t*>(p); });
  return Rows(data, {size_t(batch), size_t(seq)}, owner);
}

class Loader {
 public:
  Loader(const std::string& dir, int64_t batch_size, int64_t seq_len, int rank, int ranks, bool shuffle,
         uint64_t seed, int num_workers, int prefetch_factor)
      : loader_(std::make_unique<data::ShardLoader>(dir, data::ShardLoaderOptions{.batch_size = batch_size,
                                                                                  .seq_len = seq_len,
                                                                                  .micro_batches_per_step = 1,
                                                                                  .rank = rank,
                                                                                  .ranks = ranks,
                                                                                  .shuffle = shuffle,
                                                                                  .seed = seed,
                                                                                  .num_workers = num_workers,
                                                                                  .prefetch_factor = prefetch_factor})) {}

  // This rank's next micro-batch: (input_ids, targets, positions, segments, input_tokens,
  // target_tokens). targets[t] is the token to predict at t (-100: none), as keel's trainer uses.
  nb::tuple next() {
    const data::PackedMicroBatch* batch = nullptr;
    {
      nb::gil_scoped_release released;  // workers may still be filling it
      batch = &loader_->next_step()[0];
    }
    return nb::make_tuple(rows(batch->input_ids, batch->batch, batch->seq),
                          rows(batch->targets, batch->batch, batch->seq),
                          rows(batch->positions, batch->batch, batch->seq),
                          rows(batch->segments, batch->batch, batch->seq), batch->input_tokens,
                          batch->target_tokens);
  }

  data::ShardLoader& loader() { return *loader_; }

 private:
  std::unique_ptr<data::ShardLoader> loader_;
};

}  // namespace

void bind_loader(nb::module_& m) {
  using namespace nb::literals;
  nb::class_<Loader>(m, "ShardLoader", "keel's prefetching loader over a prepared directory (data/shard_loader.h)")
      .def(nb::init<const std::string&, int64_t, int64_t, int, int, bool, uint64_t, int, int>(), "directory"_a,
           "batch_size"_a, "seq_len"_a = 0, "rank"_a = 0, "ranks"_a = 1, "shuffle"_a = true, "seed"_a = 42,
           "num_workers"_a = 1, "prefetch_factor"_a = 2)
      .def("next", &Loader::next)
      .def("seek", [](Loader& l, int64_t samples) { l.loader().seek(samples); }, "samples_consumed"_a)
      .def_prop_ro("position", [](Loader& l) { return l.loader().position(); })
      .def_prop_ro("samples_per_step", [](Loader& l) { return l.loader().samples_per_step(); })
      .def_prop_ro("sequences", [](Loader& l) { return l.loader().sequences(); })
      .def_prop_ro("fingerprint", [](Loader& l) { return l.loader().fingerprint(); })
      .def_prop_ro("seq_len", [](Loader& l) { return l.loader().manifest().max_seq_len; })
      .def_prop_ro("vocab_size", [](Loader& l) { return l.loader().manifest().vocab_size; })
      .def_prop_ro("pad_id", [](Loader& l) { return l.loader().manifest().pad_id; });
}

}  // namespace keel::bindings
