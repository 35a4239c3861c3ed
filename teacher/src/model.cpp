#include "distill/teacher/model.h"

#include <dlfcn.h>
#include <sys/stat.h>

#include <torch/script.h>

#include <cstring>
#include <mutex>

#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/core/sha256.h"
#include "distill/core/strings.h"
#include "distill/core/sys.h"

namespace distill {
namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, TeacherFactory> factories;
  std::vector<std::string> duplicates;
};
Registry& registry() {
  static Registry r;
  return r;
}

class FunctionTeacher : public TeacherModel {
 public:
  FunctionTeacher(std::function<at::Tensor(const std::vector<at::Tensor>&)> fn, std::string output)
      : fn_(std::move(fn)), output_(std::move(output)) {}
  std::map<std::string, at::Tensor> forward(const std::vector<at::Tensor>& inputs) override {
    return {{output_, fn_(inputs)}};
  }

 private:
  std::function<at::Tensor(const std::vector<at::Tensor>&)> fn_;
  std::string output_;
};

class ScriptTeacher : public TeacherModel {
 public:
  explicit ScriptTeacher(const TeacherOptions& o) : options_(o), fingerprint_(fileFingerprint(o.path)) {
    try {
      module_ = torch::jit::load(o.path, torch::Device(o.device));
    } catch (const std::exception& e) {
      DISTILL_THROW(ConfigError, "teacher.path: cannot load TorchScript file '", o.path,
                    "': ", std::string(e.what()).substr(0, 400));
    }
    module_.eval();
    DISTILL_CHECK_T(ConfigError, module_.find_method(o.method).has_value(), "teacher.method: '", o.method,
                    "' is not a method of the TorchScript module in '", o.path, "'");
  }

  std::map<std::string, at::Tensor> forward(const std::vector<at::Tensor>& inputs) override {
    std::vector<c10::IValue> args(inputs.begin(), inputs.end());
    c10::IValue out = module_.get_method(options_.method)(std::move(args));
    std::map<std::string, at::Tensor> result;
    if (out.isTensor()) {
      result[options_.output] = out.toTensor();
    } else if (out.isTuple()) {
      result[options_.output] = out.toTupleRef().elements().at(0).toTensor();
    } else if (out.isGenericDict()) {
      auto dict = out.toGenericDict();
      auto want = options_.hidden_states;
      want.push_back(options_.output);
      for (auto& name : want) {
        DISTILL_CHECK_T(ProtocolError, dict.contains(name), "teacher output has no entry '", name,
                        "' (teacher.output / teacher.hidden_states)");
        result[name] = dict.at(name).toTensor();
      }
    } else {
      DISTILL_THROW(ProtocolError, "teacher method '", options_.method, "' returned ", out.tagKind(),
                    "; expected a tensor, a tuple or a dict");
    }
    return result;
  }
  std::string fingerprint() const override { return fingerprint_; }
  std::vector<std::pair<std::string, at::Tensor>> state() const override {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const auto& p : module_.named_parameters(true)) out.emplace_back("parameter " + p.name, p.value);
    for (const auto& b : module_.named_buffers(true)) out.emplace_back("buffer " + b.name, b.value);
    return out;
  }

 private:
  TeacherOptions options_;
  std::string fingerprint_;
  torch::jit::Module module_;
};

} // namespace

std::optional<TeacherHead> TeacherModel::head(const TeacherOptions& options) const {
  const auto st = state();
  // state() names its tensors "parameter <name>" or "buffer <name>": either, or the bare name, matches.
  const auto find = [&st](const std::string& name) -> at::Tensor {
    for (const auto& [key, t] : st) {
      if (key == name || key == "parameter " + name || key == "buffer " + name) return t;
    }
    return {};
  };
  TeacherHead h;
  h.weight = find(options.head.weight);
  if (!h.weight.defined()) return std::nullopt;
  if (!options.head.bias.empty()) {
    h.bias = find(options.head.bias);
    DISTILL_CHECK_T(ConfigError, h.bias.defined(), "teacher.head.bias: the teacher model has no parameter or buffer '",
                    options.head.bias, "' (its head's weight '", options.head.weight, "' it has); name its bias, or \"\"");
  }
  h.softcap = options.head.softcap;
  h.scale = options.head.scale;
  return h;
}

std::shared_ptr<TeacherModel> teacherFromFunction(std::function<at::Tensor(const std::vector<at::Tensor>&)> fn,
                                                  std::string outputName) {
  return std::make_shared<FunctionTeacher>(std::move(fn), std::move(outputName));
}

bool registerTeacher(const std::string& name, TeacherFactory factory) {
  auto& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  if (!r.factories.emplace(name, std::move(factory)).second) r.duplicates.push_back(name);
  return true;
}

std::vector<std::string> registeredTeachers() {
  auto& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  std::vector<std::string> names;
  for (auto& kv : r.factories) names.push_back(kv.first);
  return names;
}

std::string fileFingerprint(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return path + " (missing)";
  return path + " " + std::to_string(st.st_size) + " bytes mtime " + std::to_string(st.st_mtime);
}

uint64_t teacherFingerprint(const TeacherModel& model, const std::string& head) {
  // The first 8 bytes of a SHA-256 (core/sha256.h, the digest of every identity in distill).
  Sha256 h;
  h.addString("distill-teacher-1");
  h.addString(head);
  const auto state = model.state();
  for (const auto& [name, t] : state) {
    h.addString(name);
    h.addString(c10::toString(t.scalar_type()));
    h.addInt(t.dim());
    for (int64_t d : t.sizes()) h.addInt(d);
    if (t.numel() == 0) continue;
    const at::Tensor flat = t.detach().reshape({-1});
    const at::Tensor at16 = at::linspace(0, double(flat.numel() - 1), 16, at::kDouble).to(at::kLong);
    const at::Tensor values = flat.index_select(0, at16.to(flat.device())).to(at::kDouble).cpu().contiguous();
    h.add(values.data_ptr(), values.nbytes());
  }
  if (state.empty()) {
    if (model.fingerprint().empty() && head.empty()) return 0; // nothing to tell this teacher by: not stated
    h.addString(model.fingerprint());
  }
  const Sha256::Digest digest = h.finish();
  uint64_t out = 0;
  std::memcpy(&out, digest.data(), sizeof out);
  return out == 0 ? 1 : out;
}

std::shared_ptr<TeacherModel> loadTeacherModel(const TeacherOptions& o) {
  if (o.kind == TeacherKind::kTorchscript) {
    // Only a regular file: torch::jit::load on a FIFO blocks until a writer comes.
    const std::string problem = regularFileProblem(o.path);
    DISTILL_CHECK_T(ConfigError, problem.empty(), "teacher.path: '", o.path, "': ", problem);
    return std::make_shared<ScriptTeacher>(o);
  }
  if (o.kind == TeacherKind::kRegistered) {
    // RTLD_GLOBAL: the library's static initialisers register into our registry.
    void* handle = ::dlopen(o.library.c_str(), RTLD_NOW | RTLD_GLOBAL);
    DISTILL_CHECK_T(ConfigError, handle != nullptr, "teacher.library: cannot load '", o.library, "': ", ::dlerror());
    TeacherFactory factory;
    {
      auto& r = registry();
      std::lock_guard<std::mutex> g(r.mu);
      for (auto& d : r.duplicates) {
        DISTILL_CHECK_T(ConfigError, d != o.module, "teacher.module: '", o.module, "' is registered more than once");
      }
      auto it = r.factories.find(o.module);
      if (it != r.factories.end()) factory = it->second;
    }
    DISTILL_CHECK_T(
        ConfigError, factory != nullptr, "teacher.module: no teacher registered as '", o.module, "' in '", o.library,
        "'; registered: ", (registeredTeachers().empty() ? std::string("(none)") : join(registeredTeachers())));
    if (!o.weights.empty()) {
      const std::string problem = regularFileProblem(o.weights);
      DISTILL_CHECK_T(ConfigError, problem.empty(), "teacher.weights: '", o.weights, "': ", problem);
    }
    return factory(o);
  }
  DISTILL_THROW(ConfigError, "teacher.kind: '", o.kind,
                "' has no model file to load; with kind self the trainer calls distill::serve()");
}

} // namespace distill
