// Note [Safetensors]
// The format (huggingface/safetensors, "Format"), which we write and read ourselves:
//   - 8 bytes: N, the length of the header, an unsigned little-endian 64-bit integer;
//   - N bytes: a UTF-8 JSON object. Key "__metadata__" (optional) maps strings to
//     strings; every other key is a tensor name mapping to {"dtype": "F32" | "BF16" |
//     "F16" | ..., "shape": [dims], "data_offsets": [begin, end]}. The header may be
//     padded with spaces (0x20); we pad it to a multiple of 8 so that the data starts
//     8-byte aligned, as the reference writer does;
//   - the data: every tensor's bytes, little-endian, row-major (C order), at
//     [begin, end) counted from the first byte after the header. The ranges tile the
//     data exactly: no gap, no overlap, nothing after the last one.
// A reader (the reference one included) rejects a header over 100 MB, a range whose
// length is not numel * dtype size, and ranges that do not tile the data. A set of files
// has an index, model.safetensors.index.json: {"metadata": {"total_size": bytes of tensor
// data}, "weight_map": {name: file}}, as transformers writes and reads it.
#include "safetensors.h"

#include "../publish.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

namespace fs = std::filesystem;

namespace fsdp::st {
namespace {

constexpr uint64_t kMaxHeader = 100'000'000;  // the reference implementation's limit

const std::map<std::string, size_t>& dtype_sizes() {
  static const std::map<std::string, size_t> m = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8}, {"I32", 4}, {"I16", 2},
      {"I8", 1},  {"U64", 8}, {"U32", 4}, {"U16", 2},  {"U8", 1},  {"BOOL", 1}};
  return m;
}

std::string err_text() { return std::strerror(errno); }

void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t{1} << 30));
    if (w < 0 && errno == EINTR) continue;
    TORCH_CHECK(w > 0, "cannot write ", path, ": ", err_text(), ". Is the disk full?");
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void read_all(int fd, uint64_t offset, void* out, uint64_t n, const std::string& path) {
  auto* p = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t r =
        ::pread(fd, p, std::min<uint64_t>(n, uint64_t{1} << 30), static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    TORCH_CHECK(r > 0, "cannot read ", path, " at byte ", offset, ": ",
                r == 0 ? std::string("the file ends early (truncated)") : err_text());
    p += r;
    n -= static_cast<uint64_t>(r);
    offset += static_cast<uint64_t>(r);
  }
}

}  // namespace

size_t dtype_size(const std::string& dtype) {
  auto it = dtype_sizes().find(dtype);
  TORCH_CHECK(it != dtype_sizes().end(), "safetensors dtype '", dtype,
              "' is not known (F64, F32, F16, BF16, I64, I32, I16, I8, U64, U32, U16, U8, BOOL)");
  return it->second;
}

uint64_t nbytes(const Spec& spec) {
  uint64_t n = dtype_size(spec.dtype);
  for (int64_t d : spec.shape) {
    TORCH_CHECK(d >= 0, "tensor '", spec.name, "' has a negative dimension");
    n *= static_cast<uint64_t>(d);
  }
  return n;
}

std::vector<FilePlan> plan_files(const std::vector<Spec>& specs, uint64_t max_shard_size) {
  TORCH_CHECK(max_shard_size > 0,
              "max_shard_size must be positive (bytes; Hugging Face's default is 5 GB)");
  std::vector<FilePlan> files;
  for (size_t i = 0; i < specs.size(); ++i) {
    const uint64_t b = nbytes(specs[i]);
    if (files.empty() ||
        (!files.back().tensors.empty() && files.back().data_bytes + b > max_shard_size)) {
      files.emplace_back();
    }
    files.back().tensors.push_back(i);
    files.back().data_bytes += b;
  }
  if (files.empty()) files.emplace_back();
  const size_t n = files.size();
  for (size_t k = 0; k < n; ++k) {
    if (n == 1) {
      files[k].name = "model.safetensors";
    } else {
      char buf[64];
      std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", k + 1, n);
      files[k].name = buf;
    }
  }
  return files;
}

std::string header_bytes(const std::vector<Spec>& specs, const std::vector<size_t>& order,
                         const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (size_t i : order) {
    const Spec& s = specs.at(i);
    TORCH_CHECK(!s.name.empty() && s.name != "__metadata__", "tensor name '", s.name,
                "' cannot be stored in safetensors");
    TORCH_CHECK(!h.contains(s.name), "tensor '", s.name, "' appears twice");
    const uint64_t b = nbytes(s);
    h[s.name] = {{"dtype", s.dtype}, {"shape", s.shape}, {"data_offsets", {offset, offset + b}}};
    offset += b;
  }
  std::string json = h.dump();
  json.append((8 - json.size() % 8) % 8, ' ');
  TORCH_CHECK(json.size() <= kMaxHeader, "the safetensors header would be ", json.size(),
              " bytes, over the format's limit of 100 MB (too many tensors for one file)");
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int k = 0; k < 8; ++k)
    out[static_cast<size_t>(k)] = static_cast<char>((n >> (8 * k)) & 0xff);
  return out + json;
}

std::string index_json(const std::vector<Spec>& specs, const std::vector<FilePlan>& files) {
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  uint64_t total = 0;
  for (const auto& f : files) {
    for (size_t i : f.tensors) weight_map[specs.at(i).name] = f.name;
    total += f.data_bytes;
  }
  nlohmann::ordered_json j = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  return j.dump(2) + "\n";
}

FileWriter::FileWriter(std::string path, const std::string& header, uint64_t data_bytes)
    : path_(std::move(path)), tmp_(path_ + ".tmp"), expected_(data_bytes) {
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd_ >= 0, "cannot create ", tmp_, ": ", err_text(), ckpt::kCheckTheDirectory);
  write_all(fd_, header.data(), header.size(), tmp_);
}

FileWriter::~FileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!published_) ::unlink(tmp_.c_str());
}

void FileWriter::append(const void* data, size_t n) {
  TORCH_CHECK(fd_ >= 0, "internal: append to a finished safetensors file ", path_);
  TORCH_CHECK(written_ + n <= expected_, "internal: ", path_,
              " gets more data than its header declares");
  write_all(fd_, data, n, tmp_);
  written_ += n;
}

void FileWriter::finish() {
  TORCH_CHECK(written_ == expected_, "internal: ", path_, " got ", written_,
              " bytes of data, its header declares ", expected_);
  TORCH_CHECK(::fsync(fd_) == 0, "cannot fsync ", tmp_, ": ", err_text());
  const int rc = ::close(fd_);
  fd_ = -1;
  TORCH_CHECK(rc == 0, "cannot close ", tmp_, ": ", err_text());
  finished_ = true;
}

void FileWriter::publish() {
  TORCH_CHECK(finished_, "internal: publishing unfinished ", path_);
  ckpt::publish_atomically(tmp_, path_);
  published_ = true;
}

DirWriter::DirWriter(std::string dir, std::vector<Spec> specs,
                     std::map<std::string, std::string> metadata, uint64_t max_shard_size)
    : dir_(std::move(dir)), specs_(std::move(specs)), metadata_(std::move(metadata)) {
  files_ = plan_files(specs_, max_shard_size);
  std::error_code ec;
  fs::create_directories(dir_, ec);
  TORCH_CHECK(fs::is_directory(dir_), "cannot create the export directory ", dir_, ": ",
              ec ? ec.message() : std::string("a file of that name exists"));
}

void DirWriter::add(size_t index, const void* data, uint64_t n) {
  TORCH_CHECK(index == next_ && index < specs_.size(), "internal: safetensors tensor ", index,
              " given, ", next_, " expected");
  TORCH_CHECK(n == nbytes(specs_[index]), "internal: tensor '", specs_[index].name, "' got ", n,
              " bytes, its dtype and shape need ", nbytes(specs_[index]));
  while (in_file_ == files_[file_].tensors.size()) {  // files without tensors are finished at once
    ++file_;
    in_file_ = 0;
  }
  if (in_file_ == 0) {
    const FilePlan& f = files_[file_];
    writers_.push_back(std::make_unique<FileWriter>((fs::path(dir_) / f.name).string(),
                                                    header_bytes(specs_, f.tensors, metadata_),
                                                    f.data_bytes));
  }
  writers_.back()->append(data, n);
  ++next_;
  if (++in_file_ == files_[file_].tensors.size()) writers_.back()->finish();
}

void DirWriter::finish() {
  TORCH_CHECK(next_ == specs_.size(), "internal: safetensors export finished after ", next_, " of ",
              specs_.size(), " tensors");
  if (specs_.empty()) {  // one empty file
    writers_.push_back(std::make_unique<FileWriter>((fs::path(dir_) / files_[0].name).string(),
                                                    header_bytes(specs_, {}, metadata_), 0));
    writers_.back()->finish();
  }
  for (auto& w : writers_) w->publish();
  const fs::path index = fs::path(dir_) / "model.safetensors.index.json";
  if (files_.size() > 1) {  // the index: a file of "header" only, written and published alike
    FileWriter idx(index.string(), index_json(specs_, files_), 0);
    idx.finish();
    idx.publish();
  }
  // An earlier export with another number of files leaves files this one does not
  // replace; they would confuse a reader of the directory.
  std::set<std::string> mine;
  for (const auto& f : files_) mine.insert(f.name);
  if (files_.size() > 1) mine.insert(index.filename().string());
  for (const auto& e : fs::directory_iterator(dir_)) {
    const std::string n = e.path().filename().string();
    const bool ours = n == "model.safetensors" || n == "model.safetensors.index.json" ||
                      (n.rfind("model-", 0) == 0 && n.size() > 12 &&
                       n.compare(n.size() - 12, 12, ".safetensors") == 0);
    if (ours && !mine.count(n)) fs::remove(e.path());
  }
}

bool is_safetensors(const std::string& path) {
  const fs::path p(path);
  if (fs::is_directory(p)) {
    return fs::exists(p / "model.safetensors") || fs::exists(p / "model.safetensors.index.json");
  }
  const std::string name = p.filename().string();
  auto ends = [&](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  return ends(".safetensors") || ends(".safetensors.index.json");
}

Reader::Reader(const std::string& path) {
  // A malformed file throws from here, where no destructor closes what was opened
  // (found by fuzzing: every rejected file leaked its descriptor).
  try {
    open(path);
  } catch (...) {
    for (int fd : fds_) ::close(fd);
    throw;
  }
}

void Reader::open(const std::string& path) {
  fs::path p(path);
  if (fs::is_directory(p)) {
    p = fs::exists(p / "model.safetensors.index.json") ? p / "model.safetensors.index.json"
                                                       : p / "model.safetensors";
  }
  TORCH_CHECK(fs::exists(p), "safetensors file ", p.string(), " does not exist");
  const std::string name = p.filename().string();
  if (name.size() > 5 && name.compare(name.size() - 5, 5, ".json") == 0) {
    std::ifstream in(p);
    nlohmann::json idx;
    try {
      in >> idx;
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK(false, p.string(), " is not valid JSON: ", e.what());
    }
    TORCH_CHECK(idx.is_object() && idx.contains("weight_map") && idx["weight_map"].is_object(),
                p.string(), ": not a safetensors index (no \"weight_map\" object)");
    std::map<std::string, std::string> wanted;  // tensor -> file
    std::vector<std::string> order;             // files, first use first
    for (auto& [t, f] : idx["weight_map"].items()) {
      TORCH_CHECK(f.is_string(), p.string(), ": weight_map[\"", t, "\"] is not a file name");
      const std::string file = f.get<std::string>();
      TORCH_CHECK(file.find('/') == std::string::npos, p.string(), ": weight_map names '", file,
                  "', which is not a file beside the index");
      wanted[t] = file;
      if (std::find(order.begin(), order.end(), file) == order.end()) order.push_back(file);
    }
    for (size_t k = 0; k < order.size(); ++k)
      open_file((p.parent_path() / order[k]).string(), k == 0);
    for (const auto& [t, e] : entries_) {
      auto it = wanted.find(t);
      TORCH_CHECK(it != wanted.end(), p.string(), ": tensor '", t, "' is in ", files_[e.file],
                  " but not in the index's weight_map");
      TORCH_CHECK(fs::path(files_[e.file]).filename() == it->second, p.string(),
                  ": the index puts '", t, "' in ", it->second, " but it is in ", files_[e.file]);
    }
    for (const auto& [t, f] : wanted) {
      TORCH_CHECK(entries_.count(t), p.string(), ": the index names tensor '", t, "' in ", f,
                  ", which does not hold it");
    }
  } else {
    open_file(p.string(), true);
  }
}

Reader::~Reader() {
  for (int fd : fds_) ::close(fd);
}

namespace {

// The JSON header of an open safetensors file of `size` bytes; `header_len` receives its
// length (the data start 8 bytes after it).
nlohmann::json read_header_json(int fd, const std::string& path, uint64_t size,
                                uint64_t& header_len) {
  TORCH_CHECK(size >= 8, path, " (", size,
              " bytes) is not a safetensors file: shorter than its 8-byte header length");
  unsigned char len[8];
  read_all(fd, 0, len, 8, path);
  uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = (n << 8) | len[k];
  TORCH_CHECK(n <= kMaxHeader, path, ": header length ", n,
              " is over the format's limit of 100 MB: not a safetensors "
              "file, or corrupted");
  TORCH_CHECK(8 + n <= size, path, ": header length ", n, " runs past the end of the file (", size,
              " bytes): truncated");
  std::string text(n, '\0');
  read_all(fd, 8, text.data(), n, path);
  TORCH_CHECK(n > 0 && text[0] == '{', path,
              ": the header does not start with '{': not a safetensors file");
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, path, ": the header is not valid JSON: ", e.what());
  }
  TORCH_CHECK(h.is_object(), path, ": the header is not a JSON object");
  header_len = n;
  return h;
}

// One tensor's header entry, checked against the `data_len` bytes of data.
Entry parse_entry(const std::string& path, const std::string& key, const nlohmann::json& v,
                  size_t file, uint64_t data_len) {
  TORCH_CHECK(
      v.is_object() && v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"),
      path, ": tensor '", key, "' lacks dtype, shape or data_offsets");
  Entry e;
  e.file = file;
  TORCH_CHECK(v["dtype"].is_string(), path, ": tensor '", key, "': dtype is not a string");
  e.dtype = v["dtype"].get<std::string>();
  TORCH_CHECK(v["shape"].is_array(), path, ": tensor '", key, "': shape is not an array");
  for (auto& d : v["shape"]) {
    TORCH_CHECK(d.is_number_unsigned(), path, ": tensor '", key, "': shape holds ", d.dump(),
                ", not a non-negative integer");
    e.shape.push_back(d.get<int64_t>());
  }
  const auto& off = v["data_offsets"];
  TORCH_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() &&
                  off[1].is_number_unsigned(),
              path, ": tensor '", key, "': data_offsets is not [begin, end]");
  e.begin = off[0].get<uint64_t>();
  e.end = off[1].get<uint64_t>();
  TORCH_CHECK(e.begin <= e.end && e.end <= data_len, path, ": tensor '", key, "': data_offsets [",
              e.begin, ", ", e.end, "] lie outside the ", data_len,
              " bytes of data: truncated or corrupted");
  const uint64_t want = nbytes(Spec{key, e.dtype, e.shape});
  TORCH_CHECK(e.end - e.begin == want, path, ": tensor '", key, "' (", e.dtype, ", ",
              e.shape.size(), " dims) needs ", want, " bytes but data_offsets give ",
              e.end - e.begin);
  return e;
}

// The tensors' [begin, end) ranges must tile the data exactly: no overlap, no gap, nothing
// after the last.
void check_ranges_tile(const std::string& path, std::vector<std::pair<uint64_t, uint64_t>> ranges,
                       uint64_t data_len) {
  std::sort(ranges.begin(), ranges.end());
  uint64_t at = 0;
  for (const auto& [b, e] : ranges) {
    TORCH_CHECK(b == at, path, ": the tensors' data_offsets ",
                b == at  ? ""
                : b < at ? "overlap"
                         : "leave a gap",
                " at byte ", std::min(b, at), " of the data");
    at = e;
  }
  TORCH_CHECK(at == data_len, path, ": ", data_len - at,
              " bytes after the last tensor's data: not a valid file");
}

}  // namespace

void Reader::open_file(const std::string& path, bool take_metadata) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "cannot open safetensors file ", path, ": ", err_text());
  fds_.push_back(fd);
  files_.push_back(path);
  struct stat sb {};
  TORCH_CHECK(::fstat(fd, &sb) == 0, "cannot stat ", path, ": ", err_text());
  const auto size = static_cast<uint64_t>(sb.st_size);
  uint64_t n = 0;
  const nlohmann::json h = read_header_json(fd, path, size, n);
  const size_t file = files_.size() - 1;
  const uint64_t data_len = size - 8 - n;
  data_start_.push_back(8 + n);
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto& [key, v] : h.items()) {
    if (key == "__metadata__") {
      TORCH_CHECK(v.is_object(), path, ": __metadata__ is not an object");
      for (auto& [mk, mv] : v.items()) {
        TORCH_CHECK(mv.is_string(), path, ": __metadata__[\"", mk, "\"] is not a string");
        if (take_metadata) metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    Entry e = parse_entry(path, key, v, file, data_len);
    TORCH_CHECK(!entries_.count(key), path, ": tensor '", key, "' also appears in ",
                files_[entries_[key].file]);
    ranges.emplace_back(e.begin, e.end);
    entries_[key] = std::move(e);
  }
  check_ranges_tile(path, std::move(ranges), data_len);
}

void Reader::read(const std::string& name, uint64_t offset, uint64_t n, void* out) const {
  auto it = entries_.find(name);
  TORCH_CHECK(it != entries_.end(), "no tensor '", name, "' in ", files_.empty() ? "" : files_[0]);
  const Entry& e = it->second;
  TORCH_CHECK(offset + n <= e.end - e.begin, "internal: read past tensor '", name, "'");
  read_all(fds_[e.file], data_start_[e.file] + e.begin + offset, out, n, files_[e.file]);
}

}  // namespace fsdp::st
