#include "distill/teacher/server.h"

#include "distill/ipc/torchrun.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <chrono>
#include <deque>
#include <exception>
#include <limits>
#include <map>
#include <sstream>

#include "answer/answer.h"
#include "answer_check.h"
#include "autocast_scope.h"
#include "cache/cache.h"
#include "head.h"
#include "pending.h"
#include "request.h"
#include "distill/core/clock.h"
#include "distill/core/config.h"
#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/core/trace.h"
#include "distill/ipc/channel.h"

namespace distill {
namespace {

using ipc::MsgKind;
using ipc::ReceivedMessage;

// Thrown out of the cache's compute when an answer is not finite: nothing of the
// batch is stored, and it is answered again without the cache (answer_check.h).
struct NonfiniteInCache {};

class Server {
 public:
  Server(TeacherContext& ctx, std::shared_ptr<TeacherModel> model)
      : ctx_(ctx), cfg_(ctx.config()), model_(std::move(model)) {}

  ServeStats run() {
    AbandonOnFailure<std::deque<Pending>> keep(pending_);
    attachAndAdmit();
    const int students = int(mine_.size());
    auto start = Clock::now();
    windowStart_ = start;
    int active = students;
    while (active > 0) {
      if (pending_.empty()) {
        // Block for the next request of any student. A student that dies
        // surfaces here as PeerLostError; a quiet period is no error (students
        // may evaluate or checkpoint), so an expired deadline only warns.
        auto m = endpoint_->tryWaitAny(Deadline::afterSeconds(cfg_.run.peerWaitS()));
        if (!m) {
          DISTILL_LOG(kWarning) << "no request from any student for " << cfg_.run.peerWaitS()
                                << " s; still waiting (students are alive)";
          continue;
        }
        take(std::move(*m));
      }
      // Everything else that is ready now joins the batch.
      for (int i : mine_) {
        while (auto m = endpoint_->poll(i)) take(std::move(*m));
      }
      serveOneBatch();
      active = 0;
      for (int i : mine_) active += finished_[i] ? 0 : 1;
      if (!pending_.empty()) active = std::max(active, 1);
    }
    stats_.wallSeconds = std::chrono::duration<double>(Clock::now() - start).count();
    double window = std::chrono::duration<double>(Clock::now() - windowStart_).count();
    if (window > 0) segment_->setTeacherBusy(teacher_, windowBusy_ / window); // the last, partial window
    // torchrun: no launcher removes the segment; its students are done with it.
    if (ctx_.topology().torchrun) ipc::Segment::remove(ctx_.topology().segment);
    DISTILL_LOG(kInfo) << "teacher done: " << stats_.requests << " requests in " << stats_.batches << " batches, "
                       << stats_.errors << " errors, " << stats_.masked
                       << " token(s) masked as not finite (teacher.on_nonfinite), forward " << stats_.forwardSeconds
                       << " s of " << stats_.wallSeconds << " s";
    if (cache_) logCacheSummary();
    return stats_;
  }

 private:
  // Attaches to the node's segment as teacher topo.teacherIndex, admits the
  // students it serves and, in a restarted incarnation, notes which of them
  // finished while no teacher ran.
  void attachAndAdmit() {
    checkResponseFits(cfg_.teacher);
    const Topology& topo = ctx_.topology();
    DISTILL_CHECK_T(ConfigError, !topo.segment.empty(),
                    "the teacher has no segment (DISTILL_SEGMENT is not set): start the job with distill-run");
    // teacher.answer hidden: the head published before any student is admitted (they map it at admission).
    head_ = serveHead(*model_, cfg_.teacher, topo.segment, topo.teacherIndex);
    vocab_ = head_.vocab;
    fingerprint_ = teacherFingerprint(*model_, head_.fingerprint);
    if (cfg_.teacher.cache.mode != CacheMode::kOff) openCache();
    teacher_ = topo.teacherIndex;
    device_ = teacherDevice(cfg_.teacher, teacher_);
    auto startup = Deadline::afterSeconds(cfg_.run.startup_timeout_s);
    auto layout = ipc::SegmentLayout::expectedFromConfig(cfg_, topo.studentsPerNode(), topo.teachersPerNode);
    segment_ = ipc::Segment::attach(topo.segment, topo.jobId, layout, startup);
    auto options = ipc::EndpointOptions::fromOptions(cfg_.transport, topo.globalRank, device_);
    options.config = configDescription(cfg_);
    endpoint_.emplace(*segment_, options, teacher_);
    mine_ = endpoint_->students();
    // Every student must run the config this teacher serves: compared key by
    // key before it is admitted, so that a difference (a --set that reached
    // the students only) is an error naming the keys, not a silently ignored
    // teacher.topk or a tag-order refusal later.
    endpoint_->waitAdmission(
        startup, [&](int local, const std::string& theirs) { return admissionProblem(topo, local, theirs); });
    DISTILL_LOG(kInfo) << "teacher " << teacher_ << " of " << topo.teachersPerNode << " serving " << mine_.size()
                       << " local student(s) on " << topo.segment << " (device " << device_ << "), output "
                       << describeAnswer(cfg_.teacher, nullptr) << ", fingerprint " << std::hex << fingerprint_
                       << std::dec;
    const int perNode = topo.studentsPerNode();
    stats_.perStudent.assign(perNode, 0);
    last_.assign(perNode, std::nullopt);
    finished_.assign(perNode, false);
    if (const int restarts = segment_->teacherRestarts(teacher_); restarts > 0) {
      // A restarted incarnation: students that finished while no teacher ran
      // send nothing more; everything else carries on from the rings.
      int done = 0;
      for (int s : mine_) done += (finished_[s] = endpoint_->studentDone(s)) ? 1 : 0;
      DISTILL_LOG(kWarning) << "teacher restarted (" << restarts << " of " << segment_->teacherMaxRestarts()
                            << " restarts): resuming with " << int(mine_.size()) - done << " active student(s)";
    }
  }

  // "" if local student `local`, which published `theirs` at attach, runs the
  // config this teacher serves; otherwise the refusal, naming each differing key.
  std::string admissionProblem(const Topology& topo, int local, const std::string& theirs) const {
    const std::string who = "student rank " + std::to_string(topo.studentRankOf(topo.nodeRank, local)) + " (local " +
        std::to_string(local) + ")";
    if (theirs.empty()) return who + " published no config to compare with the teacher's; it cannot be admitted";
    std::vector<ConfigMismatch> diff;
    try {
      diff = compareConfig(cfg_, theirs);
    } catch (const Error& e) {
      return who + " published a config the teacher cannot read: " + e.message();
    }
    if (diff.empty()) return "";
    // Values shortened: the student reads this from a fixed area of the segment.
    auto shortened = [](const std::string& v) { return v.size() <= 60 ? v : v.substr(0, 57) + "..."; };
    std::string text =
        who + " runs a config that differs from its teacher's in " + std::to_string(diff.size()) + " key(s):";
    for (const ConfigMismatch& d : diff) {
      text += " " + d.key + " (teacher " + shortened(d.mine) + ", student " + shortened(d.theirs) + ");";
    }
    return text +
        " every process of a job must run one config: give overrides to distill-run (--set before"
        " `--`), which passes them to every rank; a --set after `--` reaches the trainer's processes only";
  }

  // Accepts one message from a ring: finish, or a request queued for a batch
  // (after its tag, dtypes and shapes are checked; errors are answered here).
  void take(ReceivedMessage m) {
    const int s = m.student();
    if (m.kind() == MsgKind::kFinish) {
      finished_[s] = true;
      DISTILL_LOG(kDebug) << "student " << m.senderRank() << " finished";
      return;
    }
    const Tag tag = m.tag();
    std::string why;
    if (m.kind() != MsgKind::kRequest) {
      why = std::string("unexpected message kind ") + ipc::msgKindName(m.kind());
    } else {
      why = checkTagOrder(last_[s], tag, cfg_.student.grad_acc_steps);
      // In order: it is the student's latest request, even if its inputs are
      // refused below (else its next, valid request would be a "seq gap").
      if (why.empty()) last_[s] = tag;
    }
    Pending p;
    if (why.empty()) why = checkInputs(m, &p);
    if (!why.empty()) {
      answerError(s, m.tag(),
                  "teacher rejected the request of student rank " + std::to_string(m.senderRank()) + ": " + why);
      return;
    }
    p.student = s;
    p.msg = std::move(m);
    pending_.push_back(std::move(p));
  }

  std::string checkInputs(const ReceivedMessage& m, Pending* p) {
    return checkRequest(m, cfg_, cache_ && cfg_.teacher.cache.keys == CacheKeys::kPrefix, signature_, p);
  }

  // Takes pending requests in order while they fit the token budget and share
  // the trailing shape of the first, and its kind of answer (ids of the same
  // width, or none); a student's later requests never overtake its earlier
  // ones. Runs forward once and answers each request.
  void serveOneBatch() {
    if (pending_.empty()) return;
    std::vector<Pending> batch;
    std::vector<bool> blocked(finished_.size(), false);
    int64_t tokens = 0;
    auto trailing = pending_.front().inputs[0].sizes().slice(1).vec();
    const int64_t width = idsWidth(pending_.front());
    for (auto it = pending_.begin(); it != pending_.end();) {
      bool fits = tokens + it->tokens <= cfg_.teacher.max_batch_tokens &&
          it->inputs[0].sizes().slice(1).vec() == trailing && idsWidth(*it) == width && !blocked[it->student];
      if (!fits) {
        blocked[it->student] = true;
        ++it;
        continue;
      }
      tokens += it->tokens;
      batch.push_back(std::move(*it));
      it = pending_.erase(it);
    }

    AbandonOnFailure<std::vector<Pending>> keep(batch);
    auto t0 = Clock::now();
    std::map<std::string, at::Tensor> out;
    std::vector<Answer> cached; // with teacher.cache: each request's answer
    std::vector<int64_t> sizes;
    try {
      c10::InferenceMode guard;
      const std::string label = std::to_string(batch.size()) + " request(s), " + std::to_string(tokens) + " tokens";
      nonfinite_.reset(); // this batch's, set by compute() outside the cache
      batchIds_ = width > 0 ? concatIds(batch) : at::Tensor(); // ids answers: never cached (keys hold no ids)
      if (cache_ && width == 0) {
        std::vector<std::vector<at::Tensor>> requests;
        for (auto& p : batch) requests.push_back(p.inputs);
        try {
          cached = cache_->answer(
              requests,
              [&](const std::vector<at::Tensor>& rows, const at::Tensor& positions) {
                if (answerKindOf(cfg_.teacher) == AnswerKind::kSampled) { // the draws of the rows it computes
                  rowKeys_ = sampleKeys(batch, cfg_.run.seed, cache_->computingRows(), positions);
                }
                return compute(rows, label, positions, /*inCache=*/true);
              },
              cfg_.transport.cuda_ipc == CudaIpc::kOff ? at::Device(at::kCPU) : at::Device(device_));
        } catch (const NonfiniteInCache&) {
          cached.clear(); // answered below as without the cache, and not stored
        }
      }
      const bool direct = cached.empty();
      std::vector<at::Tensor> inputs;
      for (size_t i = 0; direct && i < batch[0].inputs.size(); ++i) {
        std::vector<at::Tensor> parts;
        for (auto& p : batch) parts.push_back(p.inputs[i]);
        inputs.push_back(at::cat(parts, 0));
      }
      // The request slots stay held until each request is answered: if this
      // process dies in forward, the next incarnation finds them still in the
      // ring and serves them (elastic teacher). With student.in_flight <=
      // transport.slots this never makes a student wait for a slot.
      rowKeys_ = answerKindOf(cfg_.teacher) == AnswerKind::kSampled ? sampleKeys(batch, cfg_.run.seed) : at::Tensor();
      for (auto& p : batch) {
        sizes.push_back(p.inputs[0].size(0));
        p.inputs.clear();
      }
      if (direct) out = compute(inputs, label, at::Tensor(), /*inCache=*/false).answer;
    } catch (const std::exception& e) {
      // The teacher's own failure (its model raised, or answered in the wrong shape), named first;
      // its requests stay in the rings for a restarted teacher (AbandonOnFailure, giveUpIfRepeated).
      DISTILL_LOG(kError) << "teacher " << teacher_ << " failed on a batch of " << batch.size() << " request(s) ("
                          << tokens << " tokens): " << e.what();
      giveUpIfRepeated(batch, e.what(), teacher_, *segment_);
      throw;
    }
    noteBusy(t0, Clock::now());
    if (cache_) publishCache();
    answerBatch(batch, cached, out, sizes);
  }

  // Answers each request: from `cached` (one answer per request) or its rows of `out`.
  void answerBatch(std::vector<Pending>& batch, const std::vector<Answer>& cached,
                   const std::map<std::string, at::Tensor>& out, const std::vector<int64_t>& sizes) {
    int64_t offset = 0;
    for (size_t b = 0; b < batch.size(); ++b) {
      const int64_t first = offset, rows = sizes[b];
      offset += rows;
      if (nonfinite_ && nonfiniteAnswered(batch[b], first, rows)) continue;
      ipc::OutMessage reply;
      reply.kind = MsgKind::kResponse;
      reply.tag = batch[b].msg.tag();
      reply.vocab = vocab_; // the students check it against theirs (loss.vocab)
      reply.teacher = fingerprint_; // and that one teacher answers them all run long
      reply.answer = batchKind(); // what its tensors are (core/answer_kinds.h)
      if (!cached.empty()) {
        for (auto& [name, t] : cached[b]) reply.tensors.emplace_back(name, t);
      }
      for (auto& [name, t] : out) reply.tensors.emplace_back(name, t.narrow(0, first, rows));
      endpoint_->reply(batch[b].student, reply, Deadline::afterSeconds(cfg_.run.peerWaitS()));
      batch[b].msg.release(); // answered: only now may the slot be reused
      ++stats_.requests;
      ++stats_.perStudent[batch[b].student];
    }
  }

  // teacher.cache: keys carry the answer context, whose fingerprint hashes every
  // parameter and buffer of the model once here.
  void openCache() {
    const auto t0 = Clock::now();
    std::string context = answerContext(cfg_.teacher, cfg_.loss.temperature, *model_, head_.fingerprint, cfg_.run.seed);
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    cache_ = std::make_unique<TeacherCache>(cfg_.teacher.cache, std::move(context), cfg_.teacher.inputs,
                                            cfg_.loss.temperature);
    DISTILL_LOG(kInfo) << "teacher cache " << cfg_.teacher.cache.path << " (mode " << cfg_.teacher.cache.mode
                       << "): model fingerprint took " << static_cast<int64_t>(ms + 0.5) << " ms, store "
                       << cache_->storeBytes() << " bytes";
  }

  // The cache's counters in the segment: distill-run's status line and balance
  // verdict read them (the hit share is hits / lookups everywhere).
  void publishCache() {
    const CacheStats& c = cache_->stats();
    ipc::TeacherCacheGauge g;
    std::tie(g.lookups, g.hits) = cache_->hitShareCounts();
    g.storedTokens = c.insertedTokens;
    g.storedBytes = c.storedBytes;
    if (cache_->full()) {
      g.full = cache_->maxBytesReached() ? ipc::TeacherCacheGauge::Full::kMaxBytes
                                         : ipc::TeacherCacheGauge::Full::kWriteFailed;
    }
    segment_->setTeacherCache(teacher_, g);
  }

  void logCacheSummary() { DISTILL_LOG(kInfo) << cache_->summary(); }

  // The model's shaped answer for batched inputs (one forward call); with
  // `positions` (teacher.cache.keys prefix), only theirs (gatherPositions).
  // `inCache`: called by the cache, which must never store an answer that is not finite.
  TeacherCache::Computed compute(const std::vector<at::Tensor>& rows, const std::string& label,
                                 const at::Tensor& positions, bool inCache) {
    std::vector<at::Tensor> inputs;
    for (const at::Tensor& t : rows) inputs.push_back(t.to(at::Device(device_)));
    AutocastScope autocast(cfg_.teacher, at::Device(device_));
    trace::Event ev; // the model is user code: a stall here shows as "busy in the model's forward"
    ev.op = trace::Op::kForward;
    ev.label = label;
    trace::Scope recorded(ev);
    auto raw = model_->forward(inputs);
    ++stats_.batches;
    auto it = raw.find(cfg_.teacher.output);
    DISTILL_CHECK_T(ProtocolError, it != raw.end(), "teacher model returned no '", cfg_.teacher.output,
                    "' (teacher.output)");
    checkOutputShape(cfg_.teacher, it->second, inputs[0]);
    checkVocab(cfg_.teacher, it->second);
    const int64_t vocab = head_.vocab > 0 ? head_.vocab : it->second.dim() >= 1 ? it->second.size(-1) : 0;
    if (vocab > 0) vocab_ = vocab;
    const bool mask = cfg_.teacher.on_nonfinite == TeacherOnNonfinite::kMask;
    auto nf = findNonfinite(it->second); // one reduction when finite
    if (nf && inCache) throw NonfiniteInCache{};
    if (nf) nonfiniteLogits_ = it->second;
    if (nf && mask) zeroNonfinite(it->second, *nf);
    std::vector<std::string> names = cfg_.teacher.hidden_states;
    names.push_back(cfg_.teacher.output);
    if (positions.defined()) raw = gatherPositions(raw, names, positions, inputs[0].size(1));
    auto answer = shape(std::move(raw));
    if (nf && mask) markMasked(answer, batchKind(), *nf);
    if (nf) nonfinite_ = std::move(nf);
    return {std::move(answer), vocab};
  }

  // A request of the batch whose rows [offset, offset + rows) hold a token that
  // is not finite: teacher.on_nonfinite error answers it with the teacher's
  // error (true: answered); mask counts its tokens and lets it be answered (false).
  bool nonfiniteAnswered(Pending& p, int64_t offset, int64_t rows) {
    const int64_t tokens = nonfiniteTokens(*nonfinite_, offset, rows);
    if (tokens == 0) return false;
    if (cfg_.teacher.on_nonfinite == TeacherOnNonfinite::kMask) {
      stats_.masked += tokens;
      return false;
    }
    answerError(p.student, p.msg.tag(),
                nonfiniteError(ctx_.topology().globalRank, teacher_, p.msg.tag(), p.msg.senderRank(),
                               cfg_.teacher.output, describeNonfinite(nonfiniteLogits_, *nonfinite_, offset, rows)));
    p.msg.release();
    return true;
  }

  // The ids a request asks an answer at: k per position, 0 for none.
  static int64_t idsWidth(const Pending& p) { return p.ids.defined() ? p.ids.size(-1) : 0; }
  static at::Tensor concatIds(const std::vector<Pending>& batch) {
    std::vector<at::Tensor> parts;
    for (const Pending& p : batch) parts.push_back(p.ids.to(at::kLong));
    return at::cat(parts, 0);
  }
  AnswerKind batchKind() const { return batchIds_.defined() ? AnswerKind::kIds : answerKindOf(cfg_.teacher); }

  // The configured kind's answer (teacher/src/answer/), plus hidden states; or the batch's ids answer.
  std::map<std::string, at::Tensor> shape(std::map<std::string, at::Tensor> raw) {
    const ShapeContext context{cfg_.teacher, cfg_.loss.temperature, rowKeys_};
    const at::Tensor& logits = raw.at(cfg_.teacher.output);
    std::map<std::string, at::Tensor> out =
        batchIds_.defined() ? shapeIds(logits, batchIds_, context) : shapeAnswer(logits, context);
    for (auto& name : batchIds_.defined() ? std::vector<std::string>() : cfg_.teacher.hidden_states) {
      auto h = raw.find(name);
      DISTILL_CHECK_T(ProtocolError, h != raw.end(), "teacher model returned no hidden state '", name,
                      "' (teacher.hidden_states)");
      out[name] = h->second.contiguous();
    }
    if (cfg_.transport.cuda_ipc == CudaIpc::kOff) {
      for (auto& kv : out) kv.second = kv.second.cpu();
    }
    return out;
  }

  void answerError(int student, const Tag& tag, const std::string& text) {
    DISTILL_LOG(kError) << text;
    ipc::OutMessage reply;
    reply.kind = MsgKind::kError;
    reply.tag = tag;
    reply.errorText = text;
    endpoint_->reply(student, reply, Deadline::afterSeconds(cfg_.run.peerWaitS()));
    ++stats_.errors;
  }

  // Share of wall time spent in forward over about a second, published in the
  // segment (Segment::teacherBusy: the launcher's status line) and logged at debug.
  void noteBusy(Clock::time_point t0, Clock::time_point t1) {
    double s = std::chrono::duration<double>(t1 - t0).count();
    stats_.forwardSeconds += s;
    windowBusy_ += s;
    double window = std::chrono::duration<double>(t1 - windowStart_).count();
    if (window >= 1.0) {
      lastBusy_ = windowBusy_ / window;
      segment_->setTeacherBusy(teacher_, lastBusy_);
      DISTILL_LOG(kDebug) << "teacher busy " << static_cast<int>(lastBusy_ * 100) << "%";
      windowBusy_ = 0;
      windowStart_ = t1;
    }
  }

  TeacherContext& ctx_;
  const Config& cfg_;
  std::shared_ptr<TeacherModel> model_;
  std::optional<ipc::Segment> segment_;
  std::optional<ipc::TeacherEndpoint> endpoint_;
  std::deque<Pending> pending_;
  at::Tensor rowKeys_; // the batch being computed: sampleKeys
  at::Tensor batchIds_; // the batch being computed: its requests' ids [rows, T, k] (an ids batch), or undefined
  std::vector<std::optional<Tag>> last_;
  std::vector<bool> finished_; // by local student index (only those in mine_ are used)
  std::vector<int> mine_; // the local students this teacher serves (teacher i % K)
  // The width of the model's logits (its vocabulary), known from its first
  // forward; stated in every response (0 before: answers all from the cache).
  int64_t vocab_ = 0;
  uint64_t fingerprint_ = 0; // teacherFingerprint: in every answer
  int teacher_ = 0; // its index among the node's teachers
  std::string device_; // teacherDevice(teacher.*, teacher_)
  InputSignature signature_;
  std::unique_ptr<TeacherCache> cache_; // teacher.cache, mode not off
  ServedHead head_; // teacher.answer hidden: its head (head.h)
  std::optional<Nonfinite> nonfinite_; // the batch's tokens that are not finite (nonfinite.h), if any
  at::Tensor nonfiniteLogits_; // the output they are in, as the model gave it
  ServeStats stats_;
  Clock::time_point windowStart_;
  double windowBusy_ = 0;
  double lastBusy_ = 0;
};

} // namespace

ServeStats serve(TeacherContext& ctx, std::shared_ptr<TeacherModel> model) {
  DISTILL_CHECK_T(ConfigError, model != nullptr, "serve(): no teacher model");
  return Server(ctx, std::move(model)).run();
}

} // namespace distill
