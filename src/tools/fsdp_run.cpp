// fsdp-run: starts N local ranks with the torchrun environment.
//
//   fsdp-run --nproc N [--master-port P] [--tee] [--peak-rss-json FILE] -- CMD ARGS...
//
// Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
// MASTER_PORT (and OMP_NUM_THREADS=1 unless set, as torchrun). SIGINT and SIGTERM are forwarded to
// every rank. If a rank fails, the others are stopped and fsdp-run exits non-zero, naming the rank
// and how it ended.
// --peak-rss-json writes each rank's peak resident memory ({"peak_rss_kb": [...]}, from
// wait4): the rank process's own, unlike the getrusage(RUSAGE_CHILDREN) or wait4 figure
// of fsdp-run itself, which keeps the peak of whatever process exec'd fsdp-run (the
// kernel carries a process's maximum RSS across exec).
#include <fsdp/version.h>
#include "tool_main.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

namespace {

volatile sig_atomic_t g_signal = 0;
void on_signal(int sig) { g_signal = sig; }

const char* kUsage =
    "usage: fsdp-run --nproc N [--master-port P] [--tee] [--peak-rss-json FILE] -- CMD ARGS...\n";

int usage(const std::string& why) {
  std::cerr << "fsdp-run: error: " << why << "\n" << kUsage;
  return 2;
}

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  int port = ntohs(a.sin_port);
  close(fd);
  return port;
}

bool parse_int(const std::string& s, int& out) {
  char* end = nullptr;
  long v = std::strtol(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || v < INT32_MIN || v > INT32_MAX) return false;
  out = static_cast<int>(v);
  return true;
}

std::string describe(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    const char* name = sigabbrev_np(sig);
    return std::string("was killed by signal ") +
           (name ? std::string("SIG") + name : std::to_string(sig));
  }
  return "ended with status " + std::to_string(status);
}

/// What the command line asks for.
struct Args {
  int nproc = -1;            ///< ranks to start
  int port = 0;              ///< rendezvous port; 0: a free one
  bool tee = false;          ///< prefix each output line with its rank
  std::string rss_json;      ///< where to write each rank's peak RSS ("": nowhere)
  char** command = nullptr;  ///< the rank's argv, from the first word after --
};

// Reads the flags into `args`. Returns an exit status when the run ends here (help,
// version, bad usage), or -1 to go on.
int parse_args(int argc, char** argv, Args& args) {
  int i = 1;
  for (; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (a == "--version") {
      std::cout << fsdp::version_line("fsdp-run") << "\n";
      return 0;
    }
    if (a == "-h" || a == "--help") {
      std::cout << kUsage
                << "  --nproc N        ranks to start on this machine\n"
                   "  --master-port P  rendezvous port (default: a free one)\n"
                   "  --tee            prefix every output line with its rank\n"
                   "  --peak-rss-json FILE  at the end, write each rank's peak RSS: "
                   "{\"peak_rss_kb\": [...]}\n"
                   "  --version        print the version\n";
      return 0;
    }
    // --flag=value or --flag value
    auto value = [&]() -> std::string {
      auto eq = a.find('=');
      if (eq != std::string::npos) return a.substr(eq + 1);
      return i + 1 < argc ? argv[++i] : "";
    };
    if (a == "--nproc" || a.rfind("--nproc=", 0) == 0) {
      std::string v = value();
      if (!parse_int(v, args.nproc) || args.nproc < 1)
        return usage("--nproc '" + v + "' must be a positive integer");
    } else if (a == "--master-port" || a.rfind("--master-port=", 0) == 0) {
      std::string v = value();
      if (!parse_int(v, args.port) || args.port < 1 || args.port > 65535) {
        return usage("--master-port '" + v + "' must be a TCP port between 1 and 65535");
      }
    } else if (a == "--tee") {
      args.tee = true;
    } else if (a == "--peak-rss-json" || a.rfind("--peak-rss-json=", 0) == 0) {
      args.rss_json = value();
      if (args.rss_json.empty()) return usage("--peak-rss-json needs a file name");
      if (!std::ofstream(args.rss_json))
        return usage("--peak-rss-json " + args.rss_json + ": cannot write the file");
    } else {
      return usage("unknown option '" + a + "'; put the command after --");
    }
  }
  if (args.nproc < 1) return usage("--nproc N is required");
  if (i >= argc) return usage("no command given after --");
  args.command = argv + i;
  return -1;
}

// In the child: the torchrun environment of rank `r`, then the command.
[[noreturn]] void exec_rank(const Args& args, int r, const int fds[2]) {
  const int nproc = args.nproc;
  setenv("RANK", std::to_string(r).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(nproc).c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
  setenv("GROUP_RANK", "0", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(args.port).c_str(), 1);
  // As torchrun does: N ranks on one node share its cores, so each gets one
  // intra-op thread unless the user chose otherwise. (It also makes runs under
  // both launchers compute bit for bit alike.)
  if (nproc > 1) setenv("OMP_NUM_THREADS", "1", 0);
  if (args.tee) {
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    close(fds[0]);
    close(fds[1]);
  }
  execvp(args.command[0], args.command);
  std::cerr << "fsdp-run: cannot run '" << args.command[0] << "': " << std::strerror(errno) << "\n";
  _exit(127);
}

/// The started ranks: their processes and, with --tee, the read ends of their output.
struct Ranks {
  std::vector<pid_t> pids;  ///< -1 once reaped
  std::vector<int> pipes;   ///< -1 without --tee, or once closed
  void kill_all(int sig) const {
    for (pid_t p : pids) {
      if (p > 0) kill(p, sig);
    }
  }
};

// Forks every rank. Returns false (after saying why) if a pipe or a fork failed.
bool start_ranks(const Args& args, Ranks& ranks) {
  ranks.pids.assign(args.nproc, -1);
  ranks.pipes.assign(args.nproc, -1);
  for (int r = 0; r < args.nproc; ++r) {
    int fds[2] = {-1, -1};
    if (args.tee && pipe(fds) != 0) {
      std::perror("fsdp-run: pipe");
      return false;
    }
    pid_t pid = fork();
    if (pid < 0) {
      std::perror("fsdp-run: fork");
      return false;
    }
    if (pid == 0) exec_rank(args, r, fds);
    ranks.pids[r] = pid;
    if (args.tee) {
      close(fds[1]);
      ranks.pipes[r] = fds[0];
    }
  }
  return true;
}

// --tee: copies whole lines from the ranks' pipes to stdout, each prefixed with its rank.
class OutputPump {
 public:
  explicit OutputPump(Ranks& ranks) : ranks_(ranks), partial_(ranks.pipes.size()) {}

  // Waits up to `timeout_ms` for output (or just sleeps without --tee) and copies it.
  void pump(bool tee, int timeout_ms) {
    if (!tee) {
      std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
      return;
    }
    std::vector<pollfd> pf;
    for (int fd : ranks_.pipes) {
      if (fd >= 0) pf.push_back({fd, POLLIN, 0});
    }
    if (pf.empty() || poll(pf.data(), pf.size(), timeout_ms) <= 0) return;
    for (auto& p : pf) {
      if (p.revents & (POLLIN | POLLHUP)) read_from(p.fd);
    }
  }

  bool open() const {
    return std::any_of(ranks_.pipes.begin(), ranks_.pipes.end(), [](int fd) { return fd >= 0; });
  }

 private:
  void read_from(int fd) {
    size_t r = 0;
    while (ranks_.pipes[r] != fd) ++r;
    std::string& partial = partial_[r];
    char buf[4096];
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) {
      if (!partial.empty()) std::cout << "[rank " << r << "] " << partial << "\n";
      partial.clear();
      close(fd);
      ranks_.pipes[r] = -1;
      return;
    }
    partial.append(buf, static_cast<size_t>(n));
    size_t nl;
    while ((nl = partial.find('\n')) != std::string::npos) {
      std::cout << "[rank " << r << "] " << partial.substr(0, nl) << "\n";
      partial.erase(0, nl + 1);
    }
    std::cout.flush();
  }

  Ranks& ranks_;
  std::vector<std::string> partial_;  ///< each rank's output after its last newline
};

/// Waits for every rank: forwards SIGINT/SIGTERM, stops the others when one fails
/// (SIGTERM, then SIGKILL after a grace period), and keeps each rank's peak RSS.
class Supervisor {
 public:
  Supervisor(const Args& args, Ranks& ranks)
      : args_(args), ranks_(ranks), pump_(ranks), peak_rss_kb_(ranks.pids.size(), 0) {}

  // Returns fsdp-run's exit status.
  int wait_all() {
    int alive = args_.nproc;
    while (alive > 0) {
      pump_.pump(args_.tee, 50);
      if (g_signal != 0 && !stopping_) {
        std::cerr << "fsdp-run: received signal " << g_signal << "; forwarding it to every rank\n";
        stop(g_signal, 128 + g_signal, 10);
      }
      for (int r = 0; r < args_.nproc; ++r) alive -= reap(r, alive) ? 1 : 0;
      if (stopping_ && alive > 0 && std::chrono::steady_clock::now() > deadline_)
        ranks_.kill_all(SIGKILL);
    }
    while (args_.tee && pump_.open()) pump_.pump(true, 50);
    return exit_code_;
  }

  const std::vector<long>& peak_rss_kb() const { return peak_rss_kb_; }

 private:
  // Sends `sig` to every rank; SIGKILL follows after `grace_s` seconds.
  void stop(int sig, int exit_code, int grace_s) {
    ranks_.kill_all(sig);
    stopping_ = true;
    exit_code_ = exit_code;
    deadline_ = std::chrono::steady_clock::now() + std::chrono::seconds(grace_s);
  }

  // Reaps rank `r` if it ended; `alive` counts it still. Returns whether it ended.
  bool reap(int r, int alive) {
    if (ranks_.pids[r] <= 0) return false;
    int status = 0;
    rusage ru{};
    if (wait4(ranks_.pids[r], &status, WNOHANG, &ru) != ranks_.pids[r]) return false;
    peak_rss_kb_[static_cast<size_t>(r)] = ru.ru_maxrss;  // KiB on Linux
    ranks_.pids[r] = -1;
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!ok && !stopping_) {
      std::cerr << "fsdp-run: rank " << r << " " << describe(status) << "; stopping the other "
                << alive - 1 << " rank(s)\n";
      stop(SIGTERM, WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), 3);
    }
    return true;
  }

  const Args& args_;
  Ranks& ranks_;
  OutputPump pump_;
  std::vector<long> peak_rss_kb_;
  bool stopping_ = false;
  int exit_code_ = 0;
  std::chrono::steady_clock::time_point deadline_ = std::chrono::steady_clock::now();
};

void write_rss_json(const std::string& file, const std::vector<long>& peak_rss_kb) {
  std::ofstream out(file);
  out << "{\"peak_rss_kb\": [";
  for (size_t r = 0; r < peak_rss_kb.size(); ++r) out << (r ? ", " : "") << peak_rss_kb[r];
  out << "]}\n";
}

int run(int argc, char** argv) {
  Args args;
  if (int status = parse_args(argc, argv, args); status >= 0) return status;
  if (args.port == 0) args.port = free_port();

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  Ranks ranks;
  if (!start_ranks(args, ranks)) return 1;
  Supervisor supervisor(args, ranks);
  const int exit_code = supervisor.wait_all();
  if (!args.rss_json.empty()) write_rss_json(args.rss_json, supervisor.peak_rss_kb());
  return exit_code;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::tools::tool_main("fsdp-run", [&] { return run(argc, argv); });
}
