#pragma once
// How the ranks of a collective checkpoint call learn one outcome (Note [Agreed
// outcomes]): either every rank tries and they agree whether any failed, or rank 0
// tries and everyone learns. Then every rank throws alike, so no rank goes on alone.

#include <fsdp/process_group.h>

#include <functional>
#include <string>

namespace fsdp::ckpt {

/// Collective (a MAX all-reduce of one flag): whether any rank's `error` is non-empty.
/// `error` is this rank's outcome, "" for success.
bool any_rank_failed(const ProcessGroup& pg, const std::string& error);

/// Collective (a broadcast of one flag from rank 0): whether rank 0's `error` is
/// non-empty. The other ranks' `error` is ignored.
bool rank0_failed(const ProcessGroup& pg, const std::string& error);

/// What a rank adds to "<what> failed" after an agreed failure: ": <error>" where it
/// failed itself, or `elsewhere` (" on rank 0 (see its error)", ...).
std::string failure_detail(const std::string& error,
                           const std::string& elsewhere = " on another rank (see its error)");

/// Rank 0 tries: runs `fn` there only. Everyone learns: collective; if `fn` threw, every
/// rank throws "<what> failed: <rank 0's error>" (elsewhere: "<what> failed on rank 0
/// (see its error)").
void rank0_tries(const ProcessGroup& pg, const std::string& what, const std::function<void()>& fn);

}  // namespace fsdp::ckpt
