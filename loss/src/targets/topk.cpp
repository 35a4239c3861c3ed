// The reader of top-k answers (targets.h): values, indices and the optional
// logsumexp and log tail; the index checks (range, repeats) and the check of
// the teacher's logsumexp against its own top-k (losses.h).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "../cpu/loss_kernel.h"
#include "distill/core/errors.h"
#include "targets.h"

namespace distill::loss_impl {
namespace {

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

// The top-k values, indices and per-token tensors: shapes, dtypes, devices. Returns k.
int64_t readTopkTensors(Problem& pb, const TopkAnswer& teacher, const StudentShape& z) {
  const at::Tensor &tv = teacher.values, &ti = teacher.indices;
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
  if (teacher.logsumexp.defined()) pb.tLse = perToken(protocol::kLogsumexp, teacher.logsumexp);
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


} // namespace

int64_t answerWidth(const TopkAnswer&) { return -1; }

void readTarget(Problem& pb, const TopkAnswer& a, const StudentShape& z, ReadState& s) {
  const int64_t k = readTopkTensors(pb, a, z);
  s.checks.push_back({((pb.tIndices >= 0) & (pb.tIndices < pb.vt)).all(), [&pb] {
                        DISTILL_THROW(ProtocolError, pb.fn,
                                      ": teacher top-k indices: every index must "
                                      "be in [0, ",
                                      pb.vt, ")", pb.vt > pb.v ? " (the teacher's vocabulary)" : "");
                      }});
  if (k > 1) s.checks.push_back(uniqueIndices(pb, k));
  // Dropped top-k entries are null buckets, which only the ATen-op path takes.
  if (s.truncate && s.cpuFused && anyTopkDropped(pb)) s.cpuFused = false;
  topkLogSum(pb, z, s.options, s.cpuFused, s.keep, s.checks, k);
}

} // namespace distill::loss_impl
