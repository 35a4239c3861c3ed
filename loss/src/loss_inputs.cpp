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

#include "cpu/loss_kernel.h"
#include "distill/core/errors.h"
#include "loss_problem.h"

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
  }
  DISTILL_THROW(ConfigError, "loss.kind: expected forward_kl | reverse_kl | jsd, found value ", static_cast<int>(k));
}

namespace {

// Machine epsilon of a floating dtype (the teacher data's rounding).
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

// A per-row data check, evaluated with all the others in one device sync.
struct DataCheck {
  at::Tensor ok; // 0-dim bool
  std::function<void()> fail; // throws the error (may look at the data again)
};

// With the teacher's logsumexp: its own top-k (and log tail) must not say that
// the probabilities sum above 1 (or, with the tail, to anything but 1) by more
// than rounding; see losses.h.
DataCheck logsumexpCheck(const Problem& pb, const at::Tensor& keep) {
  const at::Tensor& s = pb.tLogSum;
  at::Tensor lse = pb.tLse.to(pb.compute);
  at::Tensor diff = s - lse;
  at::Tensor tol = lse.abs().mul(8 * pb.eps).add_(kLogsumexpTolerance);
  at::Tensor rowOk = (pb.tLogTail.defined() ? diff.abs() : diff).le(tol).logical_and_(at::isfinite(lse));
  at::Tensor bad = keep.logical_and(rowOk.logical_not());
  DataCheck c;
  c.ok = bad.any().logical_not();
  c.fail = [pb, s, lse, tol, bad] {
    const int64_t row = bad.nonzero().select(1, 0)[0].item<int64_t>();
    const double sv = s[row].item<double>(), lv = lse[row].item<double>(), tv = tol[row].item<double>();
    const bool tail = pb.tLogTail.defined();
    // Said as measured (issue 39): a teacher output that is not finite contradicts nothing.
    DISTILL_CHECK_T(ProtocolError, std::isfinite(sv) && std::isfinite(lv), pb.fn, ": teacher top-k, token row ", row,
                    " of ", pb.n, ": the teacher's output for it is not finite (NaN or +inf in its logsumexp or "
                    "top-k values), so there is nothing to measure or renormalise; a distill teacher refuses such "
                    "answers (teacher.on_nonfinite), so this output came from another producer");
    DISTILL_THROW(ProtocolError, pb.fn, ": teacher top-k, token row ", row, " of ", pb.n, ": the sent logsumexp ", lv,
                  " contradicts the sent top-k",
                  tail ? " and log tail: logaddexp(logsumexp(values / T), log_tail)" : ": logsumexp(values / T)", " = ",
                  sv, " at T = loss.temperature = ", pb.temperature, "; they differ by ", sv - lv, " (the ",
                  tail ? "k+1 buckets'" : "top-k", " probabilities would sum to ", std::exp(sv - lv),
                  "), beyond the tolerance ", tv,
                  " (kLogsumexpTolerance + 8 eps |logsumexp|, losses.h). "
                  "A logsumexp sent at another temperature?");
  };
  return c;
}

void rowLogsumexp(const float* x, int64_t n, int64_t k, double t, float* out) {
  lossk::kernels().rowLogsumexpF(x, n, k, t, out);
}
void rowLogsumexp(const double* x, int64_t n, int64_t k, double t, double* out) {
  lossk::kernels().rowLogsumexpD(x, n, k, t, out);
}

// The options' part of a Problem.
Problem fromOptions(const LossOptions& o, double normalizer, const char* fn) {
  validateLossOptions(o);
  DISTILL_CHECK_T(UsageError, std::isfinite(normalizer) && normalizer >= 0, fn,
                  ": normalizer must be a positive token count (0 only for a call without "
                  "non-ignored tokens), found ",
                  normalizer);
  Problem pb;
  pb.kind = kindOf(o.kind);
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

bool nkShape(const Problem& pb, const at::Tensor& t, int64_t k) {
  return t.dim() >= 1 && t.size(-1) == k && t.numel() == pb.n * k;
}

void readDenseTeacher(Problem& pb, const TeacherOutput& teacher, const StudentShape& z) {
  const at::Tensor& tl = teacher.logits;
  DISTILL_CHECK_T(ProtocolError, nkShape(pb, tl, pb.vt) && at::isFloatingType(tl.scalar_type()), pb.fn,
                  ": teacher logits: expected floating [", pb.n, ", ", pb.vt, "] (or the student's ", z.shape,
                  "), found ", shapeOf(tl), " ", c10::toString(tl.scalar_type()));
  checkDevice("teacher logits", tl, z);
  pb.tLogits = tl.reshape({pb.n, pb.vt});
  if (pb.vt > pb.v) { // loss.vocab truncate: the student's ids only (loss_vocab.cpp)
    pb.tFull = pb.tLogits;
    pb.tLogits = pb.tFull.narrow(1, 0, pb.v);
  }
}

// The top-k values, indices and per-token tensors: shapes, dtypes, devices. Returns k.
int64_t readTopkTeacher(Problem& pb, const TeacherOutput& teacher, const StudentShape& z) {
  const at::Tensor &tv = teacher.topkValues, &ti = teacher.topkIndices;
  DISTILL_CHECK_T(ProtocolError, tv.defined() && ti.defined(), pb.fn,
                  ": teacher output has neither logits nor top-k values and indices");
  const int64_t k = tv.dim() >= 1 ? tv.size(-1) : 0;
  DISTILL_CHECK_T(ProtocolError, k >= 1 && k <= pb.vt && nkShape(pb, tv, k) && at::isFloatingType(tv.scalar_type()),
                  pb.fn, ": teacher top-k values: expected floating [", pb.n, ", k] with 1 <= k <= V = ", pb.vt,
                  ", found ", shapeOf(tv), " ", c10::toString(tv.scalar_type()));
  DISTILL_CHECK_T(ProtocolError, nkShape(pb, ti, k) && (ti.scalar_type() == at::kInt || ti.scalar_type() == at::kLong),
                  pb.fn, ": teacher top-k indices: expected int32|int64 [", pb.n, ", ", k, "] like the values, found ",
                  shapeOf(ti), " ", c10::toString(ti.scalar_type()));
  checkDevice("teacher top-k values", tv, z);
  checkDevice("teacher top-k indices", ti, z);
  pb.tValues = tv.reshape({pb.n, k});
  pb.tIndices = ti.reshape({pb.n, k}).to(at::kLong);
  pb.eps = std::max(epsOf(pb.compute), epsOf(tv.scalar_type()));
  auto perToken = [&](const char* what, const at::Tensor& t) {
    DISTILL_CHECK_T(ProtocolError, t.numel() == pb.n && at::isFloatingType(t.scalar_type()), pb.fn, ": teacher ", what,
                    ": expected floating [", pb.n, "], found ", shapeOf(t), " ", c10::toString(t.scalar_type()));
    checkDevice((std::string("teacher ") + what).c_str(), t, z);
    pb.eps = std::max(pb.eps, epsOf(t.scalar_type()));
    return t.reshape({pb.n});
  };
  if (teacher.logsumexp.defined()) pb.tLse = perToken("logsumexp", teacher.logsumexp);
  if (teacher.logTail.defined()) pb.tLogTail = perToken("logTail", teacher.logTail);
  DISTILL_CHECK_T(ConfigError, pb.kind != Kind::kReverse || pb.tLse.defined() || pb.tLogTail.defined(),
                  "loss.kind reverse_kl with a top-k teacher needs the teacher's logsumexp (or log "
                  "tail): without it the teacher has no mass outside its top-k and KL(p_S || p_T) is "
                  "infinite; send teacher.logsumexp or use forward_kl | jsd");
  return k;
}

// No index twice within a token's top-k.
DataCheck uniqueIndices(Problem& pb, int64_t k) {
  at::Tensor unique;
  if (pb.tIndices.is_cpu()) {
    // O(N k) with one stamp per token id, instead of sorting every row (the
    // sort was ~20% of a top-k loss on CPU).
    pb.tIndices = pb.tIndices.contiguous();
    const int64_t* ip = pb.tIndices.data_ptr<int64_t>();
    std::vector<int64_t> stamp(pb.vt, -1);
    bool ok = true;
    for (int64_t r = 0; r < pb.n && ok; ++r) {
      for (int64_t b = 0; b < k; ++b) {
        const int64_t j = ip[r * k + b];
        if (j < 0 || j >= pb.vt) continue; // the range check above reports it
        if (stamp[j] == r) {
          ok = false;
          break;
        }
        stamp[j] = r;
      }
    }
    unique = at::scalar_tensor(ok, at::TensorOptions().dtype(at::kBool));
  } else {
    at::Tensor sorted = std::get<0>(pb.tIndices.sort(1));
    unique = (sorted.narrow(1, 1, k - 1) != sorted.narrow(1, 0, k - 1)).all();
  }
  return {unique, [fn = pb.fn] {
            DISTILL_THROW(ProtocolError, fn, ": teacher top-k indices: repeated index within a token's top-k");
          }};
}

// The log of what the top-k (and tail) probabilities sum to, and the check of
// the teacher's logsumexp against it.
void topkLogSum(Problem& pb, const StudentShape& z, const LossOptions& o, bool cpuFused, const at::Tensor& keep,
                std::vector<DataCheck>& checks, int64_t k) {
  if (cpuFused) {
    // The fused kernel's inputs, converted once (O(N k)).
    pb.kValues = pb.tValues.to(pb.compute).contiguous();
    if (pb.tLse.defined()) pb.kLse = pb.tLse.to(pb.compute).contiguous();
    if (pb.tLogTail.defined()) pb.kLogTail = pb.tLogTail.to(pb.compute).contiguous();
  }
  if ((pb.tLse.defined() || pb.tLogTail.defined()) && cpuFused) {
    // As below, in plain loops over the [N] rows: a dozen ATen ops on [N]
    // tensors cost a quarter of a cross-entropy at N = 1024, V = 256.
    pb.tLogSum = at::empty({pb.n}, at::TensorOptions().dtype(pb.compute).device(z.device));
    AT_DISPATCH_FLOATING_TYPES(pb.compute, "distillLoss top-k logsumexp", [&] {
      auto* out = pb.tLogSum.data_ptr<scalar_t>();
      if (pb.kLogTail.defined()) {
        rowLogsumexp(pb.kValues.data_ptr<scalar_t>(), pb.n, k, pb.temperature, out);
      } else {
        // Without the log tail, q_tail = 1 - exp(logSum - logsumexp) hangs on the
        // last bits of logSum: ATen's own logsumexp keeps the values of the
        // ATen-op path (the fused kernel's sum order would move them by up to
        // 1e-5 relative where the tail is ~1e-14).
        pb.tLogSum.copy_(at::logsumexp(pb.kValues.div(pb.temperature), 1));
      }
      if (pb.kLogTail.defined()) {
        const auto* tail = pb.kLogTail.data_ptr<scalar_t>();
        for (int64_t r = 0; r < pb.n; ++r) {
          const scalar_t a = out[r], b = tail[r]; // at::logaddexp
          out[r] = std::isinf(a) && a == b ? a : std::max(a, b) + std::log1p(std::exp(-std::abs(a - b)));
        }
      }
      if (pb.kLse.defined()) {
        const auto* lse = pb.kLse.data_ptr<scalar_t>();
        const int64_t* lab = pb.labels.data_ptr<int64_t>();
        const bool tail = pb.kLogTail.defined();
        bool ok = true;
        for (int64_t r = 0; r < pb.n && ok; ++r) {
          if (lab[r] == o.ignore_index) continue;
          const scalar_t diff = out[r] - lse[r];
          const scalar_t tol =
              std::abs(lse[r]) * static_cast<scalar_t>(8 * pb.eps) + static_cast<scalar_t>(kLogsumexpTolerance);
          ok = (tail ? std::abs(diff) : diff) <= tol && std::isfinite(lse[r]);
        }
        // The tensor form names the row and the values.
        checks.push_back({at::scalar_tensor(ok, at::TensorOptions().dtype(at::kBool)),
                          [&pb, keep] { logsumexpCheck(pb, keep).fail(); }});
      }
    });
  } else {
    if (pb.tLse.defined() || pb.tLogTail.defined()) {
      pb.tLogSum = at::logsumexp(pb.tValues.to(pb.compute).div(pb.temperature), 1);
      if (pb.tLogTail.defined()) pb.tLogSum = at::logaddexp(pb.tLogSum, pb.tLogTail.to(pb.compute));
    }
    if (pb.tLse.defined()) checks.push_back(logsumexpCheck(pb, keep));
  }
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
  pb.vt = teacherVocab(pb, teacher, o);
  const bool truncate = pb.vt > pb.v && pb.needKd;
  bool cpuFused = z.fusable && z.device.is_cpu(); // the CPU kernel's inputs are made here
  readLabels(pb, z, labels, cpuFused);
  at::Tensor keep = pb.labels != o.ignore_index;
  std::vector<DataCheck> checks; // all evaluated with one device sync
  checks.push_back({(~keep | ((pb.labels >= 0) & (pb.labels < pb.v))).all(), [&] {
                      DISTILL_THROW(ProtocolError, pb.fn, ": labels: every label must be in [0, ", pb.v,
                                    ") or ignore_index = ", o.ignore_index);
                    }});
  if (teacher.logits.defined()) {
    readDenseTeacher(pb, teacher, z);
  } else {
    const int64_t k = readTopkTeacher(pb, teacher, z);
    checks.push_back({((pb.tIndices >= 0) & (pb.tIndices < pb.vt)).all(), [&] {
                        DISTILL_THROW(ProtocolError, pb.fn,
                                      ": teacher top-k indices: every index must "
                                      "be in [0, ",
                                      pb.vt, ")", pb.vt > pb.v ? " (the teacher's vocabulary)" : "");
                      }});
    if (k > 1) checks.push_back(uniqueIndices(pb, k));
    // Dropped top-k entries are null buckets, which only the ATen-op path takes.
    if (truncate && cpuFused && anyTopkDropped(pb)) cpuFused = false;
    topkLogSum(pb, z, o, cpuFused, keep, checks, k);
  }
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
  } else if (z.fusable) {
    const RowKernel* k = rowKernel(z.device.type());
    if (k && k->adopt(pb)) pb.kernel = k;
  }
  return pb;
}

} // namespace distill::loss_impl
