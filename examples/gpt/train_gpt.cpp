// train_gpt: trains the GPT of docs/design.md, "Contracts", sharded over every rank of the
// job. The program is trainer.cpp's, shared with train_llama.
//
//   build/bin/train_gpt --steps 200                      # one process
//   build/bin/fsdp-run --nproc 2 -- build/bin/train_gpt  # two ranks on this machine
//   build/bin/train_gpt --device cuda                    # on the GPU (NCCL between ranks)
#include "trainer.h"

int main(int argc, char** argv) {
  return gpt::run_training(
      {"train_gpt", "gpt", "Train the GPT example, fully sharded over the job's ranks."}, argc,
      argv);
}
