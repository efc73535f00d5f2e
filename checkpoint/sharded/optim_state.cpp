// Optimizer state adaptor (see optim_state.h).
#include "optim_state.h"

#include "internal/optim_key.h"

#include <algorithm>
#include <iterator>

namespace fsdp::ckpt {
namespace {

double as_double(const ckpt::AttrValue& v) {
  if (const auto* i = std::get_if<int64_t>(&v)) return static_cast<double>(*i);
  if (const auto* d = std::get_if<double>(&v)) return *d;
  TORCH_CHECK(false, "optimizer hyperparameter should be a number, got a string");
}

template <class Opts>
std::map<std::string, ckpt::AttrValue> adam_like(const Opts& o) {
  return {{"lr", o.lr()},
          {"beta1", std::get<0>(o.betas())},
          {"beta2", std::get<1>(o.betas())},
          {"eps", o.eps()},
          {"weight_decay", o.weight_decay()},
          {"amsgrad", int64_t{o.amsgrad() ? 1 : 0}}};
}

template <class Opts>
void set_adam_like(Opts& o, const std::map<std::string, ckpt::AttrValue>& hp) {
  auto get = [&](const char* k, double dflt) { return hp.count(k) ? as_double(hp.at(k)) : dflt; };
  o.lr(get("lr", o.lr()));
  o.betas(
      std::make_tuple(get("beta1", std::get<0>(o.betas())), get("beta2", std::get<1>(o.betas()))));
  o.eps(get("eps", o.eps()));
  o.weight_decay(get("weight_decay", o.weight_decay()));
  o.amsgrad(get("amsgrad", o.amsgrad() ? 1 : 0) != 0);
}

template <class State>
ParamState adam_state(const State& s) {
  ParamState out;
  out.step = s.step();
  out.tensors = {{"exp_avg", s.exp_avg()}, {"exp_avg_sq", s.exp_avg_sq()}};
  if (s.max_exp_avg_sq().defined()) out.tensors.emplace_back("max_exp_avg_sq", s.max_exp_avg_sq());
  return out;
}

// Takes the tensors of `st` as they are (the loader made them for this): a copy, or a
// zero tensor made first and then replaced, would touch every byte of the optimizer
// state once more (on a virtual machine, first touches of fresh pages cost more than the
// disk read). Zeros only for a moment the file lacks.
template <class State>
std::unique_ptr<State> make_adam_state(const at::Tensor& p, ParamState&& st) {
  auto s = std::make_unique<State>();
  s->step(st.step);
  for (auto& [name, t] : st.tensors) {
    if (name == "exp_avg")
      s->exp_avg(std::move(t));
    else if (name == "exp_avg_sq")
      s->exp_avg_sq(std::move(t));
    else if (name == "max_exp_avg_sq")
      s->max_exp_avg_sq(std::move(t));
    else
      TORCH_CHECK(false, "optimizer state '", name, "' does not belong to Adam/AdamW");
  }
  if (!s->exp_avg().defined()) s->exp_avg(torch::zeros_like(p, at::MemoryFormat::Contiguous));
  if (!s->exp_avg_sq().defined()) s->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Contiguous));
  return s;
}

}  // namespace

std::string optimizer_kind(torch::optim::Optimizer& opt) {
  if (dynamic_cast<torch::optim::AdamW*>(&opt)) return "adamw";
  if (dynamic_cast<torch::optim::Adam*>(&opt)) return "adam";
  if (dynamic_cast<torch::optim::SGD*>(&opt)) return "sgd";
  TORCH_CHECK(
      false,
      "checkpoints hold the state of torch::optim::Adam, AdamW and SGD; this optimizer is none "
      "of them (pass nullptr to save or load without optimizer state)");
}

std::pair<int, int> find_param(torch::optim::Optimizer& opt, const at::Tensor& param) {
  auto& groups = opt.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& ps = groups[g].params();
    for (size_t i = 0; i < ps.size(); ++i) {
      if (ps[i].unsafeGetTensorImpl() == param.unsafeGetTensorImpl())
        return {static_cast<int>(g), static_cast<int>(i)};
    }
  }
  return {-1, -1};
}

ParamState get_param_state(torch::optim::Optimizer& opt, const at::Tensor& param) {
  auto& state = opt.state();
  auto it = state.find(detail::optim_state_key(state, param));
  if (it == state.end()) return {};
  const std::string kind = optimizer_kind(opt);
  if (kind == "adamw")
    return adam_state(static_cast<const torch::optim::AdamWParamState&>(*it->second));
  if (kind == "adam")
    return adam_state(static_cast<const torch::optim::AdamParamState&>(*it->second));
  const auto& s = static_cast<const torch::optim::SGDParamState&>(*it->second);
  ParamState out;
  if (s.momentum_buffer().defined()) out.tensors = {{"momentum_buffer", s.momentum_buffer()}};
  return out;
}

void set_param_state(torch::optim::Optimizer& opt, const at::Tensor& param, ParamState&& st) {
  auto& state = opt.state();
  const auto key = detail::optim_state_key(state, param);
  const std::string kind = optimizer_kind(opt);
  if (kind == "adamw") {
    state[key] = make_adam_state<torch::optim::AdamWParamState>(param, std::move(st));
  } else if (kind == "adam") {
    state[key] = make_adam_state<torch::optim::AdamParamState>(param, std::move(st));
  } else {
    auto s = std::make_unique<torch::optim::SGDParamState>();
    for (auto& [name, t] : st.tensors) {
      TORCH_CHECK(name == "momentum_buffer", "optimizer state '", name, "' does not belong to SGD");
      s->momentum_buffer(std::move(t));
    }
    state[key] = std::move(s);
  }
}

std::vector<std::pair<at::Tensor, int64_t>> shard_views(torch::optim::Optimizer& opt,
                                                        const at::Tensor& shard) {
  std::vector<std::pair<at::Tensor, int64_t>> out;
  for (const auto& group : opt.param_groups()) {
    for (const auto& p : group.params()) {
      if (p.unsafeGetTensorImpl() == shard.unsafeGetTensorImpl() || !p.is_alias_of(shard)) continue;
      const int64_t off = p.storage_offset() - shard.storage_offset();
      TORCH_CHECK(off >= 0 && off + p.numel() <= shard.numel() && p.is_contiguous(),
                  "checkpoint: an optimizer parameter shares a shard's storage but is not a "
                  "contiguous range of it; build views with fsdp::ShardParamGroups");
      out.emplace_back(p, off);
    }
  }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a.second < b.second; });
  return out;
}

int shard_group(torch::optim::Optimizer& opt, const at::Tensor& shard) {
  const int g = find_param(opt, shard).first;
  if (g >= 0) return g;
  const auto views = shard_views(opt, shard);
  return views.empty() ? -1 : find_param(opt, views.front().first).first;
}

ShardStateParts get_shard_state_parts(torch::optim::Optimizer& opt, const at::Tensor& shard) {
  ShardStateParts out;
  auto add = [&](const ParamState& st, int64_t off) {
    out.step = std::max(out.step, st.step);
    for (const auto& [name, t] : st.tensors) {
      auto it = std::find_if(out.states.begin(), out.states.end(),
                             [&](const auto& e) { return e.first == name; });
      if (it == out.states.end()) {
        out.states.emplace_back(name, std::vector<std::pair<int64_t, at::Tensor>>{});
        it = std::prev(out.states.end());
      }
      if (off >= 0) it->second.emplace_back(off, t.reshape({-1}));
    }
  };
  if (find_param(opt, shard).first >= 0) {
    add(get_param_state(opt, shard), 0);
    return out;
  }
  const auto views = shard_views(opt, shard);
  if (views.empty()) {
    // A rank that holds only padding of this shard has no view of it, but takes part in
    // collectives over the state as the others do: zeros named like any stepped state.
    for (const auto& group : opt.param_groups()) {
      for (const auto& p : group.params()) {
        ParamState any = get_param_state(opt, p);
        if (any.tensors.empty()) continue;
        add(any, -1);
        return out;
      }
    }
    return out;
  }
  for (const auto& [v, off] : views) add(get_param_state(opt, v), off);
  return out;
}

ParamState get_shard_state(torch::optim::Optimizer& opt, const at::Tensor& shard) {
  if (find_param(opt, shard).first >= 0) return get_param_state(opt, shard);
  const ShardStateParts parts = get_shard_state_parts(opt, shard);
  ParamState out;
  out.step = parts.step;
  for (const auto& [name, pieces] : parts.states) {
    at::Tensor t = at::zeros({shard.numel()},
                             pieces.empty() ? shard.options() : pieces.front().second.options());
    for (const auto& [off, piece] : pieces) t.narrow(0, off, piece.numel()).copy_(piece);
    out.tensors.emplace_back(name, t);
  }
  return out;
}

void set_shard_state(torch::optim::Optimizer& opt, const at::Tensor& shard, ParamState&& st) {
  if (find_param(opt, shard).first >= 0) return set_param_state(opt, shard, std::move(st));
  for (const auto& [v, off] : shard_views(opt, shard)) {
    ParamState part;
    part.step = st.step;
    for (const auto& [name, t] : st.tensors)
      part.tensors.emplace_back(name, t.reshape({-1}).narrow(0, off, v.numel()).view(v.sizes()));
    set_param_state(opt, v, std::move(part));
  }
}

std::map<std::string, ckpt::AttrValue> group_hparams(torch::optim::Optimizer& opt, size_t g) {
  auto& o = opt.param_groups().at(g).options();
  if (auto* a = dynamic_cast<torch::optim::AdamWOptions*>(&o)) return adam_like(*a);
  if (auto* a = dynamic_cast<torch::optim::AdamOptions*>(&o)) return adam_like(*a);
  auto& s = dynamic_cast<torch::optim::SGDOptions&>(o);
  return {{"lr", s.lr()},
          {"momentum", s.momentum()},
          {"dampening", s.dampening()},
          {"weight_decay", s.weight_decay()},
          {"nesterov", int64_t{s.nesterov() ? 1 : 0}}};
}

void set_group_hparams(torch::optim::Optimizer& opt, size_t g,
                       const std::map<std::string, ckpt::AttrValue>& hp) {
  auto& o = opt.param_groups().at(g).options();
  if (auto* a = dynamic_cast<torch::optim::AdamWOptions*>(&o)) return set_adam_like(*a, hp);
  if (auto* a = dynamic_cast<torch::optim::AdamOptions*>(&o)) return set_adam_like(*a, hp);
  auto& s = dynamic_cast<torch::optim::SGDOptions&>(o);
  auto get = [&](const char* k, double dflt) { return hp.count(k) ? as_double(hp.at(k)) : dflt; };
  s.lr(get("lr", s.lr()));
  s.momentum(get("momentum", s.momentum()));
  s.dampening(get("dampening", s.dampening()));
  s.weight_decay(get("weight_decay", s.weight_decay()));
  s.nesterov(get("nesterov", s.nesterov() ? 1 : 0) != 0);
}

void check_optimizer_holds(int group, int64_t length, const char* what, const std::string& unit) {
  TORCH_CHECK(group >= 0 || length == 0, what, ": the optimizer does not hold the shard of unit '",
              unit, "'. Build it from model.sharded_parameters() or fsdp::ShardParamGroups.");
}

}  // namespace fsdp::ckpt
