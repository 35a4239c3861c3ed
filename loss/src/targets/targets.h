#pragma once

// One reader per answer kind (core/answer_kinds.h): it checks a TeacherOutput's
// tensors of its kind (shapes, dtypes, devices) against the student's shape
// and puts them into the Problem (loss_problem.h); its data checks join the
// call's, evaluated with one device sync. prepare() (loss_inputs.cpp) picks
// the reader by the answer's type (std::visit). A new kind is one more
// overload here and its file beside logits.cpp and topk.cpp (ids.cpp, sampled.cpp).
//
// Internal to loss/src. Not thread-safe beyond what a Problem is (one call's).

#include <ATen/ATen.h>

#include <functional>
#include <vector>

#include "../loss_problem.h"

namespace distill::loss_impl {

// A per-row data check, evaluated with all the others in one device sync.
struct DataCheck {
  at::Tensor ok; // 0-dim bool
  std::function<void()> fail; // throws the error (may look at the data again)
};

// What a reader may use and change of the call being prepared.
struct ReadState {
  const LossOptions& options;
  const at::Tensor& keep; // [N] bool: labels not ignored
  std::vector<DataCheck>& checks;
  bool truncate = false; // loss.vocab truncate applies (the teacher's vocabulary is larger)
  bool cpuFused = false; // the CPU kernel computes the chunks (a reader may turn it off)
};

// The vocabulary width the answer itself shows (-1: it shows none); teacherVocab checks it.
int64_t answerWidth(const LogitsAnswer& a);
int64_t answerWidth(const TopkAnswer& a);
int64_t answerWidth(const HiddenAnswer& a); // its head's rows

void readTarget(Problem& pb, const LogitsAnswer& a, const StudentShape& z, ReadState& s); // targets/logits.cpp
void readTarget(Problem& pb, const TopkAnswer& a, const StudentShape& z, ReadState& s); // targets/topk.cpp
void readTarget(Problem& pb, const HiddenAnswer& a, const StudentShape& z, ReadState& s); // targets/hidden.cpp
int64_t answerWidth(const IdsAnswer& a);
int64_t answerWidth(const SampledAnswer& a);

void readTarget(Problem& pb, const LogitsAnswer& a, const StudentShape& z, ReadState& s); // targets/logits.cpp
void readTarget(Problem& pb, const TopkAnswer& a, const StudentShape& z, ReadState& s); // targets/topk.cpp
void readTarget(Problem& pb, const IdsAnswer& a, const StudentShape& z, ReadState& s); // targets/ids.cpp
void readTarget(Problem& pb, const SampledAnswer& a, const StudentShape& z, ReadState& s); // targets/sampled.cpp

// Shared by the readers (loss_inputs.cpp).
double epsOf(at::ScalarType t); // machine epsilon of a floating dtype (the teacher data's rounding)
void checkDevice(const char* what, const at::Tensor& t, const StudentShape& z);
inline bool nkShape(const Problem& pb, const at::Tensor& t, int64_t k) {
  return t.defined() && t.dim() >= 1 && t.size(-1) == k && t.numel() == pb.n * k;
}

} // namespace distill::loss_impl
