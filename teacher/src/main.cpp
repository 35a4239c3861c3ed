// distill-teacher: the built-in teacher server (teacher.kind torchscript or registered).
#include "distill/teacher/teacher_main.h"

int main(int argc, char** argv) { return distill::teacherMain(argc, argv); }
