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

std::string save_sharded_checkpoint(const std::string&, const ShardedModel&,
                                    torch::optim::Optimizer*, const TrainingState&,
                                    const SaveOptions&) {
  no_hdf5();
}
LoadReport load_sharded_checkpoint(const std::string&, ShardedModel&, torch::optim::Optimizer*,
                                   TrainingState*, const LoadOptions&) {
  no_hdf5();
}
std::string save_sharded_checkpoint(const std::string&, const PipelinedModel&,
                                    torch::optim::Optimizer*, const TrainingState&,
                                    const SaveOptions&) {
  no_hdf5();
}
LoadReport load_sharded_checkpoint(const std::string&, PipelinedModel&, torch::optim::Optimizer*,
                                   TrainingState*, const LoadOptions&) {
  no_hdf5();
}
std::optional<std::string> latest_checkpoint(const std::string&) { no_hdf5(); }
void export_consolidated(const std::string&, const ShardedModel&, torch::optim::Optimizer*,
                         const TrainingState&, const ExportOptions&) {
  no_hdf5();
}
void export_safetensors(const std::string&, const ShardedModel&, const TrainingState&,
                        const SafetensorsOptions&) {
  no_hdf5();
}
LoadReport import_consolidated(const std::string&, ShardedModel&, const LoadOptions&) { no_hdf5(); }
void export_consolidated(const std::string&, const PipelinedModel&, torch::optim::Optimizer*,
                         const TrainingState&, const ExportOptions&) {
  no_hdf5();
}
void export_safetensors(const std::string&, const PipelinedModel&, const TrainingState&,
                        const SafetensorsOptions&) {
  no_hdf5();
}
LoadReport import_consolidated(const std::string&, PipelinedModel&, const LoadOptions&) {
  no_hdf5();
}
LoadReport load_consolidated(const std::string&, torch::nn::Module&, const LoadOptions&) {
  no_hdf5();
}
std::map<std::string, AttrValue> consolidated_attributes(const std::string&) { no_hdf5(); }
void consolidate_checkpoint(const std::string&, const std::string&, const ConsolidateOptions&) {
  no_hdf5();
}
std::string inspect_checkpoint(const std::string&, bool) { no_hdf5(); }
}  // namespace fsdp
