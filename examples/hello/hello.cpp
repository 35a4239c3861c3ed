// distill-hello: the smallest real distill job, and the README's main job until
// the demo exists. Each student hands the teacher a tensor through its ring,
// checks the answer (the teacher doubles it), and all-reduces a checksum over
// the student group; the teacher (teacher.kind self: this same binary) serves
// and joins nothing.
//
//   distill-run --config configs/hello.yaml -- build/bin/distill-hello
#include <distill/distill.h>
#include <torch/torch.h>

int main(int argc, char** argv) {
  try {
    distill::Session s = distill::init(argc, argv);
    if (s.isTeacher()) {
      auto doubler = distill::teacherFromFunction(
          [](const std::vector<at::Tensor>& in) { return in.at(0).to(torch::kFloat) * 2; });
      auto stats = distill::serve(*s.teacher, doubler);
      DISTILL_LOG(kInfo) << "served " << stats.requests << " requests";
      return 0;
    }
    auto& group = s.student->group();
    const int64_t steps = s.config.run.steps > 0 ? s.config.run.steps : 5;
    for (int64_t step = 0; step < steps; ++step) {
      for (int acc = 0; acc < s.config.student.grad_acc_steps; ++acc) {
        auto x = torch::arange(8, torch::kLong).view({2, 4}) + 100 * group.rank() + step;
        auto reply = s.client->get(s.client->submit(x, step, acc));
        auto y = reply.tensor(distill::protocol::kLogits);
        DISTILL_CHECK(torch::equal(y, x.to(torch::kFloat) * 2), "the teacher's answer is wrong");
      }
      auto sum = torch::full({1}, static_cast<double>(group.rank() + 1));
      group.allReduce(sum, distill::ReduceOp::kSum, "hello all_reduce");
      DISTILL_LOG(kInfo) << "step " << step << ": teacher answered " << s.config.student.grad_acc_steps
                         << " micro-batch(es); all_reduce over " << group.size()
                         << " students = " << sum.item<double>();
    }
    group.barrier("hello done");
    s.client->finish();
    DISTILL_LOG(kInfo) << "hello done";
    return 0;
  } catch (const std::exception& e) {
    DISTILL_LOG(kError) << e.what();
    return 1;
  }
}
