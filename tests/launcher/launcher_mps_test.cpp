// transport.cuda_mps: on (launcher/src/mps.h, docs/gpu.md): distill-run runs an MPS server of its own
// for the node's ranks. No GPU is needed: a stand-in for nvidia-cuda-mps-control, first on PATH,
// records each call (its arguments, its CUDA_MPS_PIPE_DIRECTORY, what it read), so the tests see
// what distill-run asked of the real one and when. Part of launcher_test.
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "launch.h"
#include "support/process.h"

using namespace distill::testing;

namespace {

using LauncherMps = LauncherFixture;

// A stand-in control program in `bin`: `-d` succeeds when the pipe folder exists (or prints
// FAKE_MPS_FAIL and exits 1); without arguments it reads one command from stdin.
void writeControl(const std::string& bin) {
  ASSERT_EQ(::mkdir(bin.c_str(), 0700), 0);
  const std::string path = bin + "/nvidia-cuda-mps-control";
  {
    std::ofstream f(path);
    f << "#!/bin/sh\n"
         "echo \"args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY\" >> \"$FAKE_MPS_CALLS\"\n"
         "if [ \"$1\" = -d ]; then\n"
         "  [ -n \"$FAKE_MPS_FAIL\" ] && { echo \"$FAKE_MPS_FAIL\"; exit 1; }\n"
         "  [ -d \"$CUDA_MPS_PIPE_DIRECTORY\" ] && exit 0\n"
         "  echo no pipe folder; exit 1\n"
         "fi\n"
         "read cmd; echo \"stdin=$cmd\" >> \"$FAKE_MPS_CALLS\"\n";
  }
  ASSERT_EQ(::chmod(path.c_str(), 0755), 0);
}

std::vector<std::string> linesOf(const std::string& file) {
  std::ifstream in(file);
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// Every rank (the teacher too: teacher.kind self) prints the pipe folder it inherited, then runs
// distill-hello.
std::vector<std::string> helloArgs(const std::string& logs) {
  return {"--config", sourcePath("configs/hello.yaml"), "--log-dir", logs, "--master-port", std::to_string(freePort()),
          "--set", "transport.cuda_mps=on", "--", "/bin/sh", "-c",
          "echo \"mps pipe: $CUDA_MPS_PIPE_DIRECTORY\"; exec \"$0\" \"$@\"", binPath("distill-hello")};
}

TEST_F(LauncherMps, OnStartsAServerBeforeTheRanksAndQuitsItAfterThem) {
  const std::string bin = dir_ + "/bin", calls = dir_ + "/calls";
  writeControl(bin);
  Launch l(helloArgs(dir_ + "/logs"), false, {},
           {{"PATH", bin + ":" + std::getenv("PATH")}, {"FAKE_MPS_CALLS", calls}});
  const auto st = l.finish();
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << l.text();
  const auto c = linesOf(calls);
  ASSERT_EQ(c.size(), 3u) << l.text();
  std::smatch m;
  ASSERT_TRUE(std::regex_match(c[0], m, std::regex("args=-d pipe=(/tmp/distill-mps-[0-9a-f]+/pipe)"))) << c[0];
  const std::string pipe = m[1];
  EXPECT_EQ(c[1], "args= pipe=" + pipe); // the quit: the same server
  EXPECT_EQ(c[2], "stdin=quit");
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(has(log(r), "mps pipe: " + pipe)) << "rank " << r << ": " << log(r);
  EXPECT_TRUE(has(l.text(), "transport.cuda_mps: the MPS server stopped")) << l.text();
  struct stat sb {};
  EXPECT_NE(::stat(pipe.substr(0, pipe.size() - 5).c_str(), &sb), 0) << "the server's folder is left: " << pipe;
}

TEST_F(LauncherMps, NoControlProgramOrAFailedStartStopsTheJobBeforeAnyRank) {
  const std::string empty = dir_ + "/empty";
  ASSERT_EQ(::mkdir(empty.c_str(), 0700), 0);
  Launch none(helloArgs(dir_ + "/logs1"), false, {}, {{"PATH", empty}});
  auto st = none.finish();
  EXPECT_TRUE(st.exited && st.code == 2) << st.describe() << "\n" << none.text();
  EXPECT_TRUE(has(none.text(), "transport.cuda_mps: on needs nvidia-cuda-mps-control (the NVIDIA driver's MPS "
                               "control program) on PATH"))
      << none.text();
  EXPECT_FALSE(has(none.text(), "[n0 r0 student]")) << none.text();

  const std::string bin = dir_ + "/bin", calls = dir_ + "/calls";
  writeControl(bin);
  Launch failed(helloArgs(dir_ + "/logs2"), false, {},
                {{"PATH", bin + ":" + std::getenv("PATH")}, {"FAKE_MPS_CALLS", calls},
                 {"FAKE_MPS_FAIL", "An instance of this daemon is already running"}});
  st = failed.finish();
  EXPECT_TRUE(st.exited && st.code == 2) << st.describe() << "\n" << failed.text();
  EXPECT_TRUE(has(failed.text(), " -d` exited 1: An instance of this daemon is already running (set "
                                 "transport.cuda_mps: off to run without MPS)"))
      << failed.text();
  EXPECT_FALSE(has(failed.text(), "[n0 r0 student]")) << failed.text();
  EXPECT_EQ(linesOf(calls).size(), 1u); // no quit: no server was started
}

} // namespace
