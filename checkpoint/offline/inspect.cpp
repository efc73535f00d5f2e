// Describes and verifies a checkpoint (fsdp-inspect).
#include "../format/layout.h"

#include <c10/util/Exception.h>

#include <filesystem>
#include <iomanip>
#include <set>
#include <sstream>

namespace fs = std::filesystem;

namespace fsdp {
namespace ckpt {
namespace {

std::string human(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  std::ostringstream os;
  os << std::fixed << std::setprecision(u == 0 ? 0 : 1) << bytes << " " << units[u];
  return os.str();
}

std::string attr_text(const ckpt::AttrValue& v) {
  if (const auto* i = std::get_if<int64_t>(&v)) return std::to_string(*i);
  if (const auto* d = std::get_if<double>(&v)) {
    std::ostringstream os;
    os << *d;
    return os.str();
  }
  return "\"" + std::get<std::string>(v) + "\"";
}

// Every dataset under `group`, recursively. `entered` holds the groups already walked: a
// damaged file can link a group into itself, which our writers never do.
void verify_tree(hid_t group, const std::string& where, std::vector<std::string>* unchecked,
                 std::set<std::string>& entered) {
  TORCH_CHECK(entered.insert(h5::object_id(group, where)).second, where,
              ": this group is reached twice (a link cycle): the file is corrupted");
  for (const auto& c : h5::children(group, where)) {
    const h5::Kind kind = h5::kind_of(group, c, where);
    if (kind == h5::Kind::kGroup) {
      h5::Obj g = h5::open_group(group, c, where);
      verify_tree(g, where + "/" + c, unchecked, entered);
    } else if (kind == h5::Kind::kDataset) {
      if (!h5::verify(group, c, where) && unchecked) unchecked->push_back(where + "/" + c);
    }
  }
}

std::string inspect_consolidated(const std::string& file, bool verify) {
  h5::Obj f = h5::open_file(file);
  check_format(f, kConsolidatedFormat, file);
  std::ostringstream os;
  os << "consolidated checkpoint " << file << " ("
     << human(static_cast<double>(fs::file_size(file))) << ")\n";
  for (const auto& n : h5::attr_names(f, file))
    os << "  " << n << " = " << attr_text(h5::get_attr(f, n, file)) << "\n";
  h5::Obj model = h5::open_group(f, "model", file);
  const auto names = h5::children(model, file + ":/model");
  int64_t total = 0;
  os << "  /model: " << names.size() << " tensors\n";
  for (const auto& n : names) {
    auto shape = h5::shape_of(model, n, file + ":/model");
    const int64_t numel = h5::numel_of(shape, file + ":/model", n);
    TORCH_CHECK(!__builtin_add_overflow(total, numel, &total), file,
                ":/model: more elements than fit in 64 bits: the file is corrupted");
    os << "    " << n << " " << describe_shape(shape) << " "
       << h5::elem_name(h5::elem_of(model, n, file)) << "\n";
  }
  os << "  elements: " << total << "\n";
  if (h5::exists(f, "optimizer")) {
    h5::Obj og = h5::open_group(f, "optimizer", file);
    os << "  /optimizer: " << h5::get_string(og, "kind", file) << " state for "
       << h5::children(og, file + ":/optimizer").size() << " parameters\n";
  }
  if (verify) {
    std::vector<std::string> unchecked;
    std::set<std::string> entered;
    verify_tree(f, file + ":", &unchecked, entered);
    os << "  verified: every dataset read back";
    if (unchecked.empty()) {
      os << " and every checksum matched\n";
    } else {
      os << "; " << unchecked.size()
         << " datasets carry no checksums (written by another tool), e.g. " << unchecked.front()
         << "\n";
    }
  }
  return os.str();
}

std::string inspect_sharded(const std::string& path, bool verify) {
  ShardedReader src(path);
  std::ostringstream os;
  os << "sharded checkpoint " << src.dir() << "\n";
  os << "  format = \"" << kShardedFormat
     << "\", format_version = " << h5::get_int(src.file(0), "format_version", src.file_path(0))
     << "\n";
  os << "  world_size = " << src.world_size() << ", shard_group_size = " << src.shard_group_size()
     << ", step = " << src.step() << ", optimizer = " << src.optimizer() << "\n";
  if (src.parts() > 1) {
    os << "  pipeline_stages = " << src.parts() << ": rank files of "
       << src.world_size() / src.parts() << " ranks each, one stage's units apiece\n";
  }
  int64_t bytes = 0;
  for (int r = 0; r < src.world_size(); ++r)
    bytes += static_cast<int64_t>(fs::file_size(src.file_path(r)));
  os << "  files: " << src.world_size() << " rank files, " << human(static_cast<double>(bytes))
     << " in all\n";
  int64_t total = 0;
  os << "  units: " << src.flats().size() << " flat parameters\n";
  for (const auto& sf : src.flats()) {
    os << "    unit '" << sf.unit_fqn << "' (" << (sf.trainable ? "trainable" : "frozen") << "), "
       << sf.numel << " elements, " << sf.shard_numel << " per rank";
    if (!sf.optim_states.empty()) {
      os << ", optimizer state:";
      for (const auto& s : sf.optim_states) os << " " << s;
    }
    os << "\n";
    for (const auto& e : sf.table) {
      os << "      " << e.fqn << " " << describe_shape(e.shape) << " @" << e.offset << "\n";
      total += e.numel;
    }
  }
  os << "  parameter elements: " << total << " (" << human(static_cast<double>(total) * 4)
     << " in fp32)\n";
  if (verify) {
    for (int r = 0; r < src.world_size(); ++r) {
      hid_t f = src.file(r);  // opening checks format, rank, world size and step
      const std::string p = src.file_path(r);
      // The flats of this file's pipeline stage (every flat without stages).
      const int part = r / (src.world_size() / src.parts()), local_rank = r - src.part_first(part);
      std::vector<size_t> mine;
      for (size_t k = 0; k < src.flats().size(); ++k)
        if (src.flats()[k].part == part) mine.push_back(k);
      TORCH_CHECK(h5::get_int(f, "num_flats", p) == static_cast<int64_t>(mine.size()), p, " holds ",
                  h5::get_int(f, "num_flats", p), " flat parameters but ",
                  src.parts() > 1 ? "its stage's first file holds " : "rank 0's file holds ",
                  mine.size());
      for (size_t k : mine) {
        const SourceFlat& sf = src.flats()[k];
        const std::string where = p + ":/" + src.flat_path(k);
        h5::Obj g = h5::open_group(f, src.flat_path(k), p);
        const int64_t begin = h5::get_int(g, "begin", where),
                      length = h5::get_int(g, "length", where);
        const bool writer = local_rank < sf.group;
        const int64_t want_begin =
            std::min(static_cast<int64_t>(local_rank) * sf.shard_numel, sf.numel);
        const int64_t want_len = writer ? std::min(sf.numel - want_begin, sf.shard_numel) : 0;
        TORCH_CHECK(!writer || (begin == want_begin && length == want_len), where,
                    " holds elements [", begin, ", ", begin + length, ") but should hold [",
                    want_begin, ", ", want_begin + want_len, ")");
        TORCH_CHECK(h5::shape_of(g, "param", where) == std::vector<int64_t>{want_len}, where,
                    ": dataset 'param' should hold ", want_len, " elements");
      }
      std::set<std::string> entered;
      verify_tree(f, p + ":", nullptr, entered);
    }
    os << "  verified: " << src.world_size()
       << " rank files complete, every dataset read back and every "
       << "checksum matched\n";
  }
  return os.str();
}

}  // namespace

std::string inspect(const std::string& path, bool verify) {
  TORCH_CHECK(fs::exists(path), "checkpoint path ", path, " does not exist");
  if (fs::is_directory(path)) return inspect_sharded(path, verify);
  return inspect_consolidated(path, verify);
}

}  // namespace ckpt
}  // namespace fsdp
