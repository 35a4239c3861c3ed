// signals_test: the fused CPU kernel of sampled targets and loss.kind
// sampled_token (loss/src/cpu/loss_kernel_sampled.h) against the ATen-op path
// it replaced on CPU (loss/src/sampled_chunks.cpp, detail::distillLossAtenOps):
// float64 to 1e-12 in every case it takes (temperatures, CE weights, ignored
// tokens, repeated ids, zero-count padding, importance weights, several
// chunks, fusedLinearLoss); float32 element-wise against the float64 answer;
// and that distillLoss really runs the kernel (no [C, V] temporaries).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "counting_allocator.h"
#include "distill/loss/losses.h"
#include "losses_test_util.h"

namespace distill {
namespace {

using namespace loss_testing;

struct Inputs {
  at::Tensor z, t, labels; // float64 [N, V] student and teacher logits, labels (two ignored)
};

Inputs makeInputs(int64_t n, int64_t v, double scale, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Inputs in;
  in.z = at::randn({n, v}, gen, at::kDouble) * (1.5 * scale);
  in.t = at::randn({n, v}, gen, at::kDouble) * (2 * scale);
  in.labels = at::randint(0, v, {n}, gen, at::kLong);
  in.labels[1] = -100;
  in.labels[n - 2] = -100;
  return in;
}

// Sampled targets drawn from the teacher at T: K = 6 draws per token sent as
// draws with count 1 (ids repeat), the last two entries of each row zero-count
// padding at id 0.
TeacherOutput sampledTeacher(const Inputs& in, double temp, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const int64_t n = in.z.size(0);
  at::Tensor ids = at::multinomial(at::softmax(in.t / temp, 1), 6, /*replacement=*/true, gen);
  ids = at::cat({ids, at::zeros({n, 2}, at::kLong)}, 1).to(at::kInt);
  at::Tensor counts = at::cat({at::ones({n, 6}, at::kShort), at::zeros({n, 2}, at::kShort)}, 1);
  counts[0][0] = 3; // a count above 1 too
  return TeacherOutput{SampledAnswer{ids, counts}};
}

// The sampled token x ~ p_S, the teacher's logit at it and its logsumexp at T,
// and (weighted) sampling log-probs that put the ratio on both sides of its truncation.
TeacherOutput tokenTeacher(const Inputs& in, double temp, bool weighted, at::ScalarType dtype, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor x = at::multinomial(at::softmax(in.z / temp, 1), 1, false, gen);
  at::Tensor logSample;
  if (weighted) {
    at::Tensor logp = at::log_softmax(in.z / temp, 1).gather(1, x).squeeze(1);
    logSample = (logp + at::randn(logp.sizes(), gen, at::kDouble)).to(dtype);
  }
  return TeacherOutput{IdsAnswer{in.t.gather(1, x).to(dtype), at::logsumexp(in.t / temp, 1).to(dtype), {},
                                 x.to(at::kInt), logSample}};
}

struct Out {
  LossResult r;
  at::Tensor grad;
};

Out runLoss(bool aten, const at::Tensor& z0, const at::Tensor& labels, const TeacherOutput& t, const LossOptions& o) {
  at::Tensor z = z0.clone().requires_grad_(true);
  LossResult r = aten ? detail::distillLossAtenOps(z, labels, t, o, 17.0) : distillLoss(z, labels, t, o, 17.0);
  r.loss.backward();
  return {r, z.grad()};
}

double relDiff(const at::Tensor& a, const at::Tensor& b) {
  const double x = a.item<double>(), y = b.item<double>();
  return std::abs(x - y) / std::max(1.0, std::abs(y));
}

LossOptions options(bool token, double temp, double alpha) {
  LossOptions o;
  o.kind = token ? LossKind::kSampledToken : LossKind::kForwardKl;
  o.temperature = temp;
  o.alpha = alpha;
  o.chunk_tokens = 5;
  return o;
}

// Every case the kernel takes, float64: loss, kd, ce and the gradient equal to
// the ATen-op path's to 1e-12 (the two differ only in summation order).
TEST(SignalsKernel, Float64MatchesAtenOps) {
  double worst = 0;
  for (int64_t v : {37, 300}) {
    for (double scale : {1.0, 12.0}) {
      const Inputs in = makeInputs(23, v, scale, static_cast<uint64_t>(v + scale));
      for (const char* mode : {"sampled", "token", "token_weighted"}) {
        for (double temp : {1.0, 2.5}) {
          const bool token = std::string(mode) != "sampled";
          const TeacherOutput t = token ? tokenTeacher(in, temp, std::string(mode) == "token_weighted", at::kDouble, 3)
                                        : sampledTeacher(in, temp, 3);
          for (double alpha : {0.0, 0.6, 1.0}) {
            SCOPED_TRACE(std::string(mode) + " V=" + std::to_string(v) + " scale=" + std::to_string(scale) +
                         " T=" + std::to_string(temp) + " alpha=" + std::to_string(alpha));
            const LossOptions o = options(token, temp, alpha);
            Out a = runLoss(false, in.z, in.labels, t, o), b = runLoss(true, in.z, in.labels, t, o);
            double d = std::max({relDiff(a.r.loss, b.r.loss), relDiff(a.r.kd, b.r.kd), relDiff(a.r.ce, b.r.ce)});
            d = std::max(d, maxAbs(a.grad, b.grad));
            EXPECT_LE(d, 1e-12);
            EXPECT_EQ(a.grad[1].abs().max().item<double>(), 0.0); // ignored tokens: no gradient
            worst = std::max(worst, d);
          }
        }
      }
    }
  }
  std::printf("sampled kernel vs ATen ops, float64: max difference %.3g\n", worst);
}

// float32 logits: the kernel's gradient element by element against the float64
// answer on the same inputs, within 1e-6 relative to the row's largest entry
// (a float32 softmax is known to a few 1e-7 relative at these logits; the
// sampled token's advantage see below); loss parts within 1e-6 relative. A
// wrong id, weight, scale or sign misses by far more.
TEST(SignalsKernel, Float32GradientElementwiseAgainstFloat64) {
  double worst = 0;
  for (const char* mode : {"sampled", "token", "token_weighted"}) {
    for (double temp : {1.0, 2.5}) {
      for (double alpha : {0.6, 1.0}) {
        SCOPED_TRACE(std::string(mode) + " T=" + std::to_string(temp) + " alpha=" + std::to_string(alpha));
        const Inputs in = makeInputs(19, 1000, 1.0, 11);
        const bool token = std::string(mode) != "sampled";
        const bool weighted = std::string(mode) == "token_weighted";
        // The teacher's data as float32 (sent that way); the reference reads the same values.
        const TeacherOutput t32 = token ? tokenTeacher(in, temp, weighted, at::kFloat, 5) : sampledTeacher(in, temp, 5);
        const LossOptions o = options(token, temp, alpha);
        Out a = runLoss(false, in.z.to(at::kFloat), in.labels, t32, o);
        Out b = runLoss(true, in.z.to(at::kFloat), in.labels, t32, o); // the ATen-op path in float32
        Out ref = runLoss(true, in.z.to(at::kFloat).to(at::kDouble), in.labels, t32, o);
        ASSERT_EQ(a.grad.scalar_type(), at::kFloat);
        at::Tensor scale = ref.grad.abs().amax(1, true).clamp_min(1e-30);
        const double d = ((a.grad.to(at::kDouble) - ref.grad).abs() / scale).max().item<double>();
        const double dAten = ((b.grad.to(at::kDouble) - ref.grad).abs() / scale).max().item<double>();
        if (token) {
          // The advantage d = log p_S(x) - log p_T(x) is a difference of float32 log-probabilities
          // (each known to ~eps |logsumexp|, ~5e-7 here): d's rounding scales the whole row, so
          // ~1e-6 of the row's max is float32's own floor, which the ATen-op path shows too.
          EXPECT_LE(d, std::max(1e-6, 1.1 * dAten)) << "ATen ops in float32: " << dAten;
          EXPECT_LE(d, 2e-6);
        } else {
          EXPECT_LE(d, 1e-6) << "ATen ops in float32: " << dAten;
        }
        EXPECT_LE(relDiff(a.r.loss, ref.r.loss), 1e-6);
        EXPECT_LE(relDiff(a.r.kd, ref.r.kd), 1e-6);
        worst = std::max(worst, d);
      }
    }
  }
  std::printf("sampled kernel, float32 gradient vs float64, max |difference| / row max: %.3g\n", worst);
}

// fusedLinearLoss runs the same kernel on its chunks' logits: equal to its ATen-op path.
TEST(SignalsKernel, FusedLinearLossMatchesAtenOps) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(17);
  const int64_t n = 21, d = 16, v = 101;
  at::Tensor h0 = at::randn({n, d}, gen, at::kDouble), w0 = at::randn({v, d}, gen, at::kDouble) * 0.5;
  at::Tensor b0 = at::randn({v}, gen, at::kDouble) * 0.1;
  Inputs in{at::addmm(b0, h0, w0.t()), at::randn({n, v}, gen, at::kDouble) * 2, at::randint(0, v, {n}, gen, at::kLong)};
  in.labels[4] = -100;
  for (bool token : {false, true}) {
    const double temp = 1.7;
    const TeacherOutput t = token ? tokenTeacher(in, temp, true, at::kDouble, 8) : sampledTeacher(in, temp, 8);
    const LossOptions o = options(token, temp, 0.6);
    at::Tensor grads[2][3];
    double loss[2];
    for (int aten = 0; aten < 2; ++aten) {
      at::Tensor h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
      at::Tensor b = b0.clone().requires_grad_(true);
      LossResult r = aten ? detail::fusedLinearLossAtenOps(h, w, b, in.labels, t, o, 20.0, 6)
                          : fusedLinearLoss(h, w, b, in.labels, t, o, 20.0, 6);
      r.loss.backward();
      loss[aten] = r.loss.item<double>();
      grads[aten][0] = h.grad(), grads[aten][1] = w.grad(), grads[aten][2] = b.grad();
    }
    EXPECT_NEAR(loss[0], loss[1], 1e-12 * std::max(1.0, std::abs(loss[1]))) << "token " << token;
    for (int i = 0; i < 3; ++i) EXPECT_LE(maxAbs(grads[0][i], grads[1][i]), 1e-12) << "token " << token << " " << i;
  }
}

// distillLoss on CPU float32 takes the kernel: beyond the inputs it holds the
// gradient and no [C, V] temporary (the ATen-op path holds several).
TEST(SignalsKernel, DistillLossRunsTheKernel) {
  const int64_t n = 256, v = 32000, chunk = 64;
  const Inputs in = makeInputs(n, v, 1.0, 21);
  at::Tensor z = in.z.to(at::kFloat).requires_grad_(true);
  const int64_t gradBytes = n * v * 4, chunkBytes = chunk * v * 4;
  c10::Allocator* before = c10::GetCPUAllocator();
  c10::SetCPUAllocator(&counting(), /*priority=*/100);
  for (bool token : {false, true}) {
    const TeacherOutput t = token ? tokenTeacher(in, 2.0, true, at::kFloat, 4) : sampledTeacher(in, 2.0, 4);
    LossOptions o = options(token, 2.0, 0.5);
    o.chunk_tokens = chunk;
    for (bool aten : {false, true}) {
      z.mutable_grad() = at::Tensor();
      const int64_t base = counting().live();
      counting().resetPeak();
      LossResult r = aten ? detail::distillLossAtenOps(z, in.labels, t, o, double(n)) : distillLoss(z, in.labels, t, o, double(n));
      r.loss.backward();
      const int64_t extra = counting().peak() - base - gradBytes;
      std::printf("%s %s: peak beyond inputs and gradient %.2f chunk buffers\n", aten ? "aten-ops" : "kernel",
                  token ? "sampled_token" : "sampled", double(extra) / chunkBytes);
      if (aten) {
        EXPECT_GT(extra, chunkBytes) << "the measurement tells the paths apart";
      } else {
        EXPECT_LT(extra, chunkBytes / 8) << (token ? "sampled_token" : "sampled");
      }
    }
  }
  c10::SetCPUAllocator(before, /*priority=*/100);
}

} // namespace
} // namespace distill
