#include "checkpoint_helpers.h"

#include <gtest/gtest.h>

#include <cctype>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <stdexcept>

namespace fsdp::testing {

std::string scratch_dir(const std::string& tag) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string var =
      "FSDP_CKPT_TEST_DIR_" + tag + "_" + info->test_suite_name() + "_" + info->name();
  for (char& c : var) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  if (const char* d = std::getenv(var.c_str())) return d;
  std::string tmpl = "/tmp/fsdp_ckpt_" + tag + "_XXXXXX";
  char* d = mkdtemp(tmpl.data());
  if (d == nullptr) throw std::runtime_error("mkdtemp failed");
  setenv(var.c_str(), d, 1);
  return d;
}

ShardingOptions options_for(const ProcessGroup& pg, wrap::WrapPolicy policy) {
  ShardingOptions o;
  o.process_group = pg;
  o.auto_wrap_policy = std::move(policy);
  return o;
}

torch::optim::AdamW make_adamw(const ShardedModel& model) {
  return torch::optim::AdamW(model.sharded_parameters(),
                             torch::optim::AdamWOptions(3e-3).weight_decay(0.01).eps(1e-6));
}

std::map<std::string, torch::Tensor> as_map(
    const std::vector<std::pair<std::string, torch::Tensor>>& v) {
  return std::map<std::string, torch::Tensor>(v.begin(), v.end());
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<no error>";
}

std::string file_bytes_of(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

ckpt::TrainingState sample_state(int64_t step) {
  ckpt::TrainingState st;
  st.step = step;
  st.scheduler = {{"last_step", static_cast<double>(step)}, {"warmup", 10.0}};
  st.extra = {{"data_position", std::to_string(step * kRows)}, {"note", "resume me"}};
  LossScalerState ls;
  ls.scale = 1024;
  ls.iteration = step;
  ls.last_overflow_iteration = 1;
  ls.hysteresis_left = 1;
  ls.skipped_steps = 2;
  st.loss_scaler = ls;
  auto c = small_gpt_config();
  st.model_attrs = {{"n_layer", c.n_layer},
                    {"n_head", c.n_head},
                    {"d_model", c.d_model},
                    {"block_size", c.block_size},
                    {"vocab_size", c.vocab_size}};
  return st;
}

void fill_with(const ShardedModel& model, int64_t step) {
  torch::NoGradGuard g;
  for (auto& p : model.sharded_parameters()) p.fill_(static_cast<float>(step));
}

}  // namespace fsdp::testing
