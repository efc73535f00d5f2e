// Consolidated checkpoints: one HDF5 file in the DESIGN layout (section 6), written
// from a live sharded model or offline from a sharded checkpoint, and read back into a
// sharded model (each rank its own slice) or a plain module.
#include "layout.h"
#include "optim_state.h"

#include <fsdp/checkpoint.h>
#include <fsdp/process_group.h>

#include <filesystem>
#include <iostream>
#include <set>
#include <sstream>

namespace fs = std::filesystem;

namespace fsdp {
namespace ckpt {
void report_mismatch(const std::string& what, const std::vector<std::string>& missing,
                     const std::vector<std::string>& unexpected, bool strict);
std::string describe_shape(const std::vector<int64_t>& s);

namespace {

h5::Elem export_elem(torch::Dtype d) {
  TORCH_CHECK(d == torch::kFloat32 || d == torch::kBFloat16 || d == torch::kFloat16, "export dtype ",
              c10::toString(d), " is not supported; use float32, bfloat16 or float16");
  return elem_of_dtype(d);
}

// The root of a consolidated file; the same calls in the same order from the live and
// the offline writer, so both files hold the same content.
struct Writer {
  std::string path;
  std::string tmp;
  h5::Obj file;
  h5::Obj model;
  h5::Obj optim;

  Writer(const std::string& out, h5::Elem dtype, int64_t step, const std::map<std::string, AttrValue>& attrs,
         const std::string& optimizer_kind)
      : path(out), tmp(out + ".tmp") {
    file = h5::create_file(tmp);
    h5::set_attr(file, "format", std::string(kConsolidatedFormat));
    h5::set_attr(file, "format_version", kCheckpointFormatVersion);
    h5::set_attr(file, "dtype", std::string(h5::elem_name(dtype)));
    h5::set_attr(file, "step", step);
    for (const auto& [k, v] : attrs) {
      TORCH_CHECK(k != "format" && k != "format_version" && k != "dtype" && k != "step", "model attribute '", k,
                  "' collides with a reserved root attribute");
      h5::set_attr(file, k, v);
    }
    model = h5::create_group(file, "model", tmp);
    if (!optimizer_kind.empty()) {
      optim = h5::create_group(file, "optimizer", tmp);
      h5::set_attr(optim, "kind", optimizer_kind);
    }
  }

  void optim_group(const std::string& fqn, int64_t step, const std::map<std::string, AttrValue>& hp) {
    h5::Obj g = h5::create_group(optim, fqn, tmp + ":/optimizer");
    h5::set_attr(g, "step", step);
    for (const auto& [k, v] : hp) h5::set_attr(g, k, v);
  }

  void finish() {
    h5::flush_and_sync(file, tmp);
    optim = h5::Obj();
    model = h5::Obj();
    file = h5::Obj();
    fs::rename(tmp, path);
  }
};

h5::Elem buffer_elem(const at::Tensor& b, h5::Elem dtype) {
  return b.is_floating_point() ? dtype : storage_elem(b.scalar_type());
}

std::set<std::string> datasets_of(hid_t model, const std::string& where) {
  auto v = h5::children(model, where);
  return std::set<std::string>(v.begin(), v.end());
}

h5::Obj open_consolidated(const std::string& file) {
  h5::Obj f = h5::open_file(file);
  check_format(f, kConsolidatedFormat, file);
  return f;
}

}  // namespace
}  // namespace ckpt

void export_consolidated(const std::string& file, WrapPointImpl& root, torch::optim::Optimizer* optimizer,
                         const TrainingState& state, const ExportOptions& options) {
  using namespace ckpt;
  const h5::Elem elem = export_elem(options.dtype);
  TORCH_CHECK(!options.with_optimizer || optimizer, "export_consolidated: with_optimizer needs the optimizer");
  const ProcessGroup& pg = root.sharding_options().process_group;
  const bool writer = pg.rank() == 0;
  const std::string kind = options.with_optimizer ? optimizer_kind(*optimizer) : "";
  std::unique_ptr<Writer> w;
  std::string error;
  // Rank 0 writes; on a write error it stops writing but keeps taking part in the
  // gathers, so no rank hangs, and everyone throws at the end.
  auto guarded = [&](const std::function<void()>& fn) {
    if (!writer || !error.empty()) return;
    try {
      fn();
    } catch (const std::exception& e) {
      error = e.what();
    }
  };
  guarded([&] { w = std::make_unique<Writer>(file, elem, state.step, state.model_attrs, kind); });

  const auto shards = root.local_shards();
  for (size_t k = 0; k < shards.size(); ++k) {
    const LocalShard& ls = shards[k];
    {
      at::Tensor full = root.gather_flat(k, ls.shard);
      guarded([&] {
        for (const auto& p : ls.params) {
          write_tensor(w->model, p.fqn, full.narrow(0, p.offset, p.numel).view(p.shape), elem, w->tmp + ":/model");
        }
      });
    }
    if (!options.with_optimizer || !ls.info.requires_grad) continue;
    ParamState st = get_param_state(*optimizer, ls.shard);
    if (st.tensors.empty()) continue;  // not stepped yet
    const auto hp = group_hparams(*optimizer, static_cast<size_t>(find_param(*optimizer, ls.shard).first));
    guarded([&] {
      for (const auto& p : ls.params) w->optim_group(p.fqn, st.step, hp);
    });
    for (const auto& [name, t] : st.tensors) {
      at::Tensor full = root.gather_flat(k, t.reshape({-1}));
      guarded([&] {
        for (const auto& p : ls.params) {
          write_tensor(w->optim, p.fqn + "/" + name, full.narrow(0, p.offset, p.numel).view(p.shape),
                       h5::Elem::kF32, w->tmp + ":/optimizer");
        }
      });
    }
    if (options.verbose && writer) {
      std::cout << "[fsdp] export: flat parameter " << k + 1 << "/" << shards.size() << " (unit '"
                << ls.info.unit_fqn << "')" << std::endl;
    }
  }
  guarded([&] {
    for (const auto& [name, b] : named_buffers_clean(root)) {
      write_tensor(w->model, name, b, buffer_elem(b, elem), w->tmp + ":/model");
    }
    w->finish();
  });
  at::Tensor failed = at::full({1}, error.empty() ? 0.0f : 1.0f);
  pg.broadcast(failed, 0);
  if (failed.item<float>() > 0) {
    if (writer) {
      w.reset();
      std::error_code ec;
      fs::remove(file + ".tmp", ec);
    }
    TORCH_CHECK(false, "export_consolidated to ", file, " failed",
                writer ? ": " + error : std::string(" on rank 0 (see its error)"));
  }
}

LoadReport import_consolidated(const std::string& file, WrapPointImpl& root, const LoadOptions& options) {
  using namespace ckpt;
  h5::Obj f = open_consolidated(file);
  h5::Obj model = h5::open_group(f, "model", file);
  const std::string where = file + ":/model";
  const std::set<std::string> names = datasets_of(model, where);
  LoadReport report;
  report.path = file;
  const auto shards = root.local_shards();
  const auto buffers = named_buffers_clean(root);
  std::set<std::string> used;
  std::vector<std::string> mismatched;
  for (const auto& ls : shards) {
    for (const auto& p : ls.params) {
      if (!names.count(p.fqn)) {
        report.missing.push_back(p.fqn);
        continue;
      }
      used.insert(p.fqn);
      auto shape = h5::shape_of(model, p.fqn, where);
      if (shape != p.shape) {
        mismatched.push_back(p.fqn + " (file " + describe_shape(shape) + ", model " + describe_shape(p.shape) + ")");
      }
    }
  }
  for (const auto& [name, b] : buffers) {
    if (names.count(name)) used.insert(name);
    else report.missing.push_back(name);
  }
  for (const auto& n : names) {
    if (!used.count(n)) report.unexpected.push_back(n);
  }
  std::string shapes;
  for (const auto& m : mismatched) shapes += (shapes.empty() ? "" : ", ") + m;
  TORCH_CHECK(mismatched.empty(), "checkpoint ", file, " does not match this model: shapes differ for ", shapes,
              ". Was it saved from another model?");
  report_mismatch("checkpoint " + file, report.missing, report.unexpected, options.strict);

  at::NoGradGuard no_grad;
  for (const auto& ls : shards) {
    at::Tensor dst = ls.shard.detach();
    at::Tensor buf = dst.device().is_cpu() ? dst : dst.to(at::kCPU);
    float* out = buf.data_ptr<float>();
    std::set<int64_t> seen;
    for (const auto& p : ls.params) {
      if (!names.count(p.fqn) || !seen.insert(p.offset).second) continue;
      const int64_t lo = std::max(ls.begin, p.offset), hi = std::min(ls.begin + ls.length, p.offset + p.numel);
      if (lo < hi) h5::read_range(model, p.fqn, lo - p.offset, hi - lo, out + (lo - ls.begin), h5::Elem::kF32, where);
    }
    if (ls.length < buf.numel()) buf.narrow(0, ls.length, buf.numel() - ls.length).zero_();
    if (!buf.is_same(dst)) dst.copy_(buf);
  }
  for (const auto& [name, b] : buffers) {
    if (names.count(name)) read_into(model, name, b, where);
  }
  return report;
}

LoadReport load_consolidated(const std::string& file, torch::nn::Module& module, const LoadOptions& options) {
  using namespace ckpt;
  h5::Obj f = open_consolidated(file);
  h5::Obj model = h5::open_group(f, "model", file);
  const std::string where = file + ":/model";
  const std::set<std::string> names = datasets_of(model, where);
  LoadReport report;
  report.path = file;
  auto tensors = named_parameters_clean(module);
  for (auto& b : named_buffers_clean(module)) tensors.push_back(b);
  std::set<std::string> used;
  for (const auto& [name, t] : tensors) {
    if (!names.count(name)) {
      report.missing.push_back(name);
      continue;
    }
    used.insert(name);
    auto shape = h5::shape_of(model, name, where);
    TORCH_CHECK(shape == t.sizes().vec(), "checkpoint ", file, " does not match this model: ", name, " has shape ",
                describe_shape(shape), " in the file but ", describe_shape(t.sizes().vec()),
                " in the model. Was it saved from another model?");
  }
  for (const auto& n : names) {
    if (!used.count(n)) report.unexpected.push_back(n);
  }
  report_mismatch("checkpoint " + file, report.missing, report.unexpected, options.strict);
  for (const auto& [name, t] : tensors) {
    if (names.count(name)) read_into(model, name, t, where);
  }
  return report;
}

std::map<std::string, AttrValue> consolidated_attributes(const std::string& file) {
  using namespace ckpt;
  h5::Obj f = open_consolidated(file);
  std::map<std::string, AttrValue> out;
  for (const auto& n : h5::attr_names(f, file)) out[n] = h5::get_attr(f, n, file);
  return out;
}

void consolidate_checkpoint(const std::string& sharded, const std::string& out_file,
                            const ConsolidateOptions& options) {
  using namespace ckpt;
  const h5::Elem elem = export_elem(options.dtype);
  // A small chunk cache: memory stays about one parameter whatever the model size.
  ShardedReader src(sharded, 4u << 20);
  TORCH_CHECK(!options.with_optimizer || src.optimizer() != "none", "checkpoint ", src.dir(),
              " holds no optimizer state; drop --with-optimizer");
  hid_t f0 = src.file(0);
  const std::string p0 = src.file_path(0);
  std::map<std::string, AttrValue> attrs;
  {
    h5::Obj ma = h5::open_group(f0, "model_attrs", p0);
    for (const auto& n : h5::attr_names(ma, p0)) attrs[n] = h5::get_attr(ma, n, p0);
  }
  std::map<int64_t, std::map<std::string, AttrValue>> group_hp;
  if (options.with_optimizer) {
    h5::Obj og = h5::open_group(f0, "optimizer", p0);
    const int64_t groups = h5::get_int(og, "num_groups", p0);
    for (int64_t g = 0; g < groups; ++g) {
      h5::Obj gg = h5::open_group(og, "group_" + std::to_string(g), p0);
      for (const auto& n : h5::attr_names(gg, p0)) group_hp[g][n] = h5::get_attr(gg, n, p0);
    }
  }
  size_t total = 0, done = 0;
  for (const auto& sf : src.flats()) total += sf.table.size();

  Writer w(out_file, elem, src.step(), attrs, options.with_optimizer ? src.optimizer() : "");
  try {
    for (size_t k = 0; k < src.flats().size(); ++k) {
      const SourceFlat& sf = src.flats()[k];
      for (const auto& e : sf.table) {
        at::Tensor buf = at::empty({e.numel}, at::kFloat);
        src.read(k, "param", e.offset, e.numel, buf.data_ptr<float>());
        write_tensor(w.model, e.fqn, buf.view(e.shape), elem, w.tmp + ":/model");
        ++done;
        if (options.progress) options.progress(done, total, e.fqn);
      }
      if (!options.with_optimizer || sf.optim_states.empty()) continue;
      h5::Obj og = h5::open_group(f0, flat_group(k) + "/optim", p0);
      const int64_t step = h5::get_int(og, "step", p0);
      const auto& hp = group_hp[h5::get_int(og, "group", p0)];
      for (const auto& e : sf.table) w.optim_group(e.fqn, step, hp);
      for (const auto& name : sf.optim_states) {
        for (const auto& e : sf.table) {
          at::Tensor buf = at::empty({e.numel}, at::kFloat);
          src.read(k, "optim/" + name, e.offset, e.numel, buf.data_ptr<float>());
          write_tensor(w.optim, e.fqn + "/" + name, buf.view(e.shape), h5::Elem::kF32, w.tmp + ":/optimizer");
        }
      }
    }
    if (h5::exists(f0, "buffers")) {
      h5::Obj bg = h5::open_group(f0, "buffers", p0);
      for (const auto& n : h5::children(bg, p0 + ":/buffers")) {
        const auto shape = h5::shape_of(bg, n, p0);
        const h5::Elem stored = h5::elem_of(bg, n, p0);
        const bool floating = stored == h5::Elem::kF32 || stored == h5::Elem::kF64;
        at::Tensor b = at::empty(shape, floating ? at::kDouble : (stored == h5::Elem::kU8 ? at::kByte : at::kLong));
        read_into(bg, n, b, p0 + ":/buffers");
        write_tensor(w.model, n, b, floating ? elem : stored, w.tmp + ":/model");
      }
    }
    w.finish();
  } catch (...) {
    w.optim = h5::Obj();
    w.model = h5::Obj();
    w.file = h5::Obj();
    std::error_code ec;
    fs::remove(w.tmp, ec);
    throw;
  }
}

}  // namespace fsdp
