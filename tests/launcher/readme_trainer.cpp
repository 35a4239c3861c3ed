// distill-test-trainer: a trainer written the way the README shows one, for the
// launcher tests of config handling. main() catches nothing, as a new trainer
// often does: an error escaping it is what distill::init's terminate handler
// turns into "exit code 2" plus the message (instead of SIGABRT).
//
//   distill-run --config F -- distill-test-trainer MODE [--set k=v]...
//
// MODE:
//   serve    students send 2 requests each to the teacher and finish; a self
//            teacher doubles them
//   logdir   every rank prints LOG_DIR=<run.log_dir>, then as serve
//   strict   init with the trainer keys {lr, data}: a typo in the trainer
//            section ends every rank before any waits on another
//   value    student 0 reads trainer.steps as an integer after admission (a bad
//            value throws, uncaught); the others wait in a barrier
#include <distill/distill.h>
#include <torch/torch.h>

#include <cstdio>
#include <string>

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const std::string mode = argc > 1 ? argv[1] : "serve";
  distill::InitOptions checks;
  if (mode == "strict") checks = distill::InitOptions{"lr", "data"};
  distill::Session s = distill::init(argc, argv, checks);
  if (mode == "logdir") std::printf("LOG_DIR=%s\n", s.config.run.log_dir.c_str());
  if (s.isTeacher()) {
    distill::serve(*s.teacher, distill::teacherFromFunction([](const std::vector<at::Tensor>& in) {
      return in.at(0).to(torch::kFloat) * 2;
    }));
    return 0;
  }
  auto& group = s.student->group();
  if (mode == "value") {
    if (group.rank() == 0) {
      std::printf("reading trainer.steps\n");
      std::printf("steps=%lld\n", static_cast<long long>(s.config.trainer.getInt("steps")));
    }
    group.barrier("after reading trainer.steps");
  }
  for (int64_t step = 0; step < 2; ++step) {
    auto x = torch::arange(4, torch::kLong) + step;
    auto y = s.client->get(s.client->submit(x, step, 0)).tensor(distill::protocol::kLogits);
    DISTILL_CHECK(torch::equal(y, x.to(torch::kFloat) * 2), "wrong answer from the teacher");
  }
  s.client->finish();
  std::printf("trainer done\n");
  return 0;
}
