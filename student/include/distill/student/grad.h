#pragma once

// Helpers on the student group.
//
// Normalisation under gradient accumulation and data parallelism: compute the
// loss of every micro-batch as a SUM over its tokens divided by the number of
// non-ignored tokens of the WHOLE step (all micro-batches, all students) —
// stepTokenCount() — and all-reduce the gradients with SUM. The gradient is
// then that of the same tokens as one batch on one process, whatever the
// number of valid tokens per micro-batch (tests/student/grad_test.cpp).

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

#include "distill/group/student_group.h"

namespace distill {

// Non-ignored tokens of a step across the student group (one all-reduce).
// Call it when the step opens, before taking the step's first teacher answer
// (its result normalises every micro-batch's loss): it also tells the flight
// recorder that a new step began, so that its collective and the step's
// others are labelled with the right step. 0 when every label of the step is
// ignored: distillLoss takes that normalizer for micro-batches without valid
// tokens (zero loss, zero gradient).
double stepTokenCount(StudentGroup& group, const std::vector<at::Tensor>& microBatchLabels, int64_t ignoreIndex);

// All-reduces the .grad() of `params` in place, in buckets of about
// `bucketMb` MiB (one flat tensor per bucket; dtypes and devices kept apart).
// Parameters without a gradient are skipped on every rank alike (zeros stand in
// if some rank has one and another has not would be a user bug: shapes differ).
void allReduceGradients(StudentGroup& group, const std::vector<at::Tensor>& params, double bucketMb,
                        ReduceOp op = ReduceOp::kSum);

// Copies student rank 0's `params` and `buffers` (a model's parameters() and
// buffers()) to every student, in place, in buckets of about `bucketMb` MiB:
// call it once after building the model (and loading a checkpoint), before
// the first step, as DDP does, so that every student trains the same model
// whatever its RNG did. Every student must pass tensors of the same count and
// sizes: a ConfigError names the difference otherwise (not a hang).
void broadcastParameters(StudentGroup& group, const std::vector<at::Tensor>& params,
                         const std::vector<at::Tensor>& buffers = {}, double bucketMb = 25);

// Runs `fn` on student rank 0 only and broadcasts its `count` values to every
// student (evaluation that must not run on every rank).
std::vector<double> evaluateOnRank0(StudentGroup& group, const std::function<std::vector<double>()>& fn, size_t count);

} // namespace distill
