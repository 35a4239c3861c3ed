#include <distill/distill.h>

#include <cstdio>

int main() {
  distill::Config c;
  distill::Topology t = distill::Topology::fromEnv(
      {{"RANK", "1"}, {"WORLD_SIZE", "3"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "3"}, {"MASTER_PORT", "29500"}});
  std::printf("distill %s cuda=%d student_rank=%d keys=%zu temperature=%g\n", DISTILL_VERSION, DISTILL_CUDA,
              t.studentRank, distill::configKeys().size(), c.loss.temperature);
  return t.studentRank == 1 ? 0 : 1;
}
