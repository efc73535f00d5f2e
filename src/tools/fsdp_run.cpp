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

int usage(const std::string& why) {
  std::cerr << "fsdp-run: error: " << why << "\n"
            << "usage: fsdp-run --nproc N [--master-port P] [--tee] [--peak-rss-json FILE] -- CMD "
               "ARGS...\n";
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

int run(int argc, char** argv) {
  int nproc = -1, port = 0;
  bool tee = false;
  std::string rss_json;
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
      std::cout << "usage: fsdp-run --nproc N [--master-port P] [--tee] [--peak-rss-json FILE] -- "
                   "CMD ARGS...\n"
                   "  --nproc N        ranks to start on this machine\n"
                   "  --master-port P  rendezvous port (default: a free one)\n"
                   "  --tee            prefix every output line with its rank\n"
                   "  --peak-rss-json FILE  at the end, write each rank's peak RSS: "
                   "{\"peak_rss_kb\": [...]}\n"
                   "  --version        print the version\n";
      return 0;
    }
    auto value = [&](const std::string& flag) -> std::string {
      auto eq = a.find('=');
      if (eq != std::string::npos) return a.substr(eq + 1);
      if (i + 1 >= argc) return "";
      (void)flag;
      return argv[++i];
    };
    if (a == "--nproc" || a.rfind("--nproc=", 0) == 0) {
      std::string v = value("--nproc");
      if (!parse_int(v, nproc) || nproc < 1)
        return usage("--nproc '" + v + "' must be a positive integer");
    } else if (a == "--master-port" || a.rfind("--master-port=", 0) == 0) {
      std::string v = value("--master-port");
      if (!parse_int(v, port) || port < 1 || port > 65535) {
        return usage("--master-port '" + v + "' must be a TCP port between 1 and 65535");
      }
    } else if (a == "--tee") {
      tee = true;
    } else if (a == "--peak-rss-json" || a.rfind("--peak-rss-json=", 0) == 0) {
      rss_json = value("--peak-rss-json");
      if (rss_json.empty()) return usage("--peak-rss-json needs a file name");
      if (!std::ofstream(rss_json))
        return usage("--peak-rss-json " + rss_json + ": cannot write the file");
    } else {
      return usage("unknown option '" + a + "'; put the command after --");
    }
  }
  if (nproc < 1) return usage("--nproc N is required");
  if (i >= argc) return usage("no command given after --");
  if (port == 0) port = free_port();

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  std::vector<pid_t> pids(nproc, -1);
  std::vector<int> pipes(nproc, -1);
  for (int r = 0; r < nproc; ++r) {
    int fds[2] = {-1, -1};
    if (tee && pipe(fds) != 0) {
      std::perror("fsdp-run: pipe");
      return 1;
    }
    pid_t pid = fork();
    if (pid < 0) {
      std::perror("fsdp-run: fork");
      return 1;
    }
    if (pid == 0) {
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      setenv("GROUP_RANK", "0", 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      // As torchrun does: N ranks on one node share its cores, so each gets one
      // intra-op thread unless the user chose otherwise. (It also makes runs under
      // both launchers compute bit for bit alike.)
      if (nproc > 1) setenv("OMP_NUM_THREADS", "1", 0);
      if (tee) {
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        close(fds[0]);
        close(fds[1]);
      }
      execvp(argv[i], argv + i);
      std::cerr << "fsdp-run: cannot run '" << argv[i] << "': " << std::strerror(errno) << "\n";
      _exit(127);
    }
    pids[r] = pid;
    if (tee) {
      close(fds[1]);
      pipes[r] = fds[0];
    }
  }

  std::vector<std::string> partial(nproc);
  auto pump = [&](int timeout_ms) {
    if (!tee) {
      std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
      return;
    }
    std::vector<pollfd> pf;
    for (int r = 0; r < nproc; ++r) {
      if (pipes[r] >= 0) pf.push_back({pipes[r], POLLIN, 0});
    }
    if (pf.empty() || poll(pf.data(), pf.size(), timeout_ms) <= 0) return;
    for (auto& p : pf) {
      if (!(p.revents & (POLLIN | POLLHUP))) continue;
      int r = 0;
      while (pipes[r] != p.fd) ++r;
      char buf[4096];
      ssize_t n = read(p.fd, buf, sizeof(buf));
      if (n <= 0) {
        if (!partial[r].empty()) std::cout << "[rank " << r << "] " << partial[r] << "\n";
        partial[r].clear();
        close(p.fd);
        pipes[r] = -1;
        continue;
      }
      partial[r].append(buf, static_cast<size_t>(n));
      size_t nl;
      while ((nl = partial[r].find('\n')) != std::string::npos) {
        std::cout << "[rank " << r << "] " << partial[r].substr(0, nl) << "\n";
        partial[r].erase(0, nl + 1);
      }
      std::cout.flush();
    }
  };

  std::vector<long> peak_rss_kb(static_cast<size_t>(nproc), 0);
  int alive = nproc, exit_code = 0;
  bool stopping = false;
  auto stop_deadline = std::chrono::steady_clock::now();
  while (alive > 0) {
    pump(50);
    if (g_signal != 0 && !stopping) {
      std::cerr << "fsdp-run: received signal " << g_signal << "; forwarding it to every rank\n";
      for (pid_t p : pids) {
        if (p > 0) kill(p, g_signal);
      }
      stopping = true;
      exit_code = 128 + g_signal;
      stop_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    }
    for (int r = 0; r < nproc; ++r) {
      if (pids[r] <= 0) continue;
      int status = 0;
      rusage ru{};
      if (wait4(pids[r], &status, WNOHANG, &ru) != pids[r]) continue;
      peak_rss_kb[static_cast<size_t>(r)] = ru.ru_maxrss;  // KiB on Linux
      pids[r] = -1;
      --alive;
      bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (!ok && !stopping) {
        std::cerr << "fsdp-run: rank " << r << " " << describe(status) << "; stopping the other "
                  << alive << " rank(s)\n";
        exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        for (pid_t p : pids) {
          if (p > 0) kill(p, SIGTERM);
        }
        stopping = true;
        stop_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
      }
    }
    if (stopping && alive > 0 && std::chrono::steady_clock::now() > stop_deadline) {
      for (pid_t p : pids) {
        if (p > 0) kill(p, SIGKILL);
      }
    }
  }
  while (tee && std::any_of(pipes.begin(), pipes.end(), [](int fd) { return fd >= 0; })) pump(50);
  if (!rss_json.empty()) {
    std::ofstream out(rss_json);
    out << "{\"peak_rss_kb\": [";
    for (size_t r = 0; r < peak_rss_kb.size(); ++r) out << (r ? ", " : "") << peak_rss_kb[r];
    out << "]}\n";
  }
  return exit_code;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::tools::tool_main("fsdp-run", [&] { return run(argc, argv); });
}
