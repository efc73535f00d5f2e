// HDF5 helpers for checkpoints (see h5.h).
#include "h5.h"
#include "crc32c.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <thread>

namespace fsdp::h5 {

/// Longest fixed-length string attribute a reader accepts: ours are names and short
/// values; a larger size read from a file means the file is corrupted.
constexpr size_t kMaxStringAttr = size_t{1} << 20;
namespace {

// HDF5 prints its error stack to stderr by default; the checkpoint code reports errors
// itself, with HDF5's reason folded into one line.
void quiet() {
  static std::once_flag once;
  std::call_once(once, [] { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); });
}

herr_t collect(unsigned n, const H5E_error2_t* e, void* data) {
  auto* out = static_cast<std::string*>(data);
  if (e->desc && *e->desc) {
    if (!out->empty()) *out += "; ";
    *out += e->desc;
  }
  return 0;
}

hid_t make_bf16() {
  // bfloat16: IEEE single precision with the low 16 mantissa bits dropped.
  hid_t t = H5Tcopy(H5T_IEEE_F32LE);
  H5Tset_fields(t, 15, 7, 8, 0, 7);
  H5Tset_precision(t, 16);
  H5Tset_size(t, 2);
  H5Tset_ebias(t, 127);
  return t;
}

hid_t bf16_type() {
  static hid_t t = make_bf16();
  return t;
}

Obj dataset(hid_t loc, const std::string& name, const std::string& where) {
  quiet();
  // Our writers make hard links only; a soft or external link in a damaged file could
  // name any object, or any file on this machine, and is not followed.
  H5L_info_t link{};
  if (H5Lget_info(loc, name.c_str(), &link, H5P_DEFAULT) < 0) {
    H5Eclear2(H5E_DEFAULT);  // missing: H5Dopen2 says so below
  } else if (link.type != H5L_TYPE_HARD) {
    TORCH_CHECK(false, where, ": '", name, "' is ", link.type == H5L_TYPE_SOFT ? "a soft" : "an external",
                " link, not a dataset: checkpoint files hold none, the file is corrupted");
  }
  hid_t id = H5Dopen2(loc, name.c_str(), H5P_DEFAULT);
  TORCH_CHECK(id >= 0, where, ": dataset '", name, "' is missing or unreadable (", reason(), ")");
  return Obj(id, H5Dclose);
}

Obj space_of(const Obj& ds) { return Obj(H5Dget_space(ds), H5Sclose); }

// Boxes (start, count) covering linear elements [a, b) of a row-major array of `dims`.
void boxes(const std::vector<hsize_t>& dims, size_t d, std::vector<hsize_t> prefix, hsize_t a, hsize_t b,
           std::vector<std::pair<std::vector<hsize_t>, std::vector<hsize_t>>>& out) {
  if (a >= b) return;
  const size_t n = dims.size();
  hsize_t row = 1;
  for (size_t i = d + 1; i < n; ++i) row *= dims[i];
  auto emit = [&](hsize_t first, hsize_t count) {
    std::vector<hsize_t> start(prefix), cnt(prefix.size(), 1);
    start.push_back(first);
    cnt.push_back(count);
    for (size_t i = d + 1; i < n; ++i) {
      start.push_back(0);
      cnt.push_back(dims[i]);
    }
    out.emplace_back(std::move(start), std::move(cnt));
  };
  if (d + 1 == n) {
    emit(a, b - a);
    return;
  }
  hsize_t ra = a / row, rb = b / row;
  if (ra == rb) {  // inside one row
    prefix.push_back(ra);
    boxes(dims, d + 1, prefix, a % row, b % row, out);
    return;
  }
  if (a % row != 0) {
    auto p = prefix;
    p.push_back(ra);
    boxes(dims, d + 1, p, a % row, row, out);
    ++ra;
  }
  if (rb > ra) emit(ra, rb - ra);
  if (b % row != 0) {
    prefix.push_back(rb);
    boxes(dims, d + 1, prefix, 0, b % row, out);
  }
}

// Reads or writes elements [first, first + n) of a dataset, in row-major order, through
// a 1-D memory buffer of `type`.
herr_t io_linear(hid_t ds, hid_t fspace, const std::vector<hsize_t>& dims, int64_t first, int64_t n, void* buf,
                 hid_t type, bool write) {
  hsize_t count = static_cast<hsize_t>(n);
  Obj mspace(H5Screate_simple(1, &count, nullptr), H5Sclose);
  hsize_t numel = 1;
  for (hsize_t d : dims) numel *= d;
  const bool all = dims.empty() || (first == 0 && count == numel);
  if (!all) {
    std::vector<std::pair<std::vector<hsize_t>, std::vector<hsize_t>>> bx;
    boxes(dims, 0, {}, static_cast<hsize_t>(first), static_cast<hsize_t>(first + n), bx);
    bool first_box = true;
    for (auto& b : bx) {
      H5Sselect_hyperslab(fspace, first_box ? H5S_SELECT_SET : H5S_SELECT_OR, b.first.data(), nullptr,
                          b.second.data(), nullptr);
      first_box = false;
    }
  }
  const hid_t ms = all ? H5S_ALL : mspace.id();
  const hid_t fs = all ? H5S_ALL : fspace;
  return write ? H5Dwrite(ds, type, ms, fs, H5P_DEFAULT, buf) : H5Dread(ds, type, ms, fs, H5P_DEFAULT, buf);
}

// Note [Block checksums]
// Every dataset with elements carries CRC32C checksums of its bytes as stored, one per
// block of at least 4 MiB (at most 8192 blocks), in the attributes fsdp_crc32c (uint32
// array) and fsdp_crc_block (block size in bytes). Readers verify every block a read
// touches, so a range read (resharding) checks only what it reads. Contiguous storage
// with our own checksum instead of HDF5's chunked Fletcher32 filter lets HDF5 move data
// straight between the file and the caller's buffer: the filter pipeline copied every
// chunk and ran at about a quarter of raw write speed.
constexpr const char* kCrcAttr = "fsdp_crc32c";
constexpr const char* kCrcBlockAttr = "fsdp_crc_block";

size_t block_bytes(size_t total, size_t esize) {
  size_t b = std::max<size_t>(4u << 20, (total + 8191) / 8192);
  const size_t unit = 64 * esize;  // whole elements, and whole 32-byte lanes
  return (b + unit - 1) / unit * unit;
}

std::vector<uint32_t> read_crcs(hid_t ds, const std::string& where, const std::string& name) {
  if (H5Aexists(ds, kCrcAttr) <= 0) {
    H5Eclear2(H5E_DEFAULT);
    return {};
  }
  Obj a(H5Aopen(ds, kCrcAttr, H5P_DEFAULT), H5Aclose);
  Obj sp(H5Aget_space(a), H5Sclose);
  const hssize_t n = H5Sget_simple_extent_npoints(sp);
  // The count comes from the file and sizes the allocation below.
  check_fits_in_file(ds, name + "'s checksums", n, sizeof(uint32_t), where);
  std::vector<uint32_t> out(static_cast<size_t>(std::max<hssize_t>(n, 0)));
  TORCH_CHECK(n > 0 && H5Aread(a, H5T_NATIVE_UINT32, out.data()) >= 0, where, ": the checksums of dataset '", name,
              "' are unreadable: the file is corrupted");
  return out;
}

}  // namespace

std::string reason() {
  std::string out;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, collect, &out);
  H5Eclear2(H5E_DEFAULT);
  for (char& c : out) {
    if (c == '\n') c = ' ';  // HDF5 embeds ctime()'s newline in some messages
  }
  return out.empty() ? "no detail from HDF5" : out;
}

Obj& Obj::operator=(Obj&& o) noexcept {
  if (this != &o) {
    if (id_ >= 0 && close_) close_(id_);
    id_ = std::exchange(o.id_, -1);
    close_ = o.close_;
  }
  return *this;
}

Obj::~Obj() {
  if (id_ >= 0 && close_) close_(id_);
}

const char* elem_name(Elem e) {
  switch (e) {
    case Elem::kF32: return "float32";
    case Elem::kF16: return "float16";
    case Elem::kBF16: return "bfloat16";
    case Elem::kF64: return "float64";
    case Elem::kI64: return "int64";
    case Elem::kU8: return "uint8";
  }
  return "?";
}

hid_t file_type(Elem e) {
  quiet();
  switch (e) {
    case Elem::kF32: return H5T_IEEE_F32LE;
    case Elem::kF16: {
      static hid_t t = [] {
        hid_t h = H5Tcopy(H5T_IEEE_F32LE);  // IEEE half: 1 sign, 5 exponent, 10 mantissa bits
        H5Tset_fields(h, 15, 10, 5, 0, 10);
        H5Tset_precision(h, 16);
        H5Tset_size(h, 2);
        H5Tset_ebias(h, 15);
        return h;
      }();
      return t;
    }
    case Elem::kBF16: return bf16_type();
    case Elem::kF64: return H5T_IEEE_F64LE;
    case Elem::kI64: return H5T_STD_I64LE;
    case Elem::kU8: return H5T_STD_U8LE;
  }
  return -1;
}

// Note [Float conversion]
// No float conversion is left to HDF5: its conversion of float32 to 16-bit floats
// rounds ties away from zero, where torch's Tensor::to rounds them to even, so an export
// differed from `tensor.to(dtype)` in the last bit of every exact tie (seen on an Intel
// Xeon, where such ties came up in a GPT's weights). The conversions here are c10's
// scalar ones, which Tensor::to's vectorized loops match bit for bit: round to nearest
// even, also into subnormals and to infinity on overflow. NaN is the one value whose
// bits differ between LibTorch versions (bf16: 0xffff in 1.13's vectorized path, 0x7fc0
// in 2.6's); here it is always the quiet NaN of c10's scalar rule, 0x7fc0 (bf16) or
// 0x7e00 (fp16), with the sign of the input for fp16. c10 only: the offline tools use it.
void convert(const void* src, Elem from, void* dst, Elem to, size_t n) {
  if (from == to) {
    std::memcpy(dst, src, n * H5Tget_size(mem_type(from)));
    return;
  }
  const bool half = from == Elem::kBF16 || from == Elem::kF16 || to == Elem::kBF16 || to == Elem::kF16;
  if (from == Elem::kF32 && half) {
    const auto* in = static_cast<const float*>(src);
    auto* out = static_cast<uint16_t*>(dst);
    // NaN is set here, not left to c10: with F16C, c10::Half keeps NaN payloads.
    if (to == Elem::kBF16) {
      for (size_t i = 0; i < n; ++i) out[i] = std::isnan(in[i]) ? kBF16NaN : c10::BFloat16(in[i]).x;
    } else {
      for (size_t i = 0; i < n; ++i) {
        out[i] = std::isnan(in[i]) ? static_cast<uint16_t>(kF16NaN | (std::signbit(in[i]) ? 0x8000 : 0))
                                    : c10::Half(in[i]).x;
      }
    }
  } else if (to == Elem::kF32 && half) {
    const auto* in = static_cast<const uint16_t*>(src);
    auto* out = static_cast<float*>(dst);
    if (from == Elem::kBF16) {
      for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(c10::BFloat16(in[i], c10::BFloat16::from_bits()));
    } else {
      for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(c10::Half(in[i], c10::Half::from_bits()));
    }
  } else if (from == Elem::kF64 && to == Elem::kF32) {
    // A float64 buffer (or another writer's float64 dataset) read as float32: the C++
    // cast rounds to nearest even, as Tensor::to does.
    const auto* in = static_cast<const double*>(src);
    auto* out = static_cast<float*>(dst);
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]);
  } else if (from == Elem::kF32 && to == Elem::kF64) {
    const auto* in = static_cast<const float*>(src);
    auto* out = static_cast<double*>(dst);
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<double>(in[i]);
  } else {
    TORCH_CHECK(false, "cannot convert ", elem_name(from), " to ", elem_name(to));
  }
}

namespace {
// convert(), with an error that names the file and the dataset.
void convert_named(const void* src, Elem from, void* dst, Elem to, size_t n, const std::string& where,
                   const std::string& name) {
  try {
    convert(src, from, dst, to, n);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, where, ": dataset '", name, "': ", e.what_without_backtrace());
  }
}
}  // namespace

hid_t mem_type(Elem e) {
  switch (e) {
    case Elem::kF32: return H5T_NATIVE_FLOAT;
    case Elem::kF64: return H5T_NATIVE_DOUBLE;
    case Elem::kI64: return H5T_NATIVE_INT64;
    case Elem::kU8: return H5T_NATIVE_UINT8;
    default: return file_type(e);  // 16-bit floats: memory layout is the little-endian file layout
  }
}

Obj create_file(const std::string& path) {
  quiet();
  Obj fcpl(H5Pcreate(H5P_FILE_CREATE), H5Pclose);
  H5Pset_link_creation_order(fcpl, H5P_CRT_ORDER_TRACKED | H5P_CRT_ORDER_INDEXED);
  hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, fcpl, H5P_DEFAULT);
  TORCH_CHECK(f >= 0, "cannot create checkpoint file ", path, ": ", reason(),
              ". Check that the directory exists, is writable and has free space.");
  return Obj(f, H5Fclose);
}

Obj open_file(const std::string& path, size_t cache_bytes) {
  quiet();
  struct stat st {};
  TORCH_CHECK(::stat(path.c_str(), &st) == 0, "checkpoint file ", path, " does not exist");
  htri_t is = H5Fis_hdf5(path.c_str());
  TORCH_CHECK(is > 0, "checkpoint file ", path, " (", st.st_size,
              " bytes) is not an HDF5 file: it is truncated or corrupted (", reason(), ")");
  Obj fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  // Chunks are 4 MB; a cache of a few lets range reads that share a chunk read it once.
  H5Pset_cache(fapl, 0, 521, cache_bytes, 1.0);
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl);
  TORCH_CHECK(f >= 0, "checkpoint file ", path, " (", st.st_size,
              " bytes) cannot be opened: it is truncated or corrupted (", reason(), ")");
  return Obj(f, H5Fclose);
}

void flush_and_sync(const Obj& file, const std::string& path) {
  TORCH_CHECK(H5Fflush(file, H5F_SCOPE_GLOBAL) >= 0, "cannot flush ", path, ": ", reason());
  int fd = ::open(path.c_str(), O_RDONLY);
  TORCH_CHECK(fd >= 0, "cannot open ", path, " to fsync it");
  const int rc = ::fsync(fd);
  ::close(fd);
  TORCH_CHECK(rc == 0, "fsync of ", path, " failed: the disk may be full or failing");
}

Obj create_group(hid_t loc, const std::string& name, const std::string& where) {
  quiet();
  Obj gcpl(H5Pcreate(H5P_GROUP_CREATE), H5Pclose);
  H5Pset_link_creation_order(gcpl, H5P_CRT_ORDER_TRACKED | H5P_CRT_ORDER_INDEXED);
  hid_t g = H5Gcreate2(loc, name.c_str(), H5P_DEFAULT, gcpl, H5P_DEFAULT);
  TORCH_CHECK(g >= 0, where, ": cannot create group '", name, "': ", reason());
  return Obj(g, H5Gclose);
}

Obj open_group(hid_t loc, const std::string& name, const std::string& where) {
  quiet();
  hid_t g = H5Gopen2(loc, name.c_str(), H5P_DEFAULT);
  TORCH_CHECK(g >= 0, where, ": group '", name, "' is missing or unreadable (", reason(), ")");
  return Obj(g, H5Gclose);
}

bool exists(hid_t loc, const std::string& name) {
  quiet();
  // Check each path component, as H5Lexists requires.
  size_t pos = 0;
  while (true) {
    size_t next = name.find('/', pos);
    std::string prefix = name.substr(0, next);
    if (!prefix.empty() && H5Lexists(loc, prefix.c_str(), H5P_DEFAULT) <= 0) {
      H5Eclear2(H5E_DEFAULT);
      return false;
    }
    if (next == std::string::npos) return true;
    pos = next + 1;
  }
}

// Note [Listing a group]
// One iteration in the index's native order, sorted here: for a group of more than 8
// links (dense storage: a B-tree over a heap), an ordered request (H5_ITER_INC, or
// H5Lget_name_by_idx) makes libhdf5 1.10 first build a table of every link, which costs
// a table per name asked for, and whose error path frees uninitialized entries when a
// corrupt heap object stops the build (a crash inside libhdf5 that fuzzing hit in most of
// its malformed consolidated files). The native walk of the creation-order B-tree
// builds no table; a damaged link is then an error.
std::vector<std::string> children(hid_t group, const std::string& where) {
  quiet();
  struct Link {
    std::string name;
    int64_t corder;
  };
  struct Walk {
    std::vector<Link> links;
    bool corder_valid = true;
  };
  auto collect = [](hid_t, const char* name, const H5L_info_t* info, void* data) -> herr_t {
    auto* w = static_cast<Walk*>(data);
    w->links.push_back({name, info->corder});
    w->corder_valid = w->corder_valid && info->corder_valid;
    return 0;
  };
  Walk w;
  hsize_t idx = 0;
  if (H5Literate(group, H5_INDEX_CRT_ORDER, H5_ITER_NATIVE, &idx, collect, &w) < 0) {
    // Creation order not tracked (a file from another writer): name order.
    H5Eclear2(H5E_DEFAULT);
    w = Walk{};
    w.corder_valid = false;
    idx = 0;
    TORCH_CHECK(H5Literate(group, H5_INDEX_NAME, H5_ITER_NATIVE, &idx, collect, &w) >= 0, where,
                ": cannot list group: ", reason());
  }
  if (w.corder_valid) {
    std::stable_sort(w.links.begin(), w.links.end(), [](const Link& a, const Link& b) { return a.corder < b.corder; });
  } else {
    std::sort(w.links.begin(), w.links.end(), [](const Link& a, const Link& b) { return a.name < b.name; });
  }
  std::vector<std::string> out;
  out.reserve(w.links.size());
  for (auto& l : w.links) out.push_back(std::move(l.name));
  return out;
}

void set_attr(hid_t obj, const std::string& name, const AttrValue& v) {
  quiet();
  if (H5Aexists(obj, name.c_str()) > 0) H5Adelete(obj, name.c_str());
  Obj space(H5Screate(H5S_SCALAR), H5Sclose);
  hid_t a = -1;
  if (const auto* i = std::get_if<int64_t>(&v)) {
    a = H5Acreate2(obj, name.c_str(), H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT);
    if (a >= 0) H5Awrite(a, H5T_NATIVE_INT64, i);
  } else if (const auto* d = std::get_if<double>(&v)) {
    a = H5Acreate2(obj, name.c_str(), H5T_IEEE_F64LE, space, H5P_DEFAULT, H5P_DEFAULT);
    if (a >= 0) H5Awrite(a, H5T_NATIVE_DOUBLE, d);
  } else {
    // Variable-length UTF-8: h5py reads it as str.
    const char* s = std::get<std::string>(v).c_str();
    Obj t(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(t, H5T_VARIABLE);
    H5Tset_cset(t, H5T_CSET_UTF8);
    a = H5Acreate2(obj, name.c_str(), t, space, H5P_DEFAULT, H5P_DEFAULT);
    if (a >= 0) H5Awrite(a, t, &s);
  }
  TORCH_CHECK(a >= 0, "cannot write attribute '", name, "': ", reason());
  H5Aclose(a);
}

bool has_attr(hid_t obj, const std::string& name) {
  quiet();
  htri_t r = H5Aexists(obj, name.c_str());
  if (r < 0) H5Eclear2(H5E_DEFAULT);
  return r > 0;
}

AttrValue get_attr(hid_t obj, const std::string& name, const std::string& where) {
  quiet();
  TORCH_CHECK(has_attr(obj, name), where, ": attribute '", name, "' is missing");
  Obj a(H5Aopen(obj, name.c_str(), H5P_DEFAULT), H5Aclose);
  TORCH_CHECK(a.valid(), where, ": attribute '", name, "' is unreadable (", reason(), ")");
  // The value is read into one variable below: H5Aread writes every value the
  // attribute's dataspace holds, so a corrupt one of several values overflowed it.
  Obj space(H5Aget_space(a), H5Sclose);
  const hssize_t values = H5Sget_simple_extent_npoints(space);
  TORCH_CHECK(values == 1, where, ": attribute '", name, "' holds ", values,
              " values where one is expected: the file is corrupted");
  Obj t(H5Aget_type(a), H5Tclose);
  switch (H5Tget_class(t)) {
    case H5T_INTEGER: {
      int64_t v = 0;
      TORCH_CHECK(H5Aread(a, H5T_NATIVE_INT64, &v) >= 0, where, ": attribute '", name, "': ", reason());
      return v;
    }
    case H5T_FLOAT: {
      double v = 0;
      TORCH_CHECK(H5Aread(a, H5T_NATIVE_DOUBLE, &v) >= 0, where, ": attribute '", name, "': ", reason());
      return v;
    }
    case H5T_STRING: {
      if (H5Tis_variable_str(t) > 0) {  // e.g. written by h5py
        char* s = nullptr;
        Obj mt(H5Tcopy(H5T_C_S1), H5Tclose);
        H5Tset_size(mt, H5T_VARIABLE);
        H5Tset_cset(mt, H5Tget_cset(t));
        TORCH_CHECK(H5Aread(a, mt, &s) >= 0, where, ": attribute '", name, "': ", reason());
        std::string out = s ? s : "";
        H5free_memory(s);
        return out;
      }
      // The size comes from the file: a corrupt one asked for 660 GB (found by fuzzing).
      const size_t size = H5Tget_size(t);
      TORCH_CHECK(size > 0 && size <= kMaxStringAttr, where, ": attribute '", name, "' claims a string of ", size,
                  " bytes: the file is corrupted");
      std::string s(size, '\0');
      TORCH_CHECK(H5Aread(a, t, s.data()) >= 0, where, ": attribute '", name, "': ", reason());
      s.resize(std::strlen(s.c_str()));
      return s;
    }
    default:
      TORCH_CHECK(false, where, ": attribute '", name, "' has an unsupported type");
  }
}

int64_t get_int(hid_t obj, const std::string& name, const std::string& where) {
  AttrValue v = get_attr(obj, name, where);
  TORCH_CHECK(std::holds_alternative<int64_t>(v), where, ": attribute '", name, "' should be an integer");
  return std::get<int64_t>(v);
}

double get_double(hid_t obj, const std::string& name, const std::string& where) {
  AttrValue v = get_attr(obj, name, where);
  if (const auto* i = std::get_if<int64_t>(&v)) return static_cast<double>(*i);
  TORCH_CHECK(std::holds_alternative<double>(v), where, ": attribute '", name, "' should be a number");
  return std::get<double>(v);
}

std::string get_string(hid_t obj, const std::string& name, const std::string& where) {
  AttrValue v = get_attr(obj, name, where);
  TORCH_CHECK(std::holds_alternative<std::string>(v), where, ": attribute '", name, "' should be a string");
  return std::get<std::string>(v);
}

std::vector<std::string> attr_names(hid_t obj, const std::string& where) {
  // H5Aiterate2 has one signature in HDF5 1.10 and 1.14 (H5Oget_info does not).
  std::vector<std::string> out;
  auto collect = [](hid_t, const char* name, const H5A_info_t*, void* data) -> herr_t {
    static_cast<std::vector<std::string>*>(data)->emplace_back(name);
    return 0;
  };
  hsize_t idx = 0;
  TORCH_CHECK(H5Aiterate2(obj, H5_INDEX_NAME, H5_ITER_INC, &idx, collect, &out) >= 0, where, ": ", reason());
  return out;
}

Kind kind_of(hid_t loc, const std::string& name, const std::string& where) {
  quiet();
  // A soft or external link is not followed: our files hold none, and an external link in
  // a damaged file names any file on this machine.
  H5L_info_t link{};
  TORCH_CHECK(H5Lget_info(loc, name.c_str(), &link, H5P_DEFAULT) >= 0, where, ": link '", name,
              "' is unreadable: the file is corrupted (", reason(), ")");
  if (link.type != H5L_TYPE_HARD) return Kind::kOther;
  Obj o(H5Oopen(loc, name.c_str(), H5P_DEFAULT), H5Oclose);
  TORCH_CHECK(o.valid(), where, ": object '", name, "' is unreadable: the file is corrupted (", reason(), ")");
  switch (H5Iget_type(o)) {
    case H5I_GROUP: return Kind::kGroup;
    case H5I_DATASET: return Kind::kDataset;
    default: return Kind::kOther;
  }
}

std::string object_id(hid_t obj, const std::string& where) {
  // HDF5 1.12 replaced object addresses by tokens, and H5Oget_info2 by H5Oget_info3.
#if H5_VERSION_GE(1, 12, 0)
  H5O_info2_t info{};
  TORCH_CHECK(H5Oget_info3(obj, &info, H5O_INFO_BASIC) >= 0, where, ": unreadable object header (", reason(), ")");
  return std::string(reinterpret_cast<const char*>(&info.token), sizeof(info.token));
#else
  H5O_info_t info{};
  TORCH_CHECK(H5Oget_info2(obj, &info, H5O_INFO_BASIC) >= 0, where, ": unreadable object header (", reason(), ")");
  return std::to_string(info.addr);
#endif
}

void write(hid_t loc, const std::string& name, const void* data, Elem mem, Elem file,
           const std::vector<int64_t>& shape, const std::string& where) {
  quiet();
  std::vector<hsize_t> dims(shape.begin(), shape.end());
  Obj space = dims.empty() ? Obj(H5Screate(H5S_SCALAR), H5Sclose)
                           : Obj(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose);
  Obj dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  H5Pset_obj_track_times(dcpl, false);
  // Contiguous storage: HDF5 writes and reads it straight from and into the caller's
  // buffer. Integrity comes from our block checksums (Note [Block checksums]).
  Obj ds(H5Dcreate2(loc, name.c_str(), file_type(file), space, H5P_DEFAULT, dcpl, H5P_DEFAULT), H5Dclose);
  TORCH_CHECK(ds.valid(), where, ": cannot create dataset '", name, "': ", reason());
  int64_t numel = 1;
  for (hsize_t d : dims) numel *= static_cast<int64_t>(d);
  if (numel == 0) return;
  const size_t fsize = H5Tget_size(file_type(file));
  const size_t block = block_bytes(static_cast<size_t>(numel) * fsize, fsize);
  const int64_t per_block = static_cast<int64_t>(block / fsize);
  std::vector<uint32_t> crcs;
  if (mem == file) {
    const auto* bytes = static_cast<const uint8_t*>(data);
    const size_t total = static_cast<size_t>(numel) * fsize;
    for (size_t off = 0; off < total; off += block) crcs.push_back(crc_block(bytes + off, std::min(block, total - off)));
    TORCH_CHECK(H5Dwrite(ds, mem_type(mem), H5S_ALL, H5S_ALL, H5P_DEFAULT, data) >= 0, where,
                ": cannot write dataset '", name, "': ", reason(), ". Is the disk full?");
  } else {
    // Converted block by block (Note [Float conversion]), so the checksum covers the
    // bytes in the file.
    const size_t msize = H5Tget_size(mem_type(mem));
    std::vector<uint8_t> buf(static_cast<size_t>(per_block) * fsize);
    Obj fspace(H5Dget_space(ds), H5Sclose);
    for (int64_t first = 0; first < numel; first += per_block) {
      const int64_t n = std::min(per_block, numel - first);
      convert_named(static_cast<const uint8_t*>(data) + static_cast<size_t>(first) * msize, mem, buf.data(), file,
                    static_cast<size_t>(n), where, name);
      crcs.push_back(crc_block(buf.data(), static_cast<size_t>(n) * fsize));
      TORCH_CHECK(io_linear(ds, fspace, dims, first, n, buf.data(), file_type(file), /*write=*/true) >= 0, where,
                  ": cannot write dataset '", name, "': ", reason(), ". Is the disk full?");
    }
  }
  set_attr(ds, kCrcBlockAttr, static_cast<int64_t>(block));
  hsize_t nb = crcs.size();
  Obj aspace(H5Screate_simple(1, &nb, nullptr), H5Sclose);
  Obj attr(H5Acreate2(ds, kCrcAttr, H5T_STD_U32LE, aspace, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  TORCH_CHECK(attr.valid() && H5Awrite(attr, H5T_NATIVE_UINT32, crcs.data()) >= 0, where,
              ": cannot write the checksums of '", name, "': ", reason());
}

void write_strings(hid_t loc, const std::string& name, const std::vector<std::string>& v,
                   const std::string& where) {
  // Names joined by newlines in one uint8 dataset, so the checksum filter covers them
  // (variable-length strings live in a heap that Fletcher32 does not see).
  std::string joined;
  for (const auto& s : v) {
    TORCH_CHECK(s.find('\n') == std::string::npos, where, ": name '", s, "' contains a newline");
    joined += s;
    joined += '\n';
  }
  write(loc, name, joined.data(), Elem::kU8, Elem::kU8, {static_cast<int64_t>(joined.size())}, where);
}

void write_i64(hid_t loc, const std::string& name, const std::vector<int64_t>& v, const std::string& where) {
  write(loc, name, v.data(), Elem::kI64, Elem::kI64, {static_cast<int64_t>(v.size())}, where);
}

std::vector<int64_t> shape_of(hid_t loc, const std::string& name, const std::string& where) {
  Obj ds = dataset(loc, name, where);
  Obj space = space_of(ds);
  int nd = H5Sget_simple_extent_ndims(space);
  TORCH_CHECK(nd >= 0, where, ": dataset '", name, "' has no readable shape (", reason(), ")");
  std::vector<hsize_t> dims(static_cast<size_t>(nd));
  H5Sget_simple_extent_dims(space, dims.data(), nullptr);
  for (hsize_t d : dims) {
    TORCH_CHECK(d <= static_cast<hsize_t>(INT64_MAX), where, ": dataset '", name, "' claims a dimension of ", d,
                ": the file is corrupted");
  }
  return std::vector<int64_t>(dims.begin(), dims.end());
}

int64_t numel_of(const std::vector<int64_t>& shape, const std::string& where, const std::string& name) {
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(numel, d, &numel)) {
      std::string text;
      for (int64_t e : shape) text += (text.empty() ? "" : ", ") + std::to_string(e);
      TORCH_CHECK(false, where, ": dataset '", name, "' has shape [", text,
                  "]: more elements than fit in 64 bits, the file is corrupted");
    }
  }
  return numel;
}

Elem elem_of(hid_t loc, const std::string& name, const std::string& where) {
  Obj ds = dataset(loc, name, where);
  Obj t(H5Dget_type(ds), H5Tclose);
  const size_t size = H5Tget_size(t);
  switch (H5Tget_class(t)) {
    case H5T_FLOAT: {
      if (size == 4) return Elem::kF32;
      if (size == 8) return Elem::kF64;
      if (size == 2) {
        size_t spos, epos, esize, mpos, msize;
        H5Tget_fields(t, &spos, &epos, &esize, &mpos, &msize);
        return esize == 8 ? Elem::kBF16 : Elem::kF16;
      }
      break;
    }
    case H5T_INTEGER:
      return size == 1 ? Elem::kU8 : Elem::kI64;
    default:
      break;
  }
  TORCH_CHECK(false, where, ": dataset '", name, "' has an unsupported element type");
}

void read_range(hid_t loc, const std::string& name, int64_t begin, int64_t count, void* out, Elem mem,
                const std::string& where) {
  if (count <= 0) return;
  Obj ds = dataset(loc, name, where);
  Obj fspace = space_of(ds);
  int nd = H5Sget_simple_extent_ndims(fspace);
  std::vector<hsize_t> dims(static_cast<size_t>(std::max(nd, 0)));
  if (nd > 0) H5Sget_simple_extent_dims(fspace, dims.data(), nullptr);
  int64_t numel = 1;
  for (hsize_t d : dims) {
    // The dimensions come from the file: their product must not overflow (fuzzing).
    TORCH_CHECK(d <= static_cast<hsize_t>(INT64_MAX) && !__builtin_mul_overflow(numel, static_cast<int64_t>(d), &numel),
                where, ": dataset '", name, "' claims more elements than fit in 64 bits: the file is corrupted");
  }
  TORCH_CHECK(begin >= 0 && begin + count <= numel, where, ": dataset '", name, "' holds ", numel,
              " elements; elements [", begin, ", ", begin + count, ") were asked for");
  auto fail = [&](const std::string& what) {
    TORCH_CHECK(false, where, ": cannot read dataset '", name, "': ", what, " (", reason(), ")");
  };
  const std::vector<uint32_t> crcs = read_crcs(ds, where, name);
  if (crcs.empty()) {
    // No checksums (a file from another writer). HDF5 reads the elements in the file's
    // type (swapping bytes if need be); floats are then converted here (Note [Float
    // conversion]). Integers are widened by HDF5, which is exact.
    const Elem file = elem_of(loc, name, where);
    const bool floats = file != Elem::kI64 && file != Elem::kU8;
    if (mem == file || !floats) {
      if (io_linear(ds, fspace, dims, begin, count, out, mem_type(mem), /*write=*/false) < 0) {
        fail("the file is truncated or corrupted");
      }
      return;
    }
    std::vector<uint8_t> raw(static_cast<size_t>(count) * H5Tget_size(file_type(file)));
    if (io_linear(ds, fspace, dims, begin, count, raw.data(), file_type(file), /*write=*/false) < 0) {
      fail("the file is truncated or corrupted");
    }
    convert_named(raw.data(), file, out, mem, static_cast<size_t>(count), where, name);
    return;
  }
  Obj ftype(H5Dget_type(ds), H5Tclose);
  const Elem file = elem_of(loc, name, where);
  const size_t fsize = H5Tget_size(ftype), msize = H5Tget_size(mem_type(mem));
  // Elements are moved in the stored type (HDF5 converts nothing), into buffers sized
  // for `file`'s type: a stored size that differs (a 16-byte integer is elem_of's kI64)
  // wrote past them.
  TORCH_CHECK(fsize == H5Tget_size(file_type(file)), where, ": dataset '", name, "' stores ", elem_name(file),
              " elements of ", fsize, " bytes: the file is corrupted");
  // Checksummed datasets are ours, stored contiguous and uncompressed: all of them lies in
  // the file. A larger claim (a damaged dataspace) would have verify() read fill values
  // for as long as it claims.
  check_fits_in_file(loc, name, numel, fsize, where);
  const int64_t block = get_int(ds, kCrcBlockAttr, where);
  // Both come from the file; checked before dividing by them (fuzzing found a division
  // by zero for each).
  TORCH_CHECK(fsize > 0 && block >= static_cast<int64_t>(fsize), where, ": dataset '", name,
              "' has checksum blocks of ", block, " bytes for elements of ", fsize, " bytes: the file is corrupted");
  const int64_t per_block = block / static_cast<int64_t>(fsize);
  const int64_t blocks = numel / per_block + (numel % per_block != 0 ? 1 : 0);  // no overflow for a huge block
  TORCH_CHECK(per_block > 0 && static_cast<int64_t>(crcs.size()) == blocks, where, ": dataset '", name,
              "' has ", crcs.size(), " checksums for ", blocks, " blocks: the file is corrupted");
  // Every block the range touches is read whole and verified. The blocks that lie inside
  // the range and need no conversion are read straight into `out` with one read, then
  // verified on two threads; the (at most two) edge blocks and converted ones go
  // through a buffer.
  auto* dst = static_cast<uint8_t*>(out);
  auto check = [&](int64_t k, const uint8_t* buf, int64_t n) {
    if (crc_block(buf, static_cast<size_t>(n) * fsize) != crcs[static_cast<size_t>(k)]) {
      TORCH_CHECK(false, where, ": checksum mismatch in dataset '", name, "' (block ", k, " of ", blocks,
                  "): the file is corrupted");
    }
  };
  const int64_t k_first = begin / per_block, k_last = (begin + count - 1) / per_block;
  int64_t d0 = k_first, d1 = k_last + 1;  // direct blocks [d0, d1)
  if (mem != file) {
    d1 = d0;
  } else {
    if (begin % per_block != 0) ++d0;
    if ((begin + count) % per_block != 0 && begin + count != numel) --d1;
  }
  if (d1 > d0) {
    // Pieces of 4 blocks: while piece i is verified on a second thread, piece i + 1 is
    // read, so checking costs little more than reading.
    std::string error;
    auto verify_blocks = [&](int64_t from, int64_t to) {
      try {
        for (int64_t k = from; k < to; ++k) {
          const int64_t b0 = k * per_block;
          check(k, dst + static_cast<size_t>(b0 - begin) * fsize, std::min(per_block, numel - b0));
        }
      } catch (const c10::Error& e) {
        error = e.what_without_backtrace();
      }
    };
    std::thread verifier;
    for (int64_t p0 = d0; p0 < d1; p0 += 4) {
      const int64_t p1 = std::min(d1, p0 + 4);
      const int64_t e0 = p0 * per_block, e1 = std::min(p1 * per_block, numel);
      if (io_linear(ds, fspace, dims, e0, e1 - e0, dst + static_cast<size_t>(e0 - begin) * msize, ftype,
                    /*write=*/false) < 0) {
        if (verifier.joinable()) verifier.join();
        fail("the file is truncated or corrupted");
      }
      if (verifier.joinable()) verifier.join();
      verifier = std::thread(verify_blocks, p0, p1);
    }
    if (verifier.joinable()) verifier.join();
    TORCH_CHECK(error.empty(), error);
  }
  std::vector<uint8_t> tmp;
  for (int64_t k = k_first; k <= k_last; ++k) {
    if (k >= d0 && k < d1) continue;
    const int64_t b0 = k * per_block, n = std::min(per_block, numel - b0);
    const int64_t lo = std::max(begin, b0), hi = std::min(begin + count, b0 + n);
    // Sized by the block's elements, not per_block: the block size comes from the file.
    tmp.resize(static_cast<size_t>(n) * std::max(fsize, msize));
    if (io_linear(ds, fspace, dims, b0, n, tmp.data(), ftype, /*write=*/false) < 0) {
      fail("the file is truncated or corrupted");
    }
    check(k, tmp.data(), n);
    convert_named(tmp.data() + static_cast<size_t>(lo - b0) * fsize, file, dst + static_cast<size_t>(lo - begin) * msize,
                  mem, static_cast<size_t>(hi - lo), where, name);
  }
}

bool verify(hid_t loc, const std::string& name, const std::string& where) {
  Obj ds = dataset(loc, name, where);
  const int64_t numel = numel_of(shape_of(loc, name, where), where, name);
  if (numel == 0) return true;  // nothing to check
  if (read_crcs(ds, where, name).empty()) return false;
  const Elem e = elem_of(loc, name, where);
  std::vector<uint8_t> buf(static_cast<size_t>(std::min<int64_t>(numel, int64_t{1} << 20)) * 8);
  for (int64_t pos = 0; pos < numel; pos += int64_t{1} << 20) {
    read_range(loc, name, pos, std::min<int64_t>(int64_t{1} << 20, numel - pos), buf.data(), e, where);
  }
  return true;
}

// A table's length comes from the file and sizes an allocation before anything is read:
// a corrupt one asked for 660 GB (found by fuzzing). Tables are stored uncompressed, so
// one that claims more bytes than the whole file is corrupt.
void check_fits_in_file(hid_t loc, const std::string& name, int64_t numel, size_t elem, const std::string& where) {
  const hid_t fid = H5Iget_file_id(loc);
  hsize_t file_bytes = 0;
  const bool known = fid >= 0 && H5Fget_filesize(fid, &file_bytes) >= 0;
  if (fid >= 0) H5Fclose(fid);
  if (!known) return;
  TORCH_CHECK(numel >= 0 && static_cast<double>(numel) * static_cast<double>(elem) <= static_cast<double>(file_bytes),
              where, ": dataset '", name, "' claims ", numel, " elements of ", elem, " bytes in a file of ", file_bytes,
              " bytes: the file is corrupted");
}

std::vector<std::string> read_strings(hid_t loc, const std::string& name, const std::string& where) {
  auto shape = shape_of(loc, name, where);
  TORCH_CHECK(shape.size() == 1, where, ": dataset '", name, "' should be one-dimensional");
  check_fits_in_file(loc, name, shape[0], 1, where);
  std::string joined(static_cast<size_t>(shape[0]), '\0');
  read_range(loc, name, 0, shape[0], joined.data(), Elem::kU8, where);
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < joined.size()) {
    size_t nl = joined.find('\n', pos);
    TORCH_CHECK(nl != std::string::npos, where, ": dataset '", name, "' is malformed (no final newline)");
    out.push_back(joined.substr(pos, nl - pos));
    pos = nl + 1;
  }
  return out;
}

std::vector<int64_t> read_i64(hid_t loc, const std::string& name, const std::string& where) {
  auto shape = shape_of(loc, name, where);
  TORCH_CHECK(shape.size() == 1, where, ": dataset '", name, "' should be one-dimensional");
  check_fits_in_file(loc, name, shape[0], sizeof(int64_t), where);
  std::vector<int64_t> out(static_cast<size_t>(shape[0]));
  read_range(loc, name, 0, shape[0], out.data(), Elem::kI64, where);
  return out;
}

}  // namespace fsdp::h5
