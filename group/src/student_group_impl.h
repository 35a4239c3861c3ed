#pragma once

// StudentGroup's state, shared by its sources: student_group.cpp (admission
// and backends), student_group_store.cpp (the rendezvous store's set-up),
// group_notes.cpp (the notes board) and student_group_ops.cpp (the
// collectives, blocking and asynchronous, with their deadline and the
// diagnosis of who never entered one).

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "distill/build_config.h"
#include "distill/core/clock.h"
#include "distill/core/errors.h"
#include "distill/core/strings.h"
#include "distill/group/student_group.h"
#include "distill/core/trace.h"
#include "job_store.h"

namespace distill {

// The first line of a gloo, c10d or store message, without its C++ source locations.
inline std::string firstLineOf(const std::string& s) { return withoutSourceLocations(s.substr(0, s.find('\n'))); }

struct StudentGroup::Impl {
  int rank = 0;
  int size = 0;
  int perNode = 1; // students per node: student rank r is on node r / perNode
  int procsPerNode = 1; // processes per node (students, then teachers): r's global rank is
                        // node * procsPerNode + r % perNode, as distill-run's "[rN ...]" prefixes say
  Millis timeout{0};
  int64_t seq = 0;
  // Declared first, destroyed last: the store outlives every client of it.
  std::unique_ptr<JobStoreServer> server; // student rank 0: the rendezvous store
  c10::intrusive_ptr<JobStore> jobStore; // this rank's connection (null under torchrun's agent store)
  c10::intrusive_ptr<c10d::Store> store; // prefixed "distill/students/"
  c10::intrusive_ptr<c10d::Backend> gloo;
  c10::intrusive_ptr<c10d::Backend> nccl; // null unless CUDA tensors may be reduced
  bool cudaThroughGloo = false;           // student.backend auto with students sharing a GPU

  bool serving = false; // this rank hosts the store (student rank 0)
  std::string storeWhere; // "127.0.0.1:29500 (served by student rank 0 on node 0)"
  std::string storeHostPort; // "127.0.0.1:29500"

  std::string studentName(int r) const {
    const int node = r / perNode;
    return "student rank " + std::to_string(r) + " (r" + std::to_string(node * procsPerNode + r % perNode) +
        " on node " + std::to_string(node) + ")";
  }

  // What the store says after a failure: the ranks whose counter `<prefix><rank>`
  // is below `needed` (they never got there), the ranks lost so far (their
  // connection to the store closed without a goodbye: died or failed), first
  // lost first, or why the store itself is unreachable (its host was lost).
  struct Diagnosis {
    std::vector<int> absent;
    std::vector<int> lost;
    bool storeLost = false; // the store did not answer: its connection closed
  };
  // `lossGrace`: how long to wait for a first loss to be recorded (a peer's
  // death and the error it causes here race by milliseconds). The store lives
  // in student rank 0's process, so the other ranks must read it before rank 0
  // exits: each rank reports having read, and rank 0 waits (bounded) until
  // every present rank has, before it throws.
  Diagnosis diagnose(const std::string& prefix, int64_t needed, const std::string& tag, Millis lossGrace) {
    Diagnosis d;
    try {
      if (jobStore) d.lost = jobStore->lostRanks(lossGrace);
      for (int r = 0; r < size; ++r) {
        // add(key, 0) reads without blocking (get would wait for the key to exist).
        if (store->add(prefix + std::to_string(r), 0) < needed) d.absent.push_back(r);
      }
      int present = size - static_cast<int>(d.absent.size());
      if (store->add("diagnosed/" + tag, 1) >= present) {
        store->set("diagnosed/" + tag + "/all", std::vector<uint8_t>{1});
      }
      if (serving) {
        store->setTimeout(kDiagnoseGrace);
        store->wait({"diagnosed/" + tag + "/all"});
      }
    } catch (const PeerLostError&) {
      d.storeLost = true;
    } catch (const std::exception&) {
      // A peer never read (rank 0's bounded wait): report what we know.
    }
    return d;
  }
  static constexpr Millis kDiagnoseGrace{3000};
  static constexpr Millis kLossGrace{1000};

  // "student rank 2 (r3 on node 1) was lost first (...); then student rank 3 (r4 on node 1)"
  // + "; student rank(s) 2, 3 never entered it", or the store host lost.
  std::string explain(const Diagnosis& d, const std::string& neverWhat) const {
    std::vector<std::string> parts;
    if (d.storeLost) {
      parts.push_back("the rendezvous store's host, student rank 0 (node 0) at " + storeHostPort +
                      ", was lost (the connection to it closed: its process is gone?)");
    } else if (!d.lost.empty()) {
      std::string s = studentName(d.lost[0]) +
          " was lost first (its connection to the rendezvous store closed without a goodbye: "
          "its process died or failed)";
      if (d.lost.size() > 1) {
        s += "; then ";
        std::vector<std::string> later;
        for (size_t i = 1; i < d.lost.size(); ++i) later.push_back(studentName(d.lost[i]));
        s += join(later);
      }
      parts.push_back(s);
    }
    if (!d.absent.empty()) parts.push_back("student rank(s) " + join(d.absent) + " " + neverWhat);
    std::string out;
    for (auto& p : parts) out += (out.empty() ? "" : "; ") + p;
    return out;
  }

  // The flight recorder's event of collective #mySeq: the hang table shows who is in which.
  static trace::Event eventFor(const std::string& what, int64_t mySeq) {
    trace::Event ev;
    ev.op = trace::Op::kCollective;
    ev.seq = static_cast<uint64_t>(mySeq);
    ev.label = what;
    trace::currentStep(&ev.step, &ev.accStep);
    return ev;
  }

  // A failure of a collective as "timed out after ... ms: ..." or "failed: ...";
  // rethrows distill's own errors other than a lost peer or a timeout (not a peer's doing).
  // Whether a gloo, c10d or store message reports a timeout.
  static bool saysTimedOut(const std::string& text) {
    return text.find("timed out") != std::string::npos || text.find("Timed out") != std::string::npos;
  }

  std::string failureText(const std::exception& e, const Deadline& deadline) const {
    const auto* mine = dynamic_cast<const Error*>(&e);
    if (mine && !dynamic_cast<const PeerLostError*>(mine) && !dynamic_cast<const TimeoutError*>(mine)) throw;
    const std::string text = firstLineOf(mine ? mine->message() : std::string(e.what()));
    // gloo bounds the collective by the same timeout on its own clock and may report it a few ms
    // before ours runs out ("Operation timed out!"): a timeout all the same, not a lost peer.
    const bool timeout = deadline.expired() || dynamic_cast<const TimeoutError*>(mine) || saysTimedOut(text);
    const std::string head = "timed out after " + std::to_string(this->timeout.count()) + " ms: ";
    return (timeout ? head : std::string("failed: ")) + text;
  }

  // Counts this rank's arrival, then starts the collective; on a failure
  // returns null with `how` set.
  c10::intrusive_ptr<c10d::Work> launch(const std::function<c10::intrusive_ptr<c10d::Work>()>& start,
                                        const Deadline& deadline, std::string& how) {
    try {
      store->add("arrived/" + std::to_string(rank), 1);
      return start();
    } catch (const std::exception& e) {
      how = failureText(e, deadline);
      return {};
    }
  }

  // Waits for `work` until `deadline`; on a failure sets `how`.
  void await(c10d::Work& work, const Deadline& deadline, std::string& how) {
    try {
      // gloo bounds its own transfers by the same timeout; wait() adds ours for NCCL.
      const auto left = std::chrono::duration_cast<Millis>(deadline.remaining());
      if (!work.wait(std::max(left, Millis(1)))) how = "timed out after " + std::to_string(timeout.count()) + " ms";
    } catch (const std::exception& e) {
      how = failureText(e, deadline);
    }
  }

  // Runs one collective with the arrival bookkeeping and the deadline.
  void run(const std::string& what, const std::function<c10::intrusive_ptr<c10d::Work>()>& start) {
    const int64_t mySeq = ++seq;
    trace::Scope recorded(eventFor(what, mySeq));
    const auto deadline = Deadline::after(timeout);
    std::string how; // "" = done
    auto work = launch(start, deadline, how);
    if (work) await(*work, deadline, how);
    if (!how.empty()) failed(what, mySeq, awaitedName(what, mySeq), how);
  }

  static std::string awaitedName(const std::string& what, int64_t mySeq) {
    return "student group " + what + " #" + std::to_string(mySeq);
  }

  [[noreturn]] void failed(const std::string& what, int64_t mySeq, const std::string& awaited, const std::string& how) {
    const bool timedOut = how.rfind("timed out", 0) == 0;
    auto d = diagnose("arrived/", mySeq, "c" + std::to_string(mySeq), timedOut ? Millis(0) : kLossGrace);
    std::string who = explain(d, "never entered it");
    if (who.empty()) who = "every student rank entered it; a peer failed inside it";
    if (timedOut) {
      DISTILL_THROW(TimeoutError, awaiting(awaited), "student group ", what, " #", mySeq, " ", how, "; ", who);
    }
    DISTILL_THROW(PeerLostError, awaiting(awaited), "student group ", what, " #", mySeq, " ", how, "; ", who);
  }

  c10d::Backend& backendFor(const std::vector<at::Tensor>& tensors) {
    if (!tensors.empty() && tensors[0].is_cuda() && !cudaThroughGloo) {
      DISTILL_CHECK_T(ConfigError, nccl,
                      "CUDA tensors given to the student group, but it has no "
                      "NCCL backend (built with DISTILL_CUDA=",
                      DISTILL_CUDA,
                      ", student.device/student.backend select gloo); move them to CPU or set "
                      "student.device: cuda");
      return *nccl;
    }
    return *gloo;
  }

  void openAgentStore(const Topology& topo, Millis startup, const std::string& hostPort);
  void openJobStore(const Topology& topo, Deadline deadline, const std::string& hostPort);
  void admit(Deadline deadline, Millis startup);
  void createBackends(const Topology& topo, const StudentOptions& student);
  [[noreturn]] void connectFailed(const std::string& backend, const std::exception& e) const;
};

} // namespace distill
