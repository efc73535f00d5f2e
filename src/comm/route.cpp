// Note [Gloo's interface]
// Gloo binds each rank's sockets to one local address, which it also advertises to its
// peers. Without GLOO_SOCKET_IFNAME, c10d's default device takes the address the host's
// own name resolves to, and Debian maps that name to 127.0.1.1 in /etc/hosts: ranks on
// other hosts are then told to connect to their own loopback, and fail with "Connection
// refused" (and the ranks that wait for them hang). The address that matters is the one
// the routing table uses to reach the rendezvous host, MASTER_ADDR: a UDP socket
// connect()ed there (which sends nothing) has it as its local name. On one host, with
// MASTER_ADDR on loopback, that is 127.0.0.1; on a cluster, the address of the link that
// reaches rank 0's host. GLOO_SOCKET_IFNAME, when set, still wins.
#include "route.h"

#include <c10/util/Exception.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <sstream>

namespace fsdp::detail {

std::string local_address_toward(const std::string& host, const std::string& what) {
  const std::string fix =
      "; set GLOO_SOCKET_IFNAME to the network interface that reaches it (e.g. "
      "GLOO_SOCKET_IFNAME=eth0), or fix " +
      what;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), "9", &hints, &found);
  TORCH_CHECK(rc == 0 && found != nullptr, what, "=", host, " does not resolve (",
              ::gai_strerror(rc), "), so no network interface can be chosen for it", fix);
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(found, &::freeaddrinfo);
  std::string last_error;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    const bool ok = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
                    ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
    if (!ok) last_error = std::strerror(errno);
    ::close(fd);
    if (!ok) continue;
    char text[INET6_ADDRSTRLEN] = {};
    const void* addr =
        local.ss_family == AF_INET
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
    if (::inet_ntop(local.ss_family, addr, text, sizeof(text)) != nullptr) return text;
    last_error = std::strerror(errno);
  }
  TORCH_CHECK(false, "no route from this host reaches ", what, "=", host, " (", last_error, ")",
              fix);
}

// Note [Peer probe]
namespace {

// `address`:`port` as a socket address; false when `address` is not numeric.
bool socket_address(const std::string& address, int port, sockaddr_storage& out, socklen_t& len) {
  out = {};
  auto* v4 = reinterpret_cast<sockaddr_in*>(&out);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&out);
  if (::inet_pton(AF_INET, address.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(static_cast<uint16_t>(port));
    len = sizeof(sockaddr_in);
    return true;
  }
  if (::inet_pton(AF_INET6, address.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(static_cast<uint16_t>(port));
    len = sizeof(sockaddr_in6);
    return true;
  }
  return false;
}

// Why a probe's connect failed, in words.
std::string unreachable(int err) {
  if (err == ECONNREFUSED) return "its host refuses the connection: its process is gone";
  const std::string why = std::string("cannot be reached (") + std::strerror(err) + ")";
  if (err == ENETUNREACH || err == EHOSTUNREACH) return why + ": the network to it is down";
  return why;
}

}  // namespace

ProbeListener::ProbeListener(const std::string& address) {
  sockaddr_storage sa{};
  socklen_t len = 0;
  if (!socket_address(address, 0, sa, len)) return;
  fd_ = ::socket(sa.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) return;
  sockaddr_storage bound{};
  socklen_t blen = sizeof(bound);
  if (::bind(fd_, reinterpret_cast<sockaddr*>(&sa), len) != 0 || ::listen(fd_, 128) != 0 ||
      ::getsockname(fd_, reinterpret_cast<sockaddr*>(&bound), &blen) != 0) {
    ::close(fd_);
    fd_ = -1;
    return;
  }
  port_ = ntohs(bound.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&bound)->sin_port
                                           : reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
}

ProbeListener::~ProbeListener() {
  if (fd_ >= 0) ::close(fd_);
}

std::string probe_peers(const std::vector<ProbePeer>& peers, std::chrono::milliseconds wait) {
  struct Try {
    const ProbePeer* peer = nullptr;
    int fd = -1;
    std::string result;  ///< empty: answered
  };
  std::vector<Try> tries;
  for (const auto& p : peers) {
    Try t;
    t.peer = &p;
    sockaddr_storage sa{};
    socklen_t len = 0;
    if (p.port <= 0 || !socket_address(p.address, p.port, sa, len)) {
      t.result = "not probed (it advertised no probe port)";
    } else if ((t.fd = ::socket(sa.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0)) < 0) {
      t.result = std::string("not probed (") + std::strerror(errno) + ")";
    } else if (::connect(t.fd, reinterpret_cast<sockaddr*>(&sa), len) != 0 &&
               errno != EINPROGRESS) {
      t.result = unreachable(errno);
    } else {
      t.result = "pending";
    }
    tries.push_back(std::move(t));
  }
  const auto deadline = std::chrono::steady_clock::now() + wait;
  while (true) {
    std::vector<pollfd> fds;
    std::vector<Try*> who;
    for (auto& t : tries) {
      if (t.result == "pending") {
        fds.push_back({t.fd, POLLOUT, 0});
        who.push_back(&t);
      }
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (fds.empty() || left.count() <= 0) break;
    if (::poll(fds.data(), fds.size(), static_cast<int>(left.count())) < 0 && errno != EINTR) break;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      int err = 0;
      socklen_t elen = sizeof(err);
      ::getsockopt(fds[i].fd, SOL_SOCKET, SO_ERROR, &err, &elen);
      who[i]->result = err == 0 ? "" : unreachable(err);
    }
  }
  std::ostringstream out;
  bool first = true;
  for (auto& t : tries) {
    if (t.fd >= 0) ::close(t.fd);
    if (t.result == "pending") {
      t.result = "no answer from its host within " + std::to_string(wait.count()) +
                 " ms: the network to it is down, or its host is";
    }
    if (t.result.empty()) continue;
    out << (first ? "" : "; ") << "rank " << t.peer->rank << " on " << t.peer->address << ": "
        << t.result;
    first = false;
  }
  return out.str();
}

std::string interface_address(const std::string& name) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string found;
  for (ifaddrs* a = list; a != nullptr && found.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET || name != a->ifa_name) {
      continue;
    }
    char text[INET_ADDRSTRLEN] = {};
    if (::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, text,
                    sizeof(text)) != nullptr) {
      found = text;
    }
  }
  ::freeifaddrs(list);
  return found;
}

}  // namespace fsdp::detail
