#pragma once
// What the exports of a live model share (export_hdf5.cpp, export_safetensors.cpp,
// pipeline_export.cpp, consolidate.cpp): the exported element type and the protocol by
// which rank 0 writes while every rank gathers.

#include "../agree.h"
#include "../format/weights.h"
#include "../tensor_io.h"

#include <fsdp/process_group.h>

#include <torch/torch.h>

#include <functional>
#include <string>

namespace fsdp::ckpt {

/// The element type `d` is exported as; an error for a dtype other than float32,
/// bfloat16 and float16.
ExportDtype export_dtype(torch::Dtype d);
h5::Elem export_elem(torch::Dtype d);
/// A buffer's element type in the file: floating buffers as the export's `dtype`, the
/// others as they are.
h5::Elem buffer_elem(const at::Tensor& b, h5::Elem dtype);

/// The exports' protocol: rank 0 writes; on a write error it stops writing but keeps
/// taking part in the gathers, so no rank hangs, and every rank throws at the end.
class Rank0Writes {
 public:
  explicit Rank0Writes(const ProcessGroup& pg) : pg_(pg), writer_(pg.rank() == 0) {}
  bool writer() const { return writer_; }
  /// Runs `fn` on rank 0 unless an earlier call failed there.
  void operator()(const std::function<void()>& fn) {
    if (!writer_ || !error_.empty()) return;
    try {
      fn();
    } catch (const std::exception& e) {
      error_ = e.what();
    }
  }
  /// Collective: when rank 0 failed, runs `abandon` there and throws on every rank,
  /// "<what> failed: <rank 0's error>".
  void check(const std::string& what, const std::function<void()>& abandon) {
    if (!rank0_failed(pg_, error_)) return;
    if (writer_) abandon();
    TORCH_CHECK(false, what, " failed", failure_detail(error_, " on rank 0 (see its error)"));
  }

 private:
  const ProcessGroup& pg_;
  bool writer_;
  std::string error_;
};

}  // namespace fsdp::ckpt
