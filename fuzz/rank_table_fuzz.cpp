// HCCL rank tables and the files around them. The first byte picks the parser: rank_table.json
// (check_rank_table, with and without a topology rule; a table it accepts must survive
// rank_table_json and be accepted again), /etc/hccn.conf, or a servers file.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "fuzz_support.h"
#include "keel/cluster/rank_table.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace keel;
  if (size == 0) return 0;
  const int which = data[0] % 4;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    switch (which) {
      case 0:
      case 1: {
        std::optional<cluster::HcclTopology> topology;
        if (which == 1)
          topology = size > 1 && (data[1] & 1) ? cluster::HcclTopology::Pcie : cluster::HcclTopology::HccsFullMesh;
        cluster::RankTableCheck check = cluster::check_rank_table(text, "rank_table.json", topology);
        if (!check.ok()) break;
        const std::string json = cluster::rank_table_json(check.table);
        cluster::RankTableCheck again = cluster::check_rank_table(json, "rewritten rank_table.json", topology);
        if (!again.ok())
          fuzz::property_failed("an accepted rank table is refused once rewritten",
                                fmt::format("{}\n{}", json, fmt::join(again.errors, "\n")));
        if (cluster::rank_table_json(again.table) != json) fuzz::property_failed("rank_table_json is not stable", json);
        (void)cluster::hostfile_text(check.table);
        break;
      }
      case 2: (void)cluster::parse_hccn_conf(text, "/etc/hccn.conf"); break;
      case 3: (void)cluster::parse_servers_file(text, "servers.txt"); break;
    }
  } catch (const Error&) {}
  return 0;
}
