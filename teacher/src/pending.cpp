#include "pending.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "distill/core/logging.h"
#include "distill/core/strings.h"
#include "distill/core/tag.h"
#include "answer/answer.h"

namespace distill {

std::string exceptionLine(const std::string& text) {
  std::string line = text.substr(0, text.find('\n'));
  if (line.find("failed in the TorchScript interpreter") != std::string::npos) {
    const std::string trimmed = text.substr(0, text.find_last_not_of("\n ") + 1);
    line = trimmed.substr(trimmed.rfind('\n') + 1); // npos + 1 == 0: a single line
  }
  if (line.rfind("builtins.", 0) == 0) line = line.substr(9); // TorchScript's "builtins.RuntimeError: ..."
  return withoutSourceLocations(line);
}

void giveUpIfRepeated(std::vector<Pending>& batch, const std::string& what, int teacher, const ipc::Segment& segment) {
  std::vector<int> noted; // students whose oldest request of the batch is noted
  const Pending* repeated = nullptr;
  for (auto& p : batch) {
    if (!p.msg.held() || std::find(noted.begin(), noted.end(), p.student) != noted.end()) continue;
    noted.push_back(p.student);
    if (p.msg.markFailed() && !repeated) repeated = &p;
  }
  if (!repeated) return;
  const Tag& tag = repeated->msg.tag();
  const std::string why = "teacher " + std::to_string(teacher) + " failed again on the request an earlier " +
      "incarnation failed on, so it is not restarted: the request (step " + std::to_string(tag.step) +
      ", acc_step " + std::to_string(tag.accStep) + ", seq " + std::to_string(tag.seq) + ") of student rank " +
      std::to_string(repeated->msg.senderRank()) + " (local " + std::to_string(repeated->student) +
      "): " + exceptionLine(what);
  DISTILL_LOG(kError) << why;
  segment.noteTeacherGaveUp(teacher, why);
}

at::Tensor sampleKeys(const std::vector<Pending>& batch, int64_t seed) {
  std::vector<int64_t> keys;
  for (const Pending& p : batch) {
    for (int64_t r = 0; r < p.inputs[0].size(0); ++r) {
      keys.push_back(static_cast<int64_t>(sampleKey(seed, p.student, p.msg.tag(), r)));
    }
  }
  return at::tensor(keys, at::kLong);
}

at::Tensor sampleKeys(const std::vector<Pending>& batch, int64_t seed,
                      const std::vector<std::pair<size_t, int64_t>>& rows, const at::Tensor& positions) {
  std::vector<int64_t> keys;
  for (const auto& [request, row] : rows) {
    const Pending& p = batch.at(request);
    keys.push_back(static_cast<int64_t>(sampleKey(seed, p.student, p.msg.tag(), row)));
  }
  if (!positions.defined() || rows.empty()) return at::tensor(keys, at::kLong);
  // Prefix keys: one key per position asked for (flat index row * T + t into `rows`).
  const int64_t seq = batch.at(rows[0].first).inputs.at(0).size(1);
  const at::Tensor flat = positions.to(at::kLong).cpu().contiguous();
  std::vector<int64_t> out;
  for (int64_t i = 0; i < flat.numel(); ++i) {
    const int64_t index = flat.data_ptr<int64_t>()[i];
    const auto rowKey = static_cast<uint64_t>(keys.at(size_t(index / seq)));
    out.push_back(static_cast<int64_t>(positionSampleKey(rowKey, index % seq)));
  }
  return at::tensor(out, at::kLong);
}

} // namespace distill
