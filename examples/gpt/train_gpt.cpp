// train_gpt: trains the GPT of docs/design.md, "Contracts", sharded over every rank of the
// job, one block per unit. The program is the shared trainer's
// (examples/common/trainer/trainer.cpp), which train_llama runs too.
//
//   build/bin/train_gpt --steps 200                      # one process
//   build/bin/fsdp-run --nproc 2 -- build/bin/train_gpt  # two ranks on this machine
//   build/bin/train_gpt --device cuda                    # on the GPU (NCCL between ranks)
#include "../common/trainer/trainer.h"
#include "gpt2_export.h"
#include "gpt_model.h"

int main(int argc, char** argv) {
  lm::Program p;
  p.name = "train_gpt";
  p.arch = "gpt";
  p.description = "Train the GPT example, fully sharded over the job's ranks.";
  p.block_policy = fsdp::wrap::module_type_policy<gpt::Block>();
  p.build = lm::build_sharded<gpt::GPT, lm::Config>;
  p.layers = [](const lm::Config& c) { return gpt::layer_factory(c); };
  p.layer_names = gpt::layer_param_name;
  // --export-hf: as transformers' GPT2LMHeadModel (gpt2_export.h).
  p.hf_config_json = gpt::gpt2_config_json;
  p.hf_layout = gpt::gpt2_layout;
  return lm::run_training(p, argc, argv);
}
