#pragma once
// Safetensors files: our own writer and reader of the format inference tools load
// (Note [Safetensors] in safetensors.cpp). No LibTorch and no HDF5 here: callers hand
// over bytes already in the file's dtype.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::st {

/// One tensor of a file: its name, safetensors dtype ("F32", "BF16", "F16", "I64", ...)
/// and shape.
struct Spec {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
};

/// Bytes per element of a safetensors dtype; throws naming the dtype when unknown.
size_t dtype_size(const std::string& dtype);
/// Bytes of a tensor's data.
uint64_t nbytes(const Spec& spec);

/// One output file of an export: its name and its tensors (indices into the specs), in
/// the order their data is written.
struct FilePlan {
  std::string name;
  std::vector<size_t> tensors;
  uint64_t data_bytes = 0;
};

/// Splits `specs`, in order, over files as Hugging Face does
/// (split_torch_state_dict_into_shards): a new file starts when the next tensor would take
/// the current one over `max_shard_size` bytes, and a tensor larger than that is alone
/// in its file. One file is "model.safetensors"; N files are
/// "model-00001-of-0000N.safetensors", ... Throws for max_shard_size 0.
std::vector<FilePlan> plan_files(const std::vector<Spec>& specs, uint64_t max_shard_size);

/// The first bytes of a file holding `specs[order...]` in that order: the 8-byte
/// little-endian header length, then the JSON header ("__metadata__" first when
/// `metadata` is not empty), padded with spaces to a multiple of 8 bytes so that the data
/// starts aligned.
std::string header_bytes(const std::vector<Spec>& specs, const std::vector<size_t>& order,
                         const std::map<std::string, std::string>& metadata);

/// model.safetensors.index.json for a multi-file export: metadata.total_size (bytes of
/// tensor data) and weight_map (tensor name -> file name).
std::string index_json(const std::vector<Spec>& specs, const std::vector<FilePlan>& files);

/// Writes one file under a temporary name ("<path>.tmp"): the header, then each tensor's
/// bytes in order. finish() checks that exactly the planned bytes arrived and fsyncs;
/// publish() renames it into place. Destroyed before publish(), it removes the
/// temporary file.
class FileWriter {
 public:
  FileWriter(std::string path, const std::string& header, uint64_t data_bytes);
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;
  void append(const void* data, size_t n);
  void finish();
  void publish();

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  bool finished_ = false, published_ = false;
  uint64_t expected_ = 0, written_ = 0;
};

/// An export directory: model.safetensors, or model-0000k-of-0000N.safetensors and
/// model.safetensors.index.json (plan_files). Tensors arrive in `specs` order through
/// add(); every file is written under a temporary name and published by finish(), the
/// index last, after which files of an earlier export that this one does not replace
/// are removed. Destroyed before finish(), it leaves no new file behind.
class DirWriter {
 public:
  DirWriter(std::string dir, std::vector<Spec> specs, std::map<std::string, std::string> metadata,
            uint64_t max_shard_size);
  /// The bytes of tensor `index` (the next one in order), in its dtype.
  void add(size_t index, const void* data, uint64_t n);
  void finish();
  const std::vector<FilePlan>& files() const { return files_; }

 private:
  std::string dir_;
  std::vector<Spec> specs_;
  std::map<std::string, std::string> metadata_;
  std::vector<FilePlan> files_;
  std::vector<std::unique_ptr<FileWriter>> writers_;
  size_t next_ = 0;     ///< the tensor add() expects
  size_t file_ = 0;     ///< the file being written
  size_t in_file_ = 0;  ///< tensors of it written so far
};

/// Where one tensor lives: its file (index into Reader::files()), dtype, shape and data
/// range relative to the end of that file's header.
struct Entry {
  size_t file = 0;
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

/// Reads a single .safetensors file, or a model.safetensors.index.json with the files it
/// names, or a directory holding either. Every header is checked against the format's
/// rules (size, JSON, dtypes, shapes against offsets, offsets contiguous and inside the
/// file); a violation throws naming the file and the rule.
class Reader {
 public:
  explicit Reader(const std::string& path);
  ~Reader();
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  const std::map<std::string, Entry>& entries() const { return entries_; }
  /// The "__metadata__" of the first file (string values).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::vector<std::string>& files() const { return files_; }
  /// Reads `n` bytes of tensor `name`'s data starting at byte `offset` into `out`.
  void read(const std::string& name, uint64_t offset, uint64_t n, void* out) const;

 private:
  void open(const std::string& path);
  void open_file(const std::string& path, bool take_metadata);

  std::vector<std::string> files_;
  std::vector<int> fds_;
  std::vector<uint64_t> data_start_;  ///< byte where each file's data begins
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

/// True when `path` names safetensors data: a .safetensors file, an .index.json, or a
/// directory holding model.safetensors or model.safetensors.index.json.
bool is_safetensors(const std::string& path);

}  // namespace fsdp::st
