#include "data.h"

#include "../cli.h"

#include <cmath>
#include <fstream>
#include <random>
#include <sstream>

namespace lm {
namespace {

using examples::UsageError;

const std::string kAlphabet = "abcdefghijklmnopqrstuvwxyz .,;!?";

}  // namespace

Data::Data(uint64_t seed, const std::string& path, double val_fraction)
    : seed_(seed), synthetic_(path.empty()), path_(path) {
  if (!synthetic_) {
    std::ifstream f(path, std::ios::binary);
    if (!f)
      throw UsageError("--data " + path + ": cannot open the file; give a readable text file");
    std::stringstream ss;
    ss << f.rdbuf();
    text_ = ss.str();
    train_end_ =
        text_.size() - static_cast<size_t>(static_cast<double>(text_.size()) * val_fraction);
    return;
  }
  std::mt19937_64 g(seed ^ 0x5eedULL);
  std::uniform_int_distribution<int> pick(0, static_cast<int>(kAlphabet.size()) - 1);
  for (size_t i = 0; i < kAlphabet.size(); ++i) next_.push_back({pick(g), pick(g)});
}

void Data::check(int64_t block) const {
  if (!synthetic() && static_cast<int64_t>(text_.size()) < block + 2) {
    throw UsageError("--data holds " + std::to_string(text_.size()) +
                     " bytes, fewer than --block-size + 2 = " + std::to_string(block + 2) +
                     "; use a longer file or a smaller --block-size");
  }
  const auto need = static_cast<size_t>(block + 2);
  if (!synthetic() && validates() && (train_end_ < need || text_.size() - train_end_ < need)) {
    throw UsageError("--data " + path_ + " (" + std::to_string(text_.size()) +
                     " bytes) split by --val-fraction "
                     "leaves " +
                     std::to_string(train_end_) + " bytes to train on and " +
                     std::to_string(text_.size() - train_end_) +
                     " to validate on; each needs --block-size + 2 = " + std::to_string(need) +
                     ". Use a longer file, another --val-fraction, or 0 for none");
  }
}

torch::Tensor Data::val_batch(int64_t i, int64_t rows, int64_t block) const {
  std::mt19937_64 g((seed_ ^ 0x7a11da7eULL) * 1000003ULL + static_cast<uint64_t>(i));
  auto out = torch::empty({rows, block + 1}, torch::kLong);
  auto a = out.accessor<int64_t, 2>();
  const size_t span = text_.size() - train_end_ - static_cast<size_t>(block) - 1;
  for (int64_t r = 0; r < rows; ++r) {
    const size_t start = train_end_ + g() % span;
    for (int64_t t = 0; t <= block; ++t) a[r][t] = static_cast<unsigned char>(text_[start + t]);
  }
  return out;
}

torch::Tensor Data::batch(int64_t step, int64_t rows, int64_t block) const {
  std::mt19937_64 g(seed_ * 1000003ULL + static_cast<uint64_t>(step));
  auto out = torch::empty({rows, block + 1}, torch::kLong);
  auto a = out.accessor<int64_t, 2>();
  for (int64_t r = 0; r < rows; ++r) {
    if (synthetic()) {
      int s = static_cast<int>(g() % kAlphabet.size());
      for (int64_t t = 0; t <= block; ++t) {
        a[r][t] = static_cast<unsigned char>(kAlphabet[s]);
        s = (g() % 10 < 7) ? next_[s].first : next_[s].second;
      }
    } else {
      uint64_t start = g() % (train_end_ - block - 1);
      for (int64_t t = 0; t <= block; ++t) a[r][t] = static_cast<unsigned char>(text_[start + t]);
    }
  }
  return out;
}

double Data::unigram_entropy(int64_t block) const {
  auto b = batch(-1, 256, block);
  auto counts = torch::bincount(b.reshape({-1}), {}, 256).to(torch::kDouble);
  auto p = counts / counts.sum();
  p = p.masked_select(p > 0);
  return -(p * p.log()).sum().item<double>();
}

double Data::conditional_entropy() const { return -(0.7 * std::log(0.7) + 0.3 * std::log(0.3)); }

}  // namespace lm
