// HDF5 helpers for checkpoints (see h5.h): errors, identifiers, element types, files,
// groups, links and attributes. Datasets are in h5_dataset.cpp (the map in h5_detail.h).
#include "h5_detail.h"

#include "../publish.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <mutex>

namespace fsdp::h5 {

/// Longest fixed-length string attribute a reader accepts: ours are names and short
/// values; a larger size read from a file means the file is corrupted.
constexpr size_t kMaxStringAttr = size_t{1} << 20;

namespace detail {
// HDF5 prints its error stack to stderr by default; the checkpoint code reports errors
// itself, with HDF5's reason folded into one line.
void quiet() {
  static std::once_flag once;
  std::call_once(once, [] { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); });
}
}  // namespace detail

using detail::quiet;

namespace {

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
    case Elem::kF32:
      return "float32";
    case Elem::kF16:
      return "float16";
    case Elem::kBF16:
      return "bfloat16";
    case Elem::kF64:
      return "float64";
    case Elem::kI64:
      return "int64";
    case Elem::kU8:
      return "uint8";
  }
  return "?";
}

hid_t file_type(Elem e) {
  quiet();
  switch (e) {
    case Elem::kF32:
      return H5T_IEEE_F32LE;
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
    case Elem::kBF16:
      return bf16_type();
    case Elem::kF64:
      return H5T_IEEE_F64LE;
    case Elem::kI64:
      return H5T_STD_I64LE;
    case Elem::kU8:
      return H5T_STD_U8LE;
  }
  return -1;
}

hid_t mem_type(Elem e) {
  switch (e) {
    case Elem::kF32:
      return H5T_NATIVE_FLOAT;
    case Elem::kF64:
      return H5T_NATIVE_DOUBLE;
    case Elem::kI64:
      return H5T_NATIVE_INT64;
    case Elem::kU8:
      return H5T_NATIVE_UINT8;
    default:
      return file_type(e);  // 16-bit floats: memory layout is the little-endian file layout
  }
}

Obj create_file(const std::string& path) {
  quiet();
  Obj fcpl(H5Pcreate(H5P_FILE_CREATE), H5Pclose);
  H5Pset_link_creation_order(fcpl, H5P_CRT_ORDER_TRACKED | H5P_CRT_ORDER_INDEXED);
  // Objects of 64 KiB or more start on a page, so that their bytes can be written and
  // read with O_DIRECT (Note [Direct I/O]).
  Obj fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  H5Pset_alignment(fapl, 64 << 10, 4096);
  // The structure together at the file's start, read in a few pages (Note [Direct I/O]).
  H5Pset_meta_block_size(fapl, 1 << 20);
  H5Pset_small_data_block_size(fapl, 1 << 20);
  hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, fcpl, fapl);
  TORCH_CHECK(f >= 0, "cannot create checkpoint file ", path, ": ", reason(),
              ckpt::kCheckTheDirectory);
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
    std::stable_sort(w.links.begin(), w.links.end(),
                     [](const Link& a, const Link& b) { return a.corder < b.corder; });
  } else {
    std::sort(w.links.begin(), w.links.end(),
              [](const Link& a, const Link& b) { return a.name < b.name; });
  }
  std::vector<std::string> out;
  out.reserve(w.links.size());
  for (auto& l : w.links) out.push_back(std::move(l.name));
  return out;
}

void set_attr(hid_t obj, const std::string& name, const ckpt::AttrValue& v) {
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

ckpt::AttrValue get_attr(hid_t obj, const std::string& name, const std::string& where) {
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
      TORCH_CHECK(H5Aread(a, H5T_NATIVE_INT64, &v) >= 0, where, ": attribute '", name,
                  "': ", reason());
      return v;
    }
    case H5T_FLOAT: {
      double v = 0;
      TORCH_CHECK(H5Aread(a, H5T_NATIVE_DOUBLE, &v) >= 0, where, ": attribute '", name,
                  "': ", reason());
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
      TORCH_CHECK(size > 0 && size <= kMaxStringAttr, where, ": attribute '", name,
                  "' claims a string of ", size, " bytes: the file is corrupted");
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
  ckpt::AttrValue v = get_attr(obj, name, where);
  TORCH_CHECK(std::holds_alternative<int64_t>(v), where, ": attribute '", name,
              "' should be an integer");
  return std::get<int64_t>(v);
}

double get_double(hid_t obj, const std::string& name, const std::string& where) {
  ckpt::AttrValue v = get_attr(obj, name, where);
  if (const auto* i = std::get_if<int64_t>(&v)) return static_cast<double>(*i);
  TORCH_CHECK(std::holds_alternative<double>(v), where, ": attribute '", name,
              "' should be a number");
  return std::get<double>(v);
}

std::string get_string(hid_t obj, const std::string& name, const std::string& where) {
  ckpt::AttrValue v = get_attr(obj, name, where);
  TORCH_CHECK(std::holds_alternative<std::string>(v), where, ": attribute '", name,
              "' should be a string");
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
  TORCH_CHECK(H5Aiterate2(obj, H5_INDEX_NAME, H5_ITER_INC, &idx, collect, &out) >= 0, where, ": ",
              reason());
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
  TORCH_CHECK(o.valid(), where, ": object '", name, "' is unreadable: the file is corrupted (",
              reason(), ")");
  switch (H5Iget_type(o)) {
    case H5I_GROUP:
      return Kind::kGroup;
    case H5I_DATASET:
      return Kind::kDataset;
    default:
      return Kind::kOther;
  }
}

std::string object_id(hid_t obj, const std::string& where) {
  // HDF5 1.12 replaced object addresses by tokens, and H5Oget_info2 by H5Oget_info3.
#if H5_VERSION_GE(1, 12, 0)
  H5O_info2_t info{};
  TORCH_CHECK(H5Oget_info3(obj, &info, H5O_INFO_BASIC) >= 0, where, ": unreadable object header (",
              reason(), ")");
  return std::string(reinterpret_cast<const char*>(&info.token), sizeof(info.token));
#else
  H5O_info_t info{};
  TORCH_CHECK(H5Oget_info2(obj, &info, H5O_INFO_BASIC) >= 0, where, ": unreadable object header (",
              reason(), ")");
  return std::to_string(info.addr);
#endif
}

}  // namespace fsdp::h5
