// Sharded checkpoint layout and reader (see layout.h).
#include "layout.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

namespace fs = std::filesystem;

namespace fsdp::ckpt {

std::string rank_file_name(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "rank_%05d.h5", rank);
  return buf;
}

std::string flat_group(size_t k) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "flats/%05zu", k);
  return buf;
}

void write_table(hid_t group, const std::vector<TableEntry>& t, const std::string& where) {
  std::vector<std::string> fqns;
  std::vector<int64_t> offsets, numels, ndims, dims;
  for (const auto& e : t) {
    fqns.push_back(e.fqn);
    offsets.push_back(e.offset);
    numels.push_back(e.numel);
    ndims.push_back(static_cast<int64_t>(e.shape.size()));
    dims.insert(dims.end(), e.shape.begin(), e.shape.end());
  }
  h5::write_strings(group, "fqns", fqns, where);
  h5::write_i64(group, "offsets", offsets, where);
  h5::write_i64(group, "numels", numels, where);
  h5::write_i64(group, "ndims", ndims, where);
  h5::write_i64(group, "dims", dims, where);
}

std::vector<TableEntry> read_table(hid_t group, const std::string& where) {
  auto fqns = h5::read_strings(group, "fqns", where);
  auto offsets = h5::read_i64(group, "offsets", where);
  auto numels = h5::read_i64(group, "numels", where);
  auto ndims = h5::read_i64(group, "ndims", where);
  auto dims = h5::read_i64(group, "dims", where);
  const size_t n = fqns.size();
  TORCH_CHECK(offsets.size() == n && numels.size() == n && ndims.size() == n, where,
              ": the parameter table is inconsistent (", n, " names, ", offsets.size(),
              " offsets, ", numels.size(), " sizes)");
  std::vector<TableEntry> out(n);
  size_t d = 0;
  for (size_t i = 0; i < n; ++i) {
    out[i].fqn = fqns[i];
    out[i].offset = offsets[i];
    out[i].numel = numels[i];
    int64_t prod = 1;
    for (int64_t j = 0; j < ndims[i]; ++j) {
      TORCH_CHECK(d < dims.size(), where, ": the parameter table's shapes are truncated");
      out[i].shape.push_back(dims[d]);
      prod *= dims[d++];
    }
    TORCH_CHECK(prod == numels[i] && offsets[i] >= 0, where, ": table entry '", fqns[i],
                "' is inconsistent (numel ", numels[i], " vs shape product ", prod, ")");
  }
  return out;
}

void check_format(hid_t file, const std::string& format, const std::string& where) {
  TORCH_CHECK(h5::has_attr(file, "format"), where,
              " is not an fsdp checkpoint (no 'format' attribute)");
  const std::string f = h5::get_string(file, "format", where);
  TORCH_CHECK(f == format, where, " holds format '", f, "', expected '", format, "'");
  const int64_t v = h5::get_int(file, "format_version", where);
  TORCH_CHECK(v >= 1 && v <= ckpt::kCheckpointFormatVersion, where, " has format_version ", v,
              "; this build reads versions 1 to ", ckpt::kCheckpointFormatVersion,
              v > ckpt::kCheckpointFormatVersion
                  ? ". It was written by a newer fsdp: upgrade this build to read it."
                  : ". The file is damaged.");
}

std::string resolve_checkpoint_dir(const std::string& path) {
  TORCH_CHECK(fs::exists(path), "checkpoint path ", path, " does not exist");
  TORCH_CHECK(fs::is_directory(path), "checkpoint path ", path,
              " is a file, but a sharded checkpoint is a "
              "directory of rank files (or one holding a 'latest' marker); a consolidated .h5 file "
              "needs no "
              "consolidation and loads with load_consolidated / import_consolidated");
  if (fs::exists(fs::path(path) / rank_file_name(0))) return path;
  const fs::path marker = fs::path(path) / "latest";
  TORCH_CHECK(
      fs::is_directory(path) && fs::exists(marker), "checkpoint path ", path,
      " holds no checkpoint: it has neither rank files (rank_00000.h5) nor a 'latest' marker");
  std::ifstream in(marker);
  std::string name;
  std::getline(in, name);
  while (!name.empty() && (name.back() == '\r' || name.back() == ' ')) name.pop_back();
  TORCH_CHECK(!name.empty() && name.find('/') == std::string::npos && name != "." && name != "..",
              "the 'latest' marker ", marker.string(),
              " is bad: it should name a checkpoint directory next to it, "
              "but holds '",
              name, "'. Point it at an existing step_* directory or delete it.");
  const fs::path dir = fs::path(path) / name;
  TORCH_CHECK(fs::is_directory(dir) && fs::exists(dir / rank_file_name(0)), "the 'latest' marker ",
              marker.string(), " is bad: it names '", name,
              "', which is not a checkpoint directory in ", path,
              ". Point it at an existing step_* directory or delete it.");
  return dir.string();
}

namespace {
// Asks the kernel to start reading the whole file now, so that the reads that follow
// overlap with the disk instead of waiting on each piece's readahead. Not when the large
// datasets are read past the page cache (Note [Direct I/O]), which keeps its own reads in
// flight: the advice would read the file a second time, into the cache.
void will_read(const std::string& path) {
  if (h5::direct_reads(path)) return;
  if (int fd = ::open(path.c_str(), O_RDONLY); fd >= 0) {
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_WILLNEED);
    ::close(fd);
  }
}
}  // namespace

ShardedReader::~ShardedReader() { h5::end_read_ahead(); }

ShardedReader::ShardedReader(const std::string& path, size_t cache_bytes)
    : dir_(resolve_checkpoint_dir(path)), cache_bytes_(cache_bytes) {
  const std::string p0 = file_path(0);
  will_read(p0);
  auto f0 = std::make_unique<h5::Obj>(h5::open_file(p0, cache_bytes_));
  check_format(*f0, kShardedFormat, p0);
  world_ = static_cast<int>(h5::get_int(*f0, "world_size", p0));
  group_ = static_cast<int>(h5::get_int(*f0, "shard_group_size", p0));
  step_ = h5::get_int(*f0, "step", p0);
  optimizer_ = h5::get_string(*f0, "optimizer", p0);
  TORCH_CHECK(world_ >= 1 && group_ >= 1 && group_ <= world_, p0, ": world_size ", world_,
              " and shard_group_size ", group_, " are inconsistent");
  for (int r = 0; r < world_; ++r) {
    TORCH_CHECK(fs::exists(file_path(r)), "checkpoint ", dir_, " was saved by ", world_,
                " ranks but ", rank_file_name(r),
                " is missing: the checkpoint is incomplete. Restore the file or load "
                "an older checkpoint.");
  }
  if (h5::has_attr(*f0, "pipeline_stages")) {
    parts_ = static_cast<int>(h5::get_int(*f0, "pipeline_stages", p0));
    TORCH_CHECK(parts_ >= 1 && world_ % parts_ == 0, p0, ": pipeline_stages ", parts_,
                " does not divide world_size ", world_);
  }
  files_.resize(static_cast<size_t>(world_));
  files_[0] = std::move(f0);
  for (int part = 0; part < parts_; ++part) read_part(part);
}

void ShardedReader::read_part(int part) {
  const int r = part_first(part);
  hid_t f = file(r);
  const std::string p = file_path(r);
  const int group = static_cast<int>(h5::get_int(f, "shard_group_size", p));
  TORCH_CHECK(group >= 1 && group <= world_ / parts_, p, ": shard_group_size ", group,
              " does not fit a pipeline stage of ", world_ / parts_, " ranks");
  if (parts_ > 1) {
    TORCH_CHECK(h5::get_int(f, "pipeline_stage", p) == part, p, " says it holds pipeline stage ",
                h5::get_int(f, "pipeline_stage", p), " but sits where stage ", part, " begins");
  }
  const int64_t n = h5::get_int(f, "num_flats", p);
  for (int64_t k = 0; k < n; ++k) {
    const std::string g = flat_group(static_cast<size_t>(k));
    const std::string where = p + ":/" + g;
    h5::Obj grp = h5::open_group(f, g, p);
    SourceFlat sf;
    sf.part = part;
    sf.local = static_cast<size_t>(k);
    sf.group = group;
    sf.unit_fqn = h5::get_string(grp, "unit_fqn", where);
    sf.trainable = h5::get_int(grp, "requires_grad", where) != 0;
    sf.numel = h5::get_int(grp, "numel", where);
    sf.shard_numel = h5::get_int(grp, "shard_numel", where);
    TORCH_CHECK(sf.shard_numel * group >= sf.numel, where, ": shard_numel ", sf.shard_numel,
                " times ", group, " ranks does not cover numel ", sf.numel);
    sf.table = read_table(grp, where);
    if (h5::exists(grp, "optim")) {
      h5::Obj og = h5::open_group(grp, "optim", where);
      sf.optim_states = h5::children(og, where + "/optim");
    }
    for (size_t i = 0; i < sf.table.size(); ++i) {
      TORCH_CHECK(sf.table[i].offset + sf.table[i].numel <= sf.numel, where, ": entry '",
                  sf.table[i].fqn, "' lies outside the flat parameter");
      by_fqn_.emplace(sf.table[i].fqn, std::make_pair(flats_.size(), i));
    }
    flats_.push_back(std::move(sf));
  }
}

std::string ShardedReader::file_path(int rank) const {
  return (fs::path(dir_) / rank_file_name(rank)).string();
}

hid_t ShardedReader::file(int rank) {
  auto& slot = files_.at(static_cast<size_t>(rank));
  if (!slot) {
    const std::string p = file_path(rank);
    will_read(p);
    auto f = std::make_unique<h5::Obj>(h5::open_file(p, cache_bytes_));
    check_format(*f, kShardedFormat, p);
    TORCH_CHECK(h5::get_int(*f, "rank", p) == rank && h5::get_int(*f, "world_size", p) == world_, p,
                " says it is rank ", h5::get_int(*f, "rank", p), " of ",
                h5::get_int(*f, "world_size", p), ", but sits in a checkpoint of ", world_,
                " ranks as rank ", rank);
    TORCH_CHECK(h5::get_int(*f, "step", p) == step_, p, " is from step ",
                h5::get_int(*f, "step", p), " but rank 0's file is from step ", step_,
                ": files of different checkpoints are mixed");
    slot = std::move(f);
  }
  return *slot;
}

void ShardedReader::read(size_t k, const std::string& name, int64_t pos, int64_t n, float* out) {
  const SourceFlat& sf = flats_.at(k);
  TORCH_CHECK(pos >= 0 && pos + n <= sf.numel, "read outside flat parameter ", k);
  while (n > 0) {
    const int64_t chunk = pos / sf.shard_numel;
    const int64_t within = pos - chunk * sf.shard_numel;
    const int64_t take = std::min(n, sf.shard_numel - within);
    const int r = part_first(sf.part) + static_cast<int>(chunk);
    h5::read_range(file(r), flat_group(sf.local) + "/" + name, within, take, out, h5::Elem::kF32,
                   file_path(r));
    pos += take;
    out += take;
    n -= take;
  }
}

std::string describe_shape(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// Another framework's names and transposes (weights.h).
std::string Layout::name(const std::string& fqn) const { return name_for ? name_for(fqn) : fqn; }

bool Layout::transposed(const std::string& fqn, const std::vector<int64_t>& shape) const {
  if (!transpose || !transpose(fqn)) return false;
  TORCH_CHECK(shape.size() == 2, what, " '", fqn, "', which has ", shape.size(),
              " dimensions; only 2-D tensors transpose");
  return true;
}

std::vector<int64_t> Layout::file_shape(const std::string& fqn, std::vector<int64_t> shape) const {
  if (transposed(fqn, shape)) std::swap(shape[0], shape[1]);
  return shape;
}

}  // namespace fsdp::ckpt
