// Tensors in and out of checkpoint datasets (see tensor_io.h).
#include "tensor_io.h"

#include <ATen/core/grad_mode.h>

namespace fsdp::ckpt {

h5::Elem elem_of_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat:
      return h5::Elem::kF32;
    case c10::kHalf:
      return h5::Elem::kF16;
    case c10::kBFloat16:
      return h5::Elem::kBF16;
    case c10::kDouble:
      return h5::Elem::kF64;
    case c10::kBool:
    case c10::kByte:
      return h5::Elem::kU8;
    default:
      return h5::Elem::kI64;
  }
}

std::string dtype_name(c10::ScalarType t) { return h5::elem_name(elem_of_dtype(t)); }

h5::Elem storage_elem(c10::ScalarType t) {
  if (t == c10::kDouble) return h5::Elem::kF64;
  if (c10::isFloatingType(t)) return h5::Elem::kF32;
  if (t == c10::kBool || t == c10::kByte) return h5::Elem::kU8;
  return h5::Elem::kI64;
}

namespace {
// The in-memory form HDF5 reads or writes for `file`: floats via fp32 (fp64 for doubles).
std::pair<at::ScalarType, h5::Elem> mem_form(h5::Elem file) {
  switch (file) {
    case h5::Elem::kF64:
      return {at::kDouble, h5::Elem::kF64};
    case h5::Elem::kI64:
      return {at::kLong, h5::Elem::kI64};
    case h5::Elem::kU8:
      return {at::kByte, h5::Elem::kU8};
    default:
      return {at::kFloat, h5::Elem::kF32};
  }
}
}  // namespace

at::Tensor file_bytes(const at::Tensor& t, h5::Elem file) {
  if (file == h5::Elem::kBF16 || file == h5::Elem::kF16) {
    // Rounded by torch, as `t.to(dtype)` (Note [Float conversion] in h5_convert.cpp); NaN gets the
    // bits h5::convert gives it, which 1.13's vectorized bf16 conversion does not.
    const auto dtype = file == h5::Elem::kBF16 ? at::kBFloat16 : at::kHalf;
    at::Tensor src = t.detach().to(at::kCPU);
    // A copy always: a buffer that is already `dtype` must not be changed below.
    at::Tensor c = src.to(dtype, /*non_blocking=*/false, /*copy=*/true).contiguous();
    at::Tensor nan = src.isnan();
    if (nan.any().item<bool>()) {
      at::Tensor bits = c.view(at::kShort);
      if (file == h5::Elem::kBF16) {
        bits.masked_fill_(nan, static_cast<int16_t>(h5::kBF16NaN));
      } else {
        bits.masked_fill_(nan & src.signbit(), static_cast<int16_t>(h5::kF16NaN | 0x8000));
        bits.masked_fill_(nan & ~src.signbit(), static_cast<int16_t>(h5::kF16NaN));
      }
    }
    return c;
  }
  switch (file) {
    case h5::Elem::kF32:
      return t.detach().to(at::kCPU, at::kFloat).contiguous();
    case h5::Elem::kF64:
      return t.detach().to(at::kCPU, at::kDouble).contiguous();
    case h5::Elem::kI64:
      return t.detach().to(at::kCPU, at::kLong).contiguous();
    default:
      return t.detach().to(at::kCPU, at::kByte).contiguous();
  }
}

void write_tensor(hid_t loc, const std::string& name, const at::Tensor& t, h5::Elem file,
                  const std::string& where) {
  if (file == h5::Elem::kBF16 || file == h5::Elem::kF16) {
    at::Tensor c = file_bytes(t, file);
    h5::write(loc, name, c.data_ptr(), file, file, c.sizes().vec(), where);
    return;
  }
  auto [st, mem] = mem_form(file);
  at::Tensor c = t.detach().to(at::kCPU, st).contiguous();
  h5::write(loc, name, c.data_ptr(), mem, file, c.sizes().vec(), where);
}

void write_tensor_direct(h5::DirectDatasets& direct, std::vector<at::Tensor>& hold, hid_t loc,
                         const std::string& name, const at::Tensor& t, const std::string& where) {
  at::Tensor c = t.detach().to(at::kCPU, at::kFloat).contiguous();  // no copy when it is so
  if (static_cast<int64_t>(c.nbytes()) < h5::kDirectMinBytes)
    return write_tensor(loc, name, c, h5::Elem::kF32, where);
  direct.add(loc, name, c.data_ptr(), h5::Elem::kF32, c.sizes().vec(), where);
  hold.push_back(std::move(c));
}

void write_parts_direct(h5::DirectDatasets& direct, std::vector<at::Tensor>& hold, hid_t loc,
                        const std::string& name,
                        const std::vector<std::pair<int64_t, at::Tensor>>& parts, int64_t length,
                        const std::string& where) {
  if (parts.size() == 1 && parts[0].first == 0 && parts[0].second.numel() == length)
    return write_tensor_direct(direct, hold, loc, name, parts[0].second, where);
  if (length * 4 < h5::kDirectMinBytes) {  // small: put together and written at once
    at::Tensor whole = at::zeros({length}, at::kFloat);
    for (const auto& [off, t] : parts) whole.narrow(0, off, t.numel()).copy_(t);
    return write_tensor(loc, name, whole, h5::Elem::kF32, where);
  }
  std::vector<h5::DirectDatasets::Segment> segments;
  for (const auto& [off, t] : parts) {
    at::Tensor c = t.detach().to(at::kCPU, at::kFloat).contiguous();
    segments.push_back({off, c.numel(), c.data_ptr()});
    hold.push_back(std::move(c));
  }
  direct.add_segments(loc, name, std::move(segments), h5::Elem::kF32, {length}, where);
}

void read_into(hid_t loc, const std::string& name, const at::Tensor& dst,
               const std::string& where) {
  auto shape = h5::shape_of(loc, name, where);
  TORCH_CHECK(shape == dst.sizes().vec(), where, ": dataset '", name, "' has shape ",
              c10::IntArrayRef(shape), " but the model's tensor has shape ", dst.sizes());
  auto [st, mem] = mem_form(h5::elem_of(loc, name, where));
  at::Tensor buf = at::empty(dst.sizes(), at::TensorOptions().dtype(st));
  h5::read_range(loc, name, 0, buf.numel(), buf.data_ptr(), mem, where);
  at::NoGradGuard no_grad;
  dst.detach().copy_(buf);
}

}  // namespace fsdp::ckpt
