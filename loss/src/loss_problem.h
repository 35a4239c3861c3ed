#pragma once

// What the loss's files share (internal to loss/src):
//   loss_inputs.cpp  the inputs of one call checked and flattened into a Problem
//   targets/         one reader per answer kind (targets.h), called by loss_inputs.cpp
//   losses.cpp       the chunks (fused CPU kernel or ATen ops), autograd, distillLoss
//   fused_linear.cpp fusedLinearLoss: the output projection chunked with the loss
//   sampled_chunks.cpp  the chunks of sampled targets and of loss.kind sampled_token on ATen ops
//                    (the CPU kernel's cpu/loss_kernel_sampled.h computes them where it runs)
//   hidden_head.cpp  the teacher as hidden states + head (hidden_teacher.h)
//   loss_vocab.cpp   loss.vocab: a teacher vocabulary that differs from the student's
//   row_kernel.h     the row kernels by device (cpu/, cuda/) that compute chunks in one pass

#include <ATen/ATen.h>

#include <functional>
#include <limits>
#include <sstream>
#include <string>

#include "cpu/loss_kernel.h"
#include "distill/loss/losses.h"
#include "row_kernel.h"

namespace distill::loss_impl {

using Kind = lossk::Kind;

constexpr double kInf = std::numeric_limits<double>::infinity();

inline std::string shapeOf(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

// LossOptions built in code (not parsed) may hold any value: one outside the enum is a ConfigError.
Kind kindOf(LossKind k);

// What prepare() needs of the student side: the logits' shape, dtype and
// device. fusedLinearLoss has no logits: there [N, V] is what hidden @ weight.T
// would be.
struct StudentShape {
  int64_t n = 0, v = 0;
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  std::string shape; // for messages, e.g. "[4, 128, 32000]"
  const char* what = "student logits"; // for messages
  const char* fn = "distillLoss"; // the call, for messages
  bool fusable = false; // a row kernel (row_kernel.h) may compute the chunks: contiguous rows; CPU float32 |
                        // float64, CUDA float32 | float16 | bfloat16
};

// The student logits' shape (ProtocolError when they are not floating [..., V]).
// `allowFused`: the fused CPU kernel may compute the chunks (tests turn it off
// to compare with the ATen-op path).
StudentShape studentShape(const at::Tensor& z, bool allowFused);
// Whether a row kernel takes logits of dtype t on `device` (CPU float32 | float64,
// CUDA float32 | float16 | bfloat16).
bool kernelDtype(const at::Device& device, at::ScalarType t);

// Everything one call needs, flattened to tokens.
struct Problem {
  const char* fn = "distillLoss"; // the call, for messages
  Kind kind = Kind::kForward;
  double temperature = 1, alpha = 0.5, beta = 0.5, normalizer = 1;
  bool needKd = true, needCe = true; // terms of nonzero weight: the others are not computed
  int64_t chunk = 1, n = 0, v = 0;
  at::ScalarType compute = at::kFloat; // arithmetic dtype of the chunks
  at::Tensor labels; // [N] int64
  at::Tensor valid; // [Nv] int64: rows whose label is not ignored
  bool allValid = false; // valid == 0..N-1: chunks are plain row ranges (views, no gathers)
  at::Tensor tLogits; // [N, V] or undefined
  at::Tensor tValues, tIndices; // [N, k], [N, k] int64
  at::Tensor tLse, tLogTail; // [N] or undefined each
  // Top-k, computed once for all rows (O(N k)) and shared by the logsumexp
  // check and the chunks: the log of what the top-k probabilities sum to,
  // logsumexp(values / T), with logTail logaddexp(that, logTail) [N].
  at::Tensor tLogSum;
  double eps = 0; // epsilon of the coarsest dtype of the top-k teacher data
  // The row kernel that computes the chunks (row_kernel.h: the fused CPU kernel,
  // or the CUDA one), or null: the ATen-op path below, which is also their
  // reference in tests.
  const RowKernel* kernel = nullptr;
  at::Tensor zc; // [N, V] student logits, rows contiguous (kernel; set by the caller of prepare)
  at::Tensor kValues, kLse, kLogTail; // top-k teacher data in the arithmetic dtype, contiguous (kernel)
  // loss.vocab truncate (loss_vocab.cpp; losses.h, "Vocabularies that differ").
  int64_t vt = 0; // the teacher's vocabulary (== v unless it is larger and truncated)
  at::Tensor tFull; // dense: the teacher's [N, vt] logits; tLogits is its first v columns then
  // Top-k: entries whose id was >= v ("null" buckets: value -inf, index 0, q = p = 0, never
  // gathered from nor written to the student's row); undefined when none was. Only the
  // ATen-op path takes them (Problem::fused is false then).
  at::Tensor tNull; // [N, k] bool
  double massMax = -1, massSum = -1; // the dropped teacher mass over the valid rows (-1: none dropped)
  // Sampled targets (targets/sampled.cpp): tIndices [N, K] the drawn ids, tWeights [N, K] their
  // counts / K in the arithmetic dtype (the estimated teacher distribution).
  at::Tensor tWeights;
  // loss.kind sampled_token (targets/ids.cpp): tIndices [N, 1] the sampled ids, tValues [N, 1] the
  // teacher's logits of them, tLse [N]; tSamplingLogp [N] the sampling policy's log-probs or undefined.
  bool sampledToken = false;
  at::Tensor tSamplingLogp;
  // loss.kind sampled_token, for the CPU kernel: kLogq [N] the teacher's log-probability of the
  // sampled id at T (tValues / T - tLse), kSamplingLogp [N] tSamplingLogp (or undefined), both
  // in the arithmetic dtype, contiguous.
  at::Tensor kLogq, kSamplingLogp;
};

// Checks the inputs of one distillLoss call (shapes, dtypes, devices, label
// and index ranges, the teacher's logsumexp; one device sync for the data
// checks) and flattens them to tokens. Problem::zc is the caller's to set.
Problem prepare(const StudentShape& z, const at::Tensor& labels, const TeacherOutput& teacher, const LossOptions& o,
                double normalizer);

// loss_vocab.cpp. The teacher's vocabulary V_t against the student's pb.v:
// V_t (pb.v when the teacher did not state it); ProtocolError when they differ
// and loss.vocab cannot bridge them. `stated`: TeacherOutput::vocab; `width`:
// what the answer itself shows (the full logits' width; -1: nothing).
int64_t teacherVocab(const Problem& pb, int64_t stated, int64_t width, const LossOptions& o);
// Top-k, truncating: whether any entry has an id >= pb.v (one device sync).
bool anyTopkDropped(const Problem& pb);
// Truncates the teacher to the student's vocabulary (pb.valid set, data checked):
// measures the dropped mass of every valid row into pb.massMax / massSum
// (ProtocolError above loss.max_truncated_mass) and renormalises the rest.
void truncateTeacher(Problem& pb, const LossOptions& o);
// The check of truncateTeacher on masses measured elsewhere (the two-head fused
// linear loss measures them chunk by chunk): `mass` [Nv] the dropped mass of
// each valid row, in pb.valid's order, into pb.massMax / massSum;
// ProtocolError above `maxMass` (loss.max_truncated_mass), when all of it, or
// not finite. `denseRow(row)`: a dense teacher's [V_t] logits of token `row`,
// for the message (empty: a top-k teacher).
void checkTruncatedMass(Problem& pb, double maxMass, const at::Tensor& mass,
                        const std::function<at::Tensor(int64_t)>& denseRow);
// r with pb's dropped-mass figures.
LossResult withMass(const Problem& pb, LossResult r);

// The chunks of a prepared Problem (losses.cpp): the kd and ce sums over the
// valid rows (0-dim double), the gradient of loss w.r.t. the rows of z2 [N, V]
// written into grad2 when it is defined (its ignored rows untouched). `finish`
// turns the sums into a LossResult (no autograd).
struct Sums {
  at::Tensor kd, ce;
};
Sums runChunks(const Problem& pb, const at::Tensor& z2, at::Tensor grad2);

// The hard-label CE of rows `rows` whose logits x [C, V] are given (losses.cpp):
// adds its sum to ceSum; lse1 the logsumexp of x, gce the gradient of
// (1 - alpha) ce / normalizer w.r.t. x (when needGrad). Undefined both when
// the term is not computed.
struct HardLabel {
  at::Tensor lse1, gce;
};
HardLabel hardLabelTerm(const Problem& pb, const at::Tensor& x, const at::Tensor& rows, bool needGrad,
                        at::Tensor& ceSum);
// A chunk of sampled targets or of loss.kind sampled_token (sampled_chunks.cpp):
// x [C, V] the rows' logits (our own copy, overwritten), lse1 and gce from
// hardLabelTerm; adds the kd sum and writes the rows' gradient into `grad`
// (when defined).
void sampledChunk(const Problem& pb, at::Tensor& x, const at::Tensor& rows, const at::Tensor& lse1,
                  const at::Tensor& gce, at::Tensor& grad, at::Tensor& kdSum);
LossResult finish(const Problem& pb, const Sums& s);

} // namespace distill::loss_impl
