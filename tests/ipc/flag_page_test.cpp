// The CUDA ring's flag page (ipc/src/cuda/flag_page.h): its place in the
// consumer's allocation, its words' offsets and values, and the choice between
// stream memory operations and interprocess events. Host logic only: runs on
// machines without a GPU.
#include <gtest/gtest.h>

#include <set>

#include "cuda/call_times.h"
#include "cuda/flag_page.h"

using namespace distill::ipc::cuda;

namespace {

// Inputs that allow stream memory operations; each test takes one away.
SignalInputs allYes() {
  SignalInputs in;
  in.request = SignalRequest::kAuto;
  in.pageValid = in.entryPoints = in.producerMemOps = in.consumerMemOps = in.sameDevice = true;
  return in;
}

} // namespace

TEST(FlagPage, SitsAfterTheSlotsOnItsOwnAlignedRange) {
  for (uint64_t slots : {1, 2, 4, 7, 64}) {
    for (uint64_t slotBytes : {256ull, 4096ull, 65536ull, 1ull << 30}) {
      const uint64_t page = flags::pageOffset(slots, slotBytes);
      EXPECT_GE(page, slots * slotBytes) << slots << " x " << slotBytes;
      EXPECT_EQ(page % flags::kAlign, 0u);
      EXPECT_EQ(flags::pageBytes(slots) % flags::kAlign, 0u);
      EXPECT_EQ(flags::allocationBytes(slots, slotBytes), page + flags::pageBytes(slots));
      // The last done word ends inside the page.
      EXPECT_LE(flags::doneOffset(slots, slots - 1) + sizeof(uint64_t), flags::pageBytes(slots));
    }
  }
  // Slot bytes are multiples of 256 (cuda_ipc.cpp rounds them), so the page follows the slots directly.
  EXPECT_EQ(flags::pageOffset(3, 512), 3u * 512u);
}

TEST(FlagPage, EveryWordHasItsOwnLineAfterTheControlBlock) {
  for (uint64_t slots : {1, 2, 5, 16}) {
    std::set<uint64_t> lines;
    for (uint64_t i = 0; i < slots; ++i) {
      for (uint64_t off : {flags::writtenOffset(i), flags::doneOffset(slots, i)}) {
        EXPECT_GE(off, flags::kControlBytes);
        EXPECT_EQ(off % flags::kLine, 0u);
        EXPECT_TRUE(lines.insert(off / flags::kLine).second) << "two words share line " << off / flags::kLine;
      }
    }
    EXPECT_EQ(lines.size(), 2 * slots);
  }
  EXPECT_LE(sizeof(FlagControl), flags::kControlBytes);
  EXPECT_EQ(offsetof(FlagControl, signal), 64u); // the producer's word on a line of its own
}

TEST(FlagPage, ValuesGrowAndReleaseAllPassesEveryWait) {
  EXPECT_EQ(flags::writtenValue(0), 1u); // 0 is "never written": message 0 must not pass a wait on a fresh page
  EXPECT_EQ(flags::doneValue(0), 1u);
  EXPECT_LT(flags::writtenValue(7), flags::writtenValue(8));
  // CU_STREAM_WAIT_VALUE_GEQ is cyclic: (int64_t)(word - value) >= 0.
  auto passes = [](uint64_t word, uint64_t value) { return int64_t(word - value) >= 0; };
  for (uint64_t seq : {0ull, 1ull, 1000ull, 1ull << 40}) {
    EXPECT_TRUE(passes(flags::kReleaseAll, flags::writtenValue(seq)));
    EXPECT_TRUE(passes(flags::kReleaseAll, flags::doneValue(seq)));
    EXPECT_FALSE(passes(0, flags::writtenValue(seq)));
    EXPECT_FALSE(passes(flags::writtenValue(seq), flags::writtenValue(seq + 1)));
  }
}

TEST(SignalChoice, MemOpsOnlyWhenEverythingAllowsIt) {
  std::string why;
  EXPECT_EQ(chooseSignal(allYes(), &why), Signal::kMemOps);
  EXPECT_TRUE(why.empty());
  struct Case {
    void (*off)(SignalInputs&);
    const char* reason;
  };
  const Case cases[] = {
      {[](SignalInputs& i) { i.request = SignalRequest::kEvents; }, "DISTILL_CUDA_IPC_SIGNAL=events"},
      {[](SignalInputs& i) { i.pageValid = false; }, "no initialised flag page"},
      {[](SignalInputs& i) { i.entryPoints = false; }, "entry points"},
      {[](SignalInputs& i) { i.producerMemOps = false; }, "producer's device"},
      {[](SignalInputs& i) { i.consumerMemOps = false; }, "consumer's device"},
      {[](SignalInputs& i) { i.sameDevice = false; }, "different GPUs"},
  };
  for (const auto& c : cases) {
    SignalInputs in = allYes();
    c.off(in);
    why.clear();
    EXPECT_EQ(chooseSignal(in, &why), Signal::kEvents) << c.reason;
    EXPECT_NE(why.find(c.reason), std::string::npos) << why;
  }
  // The first reason wins: an explicit request before the device facts.
  SignalInputs none;
  none.request = SignalRequest::kEvents;
  why.clear();
  EXPECT_EQ(chooseSignal(none, &why), Signal::kEvents);
  EXPECT_NE(why.find("DISTILL_CUDA_IPC_SIGNAL"), std::string::npos);
}

TEST(SignalChoice, TheEnvironmentVariable) {
  SignalRequest r = SignalRequest::kEvents;
  std::string bad;
  EXPECT_TRUE(parseSignalRequest(nullptr, &r, &bad));
  EXPECT_EQ(r, SignalRequest::kAuto);
  EXPECT_TRUE(parseSignalRequest("", &r, &bad));
  EXPECT_EQ(r, SignalRequest::kAuto);
  EXPECT_TRUE(parseSignalRequest("events", &r, &bad));
  EXPECT_EQ(r, SignalRequest::kEvents);
  EXPECT_TRUE(parseSignalRequest("auto", &r, &bad));
  EXPECT_EQ(r, SignalRequest::kAuto);
  EXPECT_FALSE(parseSignalRequest("memops-please", &r, &bad));
  EXPECT_EQ(bad, "memops-please");
}

TEST(SignalChoice, NamesForTheLog) {
  EXPECT_STREQ(signalName(Signal::kEvents), "interprocess CUDA events");
  EXPECT_NE(std::string(signalName(Signal::kMemOps)).find("stream memory operations"), std::string::npos);
  EXPECT_EQ(uint64_t(Signal::kUndecided), 0u); // a zeroed page means "not chosen yet"
}

TEST(CallTimes, SummaryNamesTheCallsMadeWithMeanAndMax) {
  CallTimes t(true);
  EXPECT_EQ(t.summary(), "no CUDA calls");
  t.add(CallTimes::kCopy, 2000);
  t.add(CallTimes::kCopy, 6000);
  t.add(CallTimes::kEventSync, 150000);
  EXPECT_EQ(t.summary(), "copy 2 x 4.0 us (max 6.0), event-sync 1 x 150.0 us (max 150.0)");
}
