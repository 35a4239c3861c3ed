// main() of every test binary: a child role when asked for one, else the tests.
#include <gtest/gtest.h>

#include "support/roles.h"

int main(int argc, char** argv) {
  int rc = distill::testing::runRoleIfRequested(argc, argv);
  if (rc >= 0) return rc;
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
