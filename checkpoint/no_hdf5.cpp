// Stand-in when the build found no HDF5: every checkpoint call explains how to get it.
#include <fsdp/checkpoint.h>

namespace fsdp {
namespace {
[[noreturn]] void no_hdf5() {
  TORCH_CHECK(false,
              "this fsdp build has no HDF5, so checkpoints are disabled: install libhdf5-dev "
              "(scripts/install-deps.sh) and rebuild");
}
}  // namespace

std::string ckpt::save_sharded_checkpoint(const std::string&, const ShardedModel&,
                                          torch::optim::Optimizer*, const ckpt::TrainingState&,
                                          const ckpt::SaveOptions&) {
  no_hdf5();
}
ckpt::LoadReport ckpt::load_sharded_checkpoint(const std::string&, ShardedModel&,
                                               torch::optim::Optimizer*, ckpt::TrainingState*,
                                               const ckpt::LoadOptions&) {
  no_hdf5();
}
std::string ckpt::save_sharded_checkpoint(const std::string&, const PipelinedModel&,
                                          torch::optim::Optimizer*, const ckpt::TrainingState&,
                                          const ckpt::SaveOptions&) {
  no_hdf5();
}
ckpt::LoadReport ckpt::load_sharded_checkpoint(const std::string&, PipelinedModel&,
                                               torch::optim::Optimizer*, ckpt::TrainingState*,
                                               const ckpt::LoadOptions&) {
  no_hdf5();
}
std::optional<std::string> ckpt::latest_checkpoint(const std::string&) { no_hdf5(); }
void ckpt::export_consolidated(const std::string&, const ShardedModel&, torch::optim::Optimizer*,
                               const ckpt::TrainingState&, const ckpt::ExportOptions&) {
  no_hdf5();
}
void ckpt::export_safetensors(const std::string&, const ShardedModel&, const ckpt::TrainingState&,
                              const ckpt::SafetensorsOptions&) {
  no_hdf5();
}
ckpt::LoadReport ckpt::import_consolidated(const std::string&, ShardedModel&,
                                           const ckpt::LoadOptions&) {
  no_hdf5();
}
void ckpt::export_consolidated(const std::string&, const PipelinedModel&, torch::optim::Optimizer*,
                               const ckpt::TrainingState&, const ckpt::ExportOptions&) {
  no_hdf5();
}
void ckpt::export_safetensors(const std::string&, const PipelinedModel&, const ckpt::TrainingState&,
                              const ckpt::SafetensorsOptions&) {
  no_hdf5();
}
ckpt::LoadReport ckpt::import_consolidated(const std::string&, PipelinedModel&,
                                           const ckpt::LoadOptions&) {
  no_hdf5();
}
ckpt::LoadReport ckpt::load_consolidated(const std::string&, torch::nn::Module&,
                                         const ckpt::LoadOptions&) {
  no_hdf5();
}
std::map<std::string, ckpt::AttrValue> ckpt::consolidated_attributes(const std::string&) {
  no_hdf5();
}
void ckpt::consolidate_checkpoint(const std::string&, const std::string&,
                                  const ckpt::ConsolidateOptions&) {
  no_hdf5();
}
std::string ckpt::inspect_checkpoint(const std::string&, bool) { no_hdf5(); }
}  // namespace fsdp
