#include "support/roles.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <exception>

namespace distill::testing {
namespace {
std::map<std::string, RoleFn>& roles() {
  static std::map<std::string, RoleFn> r;
  return r;
}
constexpr const char* kRoleFlag = "--distill-role=";
} // namespace

bool registerRole(const std::string& name, RoleFn fn) {
  roles()[name] = std::move(fn);
  return true;
}

std::string selfExe() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return {};
  buf[n] = '\0';
  return buf;
}

Child spawnRole(const std::string& name, const std::vector<std::string>& args,
                const std::map<std::string, std::string>& env, const std::string& logPath) {
  std::vector<std::string> argv{selfExe(), kRoleFlag + name};
  argv.insert(argv.end(), args.begin(), args.end());
  return spawn(argv, env, logPath);
}

int runRoleIfRequested(int argc, char** argv) {
  if (argc < 2 || std::strncmp(argv[1], kRoleFlag, std::strlen(kRoleFlag)) != 0) return -1;
  std::string name = argv[1] + std::strlen(kRoleFlag);
  auto it = roles().find(name);
  if (it == roles().end()) {
    std::fprintf(stderr, "unknown test role '%s'\n", name.c_str());
    return 98;
  }
  std::vector<std::string> args(argv + 2, argv + argc);
  try {
    return it->second(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "role %s: uncaught exception: %s\n", name.c_str(), e.what());
    return 99;
  }
}

} // namespace distill::testing
