// train_llama: trains the Llama of llama_model.h (transformers' LlamaForCausalLM, its names
// and its config.json), sharded over every rank of the job, one decoder layer per unit.
// The program is train_gpt's (examples/gpt/trainer.cpp): the same flags, precision,
// sharding, offload, checkpoints, logs and --device, with the Llama's own model flags,
// --init-from a Hugging Face model directory, and --export-hf.
//
//   build/bin/train_llama --steps 200 --n-layer 4 --n-head 8 --n-kv-head 2 --d-model 256
//   build/bin/fsdp-run --nproc 2 -- build/bin/train_llama --init-from hf_dir --export-hf out
#include "../gpt/trainer.h"

int main(int argc, char** argv) {
  return gpt::run_training({"train_llama", "llama",
                            "Train the Llama example (transformers' LlamaForCausalLM), fully "
                            "sharded over the job's ranks."},
                           argc, argv);
}
