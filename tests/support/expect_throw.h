#pragma once

// The message of the distill::Error of type E that f() throws; a test failure
// (and "") when it throws another type or nothing.

#include <gtest/gtest.h>

#include <exception>
#include <string>

namespace distill::testing {

template <typename E, typename F>
std::string expectThrow(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.message();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
    return {};
  }
  ADD_FAILURE() << "no exception";
  return {};
}

} // namespace distill::testing
