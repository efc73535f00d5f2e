// Row-major element ranges of a dataset as HDF5 hyperslab selections (see h5_detail.h).
#include "h5_detail.h"

#include <utility>

namespace fsdp::h5::detail {
namespace {

// Boxes (start, count) covering linear elements [a, b) of a row-major array of `dims`.
void boxes(const std::vector<hsize_t>& dims, size_t d, std::vector<hsize_t> prefix, hsize_t a,
           hsize_t b, std::vector<std::pair<std::vector<hsize_t>, std::vector<hsize_t>>>& out) {
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

}  // namespace

herr_t io_linear(hid_t ds, hid_t fspace, const std::vector<hsize_t>& dims, int64_t first, int64_t n,
                 void* buf, hid_t type, bool write) {
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
      H5Sselect_hyperslab(fspace, first_box ? H5S_SELECT_SET : H5S_SELECT_OR, b.first.data(),
                          nullptr, b.second.data(), nullptr);
      first_box = false;
    }
  }
  const hid_t ms = all ? H5S_ALL : mspace.id();
  const hid_t fs = all ? H5S_ALL : fspace;
  return write ? H5Dwrite(ds, type, ms, fs, H5P_DEFAULT, buf)
               : H5Dread(ds, type, ms, fs, H5P_DEFAULT, buf);
}

}  // namespace fsdp::h5::detail
