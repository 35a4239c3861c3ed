#pragma once

// One step of a student against a doubling teacher (the launcher tests'
// teacher answers 2 x its input): `acc` requests submitted at once, each
// unique to (rank, step, acc), then every answer checked against its own
// request. A lost answer hangs into the deadline, a duplicate or reordered one
// breaks the Client's tag check, a wrong one is a distill::Error here.

#include <torch/torch.h>

#include <memory>
#include <utility>
#include <vector>

#include "distill/distill.h"

namespace distill::testing {

// The launcher tests' teacher: 2 x its first input, as float.
inline std::shared_ptr<TeacherModel> doublerTeacher() {
  return teacherFromFunction([](const std::vector<at::Tensor>& in) { return in.at(0).to(torch::kFloat) * 2; });
}

// Returns the number of answers checked (`acc`).
inline int doublerStep(Client& client, int rank, int64_t step, int64_t acc) {
  std::vector<std::pair<Handle, at::Tensor>> sent;
  for (int64_t a = 0; a < acc; ++a) {
    auto x = torch::arange(4, torch::kLong) + 1000 * rank + 10 * step + a; // unique per request
    sent.emplace_back(client.submit(x, step, a), x);
  }
  int answers = 0;
  for (auto& [h, x] : sent) {
    auto y = client.get(h).tensor(protocol::kLogits);
    DISTILL_CHECK(torch::equal(y, x.to(torch::kFloat) * 2), "wrong answer at step ", step);
    ++answers;
  }
  return answers;
}

} // namespace distill::testing
