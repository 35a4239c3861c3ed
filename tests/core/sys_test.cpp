// core/sys.h: the EINTR retry, the fd owner and mkdir -p, on real system calls.

#include "distill/core/sys.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <thread>

namespace distill {
namespace {

bool isOpen(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

std::string tempDir() {
  char tmpl[] = "/tmp/distill_sys_XXXXXX";
  EXPECT_NE(::mkdtemp(tmpl), nullptr);
  return tmpl;
}

bool isDir(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::atomic<int> gHandled{0};
void onUsr2(int) { gHandled.fetch_add(1); }

// A read(2) interrupted by a signal (handler without SA_RESTART: the kernel
// returns EINTR) is retried and still gets the bytes written after it.
TEST(Sys, RetryEintrRetriesAnInterruptedRead) {
  struct sigaction sa {};
  sa.sa_handler = onUsr2; // no SA_RESTART
  struct sigaction old {};
  ASSERT_EQ(::sigaction(SIGUSR2, &sa, &old), 0);
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  Fd rd(p[0]), wr(p[1]);
  const pthread_t reader = ::pthread_self();
  std::atomic<int> calls{0};
  std::thread t([&] {
    // Interrupt the reader until a read returned EINTR and was called again
    // (a signal that lands before the read begins interrupts nothing).
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (calls.load() < 2 && std::chrono::steady_clock::now() < deadline) {
      ::pthread_kill(reader, SIGUSR2);
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    char c = 'x';
    ASSERT_EQ(::write(wr.get(), &c, 1), 1);
  });
  char c = 0;
  const ssize_t n = retryEintr([&] {
    ++calls;
    return ::read(rd.get(), &c, 1);
  });
  t.join();
  ::sigaction(SIGUSR2, &old, nullptr);
  EXPECT_EQ(n, 1);
  EXPECT_EQ(c, 'x');
  EXPECT_GE(gHandled.load(), 1);
  EXPECT_GE(calls.load(), 2) << "no read was interrupted within 20 s";
}

TEST(Sys, RetryEintrReturnsOtherErrors) {
  errno = 0;
  EXPECT_EQ(retryEintr([] { return ::close(-1); }), -1);
  EXPECT_EQ(errno, EBADF);
}

TEST(Sys, FdClosesOnDestructionAndMoves) {
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  {
    Fd a(p[0]);
    Fd b(std::move(a));
    EXPECT_FALSE(a.valid());
    EXPECT_EQ(b.get(), p[0]);
    Fd c;
    c = std::move(b);
    EXPECT_EQ(c.get(), p[0]);
    EXPECT_TRUE(isOpen(p[0]));
  }
  EXPECT_FALSE(isOpen(p[0]));
  Fd w(p[1]);
  EXPECT_EQ(w.release(), p[1]);
  EXPECT_TRUE(isOpen(p[1])); // released: not closed
  w.reset(p[1]);
  EXPECT_EQ(w.close(), 0);
  EXPECT_FALSE(isOpen(p[1]));
  EXPECT_EQ(w.close(), 0); // nothing owned: nothing to close
}

TEST(Sys, MakeDirsCreatesEveryLevel) {
  const std::string root = tempDir();
  EXPECT_EQ(makeDirs(root + "/a/b//c/"), 0);
  EXPECT_TRUE(isDir(root + "/a/b/c"));
  EXPECT_EQ(makeDirs(root + "/a/b/c"), 0); // existing: fine
  ::system(("rm -rf " + root).c_str());
}

TEST(Sys, MakeDirsNamesTheDirectoryItCouldNotMake) {
  const std::string root = tempDir();
  const std::string file = root + "/file";
  ::close(::open(file.c_str(), O_CREAT | O_WRONLY, 0644));
  std::string at;
  EXPECT_EQ(makeDirs(file + "/sub", &at), ENOTDIR);
  EXPECT_EQ(at, file);
  // The hook sees each directory and can fail one (checkpoint fault injection).
  std::vector<std::string> seen;
  EXPECT_EQ(makeDirs(root + "/x/y", &at,
                     [&](const std::string& d) {
                       seen.push_back(d);
                       return d == root + "/x/y" ? EACCES : 0;
                     }),
            EACCES);
  EXPECT_EQ(at, root + "/x/y");
  EXPECT_TRUE(isDir(root + "/x"));
  EXPECT_FALSE(isDir(root + "/x/y"));
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen.back(), root + "/x/y");
  ::system(("rm -rf " + root).c_str());
}

} // namespace
} // namespace distill
