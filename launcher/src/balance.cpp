#include "balance.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <sstream>

namespace distill::launcher {
namespace {

// Below this wait share the teacher keeps up; above kTeacherBound it sets the pace.
constexpr double kKeepsUp = 0.05;
constexpr double kTeacherBound = 0.15;

int percent(double share) { return static_cast<int>(std::lround(100 * share)); }

// "teacher.procs: 3, ": how many teacher processes would keep up, when the
// busy share is known. At the students' own pace a step takes (1 - wait) of
// today's, so the teachers' work per step fills teachers x busy / (1 - wait)
// teachers; kept below 90 % busy each.
std::string poolAdvice(double wait, std::optional<double> busy, int teachers) {
  if (!busy) return "more teacher processes (teacher.procs), ";
  const double need = teachers * *busy / (1 - std::min(wait, 0.99));
  const int procs = std::max(teachers + 1, static_cast<int>(std::ceil(need / 0.9)));
  std::ostringstream os;
  os << "teacher.procs: " << procs << " (their work at the students' pace is " << std::setprecision(2) << need
     << " teachers' worth), ";
  return os.str();
}

} // namespace

std::string balanceVerdict(double wait, std::optional<double> busy, std::optional<double> hits, int teachers,
                           const std::string& cacheNote) {
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
       << 1 / (1 - std::min(wait, 0.99)) << "x the throughput): " << poolAdvice(wait, busy, teachers)
       << "a smaller or faster teacher, "
       << (hits ? "more cache hits (a later epoch over the same rows)"
                : "the teacher-output cache (teacher.cache.mode: "
                  "readwrite) from the second epoch on")
       << ", or teacher.topk to shrink its answers";
  } else if (wait >= kKeepsUp) {
    os << "balanced: students waited " << percent(wait) << " % of each step" << busyText << hitText
       << "; the teacher nearly keeps up";
  } else {
    os << "student-bound: students waited " << percent(wait) << " % of each step" << busyText << hitText
       << "; the teacher keeps up" << (busy && *busy < 0.5 ? " with room for a larger teacher or more students" : "");
  }
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

std::string Balance::verdict(int teachers, const std::string& cacheNote) const {
  if (samples_ == 0) return "";
  return balanceVerdict(wait_ / samples_, busySamples_ ? std::optional<double>(busy_ / busySamples_) : std::nullopt,
                        hitSamples_ ? std::optional<double>(hits_) : std::nullopt, teachers, cacheNote);
}

} // namespace distill::launcher
