// Consolidated HDF5 files from a live sharded model (docs/design.md, "Contracts"), and
// the exports' shared pieces (export.h).
#include "../agree.h"
#include "../format/safetensors/safetensors.h"
#include "../name_match.h"
#include "../sharded/optim_state.h"
#include "../tensor_io.h"
#include "export.h"
#include "trace/trace.h"

#include <fsdp/checkpoint.h>
#include <fsdp/pipeline.h>
#include <fsdp/process_group.h>

#include "internal/checkpoint_view.h"

#include <filesystem>
#include <iostream>
#include <set>
#include <sstream>

namespace fsdp {
namespace ckpt {

ExportDtype export_dtype(torch::Dtype d) {
  TORCH_CHECK(d == torch::kFloat32 || d == torch::kBFloat16 || d == torch::kFloat16,
              "export dtype ", c10::toString(d),
              " is not supported; use float32, bfloat16 or float16");
  return d == torch::kFloat32    ? ExportDtype::kF32
         : d == torch::kBFloat16 ? ExportDtype::kBF16
                                 : ExportDtype::kF16;
}

h5::Elem export_elem(torch::Dtype d) { return elem_of(export_dtype(d)); }

h5::Elem buffer_elem(const at::Tensor& b, h5::Elem dtype) {
  return b.is_floating_point() ? dtype : storage_elem(b.scalar_type());
}

}  // namespace ckpt

void ckpt::export_consolidated(const std::string& file, const ShardedModel& root,
                               torch::optim::Optimizer* optimizer, const ckpt::TrainingState& state,
                               const ckpt::ExportOptions& options) {
  detail::trace::Scope span("checkpoint", []() { return std::string("consolidated export"); });
  using namespace ckpt;
  const h5::Elem elem = export_elem(options.dtype);
  TORCH_CHECK(!options.with_optimizer || optimizer,
              "export_consolidated: with_optimizer needs the optimizer");
  Rank0Writes guarded(root.sharding_options().process_group);
  const bool writer = guarded.writer();
  const std::string kind = options.with_optimizer ? optimizer_kind(*optimizer) : "";
  std::unique_ptr<ConsolidatedWriter> w;
  guarded([&] {
    w = std::make_unique<ConsolidatedWriter>(file, elem, state.step, state.model_attrs, kind);
  });

  const auto shards = detail::local_shards(root);
  for (size_t k = 0; k < shards.size(); ++k) {
    const LocalShard& ls = shards[k];
    {
      at::Tensor full = detail::gather_flat(root, k, ls.shard);
      guarded([&] {
        for (const auto& p : ls.params) {
          write_tensor(w->model, p.fqn, full.narrow(0, p.offset, p.numel).view(p.shape), elem,
                       w->tmp + ":/model");
        }
      });
    }
    if (!options.with_optimizer || !ls.info.requires_grad) continue;
    ParamState st = get_shard_state(*optimizer, ls.shard);
    if (st.tensors.empty()) continue;  // not stepped yet
    // Each parameter's group: the shard's, or that of the view holding its first element.
    const int whole = find_param(*optimizer, ls.shard).first;
    const auto views = whole >= 0 ? std::vector<std::pair<at::Tensor, int64_t>>{}
                                  : shard_views(*optimizer, ls.shard);
    guarded([&] {
      for (const auto& p : ls.params) {
        int g = whole;
        for (const auto& [v, off] : views) {
          const int64_t first = std::max<int64_t>(p.offset - ls.begin, 0);
          if (first >= off && first < off + v.numel()) g = find_param(*optimizer, v).first;
        }
        if (g < 0) g = std::max(shard_group(*optimizer, ls.shard), 0);
        w->optim_group(p.fqn, st.step, group_hparams(*optimizer, static_cast<size_t>(g)));
      }
    });
    for (const auto& [name, t] : st.tensors) {
      at::Tensor full = detail::gather_flat(root, k, t.reshape({-1}));
      guarded([&] {
        for (const auto& p : ls.params) {
          write_tensor(w->optim, p.fqn + "/" + name,
                       full.narrow(0, p.offset, p.numel).view(p.shape), h5::Elem::kF32,
                       w->tmp + ":/optimizer");
        }
      });
    }
    if (options.verbose && writer) {
      std::cout << "[fsdp] export: flat parameter " << k + 1 << "/" << shards.size() << " (unit '"
                << ls.info.unit_fqn << "')" << std::endl;
    }
  }
  guarded([&] {
    for (const auto& [name, b] : named_buffers_clean(root.as_module())) {
      write_tensor(w->model, name, b, buffer_elem(b, elem), w->tmp + ":/model");
    }
    w->finish();
  });
  guarded.check("export_consolidated to " + file, [&] {
    if (w) w->abandon();
  });
}

}  // namespace fsdp
