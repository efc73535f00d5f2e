#pragma once
// Which local address reaches a host: what Gloo should bind to when GLOO_SOCKET_IFNAME is
// not set (Note [Gloo's interface]).

#include <chrono>
#include <string>
#include <vector>

namespace fsdp::detail {

/// The numeric local address (IPv4 or IPv6) this host sends from to reach `host` (a name
/// or an address), as the kernel's routing table picks it. Throws, naming `what` (the
/// variable `host` came from, e.g. "MASTER_ADDR") and GLOO_SOCKET_IFNAME, when `host`
/// does not resolve or no route reaches it.
std::string local_address_toward(const std::string& host, const std::string& what);

}  // namespace fsdp::detail

namespace fsdp::detail {

// Note [Peer probe]
// When a collective times out, Gloo says only "Timed out waiting 5000ms for recv
// operation" — not for whom. Each Gloo group's rank keeps a listening TCP socket on the
// address it advertises (nothing accepts: the kernel completes the handshakes) and
// publishes its port with its address. A rank whose collective failed connects to each
// peer's socket at once: a peer whose host does not answer within half a second sits behind a
// network that is down (or a host that is), a refused connection means its process is
// gone, and a peer that answers is alive (it may itself be waiting).

/// A listening TCP socket on `address` (numeric IPv4/IPv6) at a free port; peers probe it.
/// Port 0 when it cannot be opened (the probe then reports the peer as unknown).
class ProbeListener {
 public:
  explicit ProbeListener(const std::string& address);
  ~ProbeListener();
  ProbeListener(const ProbeListener&) = delete;
  ProbeListener& operator=(const ProbeListener&) = delete;
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

struct ProbePeer {
  int rank = 0;         ///< job rank
  std::string address;  ///< numeric
  int port = 0;         ///< its ProbeListener's port (0: none)
};

/// "rank 2 on 10.9.0.2: no answer within 1 s (...)" for every peer that does not answer,
/// joined by "; "; empty when all answer. Probes all peers at once, for at most `wait`.
std::string probe_peers(const std::vector<ProbePeer>& peers, std::chrono::milliseconds wait);

/// The first IPv4 address of network interface `name` (GLOO_SOCKET_IFNAME), or "".
std::string interface_address(const std::string& name);

}  // namespace fsdp::detail
