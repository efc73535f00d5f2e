#pragma once
// Small models that exercise one engine behaviour each.

#include <fsdp/fsdp.h>

#include <torch/torch.h>

namespace fsdp::testing {

/// inner.a (plain) and inner.b (a wrap point inside the wrap point `inner`), then head.
class InnerImpl : public torch::nn::Module {
 public:
  InnerImpl()
      : a(register_module("a", torch::nn::Linear(8, 8))),
        b(register_module("b", FullyShardedModule<torch::nn::Linear>(torch::nn::Linear(8, 8)))) {}
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::tanh(a(x))); }
  torch::nn::Linear a;
  FullyShardedModule<torch::nn::Linear> b;
};
TORCH_MODULE(Inner);

class NestedImpl : public torch::nn::Module {
 public:
  NestedImpl()
      : inner(register_module("inner", FullyShardedModule<Inner>(Inner()))),
        head(register_module("head", torch::nn::Linear(8, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) { return head(torch::tanh(inner(x))); }
  FullyShardedModule<Inner> inner;
  torch::nn::Linear head;
};
TORCH_MODULE(Nested);

/// One wrap point called twice in a forward (weight reuse).
class ReuseImpl : public torch::nn::Module {
 public:
  ReuseImpl()
      : shared(register_module("shared",
                               FullyShardedModule<torch::nn::Linear>(torch::nn::Linear(8, 8)))),
        head(register_module("head", torch::nn::Linear(8, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) { return head(shared(torch::tanh(shared(x)))); }
  FullyShardedModule<torch::nn::Linear> shared;
  torch::nn::Linear head;
};
TORCH_MODULE(Reuse);

/// x @ w with a weight given from outside, so two modules can share one tensor.
class ProjImpl : public torch::nn::Module {
 public:
  explicit ProjImpl(torch::Tensor w) : w(register_parameter("w", std::move(w))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::matmul(x, w); }
  torch::Tensor w;
};
TORCH_MODULE(Proj);

/// Two wrap points sharing one weight tensor (tied parameters).
class TiedImpl : public torch::nn::Module {
 public:
  explicit TiedImpl(torch::Tensor w = torch::randn({8, 8}) * 0.3)
      : a(register_module("a", FullyShardedModule<Proj>(Proj(w)))),
        b(register_module("b", FullyShardedModule<Proj>(Proj(w)))),
        head(register_module("head", torch::nn::Linear(8, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) { return head(b(torch::tanh(a(x)))); }
  FullyShardedModule<Proj> a, b;
  torch::nn::Linear head;
};
TORCH_MODULE(Tied);

}  // namespace fsdp::testing
