#include <distill/distill.h>

#include <cstdio>
#include <string>

int main(int argc, char** argv) {
  // consumer_test.sh, under torchrun: the process in the teacher's slot becomes the
  // distill-teacher of the install this program links (a student waits for it).
  if (argc > 1 && std::string(argv[1]) == "--trainer") {
    distill::Session s = distill::init(argc, argv);
    std::printf("student of distill %s\n", distill::version());
    s.client->finish();
    return 0;
  }
  distill::Config c;
  distill::Topology t = distill::Topology::fromEnv(
      {{"RANK", "1"}, {"WORLD_SIZE", "3"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "3"}, {"MASTER_PORT", "29500"}});
  std::printf("distill %s (library %s) cuda=%d student_rank=%d keys=%zu temperature=%g\n", DISTILL_VERSION,
              distill::version(), DISTILL_CUDA, t.studentRank, distill::configKeys().size(), c.loss.temperature);
  return t.studentRank == 1 ? 0 : 1;
}
