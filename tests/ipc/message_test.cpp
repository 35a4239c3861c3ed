// Tensor messages between real processes: every dtype bit-exact in view and
// copy modes, in-slot allocation both ways, oversize errors, error messages,
// and a corrupted header in a ring.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <cstring>

#include "distill/core/errors.h"
#include "distill/ipc/channel.h"
#include "ipc_test_util.h"
#include "wire.h"

using namespace distill;
using namespace distill::ipc;
using namespace distill::ipc::test;
using distill::testing::forkChild;
using namespace std::chrono_literals;

namespace {

const std::string kJob = "job-msg-test";

bool sameBytes(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  auto ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), size_t(ca.nbytes())) == 0;
}

// One tensor of each dtype, with odd shapes (scalar, empty, non-contiguous).
std::vector<std::pair<std::string, at::Tensor>> everyDtype(int64_t seed) {
  at::manual_seed(uint64_t(seed));
  return {
      {"i32", at::randint(-1000000, 1000000, {3, 5}, at::kInt)},
      {"i64", at::randint(-(int64_t(1) << 40), int64_t(1) << 40, {7}, at::kLong)},
      {"f32", at::randn({4, 3, 2}).transpose(0, 2)}, // non-contiguous
      {"f16", at::randn({1, 9}).to(at::kHalf)},
      {"bf16", at::randn({2, 2, 2, 2}).to(at::kBFloat16)},
      {"bool", at::rand({11}) > 0.5},
      {"i16", at::randint(-30000, 30000, {2, 6}, at::kShort)}, // sampled answers' counts
      {"scalar", at::scalar_tensor(3.25)},
      {"empty", at::empty({0, 4})},
  };
}

// Teacher child: echoes each request's tensors back; request tensors named
// "alloc:*" are answered by in-slot allocation instead of a copy.
int echoTeacher(const std::string& name) {
  auto seg = Segment::attach(name, kJob, std::nullopt, Deadline::after(10s));
  TeacherEndpoint t(seg, opts(1));
  t.waitAdmission(Deadline::after(10s));
  for (;;) {
    auto m = t.waitAny(Deadline::after(30s));
    if (m.kind() == MsgKind::kFinish) return 0;
    if (m.tag().seq % 2 == 1) { // in-slot reply
      std::vector<TensorSpec> specs;
      for (const auto& n : m.names()) {
        auto v = m.view(n);
        specs.push_back({n, v.scalar_type(), v.sizes().vec()});
      }
      auto out = t.allocateReply(m.student(), m.tag(), specs, Deadline::after(10s));
      for (size_t i = 0; i < specs.size(); ++i) out[i].copy_(m.view(specs[i].name));
      t.publishReply(m.student());
    } else {
      OutMessage r;
      r.tag = m.tag();
      r.kind = MsgKind::kResponse;
      for (const auto& n : m.names()) r.tensors.push_back({n, m.view(n)});
      t.reply(m.student(), r, Deadline::after(10s));
    }
  }
}

void finish(StudentEndpoint& s) {
  OutMessage fin;
  fin.kind = MsgKind::kFinish;
  s.send(fin, Deadline::after(5s));
}

} // namespace

TEST(IpcMessage, EveryDtypeRoundTripsBitExact) {
  ScopedName sn;
  auto seg = Segment::create(sn.name, smallLayout(), kJob);
  auto teacher = forkChild([&] { return echoTeacher(sn.name); });
  {
    StudentEndpoint s(seg, 0, opts(0));
    s.waitAdmission(Deadline::after(10s));
    auto tensors = everyDtype(1);
    // seq 0: copy in, copy back; seq 1: copy in, in-slot reply.
    for (uint64_t seq = 0; seq < 2; ++seq) {
      for (size_t first = 0; first < tensors.size(); first += 4) {
        OutMessage m;
        m.tag = Tag{seq, 5, 0};
        for (size_t i = first; i < std::min(first + 4, tensors.size()); ++i) m.tensors.push_back(tensors[i]);
        s.send(m, Deadline::after(10s));
        auto r = s.receive(Deadline::after(10s));
        EXPECT_EQ(r.kind(), MsgKind::kResponse);
        EXPECT_EQ(r.tag().seq, seq);
        EXPECT_EQ(r.senderRank(), 1);
        std::vector<at::Tensor> copies;
        for (const auto& [name, t] : m.tensors) {
          EXPECT_TRUE(sameBytes(r.view(name), t)) << name << " (view, seq " << seq << ")";
          copies.push_back(r.copy(name));
        }
        r.release();
        EXPECT_THROW(r.view(m.tensors[0].first), IpcError);
        for (size_t i = 0; i < copies.size(); ++i)
          EXPECT_TRUE(sameBytes(copies[i], m.tensors[i].second)) << m.tensors[i].first << " (copy after release)";
      }
    }
    // In-slot allocation on the student side.
    auto t = s.allocate(Tag{2, 6, 1}, {{"a", at::kLong, {5}}, {"b", at::kBFloat16, {3, 3}}}, Deadline::after(10s));
    t[0].copy_(at::arange(5, at::kLong));
    t[1].fill_(1.5);
    s.publish();
    auto r = s.receive(Deadline::after(10s));
    EXPECT_TRUE(sameBytes(r.view("a"), at::arange(5, at::kLong)));
    EXPECT_TRUE(sameBytes(r.view("b"), at::full({3, 3}, 1.5, at::kBFloat16)));
    EXPECT_TRUE(r.has("a"));
    EXPECT_FALSE(r.has("c"));
    EXPECT_THROW(r.view("c"), ProtocolError);
    r.release();
    finish(s);
  }
  EXPECT_EQ(teacher.join(30s).code, 0);
}

TEST(IpcMessage, OversizeTensorNamesBothSizesAndKey) {
  ScopedName sn;
  auto layout = smallLayout();
  layout.maxRequestBytes = 4096;
  auto seg = Segment::create(sn.name, layout, kJob);
  StudentEndpoint s(seg, 0, opts(0));
  TeacherEndpoint t(seg, opts(1));
  OutMessage m;
  m.tensors.push_back({"input_ids", at::zeros({2048}, at::kInt)}); // 8192 bytes
  try {
    s.send(m, Deadline::after(1s));
    FAIL() << "no IpcError";
  } catch (const IpcError& e) {
    const std::string w = e.what();
    EXPECT_TRUE(contains(w, "'input_ids' of 8192 bytes")) << w;
    EXPECT_TRUE(contains(w, "holds 4096 bytes")) << w;
    EXPECT_TRUE(contains(w, "transport.max_request_bytes")) << w;
  }
  try {
    t.allocateReply(0, Tag{}, {{"logits", at::kFloat, {1 << 19}}}, Deadline::after(1s)); // 2 MiB > 1 MiB
    FAIL() << "no IpcError";
  } catch (const IpcError& e) {
    EXPECT_TRUE(contains(e.what(), "transport.max_response_bytes")) << e.what();
    EXPECT_TRUE(contains(e.what(), "2097152")) << e.what();
  }
  // Unsupported dtype and too many dims are refused before anything is written.
  OutMessage bad;
  bad.tensors.push_back({"d", at::zeros({2}, at::kDouble)});
  EXPECT_THROW(s.send(bad, Deadline::after(1s)), IpcError);
  EXPECT_FALSE(t.poll(0).has_value());
}

TEST(IpcMessage, ErrorMessagesCarryText) {
  ScopedName sn;
  auto seg = Segment::create(sn.name, smallLayout(), kJob);
  auto teacher = forkChild([&] {
    auto s2 = Segment::attach(sn.name, kJob, std::nullopt, Deadline::after(10s));
    TeacherEndpoint t(s2, opts(1));
    t.waitAdmission(Deadline::after(10s));
    auto m = t.waitAny(Deadline::after(10s));
    OutMessage e;
    e.tag = m.tag();
    e.kind = MsgKind::kError;
    e.errorText = "tag went backwards: step 3 after step 4";
    t.reply(0, e, Deadline::after(10s));
    return 0;
  });
  StudentEndpoint s(seg, 0, opts(0));
  s.waitAdmission(Deadline::after(10s));
  OutMessage m;
  m.tag = Tag{9, 3, 0};
  s.send(m, Deadline::after(10s));
  auto r = s.receive(Deadline::after(10s));
  EXPECT_EQ(r.kind(), MsgKind::kError);
  EXPECT_EQ(r.tag().seq, 9u);
  EXPECT_EQ(r.errorText(), "tag went backwards: step 3 after step 4");
  EXPECT_EQ(teacher.join(10s).code, 0);
}

TEST(IpcMessage, CorruptedHeaderInRingIsAProtocolError) {
  ScopedName sn;
  auto seg = Segment::create(sn.name, smallLayout(), kJob);
  StudentEndpoint s(seg, 0, opts(0));
  TeacherEndpoint t(seg, opts(1));
  OutMessage m;
  m.tensors.push_back({"x", at::ones({4}, at::kFloat)});
  s.send(m, Deadline::after(1s));
  {
    // Request ring of student 0, slot 0 (offsets from wire.h and the control block).
    int fd = ::open(("/dev/shm/" + sn.name).c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    const size_t size = seg.sizeBytes();
    auto* base = static_cast<uint8_t*>(::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    ::close(fd);
    ASSERT_NE(base, MAP_FAILED);
    const auto* c = reinterpret_cast<const wire::ControlBlock*>(base);
    auto* h = reinterpret_cast<wire::SlotHeader*>(base + c->ringsOffset + sizeof(wire::RingHeader) +
                                                  wire::ringEventsBytes(c->slots));
    ASSERT_EQ(h->magic, wire::kSlotMagic);
    h->tensors[0].shape[0] = 5; // nbytes no longer matches
    wire::sealHeader(*h);
    ::munmap(base, size);
  }
  try {
    t.waitAny(Deadline::after(1s));
    FAIL() << "no ProtocolError";
  } catch (const ProtocolError& e) {
    EXPECT_TRUE(contains(e.what(), "nbytes 16 != 5 elements")) << e.what();
    EXPECT_TRUE(contains(e.what(), "student rank 0")) << e.what();
  }
  EXPECT_THROW(t.poll(0), ProtocolError); // poisoned
}
