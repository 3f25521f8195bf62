// Data parallel: the compiler pass that makes a Program train together with
// options.world - 1 other processes, each on its own share of the global batch. With
// world == 1 it changes nothing at all (no node, no tensor, no attribute).
//
//  - Gradients are summed over the ranks (allreduce) in two buckets, each a `communicate`
//    phase on the update stream: the deep layers' gradients as soon as the deep backward
//    has written them (before the first layer's backward, which it may overlap), then the
//    first layer's, which are finished last. Under AMP both follow grad_cast: the FP16
//    convolution gradients are reduced in FP32, after the cast.
//  - Averaging costs no pass: the all-reduce sums, and the optimizers multiply the unscaled
//    gradient by attrs.grad_average = 1/world in the multiply that already undoes the loss
//    scale (g * (1/scale) * (1/world)). check_clip bounds the summed gradient by
//    clip * world, which is the bound `clip` on the average.
//  - The overflow flag (AMP, clipping) is all-reduced with max right after check_clip, so
//    every rank skips the same steps and their loss scales stay equal.
//  - SyncBN (options.sync_bn): BatchNorm's training forward uses the statistics of the
//    global batch — bn_stats (this rank's mean and variance), allgather, bn_fwd_sync (combine,
//    normalise, running statistics with the global unbiased variance, as PyTorch's
//    SyncBatchNorm) — and its backward the global sums: bn_bwd_reduce, allreduce,
//    bn_bwd_sync. Without it each rank normalises with its own batch.
#pragma once
#include "kiln/graph/program.h"

namespace kiln {

// Runs on a compiled Program before its memory is planned (lower_program calls it).
void add_data_parallel(Program& program);

}  // namespace kiln
