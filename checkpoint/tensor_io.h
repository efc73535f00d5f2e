#pragma once
// Tensors in and out of checkpoint datasets (the LibTorch side of the checkpoint code).

#include "format/layout.h"

#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

namespace fsdp::ckpt {

/// Element type of torch dtype for checkpoint files ("float32", "bfloat16", ...).
h5::Elem elem_of_dtype(c10::ScalarType t);
std::string dtype_name(c10::ScalarType t);

/// Writes `t` (any device) as dataset `name` with its own shape, stored as `file`
/// (a 16-bit float file gets `t.to(dtype)`, rounded by torch; other floating tensors go
/// through fp32/fp64 in memory). NaN is stored as h5::convert stores it.
void write_tensor(hid_t loc, const std::string& name, const at::Tensor& t, h5::Elem file,
                  const std::string& where);
/// write_tensor for an fp32 dataset through `direct` (Note [Direct I/O]) when it is large
/// enough: created now, its bytes written by direct.write_all(), which `hold` keeps alive
/// until then. A small one is written at once.
void write_tensor_direct(h5::DirectDatasets& direct, std::vector<at::Tensor>& hold, hid_t loc,
                         const std::string& name, const at::Tensor& t, const std::string& where);
/// The same for an fp32 dataset of `length` elements from parts in memory, each at its
/// first element (zeros between).
void write_parts_direct(h5::DirectDatasets& direct, std::vector<at::Tensor>& hold, hid_t loc,
                        const std::string& name,
                        const std::vector<std::pair<int64_t, at::Tensor>>& parts, int64_t length,
                        const std::string& where);
/// `t` on the CPU, contiguous, with exactly the bytes a file stores for it as `file`
/// (16-bit floats rounded and NaN stored as write_tensor does).
at::Tensor file_bytes(const at::Tensor& t, h5::Elem file);
/// Element type a buffer of dtype `t` is stored as in sharded checkpoints (lossless).
h5::Elem storage_elem(c10::ScalarType t);
/// Reads dataset `name` whole into `dst` (any dtype and device; shapes must match).
void read_into(hid_t loc, const std::string& name, const at::Tensor& dst, const std::string& where);

}  // namespace fsdp::ckpt
