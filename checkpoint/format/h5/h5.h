#pragma once
// A small RAII layer over HDF5's C API for the checkpoint code: files, groups,
// attributes, checksummed datasets and range reads. Every failure throws a c10::Error
// that names the file, the object and HDF5's own reason. No LibTorch here.

#include <fsdp/checkpoint_format.h>

#include <hdf5.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::h5 {

/// An HDF5 identifier with its close function; move-only.
class Obj {
 public:
  Obj() = default;
  Obj(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  Obj(Obj&& o) noexcept : id_(std::exchange(o.id_, -1)), close_(o.close_) {}
  Obj& operator=(Obj&& o) noexcept;
  Obj(const Obj&) = delete;
  Obj& operator=(const Obj&) = delete;
  ~Obj();
  hid_t id() const { return id_; }
  operator hid_t() const { return id_; }
  bool valid() const { return id_ >= 0; }

 private:
  hid_t id_ = -1;
  herr_t (*close_)(hid_t) = nullptr;
};

/// Element types in files.
enum class Elem { kF32, kF16, kBF16, kF64, kI64, kU8 };
const char* elem_name(Elem e);
hid_t file_type(Elem e);  ///< owned by this module; do not close
hid_t mem_type(Elem e);   ///< native in-memory type (bf16 uses the file layout)

/// Converts `n` elements between float32 and a 16-bit float or float64 (Note [Float
/// conversion] in h5_convert.cpp): narrowing rounds to nearest, ties to even, as torch's
/// Tensor::to does, and gives 16-bit floats one quiet NaN (per sign for fp16); widening
/// is exact. Equal types copy. Other pairs throw.
void convert(const void* src, Elem from, void* dst, Elem to, size_t n);
/// The one NaN each 16-bit type is stored with (fp16 keeps the sign bit, 0x8000).
constexpr uint16_t kBF16NaN = 0x7fc0;
constexpr uint16_t kF16NaN = 0x7e00;

/// Creates (truncating) a file; HDF5 object times are off so equal content gives equal bytes.
Obj create_file(const std::string& path);
/// Opens an existing file read-only; a missing, truncated or non-HDF5 file is an error
/// naming `path`.
Obj open_file(const std::string& path, size_t cache_bytes = 16u << 20);
/// Flushes the file and fsyncs it to disk.
void flush_and_sync(const Obj& file, const std::string& path);

Obj create_group(hid_t loc, const std::string& name, const std::string& where);
Obj open_group(hid_t loc, const std::string& name, const std::string& where);
bool exists(hid_t loc, const std::string& name);
/// Names of the direct children of a group, in creation order when tracked, else name order.
std::vector<std::string> children(hid_t group, const std::string& where);

void set_attr(hid_t obj, const std::string& name, const ckpt::AttrValue& v);
bool has_attr(hid_t obj, const std::string& name);
ckpt::AttrValue get_attr(hid_t obj, const std::string& name, const std::string& where);
int64_t get_int(hid_t obj, const std::string& name, const std::string& where);
double get_double(hid_t obj, const std::string& name, const std::string& where);
std::string get_string(hid_t obj, const std::string& name, const std::string& where);
std::vector<std::string> attr_names(hid_t obj, const std::string& where);

enum class Kind { kGroup, kDataset, kOther };
/// What the child `name` of `loc` is; an unreadable object is an error naming it. A soft
/// or external link (our files hold none) is kOther: it is not followed.
Kind kind_of(hid_t loc, const std::string& name, const std::string& where);
/// The identity of object `obj` in its file (its header's address): the same for every
/// link that reaches it, so a walk can tell a group it has already entered.
std::string object_id(hid_t obj, const std::string& where);

/// Writes a dataset of `shape` from `data` (laid out as `mem`), stored as `file`:
/// contiguous, with block CRC32C checksums (Note [Block checksums] in h5_checksums.cpp).
void write(hid_t loc, const std::string& name, const void* data, Elem mem, Elem file,
           const std::vector<int64_t>& shape, const std::string& where);
/// Datasets whose bytes are written after the file's structure, straight to the disk
/// (Note [Direct I/O] in h5_direct.cpp): add() creates each one contiguous, its space
/// allocated and nothing written; write_all() writes every one's bytes at its place in the
/// file, bypassing the page cache, and their checksums, as write() would have. The file
/// must be made by create_file (its large objects start on a page) and still be open.
class DirectDatasets {
 public:
  /// Elements [first, first + count) of a dataset, as stored (`file`), at `data`.
  struct Segment {
    int64_t first = 0, count = 0;
    const void* data = nullptr;
  };
  /// `data` holds the dataset's elements as stored (`file`), and must stay valid until
  /// write_all.
  void add(hid_t loc, const std::string& name, const void* data, Elem file,
           const std::vector<int64_t>& shape, const std::string& where);
  /// The same from pieces in memory (in order, not overlapping); the elements no segment
  /// covers are zeros.
  void add_segments(hid_t loc, const std::string& name, std::vector<Segment> segments, Elem file,
                    const std::vector<int64_t>& shape, const std::string& where);
  /// Writes them into `path`, the file holding them; returns the bytes written.
  int64_t write_all(const std::string& path);

 private:
  struct Pending {
    Obj ds;
    std::vector<Segment> segments;
    int64_t numel;
    size_t elem;
    uint64_t offset;
    std::string where, name;
    std::vector<uint32_t> crcs;
  };
  std::vector<Pending> pending_;
};
/// Stops the read-ahead that checked reads of large datasets keep going between calls
/// (Note [Direct I/O]), freeing its buffers and closing its file: call once a load is done.
void end_read_ahead();
/// Whether checked reads of `path`'s large contiguous datasets bypass the page cache
/// (Note [Direct I/O]): its file system takes O_DIRECT and FSDP_CHECKPOINT_O_DIRECT is not 0.
bool direct_reads(const std::string& path);
/// Datasets of at least this many bytes are worth writing with DirectDatasets.
constexpr int64_t kDirectMinBytes = int64_t{1} << 20;

void write_strings(hid_t loc, const std::string& name, const std::vector<std::string>& v,
                   const std::string& where);
void write_i64(hid_t loc, const std::string& name, const std::vector<int64_t>& v,
               const std::string& where);

/// Shape and stored element type of a dataset.
std::vector<int64_t> shape_of(hid_t loc, const std::string& name, const std::string& where);
/// The element count of dataset `name`'s `shape` (read from a file, so corrupt in a
/// damaged one): a product past int64 is an error naming `where` and `name`.
int64_t numel_of(const std::vector<int64_t>& shape, const std::string& where,
                 const std::string& name);
/// Checks that `numel` elements of `elem` bytes fit in the file holding `loc`, before
/// anything is sized by a count read from that file (our datasets are never compressed).
void check_fits_in_file(hid_t loc, const std::string& name, int64_t numel, size_t elem,
                        const std::string& where);
Elem elem_of(hid_t loc, const std::string& name, const std::string& where);
/// Reads elements [begin, begin + count) of the dataset in row-major order into `out`
/// (as `mem`), with hyperslab selections; every checksum block the range touches is read
/// and verified.
void read_range(hid_t loc, const std::string& name, int64_t begin, int64_t count, void* out,
                Elem mem, const std::string& where);
/// Reads the whole dataset and verifies its checksums; false when it has none.
bool verify(hid_t loc, const std::string& name, const std::string& where);
std::vector<std::string> read_strings(hid_t loc, const std::string& name, const std::string& where);
std::vector<int64_t> read_i64(hid_t loc, const std::string& name, const std::string& where);

/// HDF5's reason for the last failure (its error stack), one line.
std::string reason();

}  // namespace fsdp::h5
