// fusedLinearLoss (losses.h): the output projection chunked together with the
// loss, so that no [N, V] tensor is ever alive. Each chunk of valid tokens is
// a Problem of its own (the global one's rows, sliced) run through the chunks
// of losses.cpp, then its logits' gradient is turned into the hidden states'
// and the projection's at once (Liger-Kernel's fused linear cross-entropy):
// every chunk's logits go into one reused buffer in the input dtype, the row
// kernel (or the ATen-op path) writes their gradient over them in place, and
// nothing in the loop waits for the device (the loss parts stay there).
// With the teacher as hidden states + head (hidden_head.h), each chunk's
// teacher logits are made the same way (one more GEMM into a second reused
// buffer, no gradient) and handed to that chunk's Problem as its dense
// teacher logits.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "distill/core/errors.h"
#include "distill/loss/losses.h"
#include "hidden_teacher.h"
#include "loss_problem.h"

namespace distill {

using namespace loss_impl;

namespace {

// The inputs of one call, flattened: hidden [N, d], weight [V, d], bias [V] or undefined.
struct Linear {
  at::Tensor h, w, b;
  const HiddenTeacher* teacher = nullptr; // the teacher as hidden states + head, or null: pb's teacher output
  int64_t chunk = 1;
  bool gradH = false, gradW = false, gradB = false;
  bool anyGrad() const { return gradH || gradW || gradB; }
};

std::string describe(const at::Tensor& t) {
  return t.defined() ? shapeOf(t) + " " + std::string(c10::toString(t.scalar_type())) + " on " + t.device().str()
                     : std::string("undefined");
}

// Checks hidden, weight and bias; the shape of the logits they stand for.
StudentShape linearShape(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias, bool allowFused) {
  const bool ok = hidden.defined() && hidden.dim() >= 1 && at::isFloatingType(hidden.scalar_type()) &&
      weight.defined() && weight.dim() == 2 && weight.size(0) >= 1 && weight.size(1) == hidden.size(-1) &&
      weight.scalar_type() == hidden.scalar_type() && weight.device() == hidden.device() &&
      (!bias.defined() ||
       (bias.dim() == 1 && bias.size(0) == weight.size(0) && bias.scalar_type() == hidden.scalar_type() &&
        bias.device() == hidden.device()));
  DISTILL_CHECK_T(ProtocolError, ok,
                  "fusedLinearLoss: expected floating hidden [..., d], weight [V, d] and bias [V] (or none) of one "
                  "dtype on one device, found hidden ",
                  describe(hidden), ", weight ", describe(weight), ", bias ", describe(bias));
  StudentShape s;
  s.v = weight.size(0);
  s.n = 1; // the leading dims of hidden
  for (int64_t i = 0; i + 1 < hidden.dim(); ++i) s.n *= hidden.size(i);
  s.dtype = hidden.scalar_type();
  s.device = hidden.device();
  s.shape = "[" + std::to_string(s.n) + ", " + std::to_string(s.v) + "] (hidden " + shapeOf(hidden) + " @ weight.T)";
  s.what = "student hidden states";
  s.fn = "fusedLinearLoss";
  s.fusable = allowFused && kernelDtype(s.device, s.dtype);
  return s;
}

// Rows [first, first + count) of the valid tokens: global row ids, or a plain
// range when every token is valid.
struct Span {
  int64_t first = 0, count = 0;
  at::Tensor index; // undefined: the range [first, first + count) of the N rows
  at::Tensor of(const at::Tensor& t) const {
    if (!t.defined()) return t;
    return index.defined() ? t.index_select(0, index) : t.narrow(0, first, count).contiguous();
  }
};

// The Problem of one chunk: the global one's per-row data for its rows, every
// row valid, one chunk; its logits `zc` [C, V].
Problem chunkProblem(const Problem& pb, const Span& span, const at::Tensor& zc) {
  Problem c = pb;
  c.n = span.count;
  c.chunk = std::max<int64_t>(1, span.count);
  c.labels = span.of(pb.labels);
  c.valid = at::arange(span.count, pb.labels.options());
  c.allValid = true;
  for (at::Tensor* t : {&c.tLogits, &c.tValues, &c.tIndices, &c.tLse, &c.tLogTail, &c.tLogSum, &c.kValues, &c.kLse,
                        &c.kLogTail, &c.tNull, &c.tWeights, &c.tSamplingLogp, &c.kLogq, &c.kSamplingLogp}) {
    *t = span.of(*t);
  }
  if (c.kernel) c.zc = zc;
  return c;
}

struct Grads {
  at::Tensor h, w, b; // accumulated as each chunk ends; undefined where not wanted
};

// The teacher's side of the chunks when it is given as hidden states + head:
// its logits of the student's ids [chunk, V_s] and, for a head truncated to
// them, of the others [chunk, V_t - V_s], both reused by every chunk, and the
// dropped mass of every valid row [Nv]. Undefined when not needed.
struct TeacherBuffers {
  at::Tensor keep, drop, mass;
};

TeacherBuffers teacherBuffers(const Problem& pb, const Linear& lin) {
  TeacherBuffers tb;
  if (!lin.teacher || !pb.needKd) return tb;
  const int64_t nv = pb.valid.size(0), rows = std::min(lin.chunk, nv);
  tb.keep = at::empty({rows, pb.v}, lin.teacher->w.options());
  if (pb.vt > pb.v) {
    tb.drop = at::empty({rows, pb.vt - pb.v}, lin.teacher->w.options());
    tb.mass = at::empty({nv}, lin.teacher->w.options().dtype(pb.compute));
  }
  return tb;
}

// One chunk's teacher logits over the student's ids (the head's first V_s
// rows: a truncated head's other ids only give their mass).
at::Tensor teacherChunk(const Problem& pb, const HiddenTeacher& t, const Span& span, const TeacherBuffers& tb) {
  const at::Tensor hc = span.of(t.h);
  at::Tensor keep = tb.keep.narrow(0, 0, span.count);
  headLogits(t, hc, 0, keep);
  if (tb.drop.defined()) {
    at::Tensor drop = tb.drop.narrow(0, 0, span.count);
    headLogits(t, hc, pb.v, drop);
    droppedMass(pb, keep, drop, tb.mass.narrow(0, span.first, span.count));
  }
  return keep;
}

// w (float32) += gz^T hc. With 16-bit operands on a GPU, one half-precision GEMM accumulating in
// float32 (addmm's out_dtype overload, or mm's) instead of casting both to float32, which runs
// without tensor cores: on an H200 at V 128 256, d 4096 that float32 GEMM was most of the loss's
// time. torch versions differ in which overloads take a float32 `self`, so each is tried in turn,
// and the float32 GEMM stays the fallback; the first that works is kept.
void addWeightGrad(at::Tensor& w, const at::Tensor& gz, const at::Tensor& hc) {
  static std::atomic<int> path{0}; // 0: addmm out_dtype; 1: mm out_dtype, then add; 2: float32 GEMM
  const bool half = hc.scalar_type() == at::kBFloat16 || hc.scalar_type() == at::kHalf;
  if (w.is_cuda() && half && gz.scalar_type() == hc.scalar_type() && w.scalar_type() == at::kFloat) {
    for (int p = path.load(); p < 2; p = ++path) {
      try {
        if (p == 0) {
          at::addmm_out(w, w, gz.t(), hc, at::kFloat);
        } else {
          w.add_(at::mm(gz.t(), hc, at::kFloat));
        }
        return;
      } catch (const c10::Error&) {
        // this torch has no such kernel for these dtypes: the next path
      }
    }
  }
  w.addmm_(gz.t().to(w.scalar_type()), hc.to(w.scalar_type()));
}

// One chunk: its logits into `zc` (the reused buffer's first rows), loss sums,
// and (when wanted) d loss / d logits into `gz` (zc itself, or a second buffer
// where the row kernel cannot write in place), turned into the gradients.
void linearChunk(const Problem& pb, const Linear& lin, const Span& span, const at::Tensor& zc, const at::Tensor& gz,
                 const TeacherBuffers& tb, Sums& sums, Grads& g) {
  at::Tensor hc = span.of(lin.h); // [C, d]
  at::Tensor z = zc;
  if (lin.b.defined()) {
    at::addmm_out(z, lin.b, hc, lin.w.t());
  } else {
    at::mm_out(z, hc, lin.w.t());
  }
  Problem c = chunkProblem(pb, span, zc);
  if (tb.keep.defined()) c.tLogits = teacherChunk(pb, *lin.teacher, span, tb);
  Sums s = runChunks(c, zc, gz);
  sums.kd.add_(s.kd);
  sums.ce.add_(s.ce);
  if (!gz.defined()) return;
  if (g.h.defined()) {
    if (span.index.defined()) {
      g.h.index_copy_(0, span.index, at::mm(gz, lin.w).to(g.h.scalar_type()));
    } else {
      at::Tensor rows = g.h.narrow(0, span.first, span.count);
      at::mm_out(rows, gz, lin.w);
    }
  }
  if (g.w.defined()) {
    if (g.w.scalar_type() == gz.scalar_type() && gz.scalar_type() == hc.scalar_type()) {
      g.w.addmm_(gz.t(), hc); // one GEMM accumulating in float32 inside, into the input dtype
    } else {
      addWeightGrad(g.w, gz, hc);
    }
  }
  if (g.b.defined()) g.b.add_(gz.sum(0, /*keepdim=*/false, g.b.scalar_type()));
}

// The weight gradient's dtype: on CUDA with 16-bit inputs the input dtype (Liger's
// default: the accumulator alone would be twice the weight in float32, 2 GiB at
// V 128 256, d 4096), else float32 at least.
at::ScalarType weightGradDtype(const Problem& pb, const Linear& lin) {
  const at::ScalarType t = lin.w.scalar_type();
  return lin.w.is_cuda() && (t == at::kBFloat16 || t == at::kHalf) ? t : pb.compute;
}

// The loss and, for the inputs that want it, their gradients, chunk by chunk.
// A truncated hidden-state teacher's dropped mass is checked after the chunks
// (measured on the way), into pb.
LossResult runLinear(Problem& pb, const Linear& lin, Grads& g) {
  const int64_t d = lin.h.size(1);
  const auto acc = lin.h.options().dtype(pb.compute); // bias sums: float32 at least
  if (lin.gradH) {
    g.h = pb.allValid ? at::empty({pb.n, d}, lin.h.options()) : at::zeros({pb.n, d}, lin.h.options());
  }
  if (lin.gradW) g.w = at::zeros({pb.v, d}, lin.h.options().dtype(weightGradDtype(pb, lin)));
  if (lin.gradB) g.b = at::zeros({pb.v}, acc);
  auto dopt = at::TensorOptions().dtype(at::kDouble).device(lin.h.device());
  Sums sums{at::zeros({}, dopt), at::zeros({}, dopt)};
  const int64_t nv = pb.valid.size(0);
  // The one logits buffer of every chunk; the gradient over it in place unless
  // the row kernel rereads logits after writing (the CPU kernel's reverse KL, JSD).
  at::Tensor zbuf = at::empty({std::min(lin.chunk, nv), pb.v}, lin.h.options());
  at::Tensor gbuf;
  if (lin.anyGrad()) gbuf = pb.kernel && !pb.kernel->inPlace() ? at::empty_like(zbuf) : zbuf;
  const TeacherBuffers tb = teacherBuffers(pb, lin);
  for (int64_t c0 = 0; c0 < nv; c0 += lin.chunk) {
    Span span;
    span.first = c0;
    span.count = std::min(lin.chunk, nv - c0);
    if (!pb.allValid) span.index = pb.valid.narrow(0, c0, span.count);
    linearChunk(pb, lin, span, zbuf.narrow(0, 0, span.count),
                gbuf.defined() ? gbuf.narrow(0, 0, span.count) : at::Tensor(), tb, sums, g);
  }
  if (tb.mass.defined()) checkHiddenMass(pb, *lin.teacher, tb.mass);
  if (g.w.defined()) g.w = g.w.to(lin.w.scalar_type());
  if (g.b.defined()) g.b = g.b.to(lin.b.scalar_type());
  return finish(pb, sums);
}

// Forward computes the loss and the gradients in one pass and keeps them;
// backward scales them by the incoming gradient (once: they are handed on).
class FusedLinearFunction : public torch::autograd::Function<FusedLinearFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden,
                                                const at::Tensor& weight, const at::Tensor& bias, Problem* pb,
                                                const Linear* lin) {
    Grads g;
    LossResult r = runLinear(*pb, *lin, g);
    if (g.h.defined()) ctx->saved_data["h"] = g.h.view(hidden.sizes());
    if (g.w.defined()) ctx->saved_data["w"] = g.w;
    if (g.b.defined()) ctx->saved_data["b"] = g.b;
    ctx->saved_data["pending"] = true;
    ctx->mark_non_differentiable({r.kd, r.ce});
    return {r.loss, r.kd, r.ce};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list gradOut) {
    DISTILL_CHECK_T(UsageError, ctx->saved_data.count("pending"),
                    "fusedLinearLoss: backward ran twice through the same loss; its gradients are "
                    "handed on by the first backward (retain_graph is not supported)");
    torch::autograd::variable_list out(5);
    const char* names[] = {"h", "w", "b"};
    for (int i = 0; i < 3; ++i) {
      auto it = ctx->saved_data.find(names[i]);
      if (it == ctx->saved_data.end()) continue; // not wanted
      out[i] = it->second.toTensor();
      ctx->saved_data.erase(it); // autograd may take the buffer over
    }
    ctx->saved_data.erase("pending");
    if (!gradOut[0].defined()) return torch::autograd::variable_list(5);
    // loss.backward() passes 1: then the gradients are handed on as they are.
    const bool one = gradOut[0].is_cpu() && gradOut[0].numel() == 1 && gradOut[0].item<double>() == 1.0;
    for (int i = 0; i < 3; ++i) {
      if (out[i].defined() && !one) out[i].mul_(gradOut[0]);
    }
    return out;
  }
};

// Rows per chunk when the caller leaves it to us. CPU: a chunk's logits hold
// ~8 M elements (max(256, 2^23 / V)). CUDA: the chunk buffer near 4 N d elements
// (next_pow2(4 N / ceil(V / d)), four times Liger's rule), within [256, 2048] rows.
// Each chunk reads and writes the whole weight gradient (dW += G^T x_c), so fewer
// chunks cost less: on one H200 (N 8192, d 4096, V 128256, bf16, forward KL + CE)
// 256 rows took 63 ms, 512 48.7 ms, 1024 45.5 ms, 2048 42.8 ms, with peaks of
// 1.11 / 1.17 / 1.30 / 1.56 GiB (0.98 of them the weight gradient) and eager
// cross-entropy at 47.2 ms (docs/benchmarks.md, "On a GPU"); chunk_tokens trades back.
int64_t defaultChunk(const Problem& pb, int64_t d, const at::Device& device) {
  if (!device.is_cuda()) return std::max<int64_t>(256, (int64_t{1} << 23) / pb.v);
  const int64_t nv = std::max<int64_t>(1, pb.valid.size(0));
  const int64_t ratio = (pb.v + d - 1) / std::max<int64_t>(1, d);
  const int64_t want = (4 * nv + ratio - 1) / std::max<int64_t>(1, ratio);
  int64_t c = 1;
  while (c < want) c <<= 1;
  return std::min<int64_t>(2048, std::max<int64_t>(256, c));
}

// The teacher: its output (`teacher`), or its hidden states + head (`ht`).
LossResult fusedLinear(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                       const at::Tensor& labels, const TeacherOutput* teacher, const HiddenTeacher* ht,
                       const LossOptions& options, double normalizer, int64_t chunkTokens, bool allowFused) {
  DISTILL_CHECK_T(UsageError, chunkTokens >= 0, "fusedLinearLoss: chunk_tokens must be >= 0 (0: automatic), found ",
                  chunkTokens);
  const StudentShape shape = linearShape(hidden, weight, bias, allowFused);
  Problem pb = ht ? prepareHidden(shape, labels, *ht, options, normalizer)
                  : prepare(shape, labels, *teacher, options, normalizer);
  Linear lin;
  lin.teacher = ht;
  lin.h = hidden.reshape({pb.n, weight.size(1)});
  lin.w = weight;
  lin.b = bias;
  lin.chunk = chunkTokens > 0 ? chunkTokens : defaultChunk(pb, weight.size(1), hidden.device());
  const bool grad = at::GradMode::is_enabled();
  lin.gradH = grad && hidden.requires_grad();
  lin.gradW = grad && weight.requires_grad();
  lin.gradB = grad && bias.defined() && bias.requires_grad();
  if (!lin.anyGrad()) {
    at::NoGradGuard noGrad;
    Grads none;
    return runLinear(pb, lin, none);
  }
  // The chunks run on tensors that do not record autograd history.
  lin.h = lin.h.detach();
  lin.w = lin.w.detach();
  if (lin.b.defined()) lin.b = lin.b.detach();
  // An autograd input must be defined: no bias is an empty tensor there.
  const at::Tensor biasInput = bias.defined() ? bias : at::empty({0}, weight.options());
  torch::autograd::variable_list out = FusedLinearFunction::apply(hidden, weight, biasInput, &pb, &lin);
  return withMass(pb, LossResult{out[0], out[1], out[2], pb.valid.size(0)});
}

} // namespace

LossResult loss_impl::fusedLinearHidden(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                                        const at::Tensor& labels, const HiddenTeacher& teacher,
                                        const LossOptions& options, double normalizer, int64_t chunkTokens,
                                        bool allowFused) {
  return fusedLinear(hidden, weight, bias, labels, nullptr, &teacher, options, normalizer, chunkTokens, allowFused);
}

LossResult fusedLinearLoss(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                           const at::Tensor& labels, const TeacherOutput& teacher, const LossOptions& options,
                           double normalizer, int64_t chunkTokens) {
  if (const HiddenAnswer* h = teacher.hidden()) { // the teacher's logits made chunk by chunk beside the student's
    DISTILL_CHECK_T(UsageError, h->head != nullptr,
                    "fusedLinearLoss: the teacher answered with its hidden states but no head came with them (a "
                    "Client attaches the node's mapped head; a caller of the loss sets HiddenAnswer::head)");
    return fusedLinearLoss(hidden, weight, bias, labels, h->hidden, *h->head, options, normalizer, chunkTokens);
  }
  return fusedLinear(hidden, weight, bias, labels, &teacher, nullptr, options, normalizer, chunkTokens,
                     /*allowFused=*/true);
}

namespace detail {

LossResult fusedLinearLossAtenOps(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                                  const at::Tensor& labels, const TeacherOutput& teacher, const LossOptions& options,
                                  double normalizer, int64_t chunkTokens) {
  if (const HiddenAnswer* h = teacher.hidden()) {
    DISTILL_CHECK_T(UsageError, h->head != nullptr, "fusedLinearLoss: a hidden-state answer without its head");
    return fusedLinearLossAtenOps(hidden, weight, bias, labels, h->hidden, *h->head, options, normalizer, chunkTokens);
  }
  return fusedLinear(hidden, weight, bias, labels, &teacher, nullptr, options, normalizer, chunkTokens,
                     /*allowFused=*/false);
}

} // namespace detail

} // namespace distill
