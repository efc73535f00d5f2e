// Block checksums of checkpoint datasets (see h5_detail.h).
#include "../crc32c.h"
#include "h5_detail.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace fsdp::h5::detail {

// Note [Block checksums]
// Every dataset with elements carries CRC32C checksums of its bytes as stored, one per
// block of at least 4 MiB (at most 8192 blocks), in the attributes fsdp_crc32c (uint32
// array) and fsdp_crc_block (block size in bytes). Readers verify every block a read
// touches, so a range read (resharding) checks only what it reads. Contiguous storage
// with our own checksum instead of HDF5's chunked Fletcher32 filter lets HDF5 move data
// straight between the file and the caller's buffer: the filter pipeline copied every
// chunk and ran at about a quarter of raw write speed.
namespace {
constexpr const char* kCrcAttr = "fsdp_crc32c";
constexpr const char* kCrcBlockAttr = "fsdp_crc_block";
}  // namespace

Blocks blocks_for_write(int64_t numel, size_t elem) {
  const size_t total = static_cast<size_t>(numel) * elem;
  size_t bytes = std::max<size_t>(4u << 20, (total + 8191) / 8192);
  const size_t unit = 64 * elem;  // whole elements, and whole 32-byte lanes
  bytes = (bytes + unit - 1) / unit * unit;
  return Blocks{numel, elem, static_cast<int64_t>(bytes / elem)};
}

void write_checksums(hid_t ds, const Blocks& b, const std::vector<uint32_t>& crcs,
                     const std::string& where, const std::string& name) {
  TORCH_CHECK(static_cast<int64_t>(crcs.size()) == b.count(), "internal: ", crcs.size(),
              " checksums for ", b.count(), " blocks of '", name, "'");
  set_attr(ds, kCrcBlockAttr, static_cast<int64_t>(static_cast<size_t>(b.per_block) * b.elem));
  hsize_t n = crcs.size();
  Obj space(H5Screate_simple(1, &n, nullptr), H5Sclose);
  Obj attr(H5Acreate2(ds, kCrcAttr, H5T_STD_U32LE, space, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  TORCH_CHECK(attr.valid() && H5Awrite(attr, H5T_NATIVE_UINT32, crcs.data()) >= 0, where,
              ": cannot write the checksums of '", name, "': ", reason());
}

std::vector<uint32_t> read_checksums(hid_t ds, const std::string& where, const std::string& name) {
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
  TORCH_CHECK(n > 0 && H5Aread(a, H5T_NATIVE_UINT32, out.data()) >= 0, where,
              ": the checksums of dataset '", name, "' are unreadable: the file is corrupted");
  return out;
}

Blocks read_blocks(hid_t ds, int64_t numel, size_t elem, const std::vector<uint32_t>& crcs,
                   const std::string& where, const std::string& name) {
  const int64_t bytes = get_int(ds, kCrcBlockAttr, where);
  // Both sizes come from the file; checked before dividing by them (fuzzing found a
  // division by zero for each).
  TORCH_CHECK(elem > 0 && bytes >= static_cast<int64_t>(elem), where, ": dataset '", name,
              "' has checksum blocks of ", bytes, " bytes for elements of ", elem,
              " bytes: the file is corrupted");
  const Blocks b{numel, elem, bytes / static_cast<int64_t>(elem)};
  TORCH_CHECK(static_cast<int64_t>(crcs.size()) == b.count(), where, ": dataset '", name, "' has ",
              crcs.size(), " checksums for ", b.count(), " blocks: the file is corrupted");
  return b;
}

void check_block(const Blocks& b, const std::vector<uint32_t>& crcs, int64_t k, const void* bytes,
                 const std::string& where, const std::string& name) {
  if (crc_block(bytes, static_cast<size_t>(b.size(k)) * b.elem) != crcs[static_cast<size_t>(k)]) {
    TORCH_CHECK(false, where, ": checksum mismatch in dataset '", name, "' (block ", k, " of ",
                b.count(), "): the file is corrupted");
  }
}

}  // namespace fsdp::h5::detail
