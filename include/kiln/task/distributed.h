// Data-parallel training at the task level: what the Trainer does besides running
// a Program compiled for `world` processes. Every function is a collective (all ranks call
// it, in the same order) and does nothing with one process.
#pragma once
#include <cstdint>

#include "kiln/task/engine.h"

namespace kiln {

// Every rank must hold the same model before training starts (after initialisation, after
// --init-from or --resume): compares a hash of the master weights, optimizer moments, EMA
// and BatchNorm buffers, and the step counter, over the ranks. A rank that differs is a
// kiln::Error(State) naming it — each rank read a different file, or a different version of
// kiln runs on one node.
void check_replicas_agree(Engine& engine, int64_t step, const char* when);

// Per-rank BatchNorm (--no-sync-bn): each rank's running statistics follow its own batches;
// before an evaluation or a checkpoint they are averaged over the ranks, so that every
// rank evaluates, and rank 0 saves, the same model.
void average_bn_running_stats(Engine& engine);

// Sums of an epoch's training and evaluation counters over the ranks (in place).
void reduce_train_sums(double& loss_sum, int64_t& loss_count, int64_t& seen, int64_t& hits);
void reduce_eval_sums(double& loss_sum, int64_t& top1, int64_t& top5, int64_t& count);

}  // namespace kiln
