// Launch environment and rendezvous: how a process finds its peers.
#include <fsdp/process_group.h>

#include "backend.h"
#include "collective_ring.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdlib>
#include <sstream>
#include <thread>
#include <type_traits>

namespace fsdp {
namespace {

// Note [TCPStore and libuv]
// LibTorch 2.4+ has a libuv server for the TCPStore and asks for it by default
// (TCPStoreOptions::useLibUV = true); a build without libuv, such as Debian's, then
// refuses to start the store ("use_libuv was requested but PyTorch was build without
// libuv support"); PyPI's and pytorch.org's builds have it. LibTorch exports no way to
// ask whether the build has libuv, so the store is made with libuv and, if the build
// refuses ("... without libuv support"), at once again without it. USE_LIBUV other than
// 1, torch's own switch, skips the first try. Clients speak the same protocol to either
// server.

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

int parse_int(const char* name, const char* value, const char* fix) {
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(value, &end, 10);
  TORCH_CHECK(errno == 0 && end != value && *end == '\0' && v >= INT32_MIN && v <= INT32_MAX, name,
              "='", value, "' is not an integer. ", fix);
  return static_cast<int>(v);
}

int require_int(const char* name, const char* family, const char* fix) {
  const char* v = env(name);
  TORCH_CHECK(v != nullptr, name, " is not set, but other ", family,
              " variables are. Set it, or launch with fsdp-run / torchrun, which set them all. ",
              fix);
  return parse_int(name, v, fix);
}

// First host of a Slurm node list: "gpu[01-04,07],cpu3" -> "gpu01".
std::string first_slurm_host(const std::string& list) {
  std::string host;
  size_t i = 0;
  while (i < list.size() && list[i] != ',' && list[i] != '[') host += list[i++];
  if (i < list.size() && list[i] == '[') {
    ++i;
    while (i < list.size() && std::isdigit(static_cast<unsigned char>(list[i]))) host += list[i++];
  }
  return host;
}

}  // namespace

LaunchEnv read_launch_env() {
  LaunchEnv e;
  const char* fix = "";
  if (env("RANK") || env("WORLD_SIZE")) {
    fix = "torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.";
    e.source = "torchrun";
    e.rank = require_int("RANK", "torchrun", fix);
    e.world_size = require_int("WORLD_SIZE", "torchrun", fix);
    e.local_rank = env("LOCAL_RANK") ? parse_int("LOCAL_RANK", env("LOCAL_RANK"), fix) : e.rank;
  } else if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    fix = "srun sets SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID.";
    e.source = "slurm";
    e.rank = require_int("SLURM_PROCID", "Slurm", fix);
    e.world_size = require_int("SLURM_NTASKS", "Slurm", fix);
    e.local_rank = env("SLURM_LOCALID") ? parse_int("SLURM_LOCALID", env("SLURM_LOCALID"), fix) : 0;
    if (!env("MASTER_ADDR") && env("SLURM_JOB_NODELIST")) {
      e.master_addr = first_slurm_host(env("SLURM_JOB_NODELIST"));
    }
  } else if (env("OMPI_COMM_WORLD_RANK") || env("OMPI_COMM_WORLD_SIZE")) {
    fix = "mpirun sets OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE and OMPI_COMM_WORLD_LOCAL_RANK.";
    e.source = "openmpi";
    e.rank = require_int("OMPI_COMM_WORLD_RANK", "Open MPI", fix);
    e.world_size = require_int("OMPI_COMM_WORLD_SIZE", "Open MPI", fix);
    e.local_rank =
        env("OMPI_COMM_WORLD_LOCAL_RANK")
            ? parse_int("OMPI_COMM_WORLD_LOCAL_RANK", env("OMPI_COMM_WORLD_LOCAL_RANK"), fix)
            : 0;
  } else {
    return e;  // a single process
  }
  TORCH_CHECK(e.world_size >= 1, "world size ", e.world_size, " (from ", e.source,
              ") must be at least 1. ", fix);
  TORCH_CHECK(e.rank >= 0 && e.rank < e.world_size, "rank ", e.rank, " is not below world size ",
              e.world_size, " (from ", e.source, "); ranks run from 0 to ", e.world_size - 1, ". ",
              fix);
  TORCH_CHECK(e.local_rank >= 0, "local rank ", e.local_rank, " must not be negative. ", fix);
  if (e.world_size > 1) {
    if (env("MASTER_ADDR")) {
      e.master_addr = env("MASTER_ADDR");
    } else {
      TORCH_CHECK(e.source != "torchrun",
                  "MASTER_ADDR is not set: ranks need the rendezvous host (rank 0's address). "
                  "Set it, e.g. MASTER_ADDR=127.0.0.1 for one machine. ",
                  fix);
    }
    if (env("MASTER_PORT")) {
      e.master_port = parse_int("MASTER_PORT", env("MASTER_PORT"), "Use a free TCP port.");
    } else {
      TORCH_CHECK(e.source != "torchrun",
                  "MASTER_PORT is not set: ranks need the rendezvous port. Set it to a free TCP "
                  "port, e.g. MASTER_PORT=29500. ",
                  fix);
    }
    TORCH_CHECK(e.master_port > 0 && e.master_port < 65536, "MASTER_PORT=", e.master_port,
                " is not a TCP port; use one between 1 and 65535");
  }
  return e;
}

namespace {

std::chrono::milliseconds as_duration(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

// MASTER_ADDR:MASTER_PORT, for messages.
std::string rendezvous_address(const LaunchEnv& e) {
  return e.master_addr + ":" + std::to_string(e.master_port);
}

// ProcessGroupOptions::timeout_s, or FSDP_TIMEOUT_S when set.
double rendezvous_timeout_s(const ProcessGroupOptions& options) {
  double timeout_s = options.timeout_s;
  if (const char* t = env("FSDP_TIMEOUT_S")) {
    char* end = nullptr;
    timeout_s = std::strtod(t, &end);
    TORCH_CHECK(end != t && *end == '\0' && timeout_s > 0, "FSDP_TIMEOUT_S='", t,
                "' is not a positive number of seconds");
  }
  TORCH_CHECK(timeout_s > 0, "ProcessGroupOptions::timeout_s=", timeout_s, " must be positive");
  return timeout_s;
}

// "gloo" or "nccl": ProcessGroupOptions::backend, with "auto" resolved.
std::string resolve_backend(const ProcessGroupOptions& options) {
  const std::string& backend = options.backend;
  detail::check_backend_name(backend, "ProcessGroupOptions::backend", core::Surface::kApi);
  if (backend != "auto") return backend;
  // The backend of the device "auto" computes on: NCCL only when this node has a GPU for
  // each of its ranks (LOCAL_WORLD_SIZE), so CPU ranks beside too few GPUs use Gloo
  // rather than failing in cudaSetDevice.
  return backend_for(choose_device("auto", "ProcessGroupOptions::backend=auto: device"));
}

// The TCP store at MASTER_ADDR:MASTER_PORT: rank 0 serves it (unless torchrun's agent
// does), the others connect. Failures name the address and the fix.
c10::intrusive_ptr<c10d::Store> connect_store(const LaunchEnv& e, double timeout_s) {
  const std::string where = rendezvous_address(e);
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(e.master_port);
  // Under torchrun the elastic agent already serves a store on MASTER_PORT and tells
  // workers so; every rank is then a client.
  const char* agent_store = env("TORCHELASTIC_USE_AGENT_STORE");
  const bool use_agent_store = agent_store != nullptr && std::string(agent_store) == "True";
  so.isServer = e.rank == 0 && !use_agent_store;
  so.numWorkers = c10::nullopt;
  so.waitWorkers = false;
  so.timeout = as_duration(timeout_s);
  const char* use_libuv = env("USE_LIBUV");  // as torch reads it: "1" (or unset) is on
  so.useLibUV = use_libuv == nullptr || std::string(use_libuv) == "1";
  try {
    try {
      return c10::make_intrusive<c10d::TCPStore>(e.master_addr, so);
    } catch (const c10::Error& ex) {
      // Note [TCPStore and libuv]: this build has no libuv; use the classic server.
      const std::string what = ex.what_without_backtrace();
      if (what.find("without libuv support") == std::string::npos || !so.useLibUV) throw;
      so.useLibUV = false;
      return c10::make_intrusive<c10d::TCPStore>(e.master_addr, so);
    }
  } catch (const std::exception& ex) {
    std::string what = ex.what();
    if (so.isServer) {
      bool busy =
          what.find("in use") != std::string::npos || what.find("errno: 98") != std::string::npos;
      TORCH_CHECK(!busy, "rank 0 cannot serve the rendezvous: port ", e.master_port, " on ",
                  e.master_addr,
                  " is already in use. Pick a free port (MASTER_PORT, or "
                  "fsdp-run --master-port) or stop the process holding it.");
      TORCH_CHECK(false, "rank 0 cannot serve the rendezvous at ", where, ": ",
                  what.substr(0, what.find('\n')));
    }
    TORCH_CHECK(false, "rank ", e.rank, " could not reach the rendezvous at ", where, " within ",
                timeout_s,
                " s; missing ranks: [0]. Rank 0 serves the rendezvous: check that it "
                "is running and that MASTER_ADDR/MASTER_PORT point at it, or raise the timeout "
                "(FSDP_TIMEOUT_S).");
  }
}

// A hint for a rendezvous that timed out: MASTER_ADDR on loopback while the job spans
// hosts (LOCAL_WORLD_SIZE below WORLD_SIZE) means each host met at its own loopback.
// torchrun hands its workers rank 0's node name as MASTER_ADDR; where that name resolves
// to loopback, --local-addr (or --master-addr) gives a reachable one.
std::string loopback_across_hosts(const LaunchEnv& e) {
  const char* local = env("LOCAL_WORLD_SIZE");
  const bool loopback =
      e.master_addr == "localhost" || e.master_addr == "::1" || e.master_addr.rfind("127.", 0) == 0;
  if (!loopback || local == nullptr || std::atoi(local) >= e.world_size) return "";
  return " MASTER_ADDR=" + e.master_addr +
         " is loopback but the job spans hosts (LOCAL_WORLD_SIZE=" + local +
         ", WORLD_SIZE=" + std::to_string(e.world_size) +
         "): each host reaches only its own loopback. Set MASTER_ADDR to rank 0's host's "
         "address; under torchrun, pass --local-addr with each node's address (or "
         "--master-addr).";
}

// Note [Rendezvous arrival]
// Each rank announces itself under its own key and waits for all the others, so a
// timeout can name exactly the ranks that never came (c10d's own waits cannot).
void wait_for_every_rank(c10d::Store& store, const std::string& tag, const LaunchEnv& e,
                         double timeout_s) {
  const std::string where = rendezvous_address(e);
  store.set(tag + "arrived/" + std::to_string(e.rank), std::vector<uint8_t>{1});
  auto deadline = std::chrono::steady_clock::now() + as_duration(timeout_s);
  std::vector<int> missing;
  for (int r = 0; r < e.world_size; ++r) missing.push_back(r);
  auto listed = [](const std::vector<int>& ranks) {
    std::ostringstream list;
    for (size_t i = 0; i < ranks.size(); ++i) list << (i ? ", " : "") << ranks[i];
    return list.str();
  };
  while (true) {
    std::vector<int> still;
    try {
      for (int r : missing) {
        if (!store.check({tag + "arrived/" + std::to_string(r)})) still.push_back(r);
      }
    } catch (const std::exception& ex) {
      // Rank 0's process serves the store: when it gives up (or dies), the others learn it
      // here, and say what they were still waiting for.
      const std::string what = ex.what();
      TORCH_CHECK(false, "rank ", e.rank, " lost the rendezvous at ", where,
                  " while waiting for missing ranks: [", listed(missing),
                  "]: rank 0, which serves it, stopped or cannot be reached (",
                  what.substr(0, what.find('\n')),
                  "). See rank 0's error; start every rank with the same MASTER_ADDR, "
                  "MASTER_PORT and WORLD_SIZE, or raise the timeout (FSDP_TIMEOUT_S).",
                  loopback_across_hosts(e));
    }
    missing.swap(still);
    if (missing.empty()) return;
    if (std::chrono::steady_clock::now() > deadline) {
      TORCH_CHECK(false, "rendezvous at ", where, " timed out after ", timeout_s,
                  " s: ", missing.size(), " of ", e.world_size,
                  " ranks never arrived; missing ranks: [", listed(missing),
                  "]. Start every rank with the same MASTER_ADDR, MASTER_PORT and "
                  "WORLD_SIZE, or raise the timeout (FSDP_TIMEOUT_S).",
                  loopback_across_hosts(e));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace

ProcessGroup init_process_group(const ProcessGroupOptions& options) {
  LaunchEnv e = read_launch_env();
  const double timeout_s = rendezvous_timeout_s(options);
  detail::desync_debug_enabled();  // a bad FSDP_DEBUG fails here, before the rendezvous
  const std::string backend = resolve_backend(options);
  // One process needs no communication: the in-process backend, unless NCCL was asked for
  // by name under a launcher (a one-rank NCCL communicator runs the NCCL code path on one
  // GPU, as tests/test_cuda.cpp does).
  const bool nccl_by_name = options.backend == "nccl" && e.source != "single-process";
  if (e.world_size == 1 && !nccl_by_name) return ProcessGroup();

  c10::intrusive_ptr<c10d::Store> store = connect_store(e, timeout_s);
  // Keys of this launch (a torchrun restart starts a fresh set).
  const std::string tag =
      std::string("fsdp/") +
      (env("TORCHELASTIC_RESTART_COUNT") ? env("TORCHELASTIC_RESTART_COUNT") : "0") + "/";
  wait_for_every_rank(*store, tag, e, timeout_s);

  detail::BackendInit init;
  init.store = c10::make_intrusive<c10d::PrefixStore>(tag, store);
  init.rank = e.rank;
  init.size = e.world_size;
  init.timeout = as_duration(timeout_s);
  init.master_addr = e.master_addr;
  init.device_index = e.local_rank;
  // Every collective of the job is numbered and kept in the ring its errors print
  // (Note [Collective ring]).
  return detail::GroupAccess::make_group(detail::make_ring_backend(
      backend == "nccl" ? detail::make_nccl_backend(init) : detail::make_gloo_backend(init),
      e.rank));
}

}  // namespace fsdp
