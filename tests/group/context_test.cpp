// The teacher cannot reach a collective: checked by the compiler.
#include <gtest/gtest.h>

#include <type_traits>

#include "distill/core/context.h"
#include "distill/group/student_context.h"
#include "distill/core/errors.h"
#include "distill/group/student_group.h"

namespace {

template <typename T, typename = void>
struct HasGroup : std::false_type {};
template <typename T>
struct HasGroup<T, std::void_t<decltype(std::declval<T&>().group())>> : std::true_type {};

// Nothing but a StudentContext may construct a StudentGroup.
static_assert(!std::is_constructible_v<distill::StudentGroup, const distill::Topology&, const distill::RunOptions&,
                                       const distill::StudentOptions&>,
              "StudentGroup must not be constructible outside StudentContext");
static_assert(!std::is_copy_constructible_v<distill::StudentGroup>);
static_assert(HasGroup<distill::StudentContext>::value, "a student reaches its group");
static_assert(!HasGroup<distill::TeacherContext>::value, "the teacher must not reach a group");
static_assert(!std::is_convertible_v<distill::TeacherContext&, distill::StudentContext&>);

} // namespace

TEST(Context, TeacherContextRefusesAStudentTopology) {
  distill::Topology t;
  t.role = distill::Role::kStudent;
  EXPECT_THROW(distill::TeacherContext(t, distill::Config{}), distill::ConfigError);
}

TEST(Context, StudentContextRefusesTheTeacherTopology) {
  distill::Topology t;
  t.role = distill::Role::kTeacher;
  EXPECT_THROW(distill::StudentContext(t, distill::Config{}), distill::ConfigError);
}

TEST(Context, TeacherContextJoinsNothing) {
  distill::Topology t;
  t.role = distill::Role::kTeacher;
  t.localRank = 1;
  t.localWorldSize = 2;
  // No MASTER_PORT, no store, no peers: constructing it must not block or throw.
  distill::TeacherContext ctx(t, distill::Config{});
  EXPECT_TRUE(ctx.topology().isTeacher());
}
