// The consolidated-file writer and offline consolidation. No LibTorch here: the tools
// built on this start fast and keep about one parameter in memory (see layout.h).
#include "../format/layout.h"
#include "../format/publish.h"
#include "../format/safetensors/safetensors.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <filesystem>
#include <sstream>

namespace fs = std::filesystem;

namespace fsdp::ckpt {

namespace {
// The model description a sharded checkpoint carries (rank 0's /model_attrs).
std::map<std::string, ckpt::AttrValue> model_attrs(ShardedReader& src) {
  const std::string p0 = src.file_path(0);
  h5::Obj ma = h5::open_group(src.file(0), "model_attrs", p0);
  std::map<std::string, ckpt::AttrValue> attrs;
  for (const auto& n : h5::attr_names(ma, p0)) attrs[n] = h5::get_attr(ma, n, p0);
  return attrs;
}
}  // namespace

ConsolidatedWriter::ConsolidatedWriter(const std::string& out, h5::Elem dtype, int64_t step,
                                       const std::map<std::string, ckpt::AttrValue>& attrs,
                                       const std::string& optimizer_kind)
    : path(out), tmp(out + ".tmp") {
  file = h5::create_file(tmp);
  h5::set_attr(file, "format", std::string(kConsolidatedFormat));
  h5::set_attr(file, "format_version", ckpt::kCheckpointFormatBaseVersion);
  h5::set_attr(file, "dtype", std::string(h5::elem_name(dtype)));
  h5::set_attr(file, "step", step);
  for (const auto& [k, v] : attrs) {
    TORCH_CHECK(k != "format" && k != "format_version" && k != "dtype" && k != "step",
                "model attribute '", k, "' collides with a reserved root attribute");
    h5::set_attr(file, k, v);
  }
  model = h5::create_group(file, "model", tmp);
  if (!optimizer_kind.empty()) {
    optim = h5::create_group(file, "optimizer", tmp);
    h5::set_attr(optim, "kind", optimizer_kind);
  }
}

void ConsolidatedWriter::optim_group(const std::string& fqn, int64_t step,
                                     const std::map<std::string, ckpt::AttrValue>& hp) {
  h5::Obj g = h5::create_group(optim, fqn, tmp + ":/optimizer");
  h5::set_attr(g, "step", step);
  for (const auto& [k, v] : hp) h5::set_attr(g, k, v);
}

void ConsolidatedWriter::finish() {
  h5::flush_and_sync(file, tmp);
  optim = h5::Obj();
  model = h5::Obj();
  file = h5::Obj();
  publish_atomically(tmp, path);
}

void ConsolidatedWriter::abandon() {
  optim = h5::Obj();
  model = h5::Obj();
  file = h5::Obj();
  std::error_code ec;
  fs::remove(tmp, ec);
}

h5::Elem elem_of(ExportDtype d) {
  switch (d) {
    case ExportDtype::kF32:
      return h5::Elem::kF32;
    case ExportDtype::kBF16:
      return h5::Elem::kBF16;
    case ExportDtype::kF16:
      return h5::Elem::kF16;
  }
  TORCH_CHECK(false, "internal: export dtype ", static_cast<int>(d));
}

namespace {

// The optimizer's hyperparameters per group, from rank 0's file.
std::map<int64_t, std::map<std::string, ckpt::AttrValue>> optimizer_group_hyperparams(
    hid_t f0, const std::string& p0) {
  std::map<int64_t, std::map<std::string, ckpt::AttrValue>> group_hp;
  h5::Obj og = h5::open_group(f0, "optimizer", p0);
  const int64_t groups = h5::get_int(og, "num_groups", p0);
  for (int64_t g = 0; g < groups; ++g) {
    h5::Obj gg = h5::open_group(og, "group_" + std::to_string(g), p0);
    for (const auto& n : h5::attr_names(gg, p0)) group_hp[g][n] = h5::get_attr(gg, n, p0);
  }
  return group_hp;
}

// Flat `k`'s optimizer state, one dataset per parameter and state, in fp32.
void write_flat_optim_state(
    ShardedReader& src, size_t k, ConsolidatedWriter& w,
    const std::map<int64_t, std::map<std::string, ckpt::AttrValue>>& group_hp) {
  const SourceFlat& sf = src.flats()[k];
  if (sf.optim_states.empty()) return;
  const int r = src.flat_file(k);  // the first file of its pipeline stage (rank 0's without)
  const std::string p0 = src.file_path(r);
  h5::Obj og = h5::open_group(src.file(r), src.flat_path(k) + "/optim", p0);
  const int64_t step = h5::get_int(og, "step", p0);
  static const std::map<std::string, ckpt::AttrValue> kNone;  // a group rank 0 does not list
  const auto it = group_hp.find(h5::get_int(og, "group", p0));
  const auto& hp = it == group_hp.end() ? kNone : it->second;
  for (const auto& e : sf.table) w.optim_group(e.fqn, step, hp);
  std::vector<float> buf;
  for (const auto& name : sf.optim_states) {
    for (const auto& e : sf.table) {
      buf.assign(static_cast<size_t>(e.numel), 0.0f);
      src.read(k, "optim/" + name, e.offset, e.numel, buf.data());
      h5::write(w.optim, e.fqn + "/" + name, buf.data(), h5::Elem::kF32, h5::Elem::kF32, e.shape,
                w.tmp + ":/optimizer");
    }
  }
}

// Buffers: floating ones in the export dtype (through fp32, as the live export does),
// integer ones as stored.
void write_consolidated_buffers(hid_t f0, const std::string& p0, ConsolidatedWriter& w,
                                h5::Elem dtype) {
  if (!h5::exists(f0, "buffers")) return;
  h5::Obj bg = h5::open_group(f0, "buffers", p0);
  const std::string where = p0 + ":/buffers";
  for (const auto& n : h5::children(bg, where)) {
    const auto shape = h5::shape_of(bg, n, where);
    const int64_t numel = h5::numel_of(shape, where, n);
    h5::check_fits_in_file(bg, n, numel, 1, where);  // before sizing `raw` by it
    const h5::Elem stored = h5::elem_of(bg, n, where);
    const bool floating = stored == h5::Elem::kF32 || stored == h5::Elem::kF64;
    const h5::Elem mem = floating ? h5::Elem::kF32 : stored;
    std::vector<uint8_t> raw(static_cast<size_t>(numel) * 8);
    h5::read_range(bg, n, 0, numel, raw.data(), mem, where);
    h5::write(w.model, n, raw.data(), mem, floating ? dtype : stored, shape, w.tmp + ":/model");
  }
}

}  // namespace

void consolidate_offline(const std::string& sharded, const std::string& out_file,
                         ExportDtype export_dtype, bool with_optimizer, const Progress& progress) {
  const h5::Elem dtype = elem_of(export_dtype);
  // A small chunk cache: memory stays about one parameter whatever the model size.
  ShardedReader src(sharded, 4u << 20);
  TORCH_CHECK(!with_optimizer || src.optimizer() != "none", "checkpoint ", src.dir(),
              " holds no optimizer state; drop --with-optimizer");
  hid_t f0 = src.file(0);
  const std::string p0 = src.file_path(0);
  std::map<int64_t, std::map<std::string, ckpt::AttrValue>> group_hp;
  if (with_optimizer) group_hp = optimizer_group_hyperparams(f0, p0);
  size_t total = 0, done = 0;
  for (const auto& sf : src.flats()) total += sf.table.size();

  ConsolidatedWriter w(out_file, dtype, src.step(), model_attrs(src),
                       with_optimizer ? src.optimizer() : "");
  try {
    std::vector<float> buf;
    for (size_t k = 0; k < src.flats().size(); ++k) {
      for (const auto& e : src.flats()[k].table) {
        buf.assign(static_cast<size_t>(e.numel), 0.0f);
        src.read(k, "param", e.offset, e.numel, buf.data());
        h5::write(w.model, e.fqn, buf.data(), h5::Elem::kF32, dtype, e.shape, w.tmp + ":/model");
        ++done;
        if (progress) progress(done, total, e.fqn);
      }
      if (with_optimizer) write_flat_optim_state(src, k, w, group_hp);
    }
    buf = std::vector<float>();
    // Each pipeline stage's buffers are in its first file (rank 0's alone without stages).
    for (int part = 0; part < src.parts(); ++part) {
      const int r = src.part_first(part);
      write_consolidated_buffers(src.file(r), src.file_path(r), w, dtype);
    }
    w.finish();
  } catch (...) {
    w.abandon();
    throw;
  }
}

const char* safetensors_dtype(h5::Elem e) {
  switch (e) {
    case h5::Elem::kF32:
      return "F32";
    case h5::Elem::kBF16:
      return "BF16";
    case h5::Elem::kF16:
      return "F16";
    case h5::Elem::kF64:
      return "F64";
    case h5::Elem::kI64:
      return "I64";
    case h5::Elem::kU8:
      return "U8";
  }
  return "U8";
}

std::map<std::string, std::string> safetensors_metadata(
    h5::Elem dtype, int64_t step, const std::map<std::string, ckpt::AttrValue>& attrs) {
  std::map<std::string, std::string> m;
  for (const auto& [k, v] : attrs) {
    if (k == kHfConfigAttr) continue;  // config.json, beside the weights
    if (const auto* i = std::get_if<int64_t>(&v)) {
      m[k] = std::to_string(*i);
    } else if (const auto* d = std::get_if<double>(&v)) {
      std::ostringstream os;
      os.precision(17);  // round-trips the double
      os << *d;
      m[k] = os.str();
    } else {
      m[k] = std::get<std::string>(v);
    }
  }
  // Ours last, so that a model attribute of the same name cannot replace them.
  m["format"] = "pt";
  m["fsdp_format"] = kConsolidatedFormat;
  m["fsdp_format_version"] = std::to_string(ckpt::kCheckpointFormatBaseVersion);
  m["dtype"] = h5::elem_name(dtype);
  m["step"] = std::to_string(step);
  return m;
}

void write_hf_config(const std::string& dir, const std::map<std::string, ckpt::AttrValue>& attrs) {
  auto it = attrs.find(kHfConfigAttr);
  if (it == attrs.end()) return;
  const auto* text = std::get_if<std::string>(&it->second);
  TORCH_CHECK(text != nullptr, "model attribute ", kHfConfigAttr,
              " must be a string (a Hugging Face config.json)");
  write_atomically(std::filesystem::path(dir) / "config.json", *text);
}

namespace {

size_t elem_bytes(h5::Elem e) {
  switch (e) {
    case h5::Elem::kF64:
    case h5::Elem::kI64:
      return 8;
    case h5::Elem::kF32:
      return 4;
    case h5::Elem::kF16:
    case h5::Elem::kBF16:
      return 2;
    case h5::Elem::kU8:
      return 1;
  }
  return 1;
}

// `in`, a (rows, cols) row-major matrix of `elem`-byte elements, as its transpose in `out`.
template <class T>
void transpose_2d(const T* in, std::vector<T>& out, int64_t rows, int64_t cols,
                  size_t elem = sizeof(T)) {
  const size_t per = elem / sizeof(T);  // T units per element
  out.resize(static_cast<size_t>(rows * cols) * per);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      std::copy_n(in + static_cast<size_t>(r * cols + c) * per, per,
                  out.data() + static_cast<size_t>(c * rows + r) * per);
    }
  }
}

// The buffers of a sharded checkpoint (each pipeline stage's in its first file, rank 0's
// alone without stages), in the live export's order, with their specs appended.
struct Buffers {
  struct Buffer {
    std::string name;
    std::vector<int64_t> shape;
    h5::Elem stored, mem, out;
    size_t group;  ///< in groups
  };
  std::vector<Buffer> list;
  std::vector<std::pair<std::unique_ptr<h5::Obj>, std::string>> groups;  ///< (group, where)

  Buffers(ShardedReader& src, h5::Elem dtype, const Layout& at, std::vector<st::Spec>& specs) {
    for (int part = 0; part < src.parts(); ++part) {
      const int r = src.part_first(part);
      if (!h5::exists(src.file(r), "buffers")) continue;
      const std::string where = src.file_path(r) + ":/buffers";
      groups.emplace_back(
          std::make_unique<h5::Obj>(h5::open_group(src.file(r), "buffers", src.file_path(r))),
          where);
      const h5::Obj& bg = *groups.back().first;
      for (const auto& n : h5::children(bg, where)) {
        Buffer b{n,  h5::shape_of(bg, n, where), h5::elem_of(bg, n, where), {},
                 {}, groups.size() - 1};
        const bool floating = b.stored == h5::Elem::kF32 || b.stored == h5::Elem::kF64;
        b.mem = floating ? h5::Elem::kF32 : b.stored;
        b.out = floating ? dtype : b.stored;
        if (at.name(n).empty()) continue;
        specs.push_back({at.name(n), safetensors_dtype(b.out), at.file_shape(n, b.shape)});
        list.push_back(std::move(b));
      }
    }
  }
};

}  // namespace

void consolidate_offline_safetensors(const std::string& sharded, const std::string& out_dir,
                                     ExportDtype export_dtype, uint64_t max_shard_size,
                                     const Progress& progress, const Layout& layout) {
  const h5::Elem dtype = elem_of(export_dtype);
  ShardedReader src(sharded, 4u << 20);
  const std::map<std::string, ckpt::AttrValue> attrs = model_attrs(src);
  const Layout& at = layout;
  // Every tensor, in the live export's order: each flat's table, then the buffers.
  std::vector<st::Spec> specs;
  for (const auto& sf : src.flats()) {
    for (const auto& e : sf.table) {
      if (!at.name(e.fqn).empty())
        specs.push_back({at.name(e.fqn), safetensors_dtype(dtype), at.file_shape(e.fqn, e.shape)});
    }
  }
  const Buffers buffers(src, dtype, at, specs);
  const size_t total = specs.size();
  st::DirWriter w(out_dir, specs, safetensors_metadata(dtype, src.step(), attrs), max_shard_size);
  std::vector<float> buf, turned;
  std::vector<uint8_t> out, raw, raw_turned;
  size_t i = 0;
  for (size_t k = 0; k < src.flats().size(); ++k) {
    for (const auto& e : src.flats()[k].table) {
      if (at.name(e.fqn).empty()) continue;
      buf.assign(static_cast<size_t>(e.numel), 0.0f);
      src.read(k, "param", e.offset, e.numel, buf.data());
      if (at.transposed(e.fqn, e.shape)) {
        transpose_2d(buf.data(), turned, e.shape[0], e.shape[1]);
        buf.swap(turned);
      }
      const uint64_t n = st::nbytes(specs[i]);
      if (dtype == h5::Elem::kF32) {
        w.add(i, buf.data(), n);
      } else {
        out.resize(n);
        h5::convert(buf.data(), h5::Elem::kF32, out.data(), dtype, buf.size());
        w.add(i, out.data(), n);
      }
      ++i;
      if (progress) progress(i, total, e.fqn);
    }
  }
  buf = std::vector<float>();
  for (const auto& b : buffers.list) {
    const h5::Obj& bg = *buffers.groups[b.group].first;
    const std::string& where = buffers.groups[b.group].second;
    const int64_t numel = h5::numel_of(b.shape, where, b.name);
    h5::check_fits_in_file(bg, b.name, numel, 1, where);  // before sizing `raw` by it
    raw.assign(static_cast<size_t>(numel) * 8, 0);
    h5::read_range(bg, b.name, 0, numel, raw.data(), b.mem, where);
    if (at.transposed(b.name, b.shape)) {
      transpose_2d(raw.data(), raw_turned, b.shape[0], b.shape[1], elem_bytes(b.mem));
      raw.swap(raw_turned);
    }
    const uint64_t n = st::nbytes(specs[i]);
    out.resize(n);
    h5::convert(raw.data(), b.mem, out.data(), b.out, static_cast<size_t>(numel));
    w.add(i, out.data(), n);
    ++i;
    if (progress) progress(i, total, b.name);
  }
  w.finish();
  write_hf_config(out_dir, attrs);
}

}  // namespace fsdp::ckpt
