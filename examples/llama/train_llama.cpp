// train_llama: trains the Llama of llama_model.h (transformers' LlamaForCausalLM, its names
// and its config.json), sharded over every rank of the job, one decoder layer per unit.
// The program is train_gpt's (examples/common/trainer/trainer.cpp): the same flags,
// precision, sharding, offload, checkpoints, logs and --device, with the Llama's own model
// flags, --init-from a Hugging Face model directory, and --export-hf.
//
//   build/bin/train_llama --steps 200 --n-layer 4 --n-head 8 --n-kv-head 2 --d-model 256
//   build/bin/fsdp-run --nproc 2 -- build/bin/train_llama --init-from hf_dir --export-hf out
#include "../common/trainer/trainer.h"
#include "hf_config.h"
#include "llama_model.h"

int main(int argc, char** argv) {
  lm::Program p;
  p.name = "train_llama";
  p.arch = "llama";
  p.description =
      "Train the Llama example (transformers' LlamaForCausalLM), fully sharded over the job's "
      "ranks.";
  p.block_policy = fsdp::wrap::module_type_policy<llama::DecoderLayer>();
  p.build = [](const lm::Config& c, const fsdp::ShardingOptions& so, bool sharded) {
    return lm::build_sharded<llama::Llama>(llama::from_lm(c), so, sharded);
  };
  p.layers = [](const lm::Config& c) { return llama::layer_factory(llama::from_lm(c)); };
  p.layer_names = llama::layer_param_name;
  p.read_hf_config = llama::read_hf_config;
  p.hf_config_json = llama::hf_config_json;
  return lm::run_training(p, argc, argv);
}
