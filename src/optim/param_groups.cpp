// Parameter groups over flat shards (see param_groups.h and docs/design.md, "Parameter
// groups over flat shards").
#include <fsdp/param_groups.h>

#include "internal/optim_view.h"

#include <algorithm>
#include <map>
#include <sstream>

namespace fsdp {

struct ShardParamGroups::State {
  ParamGroupSpec spec;
  OffloadConfig offload_optimizer;
  OffloadConfig offload_param;
  ProcessGroup process_group;                  ///< the model's
  std::function<void()> shard_change_barrier;  ///< the model's (Note [Background staging])
  std::vector<ShardSegment> segments;
  std::map<std::string, size_t> group_by_fqn;
  std::vector<int64_t> numel_total;
  std::vector<int64_t> numel_local;
  std::vector<int64_t> params_total;
  /// Per trainable shard: the shard and the indices of its segments.
  struct Shard {
    torch::Tensor shard;
    std::vector<size_t> segs;
  };
  std::vector<Shard> shards;

  // A backward starts: a gradient shard whose views all lost their .grad() (an optimizer's
  // zero_grad()) is dropped, so this backward writes a fresh one instead of adding to it.
  // Ends: each view's .grad() is its range of the gradient shard (or none).
  void observe(bool starting) {
    torch::NoGradGuard no_grad;
    for (auto& sh : shards) {
      const torch::Tensor& g = sh.shard.grad();
      if (starting) {
        if (!g.defined() || sh.segs.empty()) {
          for (size_t i : sh.segs) segments[i].view.mutable_grad() = torch::Tensor();
          continue;
        }
        const bool all_none = std::all_of(sh.segs.begin(), sh.segs.end(), [&](size_t i) {
          return !segments[i].view.grad().defined();
        });
        if (all_none) sh.shard.mutable_grad() = torch::Tensor();
        continue;
      }
      for (size_t i : sh.segs) {
        ShardSegment& s = segments[i];
        if (!g.defined()) {
          s.view.mutable_grad() = torch::Tensor();
          continue;
        }
        const torch::Tensor& vg = s.view.grad();
        if (vg.defined() && vg.is_alias_of(g) &&
            vg.storage_offset() == g.storage_offset() + s.begin)
          continue;
        // Not an autograd view of the gradient shard (set_, not narrow): an optimizer's
        // zero_grad() detaches gradients in place, which autograd refuses for views.
        s.view.mutable_grad() =
            torch::empty({0}, g.options())
                .set_(g.storage(), g.storage_offset() + s.begin, {s.numel}, {1});
      }
    }
  }
};

ParamGroupSpec no_decay_groups(double weight_decay, bool embeddings_no_decay,
                               const std::string& embedding_substring) {
  ParamGroupSpec spec;
  spec.groups = {GroupOptions{"decay", std::nullopt, std::nullopt, weight_decay},
                 GroupOptions{"no_decay", std::nullopt, std::nullopt, 0.0}};
  spec.rule = [embeddings_no_decay, embedding_substring](const ParamInfo& p) -> size_t {
    const std::string& f = p.fqn;
    const bool bias = f.size() >= 4 && f.compare(f.size() - 4, 4, "bias") == 0;
    if (bias || p.shape.size() < 2) return 1;
    if (embeddings_no_decay && f.find(embedding_substring) != std::string::npos) return 1;
    return 0;
  };
  return spec;
}

ShardParamGroups::ShardParamGroups(const ShardedModel& model, ParamGroupSpec spec)
    : state_(std::make_shared<State>()) {
  state_->offload_optimizer = model.sharding_options().offload_optimizer;
  state_->offload_param = model.sharding_options().offload_param;
  state_->process_group = model.sharding_options().process_group;
  state_->shard_change_barrier = detail::shard_change_barrier_of(model);
  TORCH_CHECK(!spec.groups.empty(),
              "ShardParamGroups: the spec has no groups; give at least one GroupOptions");
  TORCH_CHECK(static_cast<bool>(spec.rule),
              "ShardParamGroups: the spec has no rule; set ParamGroupSpec::rule");
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    TORCH_CHECK(!(spec.groups[g].lr && spec.groups[g].lr_scale), "ShardParamGroups: group ", g,
                " ('", spec.groups[g].name, "') sets both lr and lr_scale; set one of them");
  }
  State& st = *state_;
  st.spec = std::move(spec);
  const size_t ng = st.spec.groups.size();
  st.numel_total.assign(ng, 0);
  st.numel_local.assign(ng, 0);
  st.params_total.assign(ng, 0);
  torch::NoGradGuard no_grad;
  const auto shards = detail::local_shards(model);
  for (size_t k = 0; k < shards.size(); ++k) {
    const LocalShard& ls = shards[k];
    if (!ls.info.requires_grad) continue;
    State::Shard sh{ls.shard, {}};
    // One entry per tensor: aliases (tied within the unit) share offset and numel and
    // take the group of the first name.
    std::vector<std::pair<const ParamInfo*, size_t>> params;
    for (const ParamInfo& p : ls.params) {
      if (!params.empty() && params.back().first->offset == p.offset &&
          params.back().first->numel == p.numel) {
        st.group_by_fqn[p.fqn] = params.back().second;
        continue;
      }
      const size_t g = st.spec.rule(p);
      TORCH_CHECK(g < ng, "ShardParamGroups: the rule put parameter '", p.fqn, "' in group ", g,
                  " but the spec has ", ng, " groups (0 to ", ng - 1, ")");
      st.group_by_fqn[p.fqn] = g;
      st.numel_total[g] += p.numel;
      st.params_total[g] += 1;
      params.emplace_back(&p, g);
    }
    // This rank's part of each parameter, merged into runs of one group.
    const torch::Tensor base = ls.shard.detach();
    const int64_t lo = ls.begin, hi = ls.begin + ls.length;
    ShardSegment cur;
    bool open = false;
    auto close = [&]() {
      if (!open) return;
      cur.view = base.narrow(0, cur.begin, cur.numel);
      cur.view.requires_grad_(true);
      st.numel_local[cur.group] += cur.numel;
      sh.segs.push_back(st.segments.size());
      st.segments.push_back(std::move(cur));
      cur = ShardSegment{};
      open = false;
    };
    for (const auto& [p, g] : params) {
      const int64_t b = std::max(p->offset, lo), e = std::min(p->offset + p->numel, hi);
      if (b >= e) continue;
      const int64_t local = b - lo;
      if (open && (cur.group != g || cur.begin + cur.numel != local)) close();
      if (!open) {
        cur.flat = k;
        cur.unit_fqn = ls.info.unit_fqn;
        cur.begin = local;
        cur.numel = 0;
        cur.group = g;
        open = true;
      }
      cur.numel += e - b;
      cur.fqns.push_back(p->fqn);
    }
    close();
    st.shards.push_back(std::move(sh));
  }
  // The model keeps the state (and so the views) in step for as long as it lives.
  detail::add_backward_observer(model, [keep = state_](bool starting) { keep->observe(starting); });
}

size_t ShardParamGroups::num_groups() const { return state_->spec.groups.size(); }

const GroupOptions& ShardParamGroups::group_options(size_t g) const {
  TORCH_CHECK(g < num_groups(), "ShardParamGroups: group ", g, " does not exist; there are ",
              num_groups());
  return state_->spec.groups[g];
}

std::vector<torch::Tensor> ShardParamGroups::views(size_t g) const {
  std::vector<torch::Tensor> out;
  for (const auto& s : state_->segments) {
    if (s.group == g) out.push_back(s.view);
  }
  return out;
}

const std::vector<ShardSegment>& ShardParamGroups::segments() const { return state_->segments; }

size_t ShardParamGroups::group_of(const std::string& fqn) const {
  auto it = state_->group_by_fqn.find(fqn);
  TORCH_CHECK(it != state_->group_by_fqn.end(), "ShardParamGroups::group_of: '", fqn,
              "' is not a trainable parameter of the model; use a clean FQN from "
              "model.param_table()");
  return it->second;
}

int64_t ShardParamGroups::group_numel(size_t g) const {
  group_options(g);
  return state_->numel_total[g];
}

int64_t ShardParamGroups::local_group_numel(size_t g) const {
  group_options(g);
  return state_->numel_local[g];
}

std::string ShardParamGroups::describe(double default_lr, double default_weight_decay) const {
  std::ostringstream os;
  for (size_t g = 0; g < num_groups(); ++g) {
    const GroupOptions& go = group_options(g);
    const double lr = go.lr ? *go.lr : go.lr_scale ? default_lr * *go.lr_scale : default_lr;
    const double wd = go.weight_decay ? *go.weight_decay : default_weight_decay;
    os << "group " << g << " '" << go.name << "': " << state_->numel_total[g] << " elements, "
       << state_->params_total[g] << " parameters (lr " << lr << ", weight_decay " << wd << ")\n";
  }
  return os.str();
}

const OffloadConfig& ShardParamGroups::offload_optimizer() const {
  return state_->offload_optimizer;
}

const OffloadConfig& ShardParamGroups::offload_param() const { return state_->offload_param; }

const ProcessGroup& ShardParamGroups::process_group() const { return state_->process_group; }

std::function<void()> detail::shard_change_barrier_of(const ShardParamGroups& groups) {
  return groups.state_->shard_change_barrier;
}

}  // namespace fsdp
