#pragma once
// train_gpt's data: byte-level batches, identical on every rank and world size for a
// given step. Without a file, a synthetic task generated from the seed: text from a
// random Markov chain over 32 characters in which each character has two likely
// successors. A model that ignores context cannot beat its unigram entropy; a GPT that
// learns the chain approaches the conditional entropy.

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace lm {

class Data {
 public:
  /// With a file, its last `val_fraction` is held out for validation (val_batch).
  Data(uint64_t seed, const std::string& path, double val_fraction = 0);

  bool synthetic() const { return synthetic_; }

  /// Throws a UsageError unless the file (and each part of its split) holds a block.
  void check(int64_t block) const;

  /// Whether a validation split is held out (a file and --val-fraction > 0).
  bool validates() const { return !synthetic() && train_end_ < text_.size(); }
  size_t train_bytes() const { return synthetic() ? 0 : train_end_; }
  size_t val_bytes() const { return synthetic() ? 0 : text_.size() - train_end_; }

  /// (rows, block + 1) tokens from the held-out part: validation batch `i` (fixed by the seed).
  torch::Tensor val_batch(int64_t i, int64_t rows, int64_t block) const;

  /// (rows, block + 1) tokens for `step`.
  torch::Tensor batch(int64_t step, int64_t rows, int64_t block) const;

  /// Entropy in nats of the byte distribution (the loss of a context-free model).
  double unigram_entropy(int64_t block) const;

  /// Entropy in nats of the next character given the current one (the synthetic task's floor).
  double conditional_entropy() const;

 private:
  uint64_t seed_;
  bool synthetic_;  ///< no --data: the Markov task (an empty file is an error, not this)
  std::string path_;
  std::string text_;
  size_t train_end_ = 0;  ///< text_[0, train_end_) trains; the rest validates
  std::vector<std::pair<int, int>>
      next_;  ///< per character: likely (p=0.7) and other (0.3) successor
};

}  // namespace lm
