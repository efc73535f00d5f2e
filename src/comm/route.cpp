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
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

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

}  // namespace fsdp::detail
