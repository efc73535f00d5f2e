#pragma once
// What the h5 translation units share, and nothing outside them includes:
//   h5.cpp            errors, identifiers, element types, files, groups, links, attributes
//   h5_convert.cpp    float conversion (Note [Float conversion])
//   h5_geometry.cpp   row-major element ranges as hyperslab selections
//   h5_checksums.cpp  block checksums (Note [Block checksums])
//   h5_dataset.cpp    datasets: write, shape, and checked range reads
//   h5_direct.cpp     datasets' bytes to and from the disk without the page cache
//                     (Note [Direct I/O])

#include "h5.h"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fsdp::h5::detail {

/// Turns off HDF5's printing of its error stack: errors are reported with reason().
void quiet();

/// Dataset `name` of `loc`, opened; missing, unreadable or a soft or external link is an
/// error naming it.
Obj dataset(hid_t loc, const std::string& name, const std::string& where);

/// Creates dataset `name` of `shape` stored as `file`, contiguous, object times off;
/// `early`: its space allocated now and never filled (Note [Direct I/O]).
Obj create_dataset(hid_t loc, const std::string& name, Elem file, const std::vector<int64_t>& shape,
                   bool early, const std::string& where);

/// convert(), with an error that names the file and the dataset.
void convert_named(const void* src, Elem from, void* dst, Elem to, size_t n,
                   const std::string& where, const std::string& name);

/// Reads or writes elements [first, first + n) of dataset `ds` (dataspace `fspace`, of
/// `dims`), in row-major order, through a 1-D memory buffer of `type`.
herr_t io_linear(hid_t ds, hid_t fspace, const std::vector<hsize_t>& dims, int64_t first, int64_t n,
                 void* buf, hid_t type, bool write);

/// How a dataset's elements are cut into checksum blocks (Note [Block checksums]):
/// blocks of `per_block` elements, the last one shorter.
struct Blocks {
  int64_t numel = 0;      ///< elements in the dataset
  size_t elem = 0;        ///< bytes per stored element
  int64_t per_block = 0;  ///< elements per block
  int64_t count() const { return numel / per_block + (numel % per_block != 0 ? 1 : 0); }
  int64_t first(int64_t k) const { return k * per_block; }
  int64_t size(int64_t k) const { return std::min(per_block, numel - k * per_block); }
};
/// The blocks a new dataset of `numel` elements of `elem` bytes is written in.
Blocks blocks_for_write(int64_t numel, size_t elem);
/// Stores the checksums of a dataset written in blocks `b`, one per block.
void write_checksums(hid_t ds, const Blocks& b, const std::vector<uint32_t>& crcs,
                     const std::string& where, const std::string& name);
/// The checksums of dataset `ds`; empty when it has none (a file from another writer).
std::vector<uint32_t> read_checksums(hid_t ds, const std::string& where, const std::string& name);
/// The blocks dataset `ds` (of `numel` elements of `elem` bytes) was written in, checked
/// against the file and against `crcs`, its checksums, before anything divides by them.
Blocks read_blocks(hid_t ds, int64_t numel, size_t elem, const std::vector<uint32_t>& crcs,
                   const std::string& where, const std::string& name);
/// Throws naming the dataset and the block unless the bytes of block `k` at `bytes`
/// match its checksum.
void check_block(const Blocks& b, const std::vector<uint32_t>& crcs, int64_t k, const void* bytes,
                 const std::string& where, const std::string& name);

/// Reads bytes [off, off + sum(pieces)) of file `path` into `dst` in order, calling
/// `after(i)` once piece i is in place while the next ones are read (Note [Direct I/O]).
/// A failed read throws `failed` followed by the reason in parentheses.
void read_pieces(const std::string& path, uint64_t off, uint8_t* dst,
                 const std::vector<size_t>& pieces, const std::function<void(size_t)>& after,
                 const std::string& failed);

}  // namespace fsdp::h5::detail
