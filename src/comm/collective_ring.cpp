// The collective ring and the desync check (Note [Collective ring]).
#include "collective_ring.h"

#include "trace/trace.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <sstream>

namespace fsdp::detail {
namespace {

thread_local std::string t_label;

constexpr size_t kRingSize = 16;

/// One collective as this rank issued it.
struct TraceEntry {
  int64_t seq = 0;
  std::string group;
  std::string op;
  std::string label;
  int64_t bytes = 0;
  int root = -1;              ///< broadcast root, -1 otherwise
  std::atomic<int> state{0};  ///< 0 in flight, 1 completed, 2 failed
  /// Note [Per-unit trace]: when it was issued (-1: not traced), and whether its span on
  /// the communication track is written (by the completion callback or the wait).
  int64_t begin_ns = -1;
  std::atomic<bool> span_written{false};
};

// "blocks.0" for "unit 'blocks.0'", "<root>" for the root unit, other labels as they are.
std::string span_subject(const std::string& label) {
  if (label == "the root unit") return "<root>";
  const std::string unit = "unit '";
  if (label.size() > unit.size() + 1 && label.compare(0, unit.size(), unit) == 0 &&
      label.back() == '\'') {
    return label.substr(unit.size(), label.size() - unit.size() - 1);
  }
  return label.empty() ? std::string("(no unit)") : label;
}

std::string span_name(const TraceEntry& e) { return e.op + " " + span_subject(e.label); }

// The collective's span on the communication track, from issue to `end_ns`; once.
void write_comm_span(TraceEntry& e, int64_t end_ns) {
  if (e.begin_ns < 0 || e.span_written.exchange(true)) return;
  trace::span(span_name(e), "comm", trace::Track::kComm, e.begin_ns, end_ns,
              "\"bytes\":" + std::to_string(e.bytes) + ",\"group\":" +
                  nlohmann::json(e.group).dump() + ",\"seq\":" + std::to_string(e.seq));
}

std::mutex g_ring_mu;
std::deque<std::shared_ptr<TraceEntry>> g_ring;  // newest last

std::string human_bytes(int64_t b) {
  std::ostringstream s;
  if (b < 1024) {
    s << b << " B";
  } else {
    const char* unit[] = {"KiB", "MiB", "GiB", "TiB"};
    double v = static_cast<double>(b) / 1024;
    int u = 0;
    while (v >= 1024 && u < 3) {
      v /= 1024;
      ++u;
    }
    s.setf(std::ios::fixed);
    s.precision(1);
    s << v << " " << unit[u];
  }
  return s.str();
}

std::string what_of(const std::string& op, const std::string& label, int64_t bytes, int root) {
  std::string s = op;
  if (root >= 0) s += " from rank " + std::to_string(root);
  s += " for " + (label.empty() ? std::string("no unit") : label) + ", " + human_bytes(bytes);
  return s;
}

std::string describe(const TraceEntry& e) {
  const int st = e.state.load();
  return "#" + std::to_string(e.seq) + " on " + e.group + ": " +
         what_of(e.op, e.label, e.bytes, e.root) +
         (st == 0   ? " (in flight)"
          : st == 1 ? " (completed)"
                    : " (failed)");
}

std::string error_text(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

/// A fingerprint of one collective, exchanged before it under FSDP_DEBUG=desync.
struct Fingerprint {
  int64_t seq;
  int64_t global_rank;
  int64_t bytes;
  int64_t root;
  char op[32];
  char label[160];

  bool same_collective(const Fingerprint& o) const {
    return seq == o.seq && bytes == o.bytes && root == o.root &&
           std::strncmp(op, o.op, sizeof op) == 0 &&
           std::strncmp(label, o.label, sizeof label) == 0;
  }
  std::string text() const {
    return what_of(std::string(op, strnlen(op, sizeof op)),
                   std::string(label, strnlen(label, sizeof label)), bytes,
                   static_cast<int>(root)) +
           " (#" + std::to_string(seq) + ")";
  }
};

void copy_field(char* dst, size_t cap, const std::string& s) {
  std::memset(dst, 0, cap);
  std::memcpy(dst, s.data(), std::min(s.size(), cap - 1));
}

std::string failure_message(int global_rank, const std::string& group, int size, bool desync,
                            const TraceEntry& e, const std::string& error,
                            const std::function<std::string()>& peer_report) {
  std::ostringstream s;
  s << "rank " << global_rank << ": collective #" << e.seq << " on " << group << " (" << size
    << " ranks), " << what_of(e.op, e.label, e.bytes, e.root) << ", did not complete: " << error;
  if (peer_report) {  // Note [Peer probe]
    const std::string silent = peer_report();
    s << "\n"
      << (silent.empty() ? "Every other rank of this group still answers a probe (one of them "
                           "may itself be waiting for a rank elsewhere)."
                         : "It waited for peers that do not answer: " + silent + ".");
  }
  s << "\nThis rank's recent collectives, oldest first:";
  for (const auto& line : recent_collectives()) s << "\n  " << line;
  if (!desync) {
    s << "\nIf another rank's list differs, the ranks are out of step (a unit called on some ranks "
         "only, or in another order); run with FSDP_DEBUG=desync to stop at the first collective "
         "that differs.";
  }
  return s.str();
}

class TracedWork : public Work {
 public:
  TracedWork(std::shared_ptr<Work> inner, std::shared_ptr<TraceEntry> entry,
             std::function<std::string(const std::string&)> fail)
      : inner_(std::move(inner)), entry_(std::move(entry)), fail_(std::move(fail)) {}
  void wait() override {
    if (entry_->state.load() == 1) return;
    {
      trace::Scope waiting("wait", [&]() { return "wait " + span_name(*entry_); });
      try {
        inner_->wait();
      } catch (const std::exception& e) {
        entry_->state = 2;
        TORCH_CHECK(false, fail_(error_text(e)));
      }
    }
    write_comm_span(*entry_, trace::now_ns());
    entry_->state = 1;
  }

 private:
  std::shared_ptr<Work> inner_;
  std::shared_ptr<TraceEntry> entry_;
  std::function<std::string(const std::string&)> fail_;
};

class RingBackend : public Backend {
 public:
  RingBackend(std::shared_ptr<Backend> inner, int global_rank, std::string group, bool desync)
      : inner_(std::move(inner)),
        global_rank_(global_rank),
        group_(std::move(group)),
        desync_(desync),
        peer_report_(inner_->peer_report()) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string name() const override { return inner_->name(); }
  double timeout_s() const override { return inner_->timeout_s(); }

  std::shared_ptr<Work> all_gather(const at::Tensor& full, const at::Tensor& shard) override {
    auto e = begin("all_gather", full, -1);
    return traced(e, [&]() { return inner_->all_gather(full, shard); });
  }
  std::shared_ptr<Work> reduce_scatter_sum(const at::Tensor& full,
                                           const at::Tensor& shard) override {
    auto e = begin("reduce_scatter", full, -1);
    return traced(e, [&]() { return inner_->reduce_scatter_sum(full, shard); });
  }
  std::shared_ptr<Work> all_reduce(const at::Tensor& tensor, ReduceKind kind) override {
    auto e = begin(kind == ReduceKind::kSum ? "all_reduce(sum)" : "all_reduce(max)", tensor, -1);
    return traced(e, [&]() { return inner_->all_reduce(tensor, kind); });
  }
  void broadcast(const at::Tensor& tensor, int root) override {
    auto e = begin("broadcast", tensor, root);
    traced(e, [&]() {
      inner_->broadcast(tensor, root);
      return std::make_shared<DoneWork>();
    })->wait();
  }
  std::shared_ptr<Work> all_to_all(const at::Tensor& out, const at::Tensor& in) override {
    auto e = begin("all_to_all", in, -1);
    return traced(e, [&]() { return inner_->all_to_all(out, in); });
  }
  int64_t wire_bytes(WireOp op, int64_t bytes, at::ScalarType dtype, int root) const override {
    return inner_->wire_bytes(op, bytes, dtype, root);
  }
  void barrier() override {
    auto e = begin("barrier", at::Tensor(), -1);
    traced(e, [&]() {
      inner_->barrier();
      return std::make_shared<DoneWork>();
    })->wait();
  }
  // Point to point goes by the ring: each rank's sequence differs by design.
  std::shared_ptr<Work> send(const at::Tensor& tensor, int dst, int tag) override {
    return inner_->send(tensor, dst, tag);
  }
  std::shared_ptr<Work> recv(const at::Tensor& tensor, int src, int tag) override {
    return inner_->recv(tensor, src, tag);
  }
  std::shared_ptr<Backend> split(const std::vector<std::vector<int>>& groups) override {
    auto sub = inner_->split(groups);
    if (sub->size() == 1) return sub;
    auto mine = find_group(groups, size(), rank());
    std::string name = group_ == "world" ? "ranks [" : group_ + "'s ranks [";
    for (size_t i = 0; i < mine.size(); ++i) name += (i ? ", " : "") + std::to_string(mine[i]);
    return std::make_shared<RingBackend>(sub, global_rank_, name + "]", desync_);
  }

 private:
  std::shared_ptr<TraceEntry> begin(const char* op, const at::Tensor& t, int root) {
    auto e = std::make_shared<TraceEntry>();
    e->seq = ++seq_;
    e->group = group_;
    e->op = op;
    e->label = t_label;
    e->bytes = t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
    e->root = root;
    {
      std::lock_guard<std::mutex> lock(g_ring_mu);
      g_ring.push_back(e);
      while (g_ring.size() > kRingSize) g_ring.pop_front();
    }
    if (desync_) check_in_step(*e, t.defined() ? t.device() : at::Device(at::kCPU));
    return e;
  }

  template <class Issue>
  std::shared_ptr<Work> traced(const std::shared_ptr<TraceEntry>& e, Issue&& issue) {
    // By value: a Work may be waited for after its backend is gone.
    auto fail = [rank = global_rank_, group = group_, size = size(), desync = desync_, e,
                 report = peer_report_](const std::string& error) {
      return failure_message(rank, group, size, desync, *e, error, report);
    };
    std::shared_ptr<Work> w;
    if (trace::on()) e->begin_ns = trace::now_ns();
    try {
      w = issue();
    } catch (const std::exception& ex) {
      e->state = 2;
      TORCH_CHECK(false, fail(error_text(ex)));
    }
    if (e->begin_ns >= 0) {
      // The span ends when the backend reports completion, where it can; else at the wait.
      w->on_completion([e]() { write_comm_span(*e, trace::now_ns()); });
    }
    return std::make_shared<TracedWork>(std::move(w), e, fail);
  }

  std::string failure(const TraceEntry& e, const std::string& error) const {
    return failure_message(global_rank_, group_, size(), desync_, e, error, peer_report_);
  }

  // Under FSDP_DEBUG=desync: every rank of the group learns every rank's next collective
  // and all fail alike when they differ.
  void check_in_step(TraceEntry& e, at::Device device) {
    Fingerprint mine{};
    mine.seq = e.seq;
    mine.global_rank = global_rank_;
    mine.bytes = e.bytes;
    mine.root = e.root;
    copy_field(mine.op, sizeof mine.op, e.op);
    copy_field(mine.label, sizeof mine.label, e.label);
    const int64_t n = static_cast<int64_t>(sizeof(Fingerprint));
    at::Tensor in = at::empty({n}, at::kByte);
    std::memcpy(in.data_ptr(), &mine, sizeof mine);
    at::Tensor out = at::empty({n * size()}, at::TensorOptions(at::kByte).device(device));
    try {
      inner_->all_gather(out, in.to(device))->wait();
    } catch (const std::exception& ex) {
      e.state = 2;
      TORCH_CHECK(false,
                  failure(e, "comparing collectives across ranks (FSDP_DEBUG=desync) failed: " +
                                 error_text(ex)));
    }
    at::Tensor host = out.cpu();
    std::vector<Fingerprint> all(static_cast<size_t>(size()));
    std::memcpy(all.data(), host.data_ptr(), all.size() * sizeof(Fingerprint));
    bool same = true;
    for (const auto& f : all) same = same && f.same_collective(all[0]);
    if (same) return;
    e.state = 2;
    // Ranks grouped by what they were about to run.
    std::vector<std::pair<std::string, std::vector<int64_t>>> kinds;
    for (const auto& f : all) {
      const std::string t = f.text();
      auto it =
          std::find_if(kinds.begin(), kinds.end(), [&](const auto& k) { return k.first == t; });
      if (it == kinds.end()) {
        kinds.push_back({t, {f.global_rank}});
      } else {
        it->second.push_back(f.global_rank);
      }
    }
    std::ostringstream s;
    s << "collectives out of step on " << group_
      << " (FSDP_DEBUG=desync): the ranks were about to run "
      << "different collectives:";
    for (const auto& [t, ranks] : kinds) {
      s << "\n  rank" << (ranks.size() > 1 ? "s " : " ");
      for (size_t i = 0; i < ranks.size(); ++i) s << (i ? ", " : "") << ranks[i];
      s << ": " << t;
    }
    s << "\nEvery rank must run the same collectives in the same order: call the same wrapped "
         "units, "
         "in the same order, on every rank (and train, evaluate and save together).";
    TORCH_CHECK(false, s.str());
  }

  std::shared_ptr<Backend> inner_;
  int global_rank_;
  std::string group_;
  bool desync_;
  std::function<std::string()> peer_report_;  ///< Note [Peer probe]
  int64_t seq_ = 0;
};

}  // namespace

CollectiveLabel::CollectiveLabel(std::string what) : previous_(std::move(t_label)) {
  t_label = std::move(what);
}
CollectiveLabel::~CollectiveLabel() { t_label = std::move(previous_); }

std::vector<std::string> recent_collectives() {
  std::lock_guard<std::mutex> lock(g_ring_mu);
  std::vector<std::string> out;
  for (const auto& e : g_ring) out.push_back(describe(*e));
  return out;
}

bool desync_debug_enabled() {
  const char* v = std::getenv("FSDP_DEBUG");
  if (v == nullptr) return false;
  bool desync = false;
  std::stringstream list(v);
  for (std::string item; std::getline(list, item, ',');) {
    if (item == "desync") {
      desync = true;
    } else if (!item.empty()) {
      TORCH_CHECK(false, "FSDP_DEBUG='", v, "' lists '", item,
                  "', which is not a debug mode; the modes are: desync (compare every collective "
                  "across ranks before it runs)");
    }
  }
  return desync;
}

std::shared_ptr<Backend> make_ring_backend(std::shared_ptr<Backend> inner, int global_rank,
                                           std::string group) {
  if (inner->size() == 1) return inner;
  const bool desync = desync_debug_enabled();
  return std::make_shared<RingBackend>(std::move(inner), global_rank, std::move(group), desync);
}

}  // namespace fsdp::detail
