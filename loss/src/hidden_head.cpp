// The teacher as hidden states + head (distill/loss/hidden_head.h): the head
// checked, its logits chunk by chunk, and what fused_linear.cpp needs around
// them (hidden_teacher.h).
#include "distill/loss/hidden_head.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "distill/core/errors.h"
#include "hidden_teacher.h"
#include "loss_problem.h"

namespace distill {

using namespace loss_impl;

namespace {

std::string tensorText(const at::Tensor& t) {
  return t.defined() ? shapeOf(t) + " " + std::string(c10::toString(t.scalar_type())) + " on " + t.device().str()
                     : std::string("undefined");
}

// Rows per chunk when the caller leaves it to us: a chunk's logits hold ~8 M
// elements, as fusedLinearLoss's CPU chunks.
int64_t autoChunk(int64_t v) { return std::max<int64_t>(256, (int64_t{1} << 23) / std::max<int64_t>(1, v)); }

} // namespace

void validateTeacherHead(const TeacherHead& head) {
  const at::Tensor& w = head.weight;
  DISTILL_CHECK_T(UsageError,
                  w.defined() && w.dim() == 2 && w.size(0) >= 1 && w.size(1) >= 1 && at::isFloatingType(w.scalar_type()),
                  "TeacherHead: weight: expected a floating [V_t, d_t] tensor with V_t, d_t >= 1 (the teacher's "
                  "output layer), found ",
                  tensorText(w));
  const at::Tensor& b = head.bias;
  DISTILL_CHECK_T(UsageError,
                  !b.defined() ||
                      (b.dim() == 1 && b.size(0) == w.size(0) && b.scalar_type() == w.scalar_type() &&
                       b.device() == w.device()),
                  "TeacherHead: bias: expected [", w.size(0), "] ", c10::toString(w.scalar_type()), " on ",
                  w.device().str(), " like the weight ", tensorText(w), ", or none; found ", tensorText(b));
  DISTILL_CHECK_T(UsageError, std::isfinite(head.softcap) && head.softcap >= 0,
                  "TeacherHead: softcap must be finite and >= 0 (0: no soft-capping), found ", head.softcap);
  DISTILL_CHECK_T(UsageError, std::isfinite(head.scale) && head.scale > 0,
                  "TeacherHead: scale must be finite and > 0 (1: no scaling), found ", head.scale);
}

namespace loss_impl {

HiddenTeacher hiddenTeacher(const at::Tensor& teacherHidden, const TeacherHead& head, const at::Device& device,
                            const char* fn) {
  validateTeacherHead(head);
  DISTILL_CHECK_T(UsageError, head.weight.device() == device, fn, ": the teacher head is on ",
                  head.weight.device().str(), ", the student's hidden states on ", device.str(),
                  ": give the head on the student's device");
  const int64_t d = head.weight.size(1);
  const at::Tensor& h = teacherHidden;
  DISTILL_CHECK_T(ProtocolError,
                  h.defined() && h.dim() >= 1 && h.size(-1) == d && at::isFloatingType(h.scalar_type()) &&
                      h.device() == device,
                  fn, ": teacher hidden states: expected floating [..., ", d, "] (the head's d_t; head weight ",
                  shapeOf(head.weight), ") on ", device.str(), ", found ", tensorText(h));
  HiddenTeacher t;
  t.h = h.detach().reshape({-1, d});
  t.w = head.weight.detach();
  if (head.bias.defined()) t.b = head.bias.detach();
  t.softcap = head.softcap;
  t.scale = head.scale;
  t.vt = head.weight.size(0);
  return t;
}

void headLogits(const HiddenTeacher& t, const at::Tensor& hc, int64_t col0, const at::Tensor& out) {
  const int64_t cols = out.size(1);
  const at::Tensor w = t.w.narrow(0, col0, cols); // rows of the head: a contiguous block
  const at::Tensor h = hc.scalar_type() == t.w.scalar_type() ? hc : hc.to(t.w.scalar_type());
  at::Tensor z = out;
  if (t.b.defined()) {
    at::addmm_out(z, t.b.narrow(0, col0, cols), h, w.t());
  } else {
    at::mm_out(z, h, w.t());
  }
  if (t.scale != 1) z.mul_(t.scale);
  if (t.softcap > 0) z.div_(t.softcap).tanh_().mul_(t.softcap);
}

Problem prepareHidden(const StudentShape& z, const at::Tensor& labels, const HiddenTeacher& t, const LossOptions& o,
                      double normalizer) {
  DISTILL_CHECK_T(ProtocolError, t.h.size(0) == z.n, z.fn, ": teacher hidden states hold ", t.h.size(0),
                  " tokens, the ", z.what, " ", z.n, " (", z.shape, ")");
  // prepare() checks a dense teacher's logits, which do not exist yet: it is
  // given a stand-in of the student's width in the head's dtype (one row,
  // broadcast: no memory), then the head's vocabulary is compared as a dense
  // teacher's would be, and the stand-in dropped (each chunk sets its logits).
  TeacherOutput standIn;
  standIn.makeLogits().logits = at::empty({1, z.v}, t.w.options()).expand({z.n, z.v});
  Problem pb = prepare(z, labels, standIn, o, normalizer);
  pb.vt = teacherVocab(pb, t.vt, -1, o); // the head's vocabulary, as a dense teacher's would be
  pb.tLogits = at::Tensor();
  return pb;
}

void droppedMass(const Problem& pb, const at::Tensor& keep, const at::Tensor& drop, const at::Tensor& mass) {
  const int64_t c = keep.size(0);
  at::Tensor lseK, lseD;
  if (keep.is_cpu() && keep.scalar_type() == pb.compute && (pb.compute == at::kFloat || pb.compute == at::kDouble)) {
    // The fused kernel's row logsumexp at T: no [C, V] temporary.
    lseK = at::empty({c}, keep.options());
    lseD = at::empty({c}, keep.options());
    const lossk::Kernels& k = lossk::kernels();
    if (pb.compute == at::kFloat) {
      k.rowLogsumexpF(keep.data_ptr<float>(), c, keep.size(1), pb.temperature, lseK.data_ptr<float>());
      k.rowLogsumexpF(drop.data_ptr<float>(), c, drop.size(1), pb.temperature, lseD.data_ptr<float>());
    } else {
      k.rowLogsumexpD(keep.data_ptr<double>(), c, keep.size(1), pb.temperature, lseK.data_ptr<double>());
      k.rowLogsumexpD(drop.data_ptr<double>(), c, drop.size(1), pb.temperature, lseD.data_ptr<double>());
    }
  } else {
    lseK = at::logsumexp(keep.to(pb.compute).div(pb.temperature), 1);
    lseD = at::logsumexp(drop.to(pb.compute).div(pb.temperature), 1);
  }
  at::Tensor m = (lseD - at::logaddexp(lseK, lseD)).exp_();
  // A +inf kept logit: the full row's logsumexp is +inf and its mass NaN there
  // (loss_vocab.cpp's denseMass), not 0.
  m.masked_fill_(lseK == std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN());
  mass.copy_(m);
}

void checkHiddenMass(Problem& pb, const HiddenTeacher& t, const at::Tensor& mass) {
  const auto row = [&t](int64_t r) {
    at::Tensor z = at::empty({1, t.vt}, t.w.options());
    headLogits(t, t.h.narrow(0, r, 1), 0, z);
    return z[0];
  };
  checkTruncatedMass(pb, t.maxTruncatedMass, mass, row);
}

} // namespace loss_impl

at::Tensor teacherLogits(const at::Tensor& teacherHidden, const TeacherHead& head, int64_t chunkTokens) {
  DISTILL_CHECK_T(UsageError, chunkTokens >= 0, "teacherLogits: chunk_tokens must be >= 0 (0: automatic), found ",
                  chunkTokens);
  validateTeacherHead(head); // before its device is read
  const HiddenTeacher t = hiddenTeacher(teacherHidden, head, head.weight.device(), "teacherLogits");
  at::NoGradGuard noGrad;
  const int64_t n = t.h.size(0);
  const int64_t chunk = chunkTokens > 0 ? chunkTokens : autoChunk(t.vt);
  at::Tensor out = at::empty({n, t.vt}, t.w.options());
  for (int64_t c0 = 0; c0 < n; c0 += chunk) {
    const int64_t c = std::min(chunk, n - c0);
    headLogits(t, t.h.narrow(0, c0, c), 0, out.narrow(0, c0, c));
  }
  std::vector<int64_t> shape = teacherHidden.sizes().vec();
  shape.back() = t.vt;
  return out.view(shape);
}

LossResult fusedLinearLoss(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                           const at::Tensor& labels, const at::Tensor& teacherHidden, const TeacherHead& teacherHead,
                           const LossOptions& options, double normalizer, int64_t chunkTokens) {
  HiddenTeacher t = hiddenTeacher(teacherHidden, teacherHead, hidden.defined() ? hidden.device() : at::kCPU,
                                  "fusedLinearLoss");
  t.maxTruncatedMass = options.max_truncated_mass;
  return fusedLinearHidden(hidden, weight, bias, labels, t, options, normalizer, chunkTokens, /*allowFused=*/true);
}

namespace detail {

LossResult fusedLinearLossAtenOps(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                                  const at::Tensor& labels, const at::Tensor& teacherHidden,
                                  const TeacherHead& teacherHead, const LossOptions& options, double normalizer,
                                  int64_t chunkTokens) {
  HiddenTeacher t = hiddenTeacher(teacherHidden, teacherHead, hidden.defined() ? hidden.device() : at::kCPU,
                                  "fusedLinearLoss");
  t.maxTruncatedMass = options.max_truncated_mass;
  return fusedLinearHidden(hidden, weight, bias, labels, t, options, normalizer, chunkTokens, /*allowFused=*/false);
}

} // namespace detail

} // namespace distill
