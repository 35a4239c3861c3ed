// The hidden-state answer end to end (issue 43; docs/teacher.md, "The
// hidden-state answer"): distill-run with 2 students and a teacher (this binary
// in the `hidden` role, teacher.kind self). The teacher answers with its final
// hidden states and publishes its head once; the students map it at
// admission and distill::Steps trains with it, with no new argument:
// the losses equal those of the same job answered with full logits. A
// restarted teacher republishes its head: the same head is mapped anew, another
// is refused (teacher.head.on_change refuse) or adopted (adopt).
#include <ATen/CPUGeneratorImpl.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <regex>
#include <stdexcept>

#include "distill/distill.h"
#include "launch.h"
#include "support/process.h"
#include "support/roles.h"
#include "support/tiny_net.h"

using namespace distill::testing;

namespace {

constexpr int64_t kVocab = 16, kDim = 8, kTeacherDim = 12, kSeq = 6, kRows = 3, kIgnore = -100;
constexpr double kSoftcap = 5, kScale = 0.5;

struct Net : TinyNet {
  Net() : TinyNet(kVocab, kDim) {}
};

distill::MicroBatch microBatch(int rank, int64_t step, int64_t acc) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(uint64_t(1000 * rank + 10 * step + acc + 1));
  distill::MicroBatch mb;
  mb.inputs = at::randint(0, kVocab, {kRows, kSeq}, g, at::kLong);
  mb.labels = at::randint(0, kVocab, {kRows, kSeq}, g, at::kLong);
  mb.labels.masked_fill_(at::rand({kRows, kSeq}, g, at::kDouble) < 0.25, kIgnore);
  return mb;
}

// The teacher: hidden = tanh(emb[ids]) [B, T, d_t]; logits = softcap * tanh(scale * (hidden @ W.T + b) / softcap).
// With teacher.answer hidden it answers the hidden states; otherwise the logits. Its head is in its
// state (lm_head.weight, lm_head.bias: teacher.head names them) or, `declared`, given by head().
// `changed`: another head (W scaled), as a teacher restarted with other weights.
class HiddenLm : public distill::TeacherModel {
 public:
  HiddenLm(bool answerHidden, bool declared, bool changed, int failAt)
      : hidden_(answerHidden), declared_(declared), failAt_(failAt) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(4242);
    emb_ = at::randn({kVocab, kTeacherDim}, g, at::kFloat);
    w_ = at::randn({kVocab, kTeacherDim}, g, at::kFloat) * (changed ? 1.5 : 1.0);
    b_ = at::randn({kVocab}, g, at::kFloat) * 0.1;
  }
  std::map<std::string, at::Tensor> forward(const std::vector<at::Tensor>& in) override {
    if (++calls_ == failAt_) throw std::runtime_error("planted failure in forward " + std::to_string(calls_));
    const at::Tensor h = at::tanh(emb_.index_select(0, in.at(0).reshape(-1))).view({in[0].size(0), in[0].size(1), -1});
    if (hidden_) return {{"logits", h}};
    const at::Tensor z = at::addmm(b_, h.reshape({-1, kTeacherDim}), w_.t()) * kScale;
    return {{"logits", (at::tanh(z / kSoftcap) * kSoftcap).view({h.size(0), h.size(1), kVocab})}};
  }
  std::vector<std::pair<std::string, at::Tensor>> state() const override {
    std::vector<std::pair<std::string, at::Tensor>> s{{"parameter emb.weight", emb_}};
    if (!declared_) s.insert(s.end(), {{"parameter lm_head.weight", w_}, {"parameter lm_head.bias", b_}});
    return s;
  }
  std::optional<distill::TeacherHead> head(const distill::TeacherOptions& o) const override {
    if (!declared_) return TeacherModel::head(o);
    return distill::TeacherHead{w_, b_, kSoftcap, kScale};
  }

 private:
  bool hidden_, declared_;
  int failAt_, calls_ = 0;
  at::Tensor emb_, w_, b_;
};

// "<segment>.head*" objects in /dev/shm.
int headObjects(const std::string& segment) {
  int n = 0;
  DIR* d = ::opendir("/dev/shm");
  if (!d) return -1;
  const std::string prefix = segment + ".head";
  while (dirent* e = ::readdir(d)) n += std::string(e->d_name).rfind(prefix, 0) == 0 ? 1 : 0;
  ::closedir(d);
  return n;
}

int student(distill::Session& s, bool fused) {
  torch::manual_seed(7);
  Net net;
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.5));
  const int rank = s.topology.studentRank, G = s.config.student.grad_acc_steps;
  if (s.client->teacherHead()) std::printf("HEADS %d\n", headObjects(s.topology.segment));
  distill::StepsOptions hooks;
  hooks.onStep = [](const distill::StepReport& r) {
    std::printf("LOSS step=%lld loss=%.17g kd=%.17g ce=%.17g\n", static_cast<long long>(r.step), r.loss, r.kd, r.ce);
  };
  distill::Steps train(s, net, opt, hooks);
  int64_t read = 0;
  auto loader = [&]() -> std::optional<distill::MicroBatch> {
    const int64_t k = read++;
    return microBatch(rank, k / G + 1, k % G);
  };
  while (auto mb = train.next(loader)) {
    if (fused) {
      train.backward(torch::tanh(net.emb(mb->inputs)), distill::OutputHead{net.fc->weight, net.fc->bias, 5});
    } else {
      train.backward(net.forward(mb->inputs));
    }
    if (train.stepEnds()) opt.step(), opt.zero_grad();
  }
  return 0;
}

} // namespace

// args: student mode (logits | fused), teacher head (state | declared), restart (none | same | changed).
DISTILL_TEST_ROLE(hidden) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  int argc = 1;
  char arg0[] = "train_hidden_test";
  char* argv[] = {arg0, nullptr};
  distill::Session s = distill::init(argc, argv);
  if (s.isTeacher()) {
    const bool restarted = std::getenv("DISTILL_TEACHER_RESTART") != nullptr;
    const std::string restart = args.at(2);
    const bool hidden = distill::answerKindOf(s.config.teacher) == distill::AnswerKind::kHidden;
    auto model = std::make_shared<HiddenLm>(hidden, args.at(1) == "declared", restarted && restart == "changed",
                                            restart != "none" && !restarted ? 5 : 0);
    distill::serve(*s.teacher, model);
    return 0;
  }
  return student(s, args.at(0) == "fused");
}

namespace {

class HiddenTest : public LauncherFixture {
 protected:
  std::vector<std::string> args(const std::string& answer, std::vector<std::string> role,
                                std::vector<std::string> more = {}) {
    std::vector<std::string> sets = {"student.grad_acc_steps=2", "student.in_flight=2", "run.steps=5",
                                     "checkpoint.dir=", "loss.alpha=0.6", "loss.temperature=2",
                                     "teacher.answer=" + answer};
    if (answer == "hidden") {
      sets.insert(sets.end(), {"teacher.hidden_size=" + std::to_string(kTeacherDim), "teacher.head.bias=lm_head.bias",
                               "teacher.head.softcap=5", "teacher.head.scale=0.5"});
    }
    sets.insert(sets.end(), more.begin(), more.end());
    std::vector<std::string> a;
    for (auto& x : sets) a.insert(a.end(), {"--set", x});
    return jobArgs(a, role, "hidden");
  }
  std::vector<double> losses(const std::string& text, int rank) {
    std::vector<double> out;
    const std::regex re("\\[r" + std::to_string(rank) + " student\\] LOSS step=[0-9]+ loss=([^ ]+) kd=([^ ]+)");
    for (std::sregex_iterator it(text.begin(), text.end(), re), end; it != end; ++it) {
      out.push_back(std::stod((*it)[1]));
      out.push_back(std::stod((*it)[2]));
    }
    return out;
  }
  std::string logs() const { return log(0) + log(1) + log(2); }
  // Runs the job; its console and every rank's log.
  std::string run(const std::vector<std::string>& a, bool ok = true) {
    Launch l(a);
    const auto st = l.finish(Ms(90000));
    EXPECT_EQ(st.exited && st.code == 0, ok) << st.describe() << "\n" << l.text() << logs();
    return l.text() + "\n" + logs();
  }
  void expectSameLosses(const std::string& a, const std::string& b) {
    for (int r : {0, 1}) {
      const auto x = losses(a, r), y = losses(b, r);
      ASSERT_EQ(x.size(), 10u) << a;
      ASSERT_EQ(y.size(), 10u) << b;
      double worst = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        EXPECT_NEAR(y[i], x[i], 1e-5 * std::abs(x[i])) << "student " << r << " #" << i;
        worst = std::max(worst, std::abs(y[i] - x[i]) / std::abs(x[i]));
      }
      std::printf("student %d: losses and kd of 5 steps, largest relative difference %.3g\n", r, worst);
    }
  }
};

// The same training, answered with full logits and with hidden states + the
// shared head (materialised and fused student paths, the head named in the
// model's state or declared by it): the same losses, step after step; the head
// is published once and both students map that one object.
TEST_F(HiddenTest, HiddenStatesTrainAsTheFullLogitsDoWithOneHeadPerNode) {
  const std::string full = run(args("logits", {"logits", "state", "none"}));
  for (const std::vector<std::string>& role : {std::vector<std::string>{"logits", "state", "none"},
                                               {"fused", "declared", "none"}}) {
    SCOPED_TRACE(role[0] + " " + role[1]);
    const std::string hidden = run(args("hidden", role));
    expectSameLosses(full, hidden);
    std::smatch m;
    ASSERT_TRUE(std::regex_search(hidden, m, std::regex("teacher 0 published its head /dev/shm/([^:]+): \\[16, 12\\] "
                                                        "float32 with bias, softcap 5, scale 0.5")))
        << hidden;
    const std::string object = m[1];
    for (int r : {0, 1}) {
      EXPECT_TRUE(has(hidden, "student rank " + std::to_string(r) + " mapped the teacher's head /dev/shm/" + object +
                                  " (generation 1, [16, 12] float32"))
          << hidden;
      EXPECT_TRUE(has(hidden, "[r" + std::to_string(r) + " student] HEADS 1")) << hidden;
    }
    EXPECT_EQ(headObjects(object.substr(0, object.size() - 5)), 0) << "removed with the segment";
  }
}

// A restarted teacher republishes its head: the same one is mapped anew and
// training goes on; another is refused (on_change refuse, the default) naming
// the object and both fingerprints, or adopted (on_change adopt).
TEST_F(HiddenTest, AHeadChangedByATeacherRestartIsRefusedOrAdopted) {
  const std::vector<std::string> restart = {"teacher.max_restarts=1"};
  const std::string same = run(args("hidden", {"logits", "state", "same"}, restart));
  EXPECT_TRUE(has(same, "teacher restarted (1 of 1 restarts)")) << same;
  EXPECT_TRUE(has(same, "mapped the teacher's republished head")) << same;
  EXPECT_TRUE(has(same, "(generation 2,")) << same;
  EXPECT_EQ(losses(same, 0).size(), 10u) << same;

  const std::string refused = run(args("hidden", {"logits", "state", "changed"}, restart), /*ok=*/false);
  EXPECT_TRUE(std::regex_search(refused, std::regex("student rank [01]: the teacher's head '/dev/shm/[^']+\\.head' "
                                                    "changed after a teacher restart: fingerprint [0-9a-f]{64} "
                                                    "\\(generation 1\\) became [0-9a-f]{64} \\(generation 2")))
      << refused;

  const std::string adopted =
      run(args("hidden", {"logits", "state", "changed"}, {"teacher.max_restarts=1", "teacher.head.on_change=adopt"}));
  EXPECT_TRUE(has(adopted, "the teacher's head changed after a restart")) << adopted;
  EXPECT_TRUE(has(adopted, "adopted the teacher's changed head")) << adopted;
  EXPECT_EQ(losses(adopted, 0).size(), 10u) << adopted;
}

// A head the model does not have is refused at the teacher's start-up, naming the model and the key.
TEST_F(HiddenTest, AHeadTheModelDoesNotHaveIsAConfigErrorAtStartUp) {
  const std::string bad = run(args("hidden", {"logits", "state", "none"}, {"teacher.head.weight=out.weight"}), false);
  EXPECT_TRUE(has(bad, "teacher.head.weight: the teacher model (teacher.kind self) has no parameter or buffer "
                       "'out.weight' (teacher.answer hidden needs its output layer); its state: parameter "
                       "emb.weight Float [16, 12], parameter lm_head.weight Float [16, 12], parameter lm_head.bias "
                       "Float [16]"))
      << bad;
}

} // namespace
