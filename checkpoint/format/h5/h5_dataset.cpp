// Checkpoint datasets (see h5.h): written contiguous with block checksums, read by
// element ranges that verify every block they touch.
#include "../crc32c.h"
#include "h5_detail.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <thread>
#include <utility>

namespace fsdp::h5 {

using namespace detail;

Obj detail::dataset(hid_t loc, const std::string& name, const std::string& where) {
  quiet();
  // Our writers make hard links only; a soft or external link in a damaged file could
  // name any object, or any file on this machine, and is not followed.
  H5L_info_t link{};
  if (H5Lget_info(loc, name.c_str(), &link, H5P_DEFAULT) < 0) {
    H5Eclear2(H5E_DEFAULT);  // missing: H5Dopen2 says so below
  } else if (link.type != H5L_TYPE_HARD) {
    TORCH_CHECK(false, where, ": '", name, "' is ",
                link.type == H5L_TYPE_SOFT ? "a soft" : "an external",
                " link, not a dataset: checkpoint files hold none, the file is corrupted");
  }
  hid_t id = H5Dopen2(loc, name.c_str(), H5P_DEFAULT);
  TORCH_CHECK(id >= 0, where, ": dataset '", name, "' is missing or unreadable (", reason(), ")");
  return Obj(id, H5Dclose);
}

namespace {

Obj space_of(const Obj& ds) { return Obj(H5Dget_space(ds), H5Sclose); }

// A dataset opened for reading, with its dimensions (from the file: their product is
// checked).
struct Opened {
  Obj ds, fspace;
  std::vector<hsize_t> dims;
  int64_t numel = 1;
};

Opened open_for_read(hid_t loc, const std::string& name, const std::string& where) {
  Opened d;
  d.ds = dataset(loc, name, where);
  d.fspace = space_of(d.ds);
  const int nd = H5Sget_simple_extent_ndims(d.fspace);
  TORCH_CHECK(nd >= 0, where, ": dataset '", name, "' has no readable shape (", reason(), ")");
  d.dims.resize(static_cast<size_t>(nd));
  if (nd > 0) H5Sget_simple_extent_dims(d.fspace, d.dims.data(), nullptr);
  for (hsize_t n : d.dims) {
    // The dimensions come from the file: their product must not overflow (fuzzing).
    TORCH_CHECK(n <= static_cast<hsize_t>(INT64_MAX) &&
                    !__builtin_mul_overflow(d.numel, static_cast<int64_t>(n), &d.numel),
                where, ": dataset '", name,
                "' claims more elements than fit in 64 bits: the file is corrupted");
  }
  return d;
}

[[noreturn]] void read_failed(const std::string& where, const std::string& name) {
  TORCH_CHECK(false, where, ": cannot read dataset '", name,
              "': the file is truncated or corrupted (", reason(), ")");
  __builtin_unreachable();
}

// A dataset without checksums (a file from another writer). HDF5 reads the elements in
// the file's type (swapping bytes if need be); floats are then converted here (Note
// [Float conversion]). Integers are widened by HDF5, which is exact.
void read_unchecked(const Opened& d, Elem file, int64_t begin, int64_t count, void* out, Elem mem,
                    const std::string& where, const std::string& name) {
  const bool floats = file != Elem::kI64 && file != Elem::kU8;
  if (mem == file || !floats) {
    if (io_linear(d.ds, d.fspace, d.dims, begin, count, out, mem_type(mem), /*write=*/false) < 0) {
      read_failed(where, name);
    }
    return;
  }
  std::vector<uint8_t> raw(static_cast<size_t>(count) * H5Tget_size(file_type(file)));
  if (io_linear(d.ds, d.fspace, d.dims, begin, count, raw.data(), file_type(file),
                /*write=*/false) < 0) {
    read_failed(where, name);
  }
  convert_named(raw.data(), file, out, mem, static_cast<size_t>(count), where, name);
}

// The file holding `ds`, and where the dataset's bytes start in it; nullopt when they
// are not one contiguous run (chunked, compact, or not allocated).
std::optional<std::pair<std::string, uint64_t>> contiguous_place(hid_t ds) {
  // Only a file on disk opened by the default (sec2) driver: not an in-memory image.
  Obj file(H5Iget_file_id(ds), H5Fclose);
  if (!file.valid()) return std::nullopt;
  Obj fapl(H5Fget_access_plist(file), H5Pclose);
  if (!fapl.valid() || H5Pget_driver(fapl) != H5FD_SEC2) return std::nullopt;
  const haddr_t at = H5Dget_offset(ds);
  if (at == HADDR_UNDEF) {
    H5Eclear2(H5E_DEFAULT);
    return std::nullopt;
  }
  const ssize_t n = H5Fget_name(ds, nullptr, 0);
  if (n <= 0) return std::nullopt;
  std::string path(static_cast<size_t>(n), '\0');
  H5Fget_name(ds, path.data(), path.size() + 1);
  return std::make_pair(path, static_cast<uint64_t>(at));
}

// Blocks [k0, k1), all inside the range read, straight into `out` (which holds the range
// from element `begin`; stored and memory types are the same). A contiguous dataset is
// read past HDF5 and the page cache (Note [Direct I/O]), each block verified as it lands
// while the next ones are read; otherwise through HDF5 in pieces of 4 blocks, piece i
// verified on a second thread while piece i + 1 is read. Either way checking costs little
// more than reading.
void read_whole_blocks(const Opened& d, hid_t ftype, const Blocks& b,
                       const std::vector<uint32_t>& crcs, int64_t k0, int64_t k1, int64_t begin,
                       uint8_t* out, const std::string& where, const std::string& name) {
  auto at = [&](int64_t element) { return out + static_cast<size_t>(element - begin) * b.elem; };
  if (const auto place = contiguous_place(d.ds)) {
    std::vector<size_t> pieces;
    for (int64_t k = k0; k < k1; ++k) pieces.push_back(static_cast<size_t>(b.size(k)) * b.elem);
    detail::read_pieces(
        place->first, place->second + static_cast<uint64_t>(b.first(k0)) * b.elem, at(b.first(k0)),
        pieces,
        [&](size_t i) {
          const int64_t k = k0 + static_cast<int64_t>(i);
          check_block(b, crcs, k, at(b.first(k)), where, name);
        },
        where + ": cannot read dataset '" + name + "': the file is truncated or corrupted");
    return;
  }
  std::string error;
  auto verify_blocks = [&](int64_t from, int64_t to) {
    try {
      for (int64_t k = from; k < to; ++k) check_block(b, crcs, k, at(b.first(k)), where, name);
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    }
  };
  std::thread verifier;
  auto join = [&] {
    if (verifier.joinable()) verifier.join();
  };
  for (int64_t p0 = k0; p0 < k1; p0 += 4) {
    const int64_t p1 = std::min(k1, p0 + 4);
    const int64_t e0 = b.first(p0), e1 = std::min(b.first(p1), b.numel);
    if (io_linear(d.ds, d.fspace, d.dims, e0, e1 - e0, at(e0), ftype, /*write=*/false) < 0) {
      join();
      read_failed(where, name);
    }
    join();
    verifier = std::thread(verify_blocks, p0, p1);
  }
  join();
  TORCH_CHECK(error.empty(), error);
}

// Block `k` read whole into `tmp` and verified; its elements inside [begin, begin +
// count) are converted from `file` into `out` (which holds the range as `mem`).
void read_block_through(const Opened& d, hid_t ftype, Elem file, const Blocks& b,
                        const std::vector<uint32_t>& crcs, int64_t k, int64_t begin, int64_t count,
                        uint8_t* out, Elem mem, std::vector<uint8_t>& tmp, const std::string& where,
                        const std::string& name) {
  const int64_t b0 = b.first(k), n = b.size(k);
  const int64_t lo = std::max(begin, b0), hi = std::min(begin + count, b0 + n);
  const size_t msize = H5Tget_size(mem_type(mem));
  // Sized by the block's elements, not per_block: the block size comes from the file.
  tmp.resize(static_cast<size_t>(n) * std::max(b.elem, msize));
  if (io_linear(d.ds, d.fspace, d.dims, b0, n, tmp.data(), ftype, /*write=*/false) < 0)
    read_failed(where, name);
  check_block(b, crcs, k, tmp.data(), where, name);
  convert_named(tmp.data() + static_cast<size_t>(lo - b0) * b.elem, file,
                out + static_cast<size_t>(lo - begin) * msize, mem, static_cast<size_t>(hi - lo),
                where, name);
}

}  // namespace

Obj detail::create_dataset(hid_t loc, const std::string& name, Elem file,
                           const std::vector<int64_t>& shape, bool early,
                           const std::string& where) {
  quiet();
  std::vector<hsize_t> dims(shape.begin(), shape.end());
  Obj space =
      dims.empty()
          ? Obj(H5Screate(H5S_SCALAR), H5Sclose)
          : Obj(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose);
  Obj dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  H5Pset_obj_track_times(dcpl, false);
  // Contiguous storage: HDF5 writes and reads it straight from and into the caller's
  // buffer. Integrity comes from our block checksums (Note [Block checksums]).
  H5Pset_layout(dcpl, H5D_CONTIGUOUS);
  if (early) {
    H5Pset_alloc_time(dcpl, H5D_ALLOC_TIME_EARLY);
    H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER);
  }
  Obj ds(H5Dcreate2(loc, name.c_str(), file_type(file), space, H5P_DEFAULT, dcpl, H5P_DEFAULT),
         H5Dclose);
  TORCH_CHECK(ds.valid(), where, ": cannot create dataset '", name, "': ", reason());
  return ds;
}

void write(hid_t loc, const std::string& name, const void* data, Elem mem, Elem file,
           const std::vector<int64_t>& shape, const std::string& where) {
  Obj ds = create_dataset(loc, name, file, shape, /*early=*/false, where);
  std::vector<hsize_t> dims(shape.begin(), shape.end());
  const int64_t numel = numel_of(shape, where, name);
  if (numel == 0) return;
  const size_t fsize = H5Tget_size(file_type(file));
  const Blocks b = blocks_for_write(numel, fsize);
  std::vector<uint32_t> crcs;
  if (mem == file) {
    const auto* bytes = static_cast<const uint8_t*>(data);
    for (int64_t k = 0; k < b.count(); ++k) {
      crcs.push_back(crc_block(bytes + static_cast<size_t>(b.first(k)) * fsize,
                               static_cast<size_t>(b.size(k)) * fsize));
    }
    TORCH_CHECK(H5Dwrite(ds, mem_type(mem), H5S_ALL, H5S_ALL, H5P_DEFAULT, data) >= 0, where,
                ": cannot write dataset '", name, "': ", reason(), ". Is the disk full?");
  } else {
    // Converted block by block (Note [Float conversion]), so the checksum covers the
    // bytes in the file.
    const size_t msize = H5Tget_size(mem_type(mem));
    std::vector<uint8_t> buf(static_cast<size_t>(b.per_block) * fsize);
    Obj fspace(H5Dget_space(ds), H5Sclose);
    for (int64_t k = 0; k < b.count(); ++k) {
      const int64_t first = b.first(k), n = b.size(k);
      convert_named(static_cast<const uint8_t*>(data) + static_cast<size_t>(first) * msize, mem,
                    buf.data(), file, static_cast<size_t>(n), where, name);
      crcs.push_back(crc_block(buf.data(), static_cast<size_t>(n) * fsize));
      TORCH_CHECK(
          io_linear(ds, fspace, dims, first, n, buf.data(), file_type(file), /*write=*/true) >= 0,
          where, ": cannot write dataset '", name, "': ", reason(), ". Is the disk full?");
    }
  }
  write_checksums(ds, b, crcs, where, name);
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
  write(loc, name, joined.data(), Elem::kU8, Elem::kU8, {static_cast<int64_t>(joined.size())},
        where);
}

void write_i64(hid_t loc, const std::string& name, const std::vector<int64_t>& v,
               const std::string& where) {
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
    TORCH_CHECK(d <= static_cast<hsize_t>(INT64_MAX), where, ": dataset '", name,
                "' claims a dimension of ", d, ": the file is corrupted");
  }
  return std::vector<int64_t>(dims.begin(), dims.end());
}

int64_t numel_of(const std::vector<int64_t>& shape, const std::string& where,
                 const std::string& name) {
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

void read_range(hid_t loc, const std::string& name, int64_t begin, int64_t count, void* out,
                Elem mem, const std::string& where) {
  if (count <= 0) return;
  const Opened d = open_for_read(loc, name, where);
  TORCH_CHECK(begin >= 0 && begin + count <= d.numel, where, ": dataset '", name, "' holds ",
              d.numel, " elements; elements [", begin, ", ", begin + count, ") were asked for");
  const Elem file = elem_of(loc, name, where);
  const std::vector<uint32_t> crcs = read_checksums(d.ds, where, name);
  if (crcs.empty()) return read_unchecked(d, file, begin, count, out, mem, where, name);

  Obj ftype(H5Dget_type(d.ds), H5Tclose);
  const size_t fsize = H5Tget_size(ftype);
  // Elements are moved in the stored type (HDF5 converts nothing), into buffers sized
  // for `file`'s type: a stored size that differs (a 16-byte integer is elem_of's kI64)
  // wrote past them.
  TORCH_CHECK(fsize == H5Tget_size(file_type(file)), where, ": dataset '", name, "' stores ",
              elem_name(file), " elements of ", fsize, " bytes: the file is corrupted");
  // Checksummed datasets are ours, stored contiguous and uncompressed: all of them lies in
  // the file. A larger claim (a damaged dataspace) would have verify() read fill values
  // for as long as it claims.
  check_fits_in_file(loc, name, d.numel, fsize, where);
  const Blocks b = read_blocks(d.ds, d.numel, fsize, crcs, where, name);

  // Every block the range touches is read whole and verified: the blocks inside the
  // range that need no conversion straight into `out`, the (at most two) edge blocks and
  // converted ones through a buffer.
  auto* dst = static_cast<uint8_t*>(out);
  const int64_t k_first = begin / b.per_block, k_last = (begin + count - 1) / b.per_block;
  int64_t k0 = k_first, k1 = k_last + 1;  // whole blocks [k0, k1)
  if (mem != file) {
    k1 = k0;
  } else {
    if (begin % b.per_block != 0) ++k0;
    if ((begin + count) % b.per_block != 0 && begin + count != d.numel) --k1;
  }
  if (k1 > k0) read_whole_blocks(d, ftype, b, crcs, k0, k1, begin, dst, where, name);
  std::vector<uint8_t> tmp;
  for (int64_t k = k_first; k <= k_last; ++k) {
    if (k < k0 || k >= k1)
      read_block_through(d, ftype, file, b, crcs, k, begin, count, dst, mem, tmp, where, name);
  }
}

bool verify(hid_t loc, const std::string& name, const std::string& where) {
  Obj ds = dataset(loc, name, where);
  const int64_t numel = numel_of(shape_of(loc, name, where), where, name);
  if (numel == 0) return true;  // nothing to check
  if (read_checksums(ds, where, name).empty()) return false;
  const Elem e = elem_of(loc, name, where);
  std::vector<uint8_t> buf(static_cast<size_t>(std::min<int64_t>(numel, int64_t{1} << 20)) * 8);
  for (int64_t pos = 0; pos < numel; pos += int64_t{1} << 20) {
    read_range(loc, name, pos, std::min<int64_t>(int64_t{1} << 20, numel - pos), buf.data(), e,
               where);
  }
  return true;
}

// A table's length comes from the file and sizes an allocation before anything is read:
// a corrupt one asked for 660 GB (found by fuzzing). Tables are stored uncompressed, so
// one that claims more bytes than the whole file is corrupt.
void check_fits_in_file(hid_t loc, const std::string& name, int64_t numel, size_t elem,
                        const std::string& where) {
  const hid_t fid = H5Iget_file_id(loc);
  hsize_t file_bytes = 0;
  const bool known = fid >= 0 && H5Fget_filesize(fid, &file_bytes) >= 0;
  if (fid >= 0) H5Fclose(fid);
  if (!known) return;
  TORCH_CHECK(numel >= 0 && static_cast<double>(numel) * static_cast<double>(elem) <=
                                static_cast<double>(file_bytes),
              where, ": dataset '", name, "' claims ", numel, " elements of ", elem,
              " bytes in a file of ", file_bytes, " bytes: the file is corrupted");
}

std::vector<std::string> read_strings(hid_t loc, const std::string& name,
                                      const std::string& where) {
  auto shape = shape_of(loc, name, where);
  TORCH_CHECK(shape.size() == 1, where, ": dataset '", name, "' should be one-dimensional");
  check_fits_in_file(loc, name, shape[0], 1, where);
  std::string joined(static_cast<size_t>(shape[0]), '\0');
  read_range(loc, name, 0, shape[0], joined.data(), Elem::kU8, where);
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < joined.size()) {
    size_t nl = joined.find('\n', pos);
    TORCH_CHECK(nl != std::string::npos, where, ": dataset '", name,
                "' is malformed (no final newline)");
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
