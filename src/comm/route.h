#pragma once
// Which local address reaches a host: what Gloo should bind to when GLOO_SOCKET_IFNAME is
// not set (Note [Gloo's interface]).

#include <string>

namespace fsdp::detail {

/// The numeric local address (IPv4 or IPv6) this host sends from to reach `host` (a name
/// or an address), as the kernel's routing table picks it. Throws, naming `what` (the
/// variable `host` came from, e.g. "MASTER_ADDR") and GLOO_SOCKET_IFNAME, when `host`
/// does not resolve or no route reaches it.
std::string local_address_toward(const std::string& host, const std::string& what);

}  // namespace fsdp::detail
