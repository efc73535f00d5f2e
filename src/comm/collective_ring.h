#pragma once
// Note [Collective ring]
// Every collective of a multi-rank process group goes through a RingBackend, which
// numbers it (per group), names what it is for, and keeps it in a short ring of this
// rank's recent collectives: sequence number, op, unit, bytes, and whether it finished.
//  - A collective that fails or times out (FSDP_TIMEOUT_S) throws an error naming the
//    collective this rank was waiting for and the last ones it completed, so the ranks'
//    errors side by side show where they parted.
//  - With FSDP_DEBUG=desync, the ranks of a group exchange a fingerprint of each
//    collective (sequence number, op, unit, bytes, root) before running it. A mismatch
//    fails at once on every rank, naming each rank's collective, instead of exchanging
//    wrong data or hanging until the timeout. It costs one small all-gather per
//    collective, so it is off by default.
// What a collective is for comes from CollectiveLabel, set by the engine around the
// collectives of one unit (a thread-local: the autograd hooks issue collectives on the
// thread running backward).

#include "backend.h"

#include <memory>
#include <string>
#include <vector>

namespace fsdp::detail {

/// Names what the collectives issued on this thread inside its scope are for (e.g. a
/// unit: "unit 'blocks.0'"). Scopes nest; the innermost wins.
class CollectiveLabel {
 public:
  explicit CollectiveLabel(std::string what);
  ~CollectiveLabel();
  CollectiveLabel(const CollectiveLabel&) = delete;
  CollectiveLabel& operator=(const CollectiveLabel&) = delete;

 private:
  std::string previous_;
};

/// `inner` with every collective kept in the ring (Note [Collective ring]). `global_rank` is this
/// process's rank in the job, for messages; `group` names the group ("world", or the
/// ranks of a split). Subgroups split from it are traced too. Reads FSDP_DEBUG.
std::shared_ptr<Backend> make_ring_backend(std::shared_ptr<Backend> inner, int global_rank,
                                           std::string group = "world");

/// This rank's recent collectives, oldest first, one line each (what errors print).
std::vector<std::string> recent_collectives();

/// Whether FSDP_DEBUG lists "desync" (a comma-separated list). Throws naming the value
/// when it lists something unknown.
bool desync_debug_enabled();

}  // namespace fsdp::detail
