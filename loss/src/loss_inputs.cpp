// The inputs of one distillLoss call, checked and flattened into a Problem
// (loss_problem.h): every shape, dtype and device at once, the data checks
// (label and index ranges, repeated indices, the teacher's logsumexp) in one
// device sync.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "distill/core/errors.h"
#include "loss_problem.h"
#include "targets/targets.h"

namespace distill::loss_impl {

// LossOptions built in code (not parsed) may hold any value: one outside the enum is a ConfigError.
Kind kindOf(LossKind k) {
  switch (k) {
    case LossKind::kForwardKl:
      return Kind::kForward;
    case LossKind::kReverseKl:
      return Kind::kReverse;
    case LossKind::kJsd:
      return Kind::kJsd;
    case LossKind::kSampledToken: // an estimate of the reverse KL (sampled_chunks.cpp computes it)
      return Kind::kReverse;
  }
  DISTILL_THROW(ConfigError, "loss.kind: expected forward_kl | reverse_kl | jsd | sampled_token, found value ",
                static_cast<int>(k));
}

double epsOf(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return std::numeric_limits<double>::epsilon();
    case at::kFloat:
      return std::numeric_limits<float>::epsilon();
    case at::kHalf:
      return 0x1p-10;
    case at::kBFloat16:
      return 0x1p-7;
    default:
      return std::numeric_limits<float>::epsilon();
  }
}

void checkDevice(const char* what, const at::Tensor& t, const StudentShape& z) {
  DISTILL_CHECK_T(ProtocolError, t.device() == z.device, z.fn, ": ", what, " on device ", t.device().str(),
                  ", expected the ", z.what, "' device ", z.device.str());
}

namespace {

// The options' part of a Problem.
Problem fromOptions(const LossOptions& o, double normalizer, const char* fn) {
  validateLossOptions(o);
  DISTILL_CHECK_T(UsageError, std::isfinite(normalizer) && normalizer >= 0, fn,
                  ": normalizer must be a positive token count (0 only for a call without "
                  "non-ignored tokens), found ",
                  normalizer);
  Problem pb;
  pb.kind = kindOf(o.kind);
  pb.sampledToken = o.kind == LossKind::kSampledToken;
  pb.temperature = o.temperature;
  pb.alpha = o.alpha;
  pb.needKd = o.alpha > 0;
  pb.needCe = o.alpha < 1;
  pb.beta = o.jsd_beta;
  pb.normalizer = normalizer;
  pb.chunk = o.chunk_tokens;
  return pb;
}

} // namespace

bool kernelDtype(const at::Device& device, at::ScalarType t) {
  if (device.is_cpu()) return t == at::kFloat || t == at::kDouble;
  return device.is_cuda() && (t == at::kFloat || t == at::kHalf || t == at::kBFloat16);
}

StudentShape studentShape(const at::Tensor& z, bool allowFused) {
  DISTILL_CHECK_T(
      ProtocolError, z.defined() && z.dim() >= 1 && at::isFloatingType(z.scalar_type()),
      "distillLoss: student logits: expected a floating tensor [..., V], found ",
      z.defined() ? shapeOf(z) + " " + std::string(c10::toString(z.scalar_type())) : std::string("undefined"));
  StudentShape s;
  s.v = z.size(-1);
  DISTILL_CHECK_T(ProtocolError, s.v >= 1, "distillLoss: student logits: vocabulary is empty, shape ", shapeOf(z));
  s.n = z.numel() / s.v;
  s.dtype = z.scalar_type();
  s.device = z.device();
  s.shape = shapeOf(z);
  // A row kernel computes the chunks (see Problem::kernel).
  s.fusable = allowFused && z.is_contiguous() && kernelDtype(z.device(), z.scalar_type());
  return s;
}

namespace {

void readLabels(Problem& pb, const StudentShape& z, const at::Tensor& labels, bool cpuFused) {
  DISTILL_CHECK_T(ProtocolError, labels.defined() && labels.scalar_type() == at::kLong && labels.numel() == pb.n, pb.fn,
                  ": labels: expected int64 with ", pb.n, " elements (", z.what, " ", z.shape, "), found ",
                  labels.defined() ? shapeOf(labels) + " " + std::string(c10::toString(labels.scalar_type()))
                                   : std::string("undefined"));
  checkDevice("labels", labels, z);
  pb.labels = labels.reshape({pb.n});
  if (cpuFused) pb.labels = pb.labels.contiguous();
}

// Evaluates every data check with one device sync; throws the first failure.
void runChecks(const std::vector<DataCheck>& checks) {
  std::vector<at::Tensor> oks;
  for (auto& c : checks) oks.push_back(c.ok);
  at::Tensor ok = at::stack(oks).cpu();
  const bool* okp = ok.data_ptr<bool>();
  for (size_t i = 0; i < checks.size(); ++i) {
    if (!okp[i]) checks[i].fail();
  }
}

} // namespace

Problem prepare(const StudentShape& z, const at::Tensor& labels, const TeacherOutput& teacher, const LossOptions& o,
                double normalizer) {
  Problem pb = fromOptions(o, normalizer, z.fn);
  pb.fn = z.fn;
  pb.n = z.n;
  pb.v = z.v;
  pb.compute = z.dtype == at::kDouble ? at::kDouble : at::kFloat;
  pb.vt = teacherVocab(pb, teacher.vocab, std::visit([](const auto& a) { return answerWidth(a); }, teacher.answer), o);
  const bool truncate = pb.vt > pb.v && pb.needKd;
  bool cpuFused = z.fusable && z.device.is_cpu(); // the CPU kernel's inputs are made here
  readLabels(pb, z, labels, cpuFused);
  at::Tensor keep = pb.labels != o.ignore_index;
  std::vector<DataCheck> checks; // all evaluated with one device sync
  checks.push_back({(~keep | ((pb.labels >= 0) & (pb.labels < pb.v))).all(), [&] {
                      DISTILL_THROW(ProtocolError, pb.fn, ": labels: every label must be in [0, ", pb.v,
                                    ") or ignore_index = ", o.ignore_index);
                    }});
  ReadState read{o, keep, checks, truncate, cpuFused};
  DISTILL_CHECK_T(ConfigError, !pb.sampledToken || !pb.needKd || teacher.ids(),
                  "loss.kind sampled_token needs ids answers of the tokens the student sampled (the teacher's logit "
                  "at each and its logsumexp), found a ", answerKind(teacher.kind()).title, " answer");
  std::visit([&](const auto& answer) { readTarget(pb, answer, z, read); }, teacher.answer);
  cpuFused = read.cpuFused;
  runChecks(checks);
  pb.valid = keep.nonzero().squeeze(1);
  pb.allValid = pb.valid.size(0) == pb.n;
  DISTILL_CHECK_T(UsageError, normalizer > 0 || pb.valid.size(0) == 0, pb.fn, ": normalizer is 0 but this call has ",
                  pb.valid.size(0), " non-ignored token(s); pass the step's token count (stepTokenCount)");
  if (truncate) truncateTeacher(pb, o);
  if (cpuFused) {
    pb.kernel = cpuRowKernel();
    pb.labels = pb.labels.contiguous();
    if (pb.tIndices.defined()) pb.tIndices = pb.tIndices.contiguous();
  } else if (z.fusable && !pb.tWeights.defined() && !pb.sampledToken) {
    const RowKernel* k = rowKernel(z.device.type());
    if (k && k->adopt(pb)) pb.kernel = k;
  }
  return pb;
}

} // namespace distill::loss_impl
