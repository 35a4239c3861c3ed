// distill.init() and the session: who this process is and the job's config.
#include "session.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <map>
#include <vector>

#include "distill/core/config.h"
#include "distill/core/errors.h"
#include "distill/group/student_group.h"

namespace distill::py {

Client& PySession::client() const {
  DISTILL_CHECK_T(UsageError, session.client, "this process is the teacher: it has no client (session.is_teacher)");
  return *session.client;
}

StudentContext& PySession::student() const {
  DISTILL_CHECK_T(UsageError, session.student, "this process is the teacher: it is in no student group");
  return *session.student;
}

namespace {

SessionPtr initSession(const std::vector<std::string>& args, std::optional<std::vector<std::string>> trainerKeys) {
  std::vector<std::string> owned = args; // init() rearranges argv: keep the strings alive here
  std::vector<char*> argv;
  for (auto& a : owned) argv.push_back(a.data());
  argv.push_back(nullptr);
  int argc = static_cast<int>(owned.size());
  InitOptions options;
  options.trainerKeys = std::move(trainerKeys);
  auto s = std::make_shared<PySession>();
  s->session = init(argc, argv.data(), options);
  for (int i = 0; i < argc; ++i) s->argv.emplace_back(argv[static_cast<size_t>(i)]);
  return s;
}

// A config value as plain text: strings without their YAML quotes and escapes
// (configEntries' canonical form), so a path reads as the path.
std::string plainValue(const std::string& v) {
  if (v.size() < 2 || v.front() != '"' || v.back() != '"') return v;
  std::string out;
  for (size_t i = 1; i + 1 < v.size(); ++i) {
    if (v[i] != '\\' || i + 2 >= v.size()) {
      out += v[i];
      continue;
    }
    const char e = v[++i];
    if (e == 'n') {
      out += '\n';
    } else if (e == 't') {
      out += '\t';
    } else if (e == 'x' && i + 2 < v.size()) {
      out += static_cast<char>(std::stoi(v.substr(i + 1, 2), nullptr, 16));
      i += 2;
    } else {
      out += e; // \" and \\ .
    }
  }
  return out;
}

pyb::dict configDict(const Config& c) {
  pyb::dict d;
  for (const auto& e : configEntries(c)) d[pyb::str(e.key)] = plainValue(e.value);
  return d;
}

pyb::dict trainerDict(const Config& c) {
  pyb::dict d;
  for (const auto& [k, v] : c.trainer.values) d[pyb::str(k)] = v;
  return d;
}

// The store of torch.distributed's student world: distill's own, with its
// secret (StudentGroup::store); a torch._C._distributed_c10d.Store in Python.
c10::intrusive_ptr<c10d::Store> torchStore(PySession& s) { return s.student().group().store("torch"); }

// session.all_reduce: in place, over the students, on distill's own group. The
// collective runs on a copy made here: the gloo worker that carries it then
// never holds the last reference to a tensor Python owns. Releasing such a
// tensor takes the GIL, and a thread that takes the GIL while the interpreter
// shuts down is ended by CPython mid-destructor (std::terminate, SIGABRT): what
// torch.distributed.all_reduce of a Python tensor risks as a process's last
// collective (docs/python.md, "Ending a job").
void allReduce(PySession& s, const at::Tensor& tensor, const std::string& op) {
  static const std::map<std::string, ReduceOp> ops{{"sum", ReduceOp::kSum}, {"max", ReduceOp::kMax},
                                                    {"min", ReduceOp::kMin}};
  const auto it = ops.find(op);
  DISTILL_CHECK_T(UsageError, it != ops.end(), "session.all_reduce: op '", op, "' is none of sum, max, min");
  auto& group = s.student().group();
  // The students' tensors are compared first: gloo takes mismatched sizes for a
  // peer's failure, or aborts the process on them. One all-reduce (MAX) of a
  // descriptor and its negation gives its maximum and minimum over the students.
  constexpr int64_t kDims = 16; // sizes compared one by one; numel covers the rest
  std::vector<int64_t> d(4 + kDims, -1);
  d[0] = static_cast<int64_t>(tensor.scalar_type());
  d[1] = static_cast<int64_t>(tensor.device().type());
  d[2] = tensor.dim();
  d[3] = tensor.numel();
  for (int64_t i = 0; i < std::min(tensor.dim(), kDims); ++i) d[4 + static_cast<size_t>(i)] = tensor.size(i);
  const auto n = static_cast<int64_t>(d.size());
  const auto mine = at::tensor(d, at::kLong);
  auto both = at::cat({mine, -mine});
  group.allReduce(both, ReduceOp::kMax, "session.all_reduce (the tensors' shapes)");
  DISTILL_CHECK_T(UsageError, both.narrow(0, 0, n).equal(-both.narrow(0, n, n)),
                  "session.all_reduce: the students passed tensors of different shapes, dtypes or devices (this "
                  "student's: ",
                  tensor.scalar_type(), " ", tensor.sizes(), " on ", tensor.device().type(), ")");
  if (tensor.numel() == 0) return;
  auto copy = tensor.clone(at::MemoryFormat::Contiguous);
  group.allReduce(copy, it->second, "session.all_reduce");
  tensor.copy_(copy); // the caller's tensor, in place
}

} // namespace

void bindSession(pyb::module_& m) {
  pyb::class_<PySession, SessionPtr>(m, "Session")
      .def_property_readonly("is_teacher", [](const PySession& s) { return s.session.isTeacher(); })
      .def_property_readonly("role", [](const PySession& s) { return std::string(roleName(s.session.topology.role)); })
      .def_property_readonly("rank", [](const PySession& s) { return s.session.topology.studentRank; })
      .def_property_readonly("world_size", [](const PySession& s) { return s.session.topology.studentWorldSize; })
      .def_property_readonly("local_rank", [](const PySession& s) { return s.session.topology.studentLocalRank; })
      .def_property_readonly("local_world_size",
                             [](const PySession& s) { return s.session.topology.studentsPerNode(); })
      .def_property_readonly("node_rank", [](const PySession& s) { return s.session.topology.nodeRank; })
      .def_property_readonly("nnodes", [](const PySession& s) { return s.session.topology.nnodes; })
      .def_property_readonly("teacher_index", [](const PySession& s) { return s.session.topology.teacherIndex; })
      .def_property_readonly("torchrun", [](const PySession& s) { return s.session.topology.torchrun; })
      .def_property_readonly("master_addr", [](const PySession& s) { return s.session.topology.masterAddr; })
      .def_property_readonly("describe", [](const PySession& s) { return s.session.topology.describe(); })
      .def_property_readonly("argv", [](const PySession& s) { return s.argv; })
      .def_property_readonly("config", [](const PySession& s) { return configDict(s.session.config); })
      .def_property_readonly("config_yaml", [](const PySession& s) { return dumpConfig(s.session.config); })
      .def_property_readonly("trainer", [](const PySession& s) { return trainerDict(s.session.config); })
      .def_property_readonly("teacher_device",
                             [](const PySession& s) {
                               DISTILL_CHECK_T(UsageError, s.session.teacher, "teacher_device: not the teacher");
                               return s.session.teacher->device();
                             })
      .def("_torch_store", &torchStore, pyb::call_guard<pyb::gil_scoped_release>())
      .def("all_reduce", &allReduce, pyb::arg("tensor"), pyb::arg("op") = "sum",
           pyb::call_guard<pyb::gil_scoped_release>())
      .def(
          "barrier", [](PySession& s) { s.student().group().barrier("python barrier"); },
          pyb::call_guard<pyb::gil_scoped_release>());
  m.def("_init", &initSession, pyb::arg("argv"), pyb::arg("trainer_keys") = std::nullopt,
        pyb::call_guard<pyb::gil_scoped_release>());
}

} // namespace distill::py
