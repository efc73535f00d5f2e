#pragma once
// The optimizer kernels' threading (src/optim).

#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <torch/torch.h>

#include <cstdint>

namespace fsdp::detail {

// Calls f(begin, end) over [0, p.numel()) split among LibTorch's intra-op threads, in
// ranges of at least 64K elements. at::parallel_for would not do: it is inline and runs
// in parallel only in code compiled with the threading backend's flags (-fopenmp for
// LibTorch's OpenMP builds), which this library is not; TensorIterator::for_each runs
// it inside LibTorch. p (contiguous) only gives the iterator its shape: f gets indices.
template <class F>
inline void for_each_range(const torch::Tensor& p, const F& f) {
  constexpr int64_t kGrain = int64_t{1} << 16;
  if (p.numel() <= kGrain || at::get_num_threads() == 1) {
    f(int64_t{0}, p.numel());
    return;
  }
  const auto flat = p.view({-1});
  auto iter = at::TensorIteratorConfig()
                  .add_output(flat)
                  .set_check_mem_overlap(false)
                  .check_all_same_dtype(false)
                  .resize_outputs(false)
                  .build();
  const char* base = static_cast<const char*>(flat.data_ptr());
  const int64_t item = static_cast<int64_t>(flat.element_size());
  iter.for_each(
      [&](char** data, const int64_t* strides, int64_t size0, int64_t size1) {
        for (int64_t j = 0; j < size1; ++j) {
          const int64_t b = (data[0] + j * strides[1] - base) / item;
          f(b, b + size0);
        }
      },
      kGrain);
}

}  // namespace fsdp::detail
