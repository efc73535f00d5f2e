// Hugging Face's safetensors from a live sharded model (Note [Safetensors]).
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

void ckpt::export_safetensors(const std::string& dir, const ShardedModel& model,
                              const ckpt::TrainingState& state,
                              const ckpt::SafetensorsOptions& options) {
  detail::trace::Scope span("checkpoint", []() { return std::string("safetensors export"); });
  using namespace ckpt;
  const h5::Elem elem = export_elem(options.dtype);
  Rank0Writes guarded(model.sharding_options().process_group);
  const bool writer = guarded.writer();
  const auto shards = detail::local_shards(model);
  const auto buffers = named_buffers_clean(model.as_module());
  // Every tensor, in order: each flat parameter's original parameters (aliases as copies
  // of their own), then the buffers. Every rank knows them; rank 0 writes.
  // SafetensorsOptions::name_for and ::transpose: another framework's names and layout.
  const Layout layout{options.name_for, options.transpose,
                      "export_safetensors: SafetensorsOptions::transpose picks"};
  std::vector<st::Spec> specs;
  for (const auto& ls : shards) {
    for (const auto& p : ls.params) {
      if (!layout.name(p.fqn).empty())
        specs.push_back(
            {layout.name(p.fqn), safetensors_dtype(elem), layout.file_shape(p.fqn, p.shape)});
    }
  }
  for (const auto& [name, b] : buffers) {
    if (!layout.name(name).empty()) {
      specs.push_back({layout.name(name), safetensors_dtype(buffer_elem(b, elem)),
                       layout.file_shape(name, b.sizes().vec())});
    }
  }
  std::unique_ptr<st::DirWriter> w;
  guarded([&] {
    w = std::make_unique<st::DirWriter>(dir, specs,
                                        safetensors_metadata(elem, state.step, state.model_attrs),
                                        options.max_shard_size);
  });
  size_t i = 0;
  for (size_t k = 0; k < shards.size(); ++k) {
    const LocalShard& ls = shards[k];
    at::Tensor full = detail::gather_flat(model, k, ls.shard);
    guarded([&] {
      // A parameter must arrive whole: DeepSpeed once saved the empty placeholders of
      // sharded parameters as "the model" (deepspeed#6836).
      TORCH_CHECK(full.numel() == ls.info.numel, "export_safetensors: unit '", ls.info.unit_fqn,
                  "' gathered ", full.numel(), " elements, its table has ", ls.info.numel);
      for (const auto& p : ls.params) {
        if (layout.name(p.fqn).empty()) continue;
        at::Tensor value = full.narrow(0, p.offset, p.numel);
        if (layout.transposed(p.fqn, p.shape))
          value = value.view(p.shape).t().contiguous().view(-1);
        at::Tensor v = file_bytes(value, elem);
        TORCH_CHECK(v.numel() == p.numel, "export_safetensors: parameter '", p.fqn, "' has ",
                    v.numel(), " elements, its shape needs ", p.numel);
        w->add(i++, v.data_ptr(), static_cast<uint64_t>(v.numel()) * v.element_size());
      }
    });
    if (options.verbose && writer) {
      std::cout << "[fsdp] safetensors export: flat parameter " << k + 1 << "/" << shards.size()
                << " (unit '" << ls.info.unit_fqn << "')" << std::endl;
    }
  }
  guarded([&] {
    for (const auto& [name, b] : buffers) {
      if (layout.name(name).empty()) continue;
      at::Tensor v = file_bytes(layout.transposed(name, b.sizes().vec()) ? b.t().contiguous() : b,
                                buffer_elem(b, elem));
      w->add(i++, v.data_ptr(), static_cast<uint64_t>(v.numel()) * v.element_size());
    }
    w->finish();
    write_hf_config(dir, state.model_attrs);
  });
  guarded.check("export_safetensors to " + dir,
                [&] { w.reset(); });  // removes its unpublished files
  if (options.verbose && writer) {
    std::cout << "[fsdp] safetensors export: " << specs.size() << " tensors in "
              << w->files().size() << " file" << (w->files().size() == 1 ? "" : "s") << " in "
              << dir << std::endl;
  }
}

}  // namespace fsdp
