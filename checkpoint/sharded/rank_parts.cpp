// The parts of a rank file besides the flat parameters, written and read side by side
// (see rank_parts.h).
#include "rank_parts.h"
#include "../tensor_io.h"
#include "optim_state.h"

#include <fsdp/fully_sharded_module.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>

#include <mutex>
#include <set>

namespace fsdp::ckpt {

// ---- /optimizer ----------------------------------------------------------------------

void write_optimizer_groups(hid_t file,
                            const std::vector<std::map<std::string, ckpt::AttrValue>>& groups,
                            const std::string& path) {
  h5::Obj og = h5::create_group(file, "optimizer", path);
  h5::set_attr(og, "num_groups", static_cast<int64_t>(groups.size()));
  for (size_t g = 0; g < groups.size(); ++g) {
    h5::Obj gg = h5::create_group(og, "group_" + std::to_string(g), path);
    for (const auto& [k, v] : groups[g]) h5::set_attr(gg, k, v);
  }
}

void read_optimizer_groups(hid_t file, const std::string& path, torch::optim::Optimizer& opt,
                           const std::string& what) {
  h5::Obj og = h5::open_group(file, "optimizer", path);
  const int64_t groups = h5::get_int(og, "num_groups", path);
  TORCH_CHECK(groups == static_cast<int64_t>(opt.param_groups().size()), what, " holds ", groups,
              " optimizer param groups but the optimizer has ", opt.param_groups().size());
  for (int64_t g = 0; g < groups; ++g) {
    h5::Obj gg = h5::open_group(og, "group_" + std::to_string(g), path);
    std::map<std::string, ckpt::AttrValue> hp;
    for (const auto& n : h5::attr_names(gg, path)) hp[n] = h5::get_attr(gg, n, path);
    set_group_hparams(opt, static_cast<size_t>(g), hp);
  }
}

// ---- /state and /model_attrs ---------------------------------------------------------

void write_training_state(hid_t file, const ckpt::TrainingState& state, const std::string& path) {
  h5::Obj sg = h5::create_group(file, "state", path);
  h5::set_attr(sg, "step", state.step);
  h5::Obj sched = h5::create_group(sg, "scheduler", path);
  for (const auto& [k, v] : state.scheduler) h5::set_attr(sched, k, v);
  h5::Obj extra = h5::create_group(sg, "extra", path);
  for (const auto& [k, v] : state.extra) h5::set_attr(extra, k, v);
  if (state.loss_scaler) {
    const LossScalerState& ls = *state.loss_scaler;
    h5::Obj lg = h5::create_group(sg, "loss_scaler", path);
    h5::set_attr(lg, "scale", ls.scale);
    h5::set_attr(lg, "iteration", ls.iteration);
    h5::set_attr(lg, "last_overflow_iteration", ls.last_overflow_iteration);
    h5::set_attr(lg, "hysteresis_left", int64_t{ls.hysteresis_left});
    h5::set_attr(lg, "skipped_steps", ls.skipped_steps);
  }
  h5::Obj ma = h5::create_group(file, "model_attrs", path);
  for (const auto& [k, v] : state.model_attrs) h5::set_attr(ma, k, v);
}

ckpt::TrainingState read_training_state(hid_t file, const std::string& path) {
  const std::string where = path + ":/state";
  ckpt::TrainingState state;
  h5::Obj sg = h5::open_group(file, "state", path);
  state.step = h5::get_int(sg, "step", where);
  h5::Obj sched = h5::open_group(sg, "scheduler", where);
  for (const auto& n : h5::attr_names(sched, where))
    state.scheduler[n] = h5::get_double(sched, n, where);
  h5::Obj extra = h5::open_group(sg, "extra", where);
  for (const auto& n : h5::attr_names(extra, where))
    state.extra[n] = h5::get_string(extra, n, where);
  if (h5::exists(sg, "loss_scaler")) {
    h5::Obj lg = h5::open_group(sg, "loss_scaler", where);
    LossScalerState ls;
    ls.scale = h5::get_double(lg, "scale", where);
    ls.iteration = h5::get_int(lg, "iteration", where);
    ls.last_overflow_iteration = h5::get_int(lg, "last_overflow_iteration", where);
    ls.hysteresis_left = static_cast<int>(h5::get_int(lg, "hysteresis_left", where));
    ls.skipped_steps = h5::get_int(lg, "skipped_steps", where);
    state.loss_scaler = ls;
  }
  h5::Obj ma = h5::open_group(file, "model_attrs", path);
  for (const auto& n : h5::attr_names(ma, path)) state.model_attrs[n] = h5::get_attr(ma, n, path);
  return state;
}

// ---- /rng ----------------------------------------------------------------------------

namespace {

// Every default generator this process has, by its dataset name.
std::vector<std::pair<std::string, at::Generator>> generators() {
  std::vector<std::pair<std::string, at::Generator>> out;
  out.emplace_back("cpu", at::detail::getDefaultCPUGenerator());
  if (torch::cuda::is_available()) {
    for (int64_t i = 0; i < static_cast<int64_t>(torch::cuda::device_count()); ++i) {
      out.emplace_back("cuda_" + std::to_string(i),
                       at::globalContext().defaultGenerator(
                           c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i))));
    }
  }
  return out;
}

}  // namespace

NamedTensors capture_rng() {
  NamedTensors out;
  for (auto& [name, gen] : generators()) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    out.emplace_back(name, at::Tensor(gen.get_state()));  // get_state() copies
  }
  return out;
}

void write_rng(hid_t file, const NamedTensors& rng, const std::string& path) {
  h5::Obj g = h5::create_group(file, "rng", path);
  for (const auto& [name, t] : rng) write_tensor(g, name, t, h5::Elem::kU8, path);
}

void restore_rng(hid_t file, const std::string& path) {
  const std::string where = path + ":/rng";
  h5::Obj g = h5::open_group(file, "rng", path);
  for (auto& [name, gen] : generators()) {
    // A file from a machine with fewer GPUs has fewer CUDA generators; "cpu" is required.
    if (name != "cpu" && !h5::exists(g, name)) continue;
    at::Tensor st = at::empty(h5::shape_of(g, name, path), at::kByte);
    h5::read_range(g, name, 0, st.numel(), st.data_ptr(), h5::Elem::kU8, where);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(st);
  }
}

// ---- /buffers ------------------------------------------------------------------------

void write_buffers(hid_t file, const NamedTensors& buffers, const std::string& path) {
  h5::Obj g = h5::create_group(file, "buffers", path);
  for (const auto& [name, b] : buffers)
    write_tensor(g, name, b, storage_elem(b.scalar_type()), path + ":/buffers");
}

void read_buffers(hid_t file, const std::string& path, const torch::nn::Module& module,
                  std::vector<std::string>& missing, std::vector<std::string>& unexpected) {
  if (!h5::exists(file, "buffers")) return;
  const std::string where = path + ":/buffers";
  h5::Obj g = h5::open_group(file, "buffers", path);
  std::set<std::string> in_file;
  for (const auto& n : h5::children(g, where)) in_file.insert(n);
  for (const auto& [name, b] : named_buffers_clean(module)) {
    if (!in_file.count(name)) {
      missing.push_back(name);
      continue;
    }
    read_into(g, name, b, where);
    in_file.erase(name);
  }
  for (const auto& n : in_file) unexpected.push_back(n);
}

}  // namespace fsdp::ckpt
