// Admission: a teacher admits its students once every one of them attached
// (and passed the config check); a student waits for that before its first
// collective. See channel_core.h and TeacherEndpoint::waitAdmission.
#include <algorithm>
#include <cstring>

#include "channel_core.h"
#include "distill/core/errors.h"

namespace distill::ipc::detail {
namespace {

int64_t toNs(Clock::duration d) { return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count(); }

// Writes the teacher's refusal where every student reads it: the text before
// the flag (release), so a student that sees the flag reads it whole.
void publishRefusal(SegmentImpl& s, const std::string& refusal) {
  auto& c = s.control();
  const size_t n = std::min(refusal.size(), size_t(wire::kRefusalBytes) - 1);
  std::memcpy(c.refusal, refusal.data(), n);
  c.refusal[n] = '\0';
  c.refused.store(1, std::memory_order_release);
  s.notifyAll();
}

} // namespace

void ChannelCore::teacherAdmission(Deadline deadline, const AdmissionCheck& check) {
  guarded([&] {
    auto& s = port_.seg();
    auto attached = [&](int i) {
      const auto& e = s.process(i);
      const auto st = wire::ProcState(e.state.load(std::memory_order_acquire));
      return e.pid.load(std::memory_order_acquire) != 0 && st != wire::ProcState::kEmpty &&
          st != wire::ProcState::kFinished && st != wire::ProcState::kDead;
    };
    // A restarted teacher also admits students that finished while no
    // teacher ran (the server then sees them done, studentDone()).
    auto& mine = s.teacherState(port_.index());
    const bool restarted = mine.restarts.load(std::memory_order_acquire) > 0;
    auto present = [&](int i) {
      return attached(i) ||
          (restarted &&
           wire::ProcState(s.process(i).state.load(std::memory_order_acquire)) == wire::ProcState::kFinished);
    };
    std::vector<int> peers;
    for (int r = 0; r < numRings(); ++r) peers.push_back(studentOf(r));
    // Each student is checked once, as soon as it is there (its config was
    // published before its attached state, which present() loaded with
    // acquire); a refusal ends the wait at once.
    std::vector<bool> checked(peers.size(), !check);
    std::string refusal;
    auto all = [&] {
      bool every = true;
      for (size_t r = 0; r < peers.size(); ++r) {
        const int i = peers[r];
        if (!present(i)) {
          every = false;
          continue;
        }
        if (checked[r]) continue;
        checked[r] = true;
        refusal = check(i, port_.publishedConfig(i));
        if (!refusal.empty()) return true;
      }
      return every;
    };
    const auto start = Clock::now();
    if (!port_.waitUntil(all, WaitDesc{wire::WaitWhat::kAdmission, -1, std::nullopt}, peers, !restarted, deadline)) {
      std::string missing;
      for (int i : peers)
        if (!present(i)) missing += distill::detail::str(missing.empty() ? "" : ", ", "local ", i);
      DISTILL_THROW(TimeoutError, awaiting("its local students to attach"), port_.describeSelf(), ": students [",
                    missing, "] did not attach to segment '", s.name, "' within ", toMs(Clock::now() - start), " ms");
    }
    if (!refusal.empty()) {
      publishRefusal(s, refusal);
      DISTILL_THROW(ConfigError, awaiting("its local students to attach"), refusal);
    }
    mine.admitted.store(port_.self().incarnation.load(std::memory_order_relaxed), std::memory_order_release);
    port_.recorder().complete(trace::Op::kAdmission, -1, -1, -1, 0, monotonicNs() - toNs(Clock::now() - start));
    port_.setState(wire::ProcState::kServing);
    s.notifyAll();
  });
}

void ChannelCore::studentAdmission(Deadline deadline) {
  guarded([&] {
    auto& s = port_.seg();
    const int t = peerOf(0); // the teacher that serves this student
    auto refused = [&] { return s.control().refused.load(std::memory_order_acquire) != 0; };
    auto admitted = [&] {
      const uint64_t a = s.teacherState(t).admitted.load(std::memory_order_acquire);
      return refused() || (a != 0 && a == s.process(t).incarnation.load(std::memory_order_relaxed));
    };
    const auto start = Clock::now();
    const auto& e = s.process(t);
    // The refusal is checked before the wait too: a teacher that refused may
    // be gone (dead) by the time this student attached.
    if (!refused() && !port_.waitUntil(admitted, WaitDesc{wire::WaitWhat::kAdmission, t, std::nullopt}, {t}, true, deadline)) {
      DISTILL_THROW(TimeoutError, awaiting("admission by the teacher"), port_.describeSelf(),
                    ": not admitted by the teacher (local ", t, ", state ",
                    wire::stateName(e.state.load(std::memory_order_relaxed)),
                    e.pid.load(std::memory_order_relaxed) ? "" : ", never attached", ") of segment '", s.name,
                    "' within ", toMs(Clock::now() - start), " ms");
    }
    if (refused()) {
      const auto& c = s.control();
      DISTILL_THROW(ConfigError, awaiting("admission by the teacher"), "admission refused by the teacher (",
                    port_.describeProcess(t), ") of segment '", s.name,
                    "': ", std::string(c.refusal, strnlen(c.refusal, sizeof c.refusal)));
    }
    port_.recorder().complete(trace::Op::kAdmission, e.rank.load(std::memory_order_relaxed), -1, -1, 0,
                              monotonicNs() - toNs(Clock::now() - start));
  });
}

} // namespace distill::ipc::detail
