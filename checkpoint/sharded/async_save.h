#pragma once
// The asynchronous save's background job (Note [Asynchronous saves]): one per process
// in flight, written and (on rank 0) published by a thread while training goes on.

#include "dir_protocol.h"
#include "snapshot.h"

#include <fsdp/checkpoint.h>
#include <fsdp/process_group.h>

#include <memory>
#include <string>

namespace fsdp::ckpt {

/// Starts the thread that writes `snap` (staged on the calling thread) as this rank's
/// file of `plan` and, on rank 0, publishes the checkpoint once every rank's file is
/// complete; it becomes the process's save in flight. `stall_s`: how long rank 0 waits
/// for the other ranks' files without progress before it gives up.
std::shared_ptr<AsyncSaveJob> start_async_save(const ShardedModel& model, SavePlan plan,
                                               RankSnapshot snap, int rank, int world,
                                               double stall_s, const ckpt::SaveOptions& options);

/// Joins the save in flight, if any, and has every rank agree whether it failed
/// anywhere; throws on every rank alike if it did, naming `fn`. Collective when a save
/// was in flight (on every rank alike: saves are collective).
void settle_previous(const ProcessGroup& pg, const char* fn);

/// Waits until the save in flight, if any, has made the copies its call left to the
/// background (Note [Background staging]); the end of every backward calls it.
void wait_for_staging();

/// Waits for the save in flight, if any, without communicating (a load reads only what
/// is complete).
void wait_for_async_save();

}  // namespace fsdp::ckpt
