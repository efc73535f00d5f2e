// Consolidated weights back into a model: import_consolidated into a sharded model
// (each rank its own slice) or a pipeline, load_consolidated into a plain module, from
// the HDF5 file of the contract or safetensors; and a file's attributes.
#include "../agree.h"
#include "../format/safetensors/safetensors.h"
#include "../name_match.h"
#include "../sharded/optim_state.h"
#include "../tensor_io.h"
#include "trace/trace.h"

#include <fsdp/checkpoint.h>
#include <fsdp/pipeline.h>
#include <fsdp/process_group.h>

#include "internal/checkpoint_view.h"

#include <filesystem>
#include <iostream>
#include <set>
#include <sstream>

namespace fs = std::filesystem;

namespace fsdp {
namespace ckpt {
namespace {

std::set<std::string> datasets_of(hid_t model, const std::string& where) {
  auto v = h5::children(model, where);
  return std::set<std::string>(v.begin(), v.end());
}

h5::Obj open_consolidated(const std::string& file) {
  h5::Obj f = h5::open_file(file);
  check_format(f, kConsolidatedFormat, file);
  return f;
}

// A consolidated file opened for loading: its /model group and dataset names.
struct ModelGroup {
  h5::Obj file;
  h5::Obj model;
  std::string where;
  std::set<std::string> names;

  explicit ModelGroup(const std::string& path)
      : file(open_consolidated(path)),
        model(h5::open_group(file, "model", path)),
        where(path + ":/model") {
    names = datasets_of(model, where);
  }
};

// Consolidated weights to load, whatever their format: the HDF5 file of the contract, or
// safetensors (a file, an index, or a directory holding either).
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  const std::set<std::string>& names() const { return names_; }
  virtual std::vector<int64_t> shape_of(const std::string& name) const = 0;
  /// Elements [first, first + count) of `name`, flattened, widened or rounded to fp32.
  virtual void read_f32(const std::string& name, int64_t first, int64_t count,
                        float* out) const = 0;
  /// The whole of `name` into `dst` (any dtype and device; shapes already checked).
  virtual void read_into(const std::string& name, const at::Tensor& dst) const = 0;

 protected:
  std::set<std::string> names_;
};

class Hdf5Source : public WeightSource {
 public:
  explicit Hdf5Source(const std::string& path) : g_(path) { names_ = g_.names; }
  ~Hdf5Source() override { h5::end_read_ahead(); }  // Note [Direct I/O]
  std::vector<int64_t> shape_of(const std::string& name) const override {
    return h5::shape_of(g_.model, name, g_.where);
  }
  void read_f32(const std::string& name, int64_t first, int64_t count, float* out) const override {
    h5::read_range(g_.model, name, first, count, out, h5::Elem::kF32, g_.where);
  }
  void read_into(const std::string& name, const at::Tensor& dst) const override {
    ckpt::read_into(g_.model, name, dst, g_.where);
  }

 private:
  ModelGroup g_;
};

class SafetensorsSource : public WeightSource {
 public:
  explicit SafetensorsSource(const std::string& path) : r_(path), where_(path) {
    for (const auto& [n, e] : r_.entries()) names_.insert(n);
  }
  std::vector<int64_t> shape_of(const std::string& name) const override {
    return r_.entries().at(name).shape;
  }
  void read_f32(const std::string& name, int64_t first, int64_t count, float* out) const override {
    const auto& e = r_.entries().at(name);
    const h5::Elem from = elem_of(e.dtype, name);
    TORCH_CHECK(from == h5::Elem::kF32 || from == h5::Elem::kBF16 || from == h5::Elem::kF16 ||
                    from == h5::Elem::kF64,
                where_, ": tensor '", name, "' is ", e.dtype,
                ", not a floating type a parameter can take");
    const size_t es = st::dtype_size(e.dtype);
    if (from == h5::Elem::kF32) {
      r_.read(name, static_cast<uint64_t>(first) * es, static_cast<uint64_t>(count) * es, out);
      return;
    }
    std::vector<uint8_t> raw(static_cast<size_t>(count) * es);
    r_.read(name, static_cast<uint64_t>(first) * es, raw.size(), raw.data());
    h5::convert(raw.data(), from, out, h5::Elem::kF32, static_cast<size_t>(count));
  }
  void read_into(const std::string& name, const at::Tensor& dst) const override {
    const auto& e = r_.entries().at(name);
    at::Tensor tmp = at::empty(e.shape, at::TensorOptions().dtype(torch_dtype(e.dtype, name)));
    if (tmp.numel() > 0) r_.read(name, 0, e.end - e.begin, tmp.data_ptr());
    at::NoGradGuard no_grad;
    dst.copy_(tmp);
  }

 private:
  h5::Elem elem_of(const std::string& d, const std::string& name) const {
    if (d == "F32") return h5::Elem::kF32;
    if (d == "BF16") return h5::Elem::kBF16;
    if (d == "F16") return h5::Elem::kF16;
    if (d == "F64") return h5::Elem::kF64;
    if (d == "I64") return h5::Elem::kI64;
    if (d == "U8") return h5::Elem::kU8;
    TORCH_CHECK(false, where_, ": tensor '", name, "' is ", d,
                ", which this library does not load");
  }
  at::ScalarType torch_dtype(const std::string& d, const std::string& name) const {
    static const std::map<std::string, at::ScalarType> m = {
        {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
        {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
        {"U8", at::kByte},    {"BOOL", at::kBool}};
    auto it = m.find(d);
    TORCH_CHECK(it != m.end(), where_, ": tensor '", name, "' is ", d,
                ", which this library does not load");
    return it->second;
  }

  st::Reader r_;
  std::string where_;
};

std::unique_ptr<WeightSource> open_weights(const std::string& path) {
  if (st::is_safetensors(path)) return std::make_unique<SafetensorsSource>(path);
  return std::make_unique<Hdf5Source>(path);
}

}  // namespace
}  // namespace ckpt

namespace ckpt {
namespace {

// import_consolidated; `stage`: `root` is a pipeline stage, and the file's names it lacks
// are the other stages' (reported as unexpected, never an error here). `apply` false:
// only matches the names and shapes (throwing as the load would), and loads nothing.
ckpt::LoadReport import_into(const std::string& file, ShardedModel& root,
                             const ckpt::LoadOptions& options, bool stage, bool apply = true) {
  detail::trace::Scope span("checkpoint", []() { return std::string("consolidated import"); });
  const auto src = open_weights(file);
  const std::set<std::string>& names = src->names();
  ckpt::LoadReport report;
  report.path = file;
  const auto shards = detail::local_shards(root);
  const auto buffers = named_buffers_clean(root.as_module());
  std::set<std::string> used;
  std::vector<std::string> mismatched;
  for (const auto& ls : shards) {
    // Tied parameters (one tensor under several names: the same offset in one unit) are
    // loaded once, from whichever name the file has: transformers, for one, writes a tied
    // embedding under its first name only.
    std::set<int64_t> present;
    for (const auto& p : ls.params) {
      if (names.count(p.fqn)) present.insert(p.offset);
    }
    for (const auto& p : ls.params) {
      if (!names.count(p.fqn)) {
        if (!present.count(p.offset)) report.missing.push_back(p.fqn);
        continue;
      }
      used.insert(p.fqn);
      auto shape = src->shape_of(p.fqn);
      if (shape != p.shape) {
        mismatched.push_back(p.fqn + " (file " + describe_shape(shape) + ", model " +
                             describe_shape(p.shape) + ")");
      }
    }
  }
  for (const auto& [name, b] : buffers) {
    if (names.count(name))
      used.insert(name);
    else
      report.missing.push_back(name);
  }
  for (const auto& n : names) {
    if (!used.count(n)) report.unexpected.push_back(n);
  }
  check_shapes_match("checkpoint " + file, mismatched);
  report_mismatch("checkpoint " + file, report.missing,
                  stage ? std::vector<std::string>{} : report.unexpected, options.strict);
  if (!apply) return report;

  at::NoGradGuard no_grad;
  for (const auto& ls : shards) {
    at::Tensor dst = ls.shard.detach();
    at::Tensor buf =
        dst.device().is_cpu() && dst.scalar_type() == at::kFloat
            ? dst
            : at::empty({dst.numel()}, dst.options().device(at::kCPU).dtype(at::kFloat));
    float* out = buf.data_ptr<float>();
    std::set<int64_t> seen;
    for (const auto& p : ls.params) {
      if (!names.count(p.fqn) || !seen.insert(p.offset).second) continue;
      const int64_t lo = std::max(ls.begin, p.offset),
                    hi = std::min(ls.begin + ls.length, p.offset + p.numel);
      if (lo < hi) src->read_f32(p.fqn, lo - p.offset, hi - lo, out + (lo - ls.begin));
    }
    if (ls.length < buf.numel()) buf.narrow(0, ls.length, buf.numel() - ls.length).zero_();
    if (!buf.is_same(dst)) dst.copy_(buf);
    ls.shard.unsafeGetTensorImpl()->bump_version();  // written through a raw pointer
  }
  for (const auto& [name, b] : buffers) {
    if (names.count(name)) src->read_into(name, b);
  }
  return report;
}

}  // namespace
}  // namespace ckpt

ckpt::LoadReport ckpt::import_consolidated(const std::string& file, ShardedModel& root,
                                           const ckpt::LoadOptions& options) {
  detail::shard_change_barrier_of(root)();  // Note [Background staging]
  return ckpt::import_into(file, root, options, /*stage=*/false);
}

ckpt::LoadReport ckpt::import_consolidated(const std::string& file, PipelinedModel& model,
                                           const ckpt::LoadOptions& options) {
  using namespace ckpt;
  const ProcessGroup& job = model.world();
  const bool staged = model.stages() > 1;
  detail::shard_change_barrier_of(model.stage_model())();  // Note [Background staging]
  const std::string what = "import_consolidated of " + file + " into a pipeline of " +
                           std::to_string(model.stages()) + " stages";
  // First the names, on every rank, so that nothing is loaded unless every stage matches.
  ckpt::LoadReport report;
  std::string error;
  std::vector<std::string> names;
  try {
    report = import_into(file, model.stage_model(), options, staged, /*apply=*/false);
    const auto all = open_weights(file)->names();
    names.assign(all.begin(), all.end());
  } catch (const std::exception& e) {
    error = e.what();
  }
  TORCH_CHECK(!any_rank_failed(job, error), what, " failed", failure_detail(error));
  if (staged) {
    // The names no stage takes: each stage's first rank marks the names it uses.
    const std::set<std::string> unused(report.unexpected.begin(), report.unexpected.end());
    auto taken = at::zeros({static_cast<int64_t>(names.size()) + 1}, at::kFloat);
    auto mark = taken.accessor<float, 1>();
    for (size_t i = 0; i < names.size(); ++i) {
      if (model.data_parallel_rank() == 0 && !unused.count(names[i]))
        mark[static_cast<int64_t>(i)] = 1.0f;
    }
    // On the model's device: the job's backend may be NCCL.
    auto summed = taken.to(model.stage_model().sharding_options().device);
    job.all_reduce_sum(summed);
    taken = summed.cpu();
    mark = taken.accessor<float, 1>();
    report.unexpected.clear();
    for (size_t i = 0; i < names.size(); ++i) {
      if (mark[static_cast<int64_t>(i)] == 0.0f) report.unexpected.push_back(names[i]);
    }
    report_mismatch("checkpoint " + file, {}, report.unexpected, options.strict);  // alike
  }
  try {
    import_into(file, model.stage_model(), options, staged);
  } catch (const std::exception& e) {
    error = e.what();
  }
  TORCH_CHECK(!any_rank_failed(job, error), what, " failed", failure_detail(error));
  return report;
}

ckpt::LoadReport ckpt::load_consolidated(const std::string& file, torch::nn::Module& module,
                                         const ckpt::LoadOptions& options) {
  using namespace ckpt;
  const auto src = open_weights(file);
  const std::set<std::string>& names = src->names();
  ckpt::LoadReport report;
  report.path = file;
  auto tensors = named_parameters_clean(module);
  for (auto& b : named_buffers_clean(module)) tensors.push_back(b);
  // Tied parameters (one tensor under several names) need one of their names in the file.
  std::set<const void*> present;
  for (const auto& [name, t] : tensors) {
    if (names.count(name)) present.insert(t.unsafeGetTensorImpl());
  }
  std::set<std::string> used;
  for (const auto& [name, t] : tensors) {
    if (!names.count(name)) {
      if (!present.count(t.unsafeGetTensorImpl())) report.missing.push_back(name);
      continue;
    }
    used.insert(name);
    auto shape = src->shape_of(name);
    TORCH_CHECK(shape == t.sizes().vec(), "checkpoint ", file, " does not match this model: ", name,
                " has shape ", describe_shape(shape), " in the file but ",
                describe_shape(t.sizes().vec()), " in the model. Was it saved from another model?");
  }
  for (const auto& n : names) {
    if (!used.count(n)) report.unexpected.push_back(n);
  }
  report_mismatch("checkpoint " + file, report.missing, report.unexpected, options.strict);
  for (const auto& [name, t] : tensors) {
    if (names.count(name)) src->read_into(name, t);
  }
  return report;
}

std::map<std::string, ckpt::AttrValue> ckpt::consolidated_attributes(const std::string& file) {
  using namespace ckpt;
  if (st::is_safetensors(file)) {
    // __metadata__ holds strings; numbers come back as numbers.
    std::map<std::string, ckpt::AttrValue> out;
    const st::Reader reader(file);
    for (const auto& [k, v] : reader.metadata()) {
      size_t used = 0;
      try {
        const long long i = std::stoll(v, &used);
        if (used == v.size()) {
          out[k] = static_cast<int64_t>(i);
          continue;
        }
        const double d = std::stod(v, &used);
        if (used == v.size()) {
          out[k] = d;
          continue;
        }
      } catch (const std::exception&) {
      }
      out[k] = v;
    }
    return out;
  }
  h5::Obj f = open_consolidated(file);
  std::map<std::string, ckpt::AttrValue> out;
  for (const auto& n : h5::attr_names(f, file)) out[n] = h5::get_attr(f, n, file);
  return out;
}

}  // namespace fsdp
