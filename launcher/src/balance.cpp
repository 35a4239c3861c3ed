#include "balance.h"

#include <dirent.h>
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <sstream>
#include <thread>
#include <vector>

namespace distill::launcher {
namespace {

// Below this wait share the teacher keeps up; above kTeacherBound it sets the pace.
constexpr double kKeepsUp = 0.05;
constexpr double kTeacherBound = 0.15;

int percent(double share) { return static_cast<int>(std::lround(100 * share)); }

// "the node's 2 cores already run 2 students and 1 teacher": what fills the node.
std::string nodeText(const NodeShape& n) {
  std::ostringstream os;
  if (n.teacherOnGpu) {
    os << "the node's " << n.gpus << " GPU" << (n.gpus == 1 ? "" : "s") << " already hold " << n.teachers
       << " teacher" << (n.teachers == 1 ? "" : "s");
    return os.str();
  }
  os << "the node's " << n.cores << " core" << (n.cores == 1 ? "" : "s") << " already run " << n.students
     << " student" << (n.students == 1 ? "" : "s") << " and " << n.teachers << " teacher"
     << (n.teachers == 1 ? "" : "s");
  if (n.teacherThreads > 1) os << " of " << n.teacherThreads << " threads";
  return os.str();
}

// "teacher.procs: 3, ": how many teacher processes would keep up, when the
// busy share is known. At the students' own pace a step takes (1 - wait) of
// today's, so the teachers' work per step fills teachers x busy / (1 - wait)
// teachers; kept below 90 % busy each. Never more than the node holds: when
// it holds no more, it says so (more would share the same cores or GPUs).
std::string poolAdvice(double wait, std::optional<double> busy, const NodeShape& node) {
  const int teachers = node.teachers, room = teacherRoom(node);
  if (room >= 0 && room <= teachers) {
    return "more teacher processes cannot help here (" + nodeText(node) +
        ": another would share them and slow every process down); what can: ";
  }
  std::ostringstream os;
  if (!busy) {
    os << "more teacher processes (teacher.procs";
    if (room >= 0) os << ", up to " << room << " on this node";
    os << "), ";
    return os.str();
  }
  const double need = teachers * *busy / (1 - std::min(wait, 0.99));
  const int procs = std::max(teachers + 1, static_cast<int>(std::ceil(need / 0.9)));
  os << "teacher.procs: " << (room >= 0 ? std::min(procs, room) : procs) << " (their work at the students' pace is "
     << std::setprecision(2) << need << " teachers' worth";
  if (room >= 0 && procs > room && node.teacherOnGpu) {
    os << "; " << procs << " would, but the node has " << node.gpus << " GPU(s), one teacher each";
  } else if (room >= 0 && procs > room) {
    os << "; " << procs << " would, but the node's " << node.cores << " cores hold " << room << " next to its "
       << node.students << " students";
  }
  os << "), ";
  return os.str();
}

// "a smaller or faster teacher, the teacher-output cache (...), or
// teacher.topk to shrink its answers": what else helps a teacher-bound job,
// each only where the config does not already do it.
std::string remedies(bool hits, const NodeShape& node) {
  std::vector<std::string> r = {"a smaller or faster teacher"};
  if (hits || node.cacheOn) {
    r.push_back("more cache hits (a later epoch over the same rows)");
  } else {
    r.push_back("the teacher-output cache (teacher.cache.mode: readwrite) from the second epoch on");
  }
  if (node.topk <= 0) r.push_back("teacher.topk to shrink its answers");
  std::string out;
  for (size_t i = 0; i < r.size(); ++i) out += (i == 0 ? "" : i + 1 == r.size() ? ", or " : ", ") + r[i];
  return out;
}

// More teachers than the node holds: fewer may be faster.
std::string crowdedText(const NodeShape& node) {
  const int room = teacherRoom(node);
  if (room < 0 || node.teachers <= std::max(room, 1)) return "";
  return "; teacher.procs: " + std::to_string(node.teachers) + " is more than the node holds (" + nodeText(node) +
      "): fewer teachers (teacher.procs: " + std::to_string(std::max(room, 1)) + ") may be faster";
}

// Visible GPUs: CUDA_VISIBLE_DEVICES when set (its entries up to the first
// invalid one, as CUDA reads it), else the /dev/nvidiaN devices.
int visibleGpus() {
  if (const char* v = std::getenv("CUDA_VISIBLE_DEVICES")) {
    int n = 0;
    for (std::istringstream is(v); !is.eof();) {
      std::string item;
      std::getline(is, item, ',');
      if (item.empty() || item[0] == '-') break;
      ++n;
    }
    return n;
  }
  int n = 0;
  if (DIR* d = ::opendir("/dev")) {
    while (dirent* e = ::readdir(d)) {
      const char* name = e->d_name;
      if (std::strncmp(name, "nvidia", 6) == 0 && name[6] != '\0' &&
          std::strspn(name + 6, "0123456789") == std::strlen(name + 6))
        ++n;
    }
    ::closedir(d);
  }
  return n;
}

} // namespace

NodeShape nodeShape(const Config& cfg) {
  NodeShape n;
  n.teachers = cfg.teacher.procs;
  n.students = cfg.run.nproc_per_node - cfg.teacher.procs;
  n.teacherThreads = cfg.teacher.threads;
  cpu_set_t set;
  CPU_ZERO(&set);
  n.cores = ::sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set)
                                                          : static_cast<int>(std::thread::hardware_concurrency());
  for (int t = 0; t < cfg.teacher.procs; ++t) n.teacherOnGpu |= parseDevice(teacherDevice(cfg.teacher, t)).cuda;
  n.gpus = visibleGpus();
  n.topk = cfg.teacher.topk;
  n.cacheOn = cfg.teacher.cache.mode != CacheMode::kOff;
  return n;
}

int teacherRoom(const NodeShape& node) {
  if (node.teacherOnGpu) return node.gpus > 0 ? node.gpus : -1;
  if (node.cores <= 0) return -1;
  return std::max(0, (node.cores - node.students) / std::max(1, node.teacherThreads));
}

std::string balanceVerdict(double wait, std::optional<double> busy, std::optional<double> hits, int teachers,
                           const std::string& cacheNote) {
  NodeShape node;
  node.teachers = teachers;
  return balanceVerdict(wait, busy, hits, node, cacheNote);
}

std::string balanceVerdict(double wait, std::optional<double> busy, std::optional<double> hits,
                           const NodeShape& node, const std::string& cacheNote) {
  const int teachers = node.teachers;
  std::ostringstream os;
  const std::string who = teachers > 1 ? "the " + std::to_string(teachers) + " teachers " : "the teacher ";
  const std::string busyText = busy ? ", " + who + std::to_string(percent(*busy)) + " % busy" : "";
  const std::string hitText =
      (hits ? ", " + std::to_string(percent(*hits)) + " % of its rows answered from its cache" : "") +
      (cacheNote.empty() ? "" : ", " + cacheNote);
  if (wait >= kTeacherBound) {
    // Were the wait gone, a step would take (1 - wait) of its time.
    os << "teacher-bound: students waited " << percent(wait) << " % of each step" << busyText << hitText
       << "; a teacher that kept up would make each step " << percent(wait) << " % shorter (" << std::setprecision(3)
       << 1 / (1 - std::min(wait, 0.99)) << "x the throughput): " << poolAdvice(wait, busy, node)
       << remedies(hits.has_value(), node);
  } else if (wait >= kKeepsUp) {
    os << "balanced: students waited " << percent(wait) << " % of each step" << busyText << hitText
       << "; the teacher nearly keeps up";
  } else {
    os << "student-bound: students waited " << percent(wait) << " % of each step" << busyText << hitText
       << "; the teacher keeps up" << (busy && *busy < 0.5 ? " with room for a larger teacher or more students" : "");
  }
  os << crowdedText(node);
  return os.str();
}

void Balance::sample(const std::vector<Rank>& ranks, std::optional<double> busy, std::optional<double> hits) {
  double wait = 0;
  int n = 0;
  for (auto& r : ranks) {
    if (r.published && !std::isnan(r.published->teacher_wait_share)) wait += r.published->teacher_wait_share, ++n;
  }
  if (n == 0) return;
  wait_ += wait / n, ++samples_;
  if (busy) busy_ += *busy, ++busySamples_;
  if (hits) hits_ = *hits, hitSamples_ = 1; // a share since the job began: the last is the job's
}

std::string Balance::verdict(const NodeShape& node, const std::string& cacheNote) const {
  if (samples_ == 0) return "";
  return balanceVerdict(wait_ / samples_, busySamples_ ? std::optional<double>(busy_ / busySamples_) : std::nullopt,
                        hitSamples_ ? std::optional<double>(hits_) : std::nullopt, node, cacheNote);
}

std::string Balance::verdict(int teachers, const std::string& cacheNote) const {
  NodeShape node;
  node.teachers = teachers;
  return verdict(node, cacheNote);
}

} // namespace distill::launcher
