// Checkpoint manifests (ckpt/src/manifest.cpp) and the scan that picks the
// checkpoint to load: round trips, corruption, parse errors that name the
// problem, every checkpoint corrupt.

#include "ckpt_fixture.h"
#include "distill/core/checksum.h"

// ---- in-process units ----------------------------------------------------------

TEST(CkptUnit, Crc32cKnownValue) {
  EXPECT_EQ(distill::crc32c("123456789", 9), 0xE3069283u);
  std::string big(100003, 'x');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 31);
  EXPECT_EQ(distill::crc32c(big.data() + 5000, big.size() - 5000, distill::crc32c(big.data(), 5000)),
            distill::crc32c(big.data(), big.size()));
}

TEST(CkptUnit, ManifestRoundTripAndCorruption) {
  distill::Manifest m;
  m.step = 7;
  m.studentWorldSize = 2;
  m.configHash = 0xfedcba9876543210ull;
  m.teacherFingerprint = "t\"5\\\n";
  m.files = {{"model.pt", 123, 0xdeadbeef}, {"rank_0.pt", 4, 1}};
  std::string text = distill::formatManifest(m);
  auto back = distill::parseManifest(text, "m.json");
  EXPECT_EQ(back.step, 7);
  EXPECT_EQ(back.studentWorldSize, 2);
  EXPECT_EQ(back.configHash, m.configHash);
  EXPECT_EQ(back.teacherFingerprint, m.teacherFingerprint);
  EXPECT_EQ(back.answerTeacher, 0u); // none noted: no "answer_teacher" key (as a 0.5.2 manifest)
  EXPECT_EQ(text.find("answer_teacher"), std::string::npos);
  m.answerTeacher = 0x0123456789abcdefull;
  const std::string named = distill::formatManifest(m);
  EXPECT_NE(named.find("\"answer_teacher\": \"0123456789abcdef\""), std::string::npos) << named;
  EXPECT_EQ(distill::parseManifest(named, "m.json").answerTeacher, m.answerTeacher);
  ASSERT_EQ(back.files.size(), 2u);
  EXPECT_EQ(back.files[0].crc32c, 0xdeadbeefu);
  std::string bad = text;
  bad[bad.find("123")] = '9'; // still valid JSON: only the checksum catches it
  EXPECT_THROW(distill::parseManifest(bad, "m.json"), distill::CheckpointError);
  EXPECT_THROW(distill::parseManifest(text.substr(0, text.size() / 2), "m.json"), distill::CheckpointError);
}

TEST(CkptUnit, FaultSeamFailsTheNthWriteNamingPathAndErrno) {
  std::string dir = ::testing::TempDir() + dt::uniqueName("ckpt-fs");
  distill::FaultyFileSystem fs(distill::FsOp::kWrite, 2, ENOSPC, "big");
  fs.createDirs(dir + "/a/b");
  std::string big(distill::PosixFileSystem::kWriteChunk * 2 + 1, 'z');
  try {
    fs.writeFile(dir + "/a/b/big", big);
    FAIL() << "no error";
  } catch (const distill::CheckpointError& e) {
    EXPECT_EQ(e.message(), "cannot write " + dir + "/a/b/big: No space left on device (errno 28)");
  }
  EXPECT_TRUE(fs.fired());
  fs.writeFile(dir + "/a/b/big", big); // the 3rd write and on pass
  EXPECT_EQ(fs.readFile(dir + "/a/b/big"), big);
  EXPECT_THROW(fs.readFile(dir + "/missing"), distill::CheckpointError);
  distill::PosixFileSystem().removeAll(dir);
}

// ---- manifest parsing (issue 14, item 8) ---------------------------------------

namespace {

constexpr const char* kCrcLine = "  \"manifest_crc32c\": \"";

// `body` (everything before the manifest_crc32c line, ending in '\n') with a
// correct trailing checksum line: only the parser can object to it.
std::string withValidCrc(const std::string& body) {
  char hex[16];
  std::snprintf(hex, sizeof hex, "%08x", distill::crc32c(body.data(), body.size()));
  return body + kCrcLine + hex + "\"\n}\n";
}

std::string manifestBody(const std::string& text) { return text.substr(0, text.rfind(kCrcLine)); }

// The CheckpointError message of parseManifest(text), or "" when it parsed.
std::string parseError(const std::string& text) {
  try {
    distill::parseManifest(text, "m.json");
  } catch (const distill::CheckpointError& e) {
    return e.message();
  }
  return "";
}

} // namespace

// Every reason names what is wrong: a bad \u escape is not "stoul", 10^6 nested
// '[' with a correct checksum is "too deeply nested", not a stack overflow, and
// the checksum is checked before anything is parsed.
TEST(CkptUnit, ManifestErrorsNameTheProblem) {
  distill::Manifest m;
  m.step = 3;
  m.studentWorldSize = 1;
  m.teacherFingerprint = "FP";
  m.files = {{"model.pt", 1, 2}};
  const std::string good = distill::formatManifest(m);
  ASSERT_EQ(parseError(good), "");
  ASSERT_EQ(parseError(withValidCrc(manifestBody(good))), "");

  std::string body = manifestBody(good);
  body.replace(body.find("\"FP\""), 4, "\"\\uZZZZ\"");
  std::string why = parseError(withValidCrc(body));
  EXPECT_NE(why.find("corrupt manifest m.json"), std::string::npos) << why;
  EXPECT_NE(why.find("\\u"), std::string::npos) << why;
  EXPECT_EQ(why.find("stoul"), std::string::npos) << why;

  // A recorded answer teacher that is not 16 hex digits is corrupt, not 0.
  m.answerTeacher = 0xabcull;
  std::string teacher = manifestBody(distill::formatManifest(m));
  teacher.replace(teacher.find("0000000000000abc"), 16, "00000000000xyz00");
  why = parseError(withValidCrc(teacher));
  EXPECT_NE(why.find("answer_teacher"), std::string::npos) << why;

  why = parseError(withValidCrc(std::string(1000000, '[') + "\n"));
  EXPECT_NE(why.find("nested"), std::string::npos) << why;

  // A flipped byte in valid JSON: the checksum says so, before any parsing.
  std::string flipped = good;
  flipped[flipped.find("model.pt")] = 'M';
  why = parseError(flipped);
  EXPECT_NE(why.find("checksum"), std::string::npos) << why;
  why = parseError(std::string(1000000, '[') + "\n" + kCrcLine + "00000000\"\n}\n");
  EXPECT_NE(why.find("checksum"), std::string::npos) << why;
  EXPECT_NE(parseError("").find("manifest_crc32c"), std::string::npos);
}

// Student rank 0 meets a manifest of 10^6 nested '[' (today: SIGSEGV) and
// falls back to the intact older checkpoint, naming the reason.
TEST_F(CkptTest, DeeplyNestedManifestFallsBackToTheOlderCheckpoint) {
  auto r = run("faulty", 2, {"steps=2"});
  expectAllOk(r);
  std::ofstream(ckpt("step_2/manifest.json"), std::ios::trunc) << std::string(1000000, '[') << "\n"
                                                               << kCrcLine << "00000000\"\n}\n";
  auto again = run("resume", 2, {});
  expectAllOk(again);
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(contains(again.logs[i], "LOADED 1")) << again.logs[i];
  EXPECT_TRUE(contains(again.logs[0], "skipping corrupt checkpoint " + ckpt("step_2"))) << again.logs[0];
}

// ---- every checkpoint corrupt (issue 14, item 9) ---------------------------------

namespace {

void flipByte(const std::string& path, std::streamoff at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(at);
  char c = 0;
  f.read(&c, 1);
  c ^= 0x5a;
  f.seekp(at);
  f.write(&c, 1);
}

} // namespace

// No checkpoint at all, or only a partial one, is a clean start. Checkpoints
// that are all corrupt are an error on every rank naming each and why
// (checkpoint.on_corrupt: error, the default), and nothing is removed; with
// on_corrupt: restart, a warning naming them and a clean start.
TEST_F(CkptTest, EveryCheckpointCorruptIsAnErrorNamingEach) {
  auto fresh = run("resume", 2, {});
  expectAllOk(fresh);
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(contains(fresh.logs[i], "LOADED none")) << fresh.logs[i];

  auto r = run("faulty", 2, {"steps=2"});
  expectAllOk(r);
  flipByte(ckpt("step_1/model.pt"), 100);
  std::ofstream(ckpt("step_2/manifest.json"), std::ios::trunc) << "{}";
  auto bad = run("resume", 2, {});
  for (int i = 0; i < 2; ++i) {
    expectExit(bad, i, 2);
    EXPECT_FALSE(contains(bad.logs[i], "LOADED")) << bad.logs[i];
    EXPECT_TRUE(contains(bad.logs[i], "no intact checkpoint in " + ckpt())) << bad.logs[i];
    EXPECT_TRUE(contains(bad.logs[i], ckpt("step_2") + ": corrupt manifest " + ckpt("step_2/manifest.json")))
        << bad.logs[i];
    EXPECT_TRUE(contains(bad.logs[i], ckpt("step_1") + ": corrupt file " + ckpt("step_1/model.pt"))) << bad.logs[i];
    EXPECT_TRUE(contains(bad.logs[i], "checkpoint.on_corrupt")) << bad.logs[i];
  }
  EXPECT_TRUE(fileExists(ckpt("step_1/model.pt")));
  EXPECT_TRUE(fileExists(ckpt("step_2/model.pt")));

  auto restart = run("resume", 2, {"on_corrupt=restart"});
  expectAllOk(restart);
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(contains(restart.logs[i], "LOADED none")) << restart.logs[i];
  EXPECT_TRUE(contains(restart.logs[0], ckpt("step_1") + ": corrupt file")) << restart.logs[0];
  EXPECT_TRUE(contains(restart.logs[0], "checkpoint.on_corrupt=restart")) << restart.logs[0];

  // Only a partial checkpoint (a kill during the first save): a clean start.
  distill::PosixFileSystem().removeAll(ckpt());
  distill::PosixFileSystem().createDirs(ckpt("step_1.tmp"));
  auto partial = run("resume", 2, {});
  expectAllOk(partial);
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(contains(partial.logs[i], "LOADED none")) << partial.logs[i];
}
