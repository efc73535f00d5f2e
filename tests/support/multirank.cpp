#include "multirank.h"
#include <iostream>
#include <sstream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <thread>

extern char** environ;

namespace fsdp::testing {
namespace {
bool g_skip_final_barrier = false;
}  // namespace

void skip_final_barrier() { g_skip_final_barrier = true; }

namespace {

std::string self_exe() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "";
  buf[n] = '\0';
  return buf;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// In a child just forked: a process group of its own (so that a kill reaches what it
// starts), its stdout and stderr into `out_path`.
void become_child(const std::string& out_path) {
  setpgid(0, 0);
  int fd = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0) {
    dup2(fd, 1);
    dup2(fd, 2);
    close(fd);
  }
}

// Starts argv with `extra` added to this environment; output goes to `out_path`.
pid_t spawn(const std::vector<std::string>& argv, const std::vector<std::string>& extra,
            const std::string& out_path) {
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv = *e;
    bool overridden = false;
    for (const auto& x : extra) {
      if (kv.compare(0, x.find('=') + 1, x, 0, x.find('=') + 1) == 0) overridden = true;
    }
    if (!overridden) env_strings.push_back(kv);
  }
  env_strings.insert(env_strings.end(), extra.begin(), extra.end());
  std::vector<char*> envp, args;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy = argv;
  for (auto& s : argv_copy) args.push_back(s.data());
  args.push_back(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    become_child(out_path);
    execve(args[0], args.data(), envp.data());
    _exit(127);
  }
  return pid;
}

int decode(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

// The rank's side of run_ranks: the process group from the environment, the body, the
// closing barrier, and the exit (0 when its checks passed). Never returns.
[[noreturn]] void run_rank(int world, const std::function<void(const ProcessGroup&)>& body) {
  at::set_num_threads(1);
  // Gloo unless the test asks (FSDP_TEST_BACKEND=auto|nccl): the suites train on the CPU,
  // and "auto" would pick NCCL on a machine with a GPU per rank.
  ProcessGroupOptions pgo;
  const char* backend = std::getenv("FSDP_TEST_BACKEND");
  pgo.backend = backend != nullptr ? backend : "gloo";
  ProcessGroup pg = init_process_group(pgo);
  EXPECT_EQ(pg.size(), world);
  // An exception ends the rank here: in a forked rank it would otherwise unwind into the
  // test process's copy of GoogleTest, which would go on to the next test.
  try {
    if (pg.size() == world) body(pg);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "rank " << pg.rank() << " threw: " << e.what();
    std::fflush(nullptr);
    std::_Exit(1);
  }
  // Rank 0 serves the store: nobody leaves before everyone is done with it (unless the
  // body broke the group on purpose, see skip_final_barrier()).
  if (!g_skip_final_barrier) pg.barrier();
  std::cout << "[fsdp rank body done]" << std::endl;
  std::fflush(nullptr);
  std::_Exit(::testing::Test::HasFailure() ? 1 : 0);
}

// Threads of this process now (/proc/self/task).
int thread_count() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') ++n;
    }
    closedir(d);
  }
  return n;
}

// Whether run_ranks may fork its ranks from this process rather than start the binary
// afresh (Note in run_ranks).
bool may_fork_ranks(const std::vector<std::string>& env) {
  const char* how = std::getenv("FSDP_TEST_RANKS");
  if (how != nullptr && std::string(how) == "exec") return false;
  return env.empty() && thread_count() == 1;
}

// A rank forked from the test process: its environment, its output to `out_path`, then
// the body (run_rank). Returns the child's pid in the parent.
pid_t fork_rank(const std::vector<std::string>& vars, const std::string& out_path, int world,
                const std::function<void(const ProcessGroup&)>& body) {
  std::cout << std::flush;
  std::cerr << std::flush;
  std::fflush(nullptr);
  pid_t pid = fork();
  if (pid != 0) return pid;
  become_child(out_path);
  for (const auto& kv : vars) {
    const auto eq = kv.find('=');
    setenv(kv.substr(0, eq).c_str(), kv.substr(eq + 1).c_str(), 1);
  }
  run_rank(world, body);
}
}  // namespace

bool is_rank_process() { return std::getenv("FSDP_TEST_RANK_PROCESS") != nullptr; }

std::string bin_dir() {
  std::string exe = self_exe();
  return exe.substr(0, exe.rfind('/'));
}

namespace {
// Whether a listening socket could take `port` on 127.0.0.1 now.
bool port_is_free(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  close(fd);
  return ok;
}
}  // namespace

int free_port() {
  // A port below the kernel's ephemeral range (32768 and up), in a block of 16 of this
  // process's own (by its pid). bind(0) alone let two tests that ctest runs at once be
  // handed the same port now and then, and their ranks joined each other's store (seen:
  // BadCheckpoint.CorruptedData and .MissingRankFile failing together).
  static std::atomic<int> next{0};
  const int base = 20000 + static_cast<int>(getpid() % 750) * 16;
  for (int i = 0; i < 16; ++i) {
    const int port = base + next++ % 16;
    if (port_is_free(port)) return port;
  }
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  int port = ntohs(a.sin_port);
  close(fd);
  return port;
}

CommandResult run_command(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                          int timeout_s) {
  char tmpl[] = "/tmp/fsdp_cmd_XXXXXX";
  int fd = mkstemp(tmpl);
  close(fd);
  CommandResult r;
  pid_t pid = spawn(argv, env, tmpl);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  int status = 0;
  while (true) {
    pid_t w = waitpid(pid, &status, WNOHANG);
    if (w == pid) {
      r.exit_code = decode(status);
      break;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
      r.timed_out = true;
      r.exit_code = decode(status);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  r.output = read_file(tmpl);
  unlink(tmpl);
  return r;
}

void run_ranks(int world, const std::function<void(const ProcessGroup&)>& body, int timeout_s,
               const std::vector<std::string>& env) {
  // A test may call run_ranks several times. Calls are numbered within the test; a rank
  // process runs only the body of the call that started it, then ends (exit status 0
  // when its checks passed), so test code after that call runs in the test process only.
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string filter = std::string(info->test_suite_name()) + "." + info->name();
  static std::string current_test;
  static int call = 0;
  if (current_test != filter) {
    current_test = filter;
    call = 0;
  }
  const int index = call++;
  if (is_rank_process()) {
    const char* want = std::getenv("FSDP_TEST_RANK_CALL");
    if (want != nullptr && std::atoi(want) != index) return;
    run_rank(world, body);
  }
  // Note: the ranks are forked from this process where it is safe and means the same,
  // else started afresh (this binary, filtered to this test, with FSDP_TEST_RANK_CALL).
  // A fresh start costs each rank LibTorch's initialisation again, about half a second of
  // CPU (mostly libtorch_cpu's static initialisers, its operator registry at the top), which over
  // the suite's ~1,000 ranks was minutes on two cores. A fresh rank re-runs the test's code before
  // this call, which is deterministic, so a forked one, which inherits its result, sees the same
  // values. Forking is safe only while this process has one thread (no OpenMP team, Gloo or CUDA
  // thread that the child would lack), and means the same only when the ranks' environment is this
  // process's: a test that passes `env` may set what LibTorch or the library read once
  // at start (ATEN_CPU_CAPABILITY, FSDP_HOST_ALLOCATOR), so its ranks start afresh.
  // FSDP_TEST_RANKS=exec starts every rank afresh.
  const bool fork_ranks = may_fork_ranks(env);
  const int port = free_port();
  std::vector<pid_t> pids;
  std::vector<std::string> outs;
  for (int r = 0; r < world; ++r) {
    char tmpl[] = "/tmp/fsdp_rank_XXXXXX";
    int fd = mkstemp(tmpl);
    close(fd);
    outs.emplace_back(tmpl);
    std::vector<std::string> vars = {"FSDP_TEST_RANK_PROCESS=1",
                                     "RANK=" + std::to_string(r),
                                     "LOCAL_RANK=" + std::to_string(r),
                                     "WORLD_SIZE=" + std::to_string(world),
                                     "LOCAL_WORLD_SIZE=" + std::to_string(world),
                                     "MASTER_ADDR=127.0.0.1",
                                     "MASTER_PORT=" + std::to_string(port),
                                     "FSDP_TIMEOUT_S=60",
                                     "OMP_NUM_THREADS=1",
                                     "FSDP_TEST_RANK_CALL=" + std::to_string(index)};
    for (const auto& kv : env) {  // the caller's value replaces a default of the same name
      const std::string name = kv.substr(0, kv.find('=') + 1);
      vars.erase(std::remove_if(vars.begin(), vars.end(),
                                [&](const std::string& v) { return v.rfind(name, 0) == 0; }),
                 vars.end());
      vars.push_back(kv);
    }
    pids.push_back(fork_ranks ? fork_rank(vars, tmpl, world, body)
                              : spawn({self_exe(), "--gtest_filter=" + filter}, vars, tmpl));
  }
  std::vector<int> codes(world, -1);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  std::chrono::steady_clock::time_point first_failure{};
  int alive = world;
  while (alive > 0) {
    for (int r = 0; r < world; ++r) {
      if (codes[r] != -1) continue;
      int status = 0;
      if (waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        codes[r] = decode(status);
        --alive;
        if (codes[r] != 0 && first_failure == std::chrono::steady_clock::time_point{}) {
          first_failure = std::chrono::steady_clock::now();
        }
      }
    }
    auto now = std::chrono::steady_clock::now();
    bool failed_long_ago = first_failure != std::chrono::steady_clock::time_point{} &&
                           now - first_failure > std::chrono::seconds(5);
    if (alive > 0 && (now > deadline || failed_long_ago)) {
      for (int r = 0; r < world; ++r) {
        if (codes[r] == -1) kill(-pids[r], SIGKILL);
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int r = 0; r < world; ++r) {
    std::string out = read_file(outs[r]);
    unlink(outs[r].c_str());
    // A rank's lines that start with "[report] " are figures a test shows (multirank.h):
    // passed on to this process's output, which ctest -V and logs keep.
    std::istringstream lines(out);
    for (std::string line; std::getline(lines, line);) {
      if (line.rfind("[report] ", 0) == 0) std::cout << line << "\n";
    }
    std::cout << std::flush;
    EXPECT_EQ(codes[r], 0) << "rank " << r << " of " << world << " failed (exit " << codes[r]
                           << "); its output:\n"
                           << out;
    if (codes[r] == 0 && out.find("[fsdp rank body done]") == std::string::npos) {
      ADD_FAILURE() << "rank " << r << " ran no test (filter " << filter << "); output:\n" << out;
    }
  }
}

}  // namespace fsdp::testing
