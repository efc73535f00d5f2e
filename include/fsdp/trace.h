#pragma once
// The per-unit trace's public side: a program's own spans beside the library's.
//
// With ShardingOptions::trace (or FSDP_TRACE) naming a directory, each rank writes a
// Chrome-trace/Perfetto JSON of its units' all-gathers, forwards, backwards, recomputes and
// reduce-scatters, the optimizer step, checkpoint I/O and waits (`fsdp-trace merge DIR`
// joins the ranks; docs/design.md, "The per-unit trace"). A TraceScope adds a span of the
// program's own (a training step, data loading) to the same compute track, and a LibTorch
// profiler range of the same name. With tracing off and no profiler running it costs an
// atomic load.

#include <memory>
#include <string>

namespace fsdp {

class TraceScope {
 public:
  explicit TraceScope(const std::string& name);
  ~TraceScope();
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Writes this process's trace file now (it is also written when a traced model is
/// destroyed, and at exit). No-op when tracing is off.
void flush_trace();

}  // namespace fsdp
