// losses_test: the fused CPU kernel (loss/src/cpu/) against the ATen-op path,
// the memory bound of the chunked loss, and half-precision teacher payloads.

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "distill/core/errors.h"
#include "distill/core/answer_kinds.h"
#include "distill/loss/losses.h"
#include "support/expect_throw.h"
#include "distill/teacher/server.h"
#include "counting_allocator.h"
#include "losses_test_util.h"

namespace distill {
namespace {

using testing::expectThrow;
using namespace loss_testing;

// ---- memory -----------------------------------------------------------------

// ---- the fused CPU kernel against the ATen-op path --------------------------

// On CPU distillLoss runs the fused kernel (loss/src/cpu/loss_kernel_impl.h);
// detail::distillLossAtenOps is the ATen-op path (CUDA, half/bfloat16) it
// replaced there. Every kind, teacher form, temperature and weight, float32
// and float64, ignored tokens, several chunks, vocabularies that are not a
// multiple of any vector width, -inf logits on both sides and logits large
// enough to underflow: values and gradients agree to rounding (loss, kd and ce
// within 1e-6 relative beyond 1, gradients within 1e-6; 1e-12 in float64).
TEST(Losses, FusedCpuKernelMatchesAtenOps) {
  double worst[2] = {0, 0}; // float32, float64
  int beyond = 0; // float32 cases beyond 1e-6, checked against float64 instead
  for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    const bool f32 = dtype == at::kFloat;
    for (int64_t v : {37, 300}) {
      for (double scale : {1.0, 12.0}) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(v * 10 + scale));
        const int64_t n = 23, k = 8;
        at::Tensor z0 = (at::randn({n, v}, gen, at::kDouble) * (1.5 * scale)).to(dtype);
        at::Tensor t = (at::randn({n, v}, gen, at::kDouble) * (2 * scale)).to(dtype);
        z0[3].narrow(0, 0, 5).fill_(-kInf); // masked student tokens
        t[4].narrow(0, 2, 6).fill_(-kInf); // masked teacher tokens
        at::Tensor labels = at::randint(0, v, {n}, gen, at::kLong);
        labels[1] = -100;
        labels[9] = -100;
        for (const char* mode : {"dense", "dense_bf16", "topk", "topk_lse", "topk_tail", "tail_only"}) {
          for (double temp : {1.0, 2.5}) {
            TeacherOutput teacher;
            if (std::string(mode) == "dense") {
              teacher.makeLogits().logits = t;
            } else if (std::string(mode) == "dense_bf16") {
              teacher.makeLogits().logits = t.to(at::kBFloat16); // converted chunk by chunk
            } else {
              auto [vals, idx] = t.topk(k, 1);
              teacher.makeTopk().values = vals;
              teacher.makeTopk().indices = std::string(mode) == "topk" ? idx.to(at::kInt) : idx;
              at::Tensor st = t.to(at::kDouble) / temp;
              if (std::string(mode) == "topk_lse" || std::string(mode) == "topk_tail") {
                teacher.makeTopk().logsumexp = at::logsumexp(st, 1).to(dtype);
              }
              if (std::string(mode) == "topk_tail" || std::string(mode) == "tail_only") {
                teacher.makeTopk().logTail = at::logsumexp(st.scatter(1, idx, -kInf), 1).to(dtype);
              }
            }
            for (const char* kind : {"forward_kl", "reverse_kl", "jsd"}) {
              if (std::string(kind) == "reverse_kl" && std::string(mode) == "topk") continue; // refused
              for (double alpha : {0.0, 0.6, 1.0}) {
                SCOPED_TRACE(std::string(f32 ? "float32 " : "float64 ") + mode + " " + kind +
                             " V=" + std::to_string(v) + " scale=" + std::to_string(scale) +
                             " T=" + std::to_string(temp) + " alpha=" + std::to_string(alpha));
                LossOptions o;
                o.kind = lossKind(kind);
                o.temperature = temp;
                o.alpha = alpha;
                o.jsd_beta = 0.3;
                o.chunk_tokens = 5;
                at::Tensor za = z0.clone().requires_grad_(true), zb = z0.clone().requires_grad_(true);
                LossResult a = distillLoss(za, labels, teacher, o, 21.0);
                LossResult b = detail::distillLossAtenOps(zb, labels, teacher, o, 21.0);
                a.loss.backward();
                b.loss.backward();
                double d = 0;
                for (auto [x, y] : {std::pair{a.loss, b.loss}, {a.kd, b.kd}, {a.ce, b.ce}}) {
                  const double xv = x.item<double>(), yv = y.item<double>();
                  ASSERT_EQ(std::isnan(xv), std::isnan(yv)) << xv << " vs " << yv;
                  ASSERT_EQ(std::isinf(xv), std::isinf(yv)) << xv << " vs " << yv;
                  // Relative to the value beyond 1: a float32 loss of 100 is only known to 7.6e-6.
                  if (std::isfinite(xv)) d = std::max(d, std::abs(xv - yv) / std::max(1.0, std::abs(yv)));
                }
                at::Tensor ga = za.grad(), gb = zb.grad();
                ASSERT_TRUE(at::equal(at::isnan(ga), at::isnan(gb)));
                at::Tensor fin = at::isfinite(gb);
                d = std::max(d, maxAbs(ga.masked_select(fin), gb.masked_select(fin)));
                // Ignored tokens get no gradient at all.
                EXPECT_EQ(ga[1].abs().max().item<double>(), 0.0);
                if (f32 && d > 1e-6) {
                  // Beyond 1e-6 in float32 (logits of +-50: a log-probability is only
                  // known to ~4e-6), the fused result must be as close to the float64
                  // computation on the same inputs as the ATen-op path is. The teacher
                  // keeps its float32 tensors: the same rounding floor r (losses.h).
                  at::Tensor zc = z0.to(at::kDouble).requires_grad_(true);
                  LossResult c = detail::distillLossAtenOps(zc, labels, teacher, o, 21.0);
                  c.loss.backward();
                  const double fa = std::abs(a.loss.item<double>() - c.loss.item<double>()) /
                      std::max(1.0, std::abs(c.loss.item<double>()));
                  const double fb = std::abs(b.loss.item<double>() - c.loss.item<double>()) /
                      std::max(1.0, std::abs(c.loss.item<double>()));
                  EXPECT_LE(fa, 1.5 * fb + 1e-6);
                  EXPECT_LE(maxAbs(ga, zc.grad()), 1.5 * maxAbs(gb, zc.grad()) + 1e-6);
                  ++beyond;
                } else {
                  EXPECT_LE(d, f32 ? 1e-6 : 1e-12);
                }
                worst[f32 ? 0 : 1] = std::max(worst[f32 ? 0 : 1], d);
              }
            }
          }
        }
      }
    }
  }
  std::printf(
      "fused CPU kernel vs ATen ops, max difference of loss, kd, ce (relative beyond 1) and gradient: "
      "float32 %.3g, float64 %.3g; %d float32 cases beyond 1e-6 (as close to float64 as ATen's)\n",
      worst[0], worst[1], beyond);
}

TEST(Losses, MemoryIsBoundedByChunks) {
  const int64_t n = 512, v = 128000, chunk = 64;
  c10::Allocator* before = c10::GetCPUAllocator();
  c10::SetCPUAllocator(&counting(), /*priority=*/100);
  const double mib = 1024.0 * 1024.0;
  const int64_t gradBytes = n * v * 4, chunkBytes = chunk * v * 4;
  {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
    at::Tensor z = at::randn({n, v}, gen, at::kFloat).requires_grad_(true);
    at::Tensor t = at::randn({n, v}, gen, at::kFloat) * 2;
    at::Tensor labels = at::randint(0, v, {n}, gen, at::kLong);
    labels.narrow(0, 0, 100).fill_(-100);
    auto [vals, idx] = t.topk(64, 1);
    at::Tensor lse = at::logsumexp(t / 2.0, 1);
    // The fused CPU kernel (distillLoss here): one row of scratch per thread;
    // the ATen-op path (CUDA, half/bfloat16): at most ~10 chunk buffers.
    for (bool aten : {false, true}) {
      for (const char* mode : {"dense", "topk_lse"}) {
        for (const char* kind : {"forward_kl", "jsd"}) {
          LossOptions o;
          o.kind = lossKind(kind);
          o.temperature = 2.0;
          o.chunk_tokens = chunk;
          TeacherOutput teacher = std::string(mode) == "dense" ? TeacherOutput{LogitsAnswer{t}}
                                                               : TeacherOutput{TopkAnswer{vals, idx.to(at::kInt), lse, {}}};
          z.mutable_grad() = at::Tensor();
          const int64_t base = counting().live();
          counting().resetPeak();
          LossResult r = aten ? detail::distillLossAtenOps(z, labels, teacher, o, 412.0)
                              : distillLoss(z, labels, teacher, o, 412.0);
          const int64_t afterForward = counting().live() - base;
          r.loss.backward();
          const int64_t extra = counting().peak() - base;
          ASSERT_TRUE(std::isfinite(r.loss.item<double>()));
          ASSERT_EQ(z.grad().sizes(), z.sizes());
          std::printf(
              "%s %s %s N=%ld V=%ld chunk=%ld: peak beyond inputs %.1f MiB = gradient %.1f "
              "MiB + %.1f MiB (%.1f chunk buffers of %.1f MiB); held after forward %.1f MiB\n",
              aten ? "aten-ops" : "fused", mode, kind, n, v, chunk, extra / mib, gradBytes / mib,
              (extra - gradBytes) / mib, double(extra - gradBytes) / chunkBytes, chunkBytes / mib, afterForward / mib);
          EXPECT_LE(extra - gradBytes, (aten ? 10 : 1) * chunkBytes);
        }
      }
    }
    // For scale: the same forward KL with plain autograd over the whole batch.
    z.mutable_grad() = at::Tensor();
    const int64_t base = counting().live();
    counting().resetPeak();
    {
      at::Tensor logp = at::log_softmax(z / 2.0, 1), logq = at::log_softmax(t / 2.0, 1);
      at::Tensor kd = (logq.exp() * (logq - logp)).sum(1).masked_select(labels != -100).sum();
      (kd * 4.0 / 412.0).backward();
    }
    const int64_t naive = counting().peak() - base;
    std::printf("plain autograd, unchunked: peak beyond inputs %.1f MiB\n", naive / mib);
    EXPECT_GT(naive, gradBytes + 10 * chunkBytes); // the measurement can tell them apart
  }
  c10::SetCPUAllocator(before, /*priority=*/100);
}

// Issue 28 item 2: teacher values and logits arrive in bfloat16 or float16
// (teacher.payload_dtype); the loss computes in float32 whatever arrives: the
// same loss and gradient as with the same values upcast to float32 by the caller.
TEST(Losses, HalfTeacherPayloadsComputeInFloat32) {
  const int64_t n = 64, v = 1000, k = 32;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(28);
  at::Tensor t = at::randn({n, v}, gen, at::kFloat) * 3;
  at::Tensor z0 = at::randn({n, v}, gen, at::kFloat);
  at::Tensor labels = at::randint(0, v, {n}, gen, at::kLong);
  LossOptions o;
  o.temperature = 2.0;
  auto run = [&](const TeacherOutput& sent) {
    at::Tensor z = z0.clone().requires_grad_();
    LossResult r = distillLoss(z, labels, sent, o, double(n));
    r.loss.backward();
    EXPECT_EQ(r.loss.scalar_type(), at::kFloat);
    return std::make_pair(r.loss.item<double>(), z.grad());
  };
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    auto out = topkOutput(t, k, o.temperature, dtype);
    TeacherOutput half, up;
    half.makeTopk().values = out.at(protocol::kTopkValues);
    ASSERT_EQ(half.topk()->values.scalar_type(), dtype);
    half.makeTopk().indices = up.makeTopk().indices = out.at(protocol::kTopkIndices);
    half.makeTopk().logsumexp = up.makeTopk().logsumexp = out.at(protocol::kLogsumexp);
    half.makeTopk().logTail = up.makeTopk().logTail = out.at(protocol::kLogTail);
    up.makeTopk().values = half.topk()->values.to(at::kFloat);
    auto [a, ga] = run(half);
    auto [b, gb] = run(up);
    EXPECT_EQ(a, b);
    EXPECT_TRUE(at::equal(ga, gb));
    // And near the float32 answer: values rounded, the k + 1 buckets still sum to 1.
    auto f = topkOutput(t, k, o.temperature);
    TeacherOutput full;
    full.makeTopk().values = f.at(protocol::kTopkValues), full.makeTopk().indices = f.at(protocol::kTopkIndices);
    full.makeTopk().logsumexp = f.at(protocol::kLogsumexp), full.makeTopk().logTail = f.at(protocol::kLogTail);
    EXPECT_NEAR(a, run(full).first, 1e-2 * std::abs(a));
    // Dense logits in the same dtype.
    TeacherOutput dense, denseUp;
    dense.makeLogits().logits = t.to(dtype);
    denseUp.makeLogits().logits = dense.logits()->logits.to(at::kFloat);
    auto [c, gc] = run(dense);
    auto [d, gd] = run(denseUp);
    EXPECT_EQ(c, d);
    EXPECT_TRUE(at::equal(gc, gd));
  }
  // float16 cannot hold a logit of 1e5: an error naming the key, not an inf sent.
  at::Tensor huge = t.clone();
  huge[0][0] = 1e5;
  try {
    topkOutput(huge, k, 1.0, at::kHalf);
    ADD_FAILURE() << "a logit of 1e5 was sent as float16";
  } catch (const ProtocolError& e) {
    EXPECT_NE(std::string(e.what()).find("overflows Half (teacher.payload_dtype)"), std::string::npos) << e.what();
  }
}

} // namespace
} // namespace distill
