#pragma once

// Options of an experiment. Each struct is one YAML section, each field one
// key of the same name in snake_case (configs/reference.yaml documents them all,
// with these defaults). Parsing and validation live in config.cpp only.

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <type_traits>
#include <vector>

namespace distill {

// Options with a fixed set of values are enums, parsed once by config.cpp;
// modules compare enum values, never option strings. Each enum's YAML
// spellings, in the order of its values, are EnumNames<E>::names: config.cpp
// parses and writes them, toString() and operator<< print them in messages.
template <class E>
struct EnumNames;

#define DISTILL_OPTION_ENUM_NAMES(E, ...)                           \
  template <>                                                       \
  struct EnumNames<E> {                                             \
    static constexpr const char* names[] = {__VA_ARGS__};           \
    static constexpr size_t count = sizeof(names) / sizeof(*names); \
  }

enum class OnHang { kTeardown, kWait };
DISTILL_OPTION_ENUM_NAMES(OnHang, "teardown", "wait");
enum class TeacherKind { kTorchscript, kRegistered, kSelf };
DISTILL_OPTION_ENUM_NAMES(TeacherKind, "torchscript", "registered", "self");
enum class Autocast { kNone, kFloat16, kBFloat16 };
DISTILL_OPTION_ENUM_NAMES(Autocast, "none", "float16", "bfloat16");
enum class PayloadDtype { kAuto, kFloat32, kBFloat16, kFloat16 };
DISTILL_OPTION_ENUM_NAMES(PayloadDtype, "auto", "float32", "bfloat16", "float16");
enum class GroupBackend { kAuto, kGloo, kNccl };
DISTILL_OPTION_ENUM_NAMES(GroupBackend, "auto", "gloo", "nccl");
enum class CudaIpc { kAuto, kOn, kOff };
DISTILL_OPTION_ENUM_NAMES(CudaIpc, "auto", "on", "off");
enum class CudaMps { kOff, kOn };
DISTILL_OPTION_ENUM_NAMES(CudaMps, "off", "on");
enum class LossKind { kForwardKl, kReverseKl, kJsd, kSampledToken };
DISTILL_OPTION_ENUM_NAMES(LossKind, "forward_kl", "reverse_kl", "jsd", "sampled_token");
enum class OnSaveError { kStop, kContinue };
DISTILL_OPTION_ENUM_NAMES(OnSaveError, "stop", "continue");
// What the loss does when the teacher's vocabulary differs from the student's
// (loss.vocab; docs/vocab.md).
enum class LossVocab { kError, kTruncate };
DISTILL_OPTION_ENUM_NAMES(LossVocab, "error", "truncate");

// teacher.on_nonfinite: what a teacher does with an answer holding NaN or +inf
// (docs/errors.md): error answers the request with the teacher's error; mask
// answers it with those tokens marked, which then learn from their labels only.
enum class TeacherOnNonfinite { kError, kMask };
DISTILL_OPTION_ENUM_NAMES(TeacherOnNonfinite, "error", "mask");
// teacher.answer: what the teacher answers with (core/answer_kinds.h). auto: top-k when
// teacher.topk > 0, else full logits; hidden: its final hidden states, its head shared once.
enum class TeacherAnswer { kAuto, kLogits, kTopk, kHidden };
DISTILL_OPTION_ENUM_NAMES(TeacherAnswer, "auto", "logits", "topk", "hidden");
// teacher.head.on_change: what a student does when a restarted teacher publishes
// another head (student/teacher_head.h, HeadChange).
enum class HeadOnChange { kRefuse, kAdopt };
DISTILL_OPTION_ENUM_NAMES(HeadOnChange, "refuse", "adopt");
// loss.on_nonfinite: a student's loss or gradient that is not finite stops the
// job (error) or skips that step's update on every student (skip_step).
enum class LossOnNonfinite { kError, kSkipStep };
DISTILL_OPTION_ENUM_NAMES(LossOnNonfinite, "error", "skip_step");

enum class OnCorrupt { kError, kRestart };
DISTILL_OPTION_ENUM_NAMES(OnCorrupt, "error", "restart");
enum class CacheMode { kOff, kRead, kWrite, kReadWrite };
DISTILL_OPTION_ENUM_NAMES(CacheMode, "off", "read", "write", "readwrite");
// teacher.cache.keys: what one stored answer is keyed by (teacher/src/cache/keys.h).
enum class CacheKeys { kRow, kPrefix };
DISTILL_OPTION_ENUM_NAMES(CacheKeys, "row", "prefix");
// teacher.cache.dtype: how float32 logits and top-k values are stored (teacher/src/cache/records.h).
enum class CacheDtype { kFloat16, kFloat32 };
DISTILL_OPTION_ENUM_NAMES(CacheDtype, "float16", "float32");
enum class FileMode { kPrivate, kGroup };
DISTILL_OPTION_ENUM_NAMES(FileMode, "private", "group");

#undef DISTILL_OPTION_ENUM_NAMES

// The YAML spelling of an option enum's value; "(invalid)" for a value outside the enum.
template <class E, class = decltype(EnumNames<E>::names)>
const char* toString(E value) {
  const auto i = static_cast<size_t>(value);
  return i < EnumNames<E>::count ? EnumNames<E>::names[i] : "(invalid)";
}

// The value an option enum's YAML spelling names; nullopt for any other text.
template <class E, class = decltype(EnumNames<E>::names)>
std::optional<E> parseEnum(const std::string& text) {
  for (size_t i = 0; i < EnumNames<E>::count; ++i) {
    if (text == EnumNames<E>::names[i]) return static_cast<E>(i);
  }
  return std::nullopt;
}

template <class E, class = decltype(EnumNames<E>::names)>
std::ostream& operator<<(std::ostream& os, E value) {
  return os << toString(value);
}

// run.file_mode's permissions (the umask may take more away): the files that
// hold model state, teacher outputs or logs, and the folders distill makes for them.
inline unsigned fileModeBits(FileMode m) { return m == FileMode::kGroup ? 0640 : 0600; }
inline unsigned dirModeBits(FileMode m) { return m == FileMode::kGroup ? 0750 : 0700; }

// A device option (teacher.device, student.device) as config.cpp accepts it:
// "cpu", "cuda" (the current device) or "cuda:N". The option stays a string
// (torch::Device takes it as is); modules that need its parts call parseDevice.
struct DeviceSpec {
  bool cuda = false;
  int index = -1; // cuda:N: N; -1: "cpu" or "cuda" (the current device)
};
DeviceSpec parseDevice(const std::string& device);

// Ranges that several keys share (config.cpp checks them; reference.yaml states them).
// Every duration has one, so that no deadline computed from a config overflows.
constexpr double kMinTimeoutS = 0.001; // 1 ms
constexpr double kMaxTimeoutS = 30 * 24 * 3600; // 30 days: 2592000 s
// Processes on one node, students + teachers: the segment's process table holds
// at most 255 students (ipc/src/wire.h kMaxStudents) and 16 teachers (kMaxTeachers).
constexpr int kMaxProcsPerNode = 256;
constexpr int kMaxTeachersPerNode = 16; // teacher.procs (== ipc's wire::kMaxTeachers)
// teacher.hidden_states: a response holds 4 tensors (ipc's kMaxTensors), the logits one of them.
constexpr int kMaxHiddenStates = 3;

// run: how the job is laid out and how long anything may wait.
struct RunOptions {
  std::string name = "distill"; // job name, used in logs and the segment name
  int nproc_per_node = 3; // processes per node: students + 1 teacher (2 .. 256)
  int nnodes = 1; // nodes in the job (>= 1; nnodes x nproc_per_node fits an int)
  int node_rank = 0; // this node, 0 .. nnodes-1
  std::string master_addr = "127.0.0.1"; // student group rendezvous host (student rank 0); the store binds to it only
  int master_port = 29500; // student group rendezvous port (1..65535; 0: a free one, single node)
  std::string log_dir = "logs"; // per-rank log files, metrics, hang reports
  // private | group: checkpoints, the teacher cache and the log files are 0600
  // in 0700 folders (owner only), or 0640 in 0750 (group-shared runs).
  FileMode file_mode = FileMode::kPrivate;
  double startup_timeout_s = 60; // admission: students <-> teacher, store connect (0.001 .. 2592000)
  double collective_timeout_s = 300; // each student-group collective (0.001 .. 2592000)
  double hang_timeout_s = 300; // no progress on any rank for this long = hang (0.001 .. 2592000)
  OnHang on_hang = OnHang::kTeardown; // teardown | wait: what the watchdog does on a hang
  double stop_grace_s = 10; // distill-run: SIGTERM follows a stop request after this (0 .. 2592000)
  double status_every_s = 30; // distill-run: a status line this often off a terminal (1 .. 2592000)
  int64_t seed = 0; // torch's RNG seed, the same on every student (StudentContext seeds it)
  int64_t steps = 0; // training steps the trainer runs (0: trainer decides)

  // How long a rank waits for a peer over the rings (a response, a free slot)
  // before it gives up with TimeoutError: twice hang_timeout_s, so that under
  // distill-run the watchdog reports the hang (who waits on whom) first, and
  // without it the wait still ends.
  double peerWaitS() const { return 2 * hang_timeout_s; }
};

// teacher: the model served by the teacher process.
struct TeacherOptions {
  TeacherKind kind = TeacherKind::kTorchscript; // torchscript | registered | self
  std::string path; // torchscript: the .pt file
  std::string library; // registered: shared library that registers the module
  std::string module; // registered: name the module was registered under
  std::string weights; // registered: torch::save file with its weights ("" = none)
  std::string method = "forward"; // torchscript: method to call
  std::vector<std::string> inputs = {"input_ids"}; // names of the request tensors, in call order
  std::string output = "logits"; // name of the output tensor (first element if a tuple)
  std::vector<std::string> hidden_states; // extra named outputs to return (dict outputs only)
  std::string device = "cpu"; // cpu | cuda | cuda:N
  int procs = 1; // teacher processes per node: the last `procs` local ranks (>= 1, < run.nproc_per_node)
  std::vector<std::string> devices; // one device per teacher, or one for all ([] = `device`); see teacherDevice
  Autocast autocast = Autocast::kNone; // none | float16 | bfloat16: the forward under torch autocast (cpu or cuda)
  int64_t max_batch_tokens = 16384; // batch requests of several students up to this many tokens
  int64_t topk = 0; // 0: full logits; k > 0: top-k values + int32 indices
  // K > 0: sampled answers, K ids drawn per position from softmax(logits / loss.temperature) with
  // replacement, sent as unique ids and counts (answer_kinds.h); reproducible from run.seed.
  int64_t samples = 0;
  // k > 0: a request may carry up to k ids per position (request_ids [B, T, k]), answered as the
  // teacher's logits at them (ids answers, answer_kinds.h); sizes the request and response slots.
  int64_t request_ids = 0;
  // auto | float32 | bfloat16 | float16: the dtype of the logits or top-k values
  // sent (logsumexp and log tail stay float32). auto: teacher.autocast's dtype
  // when set, else the output's (float16 and bfloat16 kept, anything else float32).
  PayloadDtype payload_dtype = PayloadDtype::kAuto;
  int64_t vocab_size = 0; // the teacher's vocabulary V (0: unknown); sizes full-logits response slots
  int max_restarts = 0; // distill-run restarts each dead teacher this many times
  int threads = 0; // torch intra-op threads (0: torch's default)
  // error | mask: an answer with NaN or +inf (-inf is a legal logit) is the teacher's error, or
  // (mask) its tokens are marked and learn from their labels only; such an answer is never cached.
  TeacherOnNonfinite on_nonfinite = TeacherOnNonfinite::kError;
  // The teacher-output cache (teacher/src/cache/cache.h): rows answered before are
  // answered from an LMDB store at `path` without a forward.
  struct CacheOptions {
    std::string path; // the store's directory ("" with mode off)
    CacheMode mode = CacheMode::kOff; // off | read | write | readwrite
    int64_t max_bytes = int64_t(1) << 30; // the store's size limit; full: inserts stop, hits go on
    OnCorrupt on_corrupt = OnCorrupt::kError; // error | restart: a truncated or invalid store is set aside
    // row | prefix: one answer per row keyed by the whole row, or one per position keyed by the
    // position's prefix (inputs[0..t]); prefix is for a causal teacher only, whose answer at
    // position t depends on inputs[0..t] alone (the user asserts it), inputs and outputs [B, T, ...].
    CacheKeys keys = CacheKeys::kRow;
    // float16 | float32: float32 logits and top-k values stored as float16 (half the bytes; every
    // answer, hit or miss, then carries float16's rounding, so a cached run differs from an
    // uncached one in the last digits) or as they are (a cached run equals an uncached one bit
    // for bit). Logits of another dtype are stored as they are either way.
    CacheDtype dtype = CacheDtype::kFloat16;
  };
  CacheOptions cache;
  // auto | logits | topk | hidden (core/answer_kinds.h; docs/teacher.md, "The hidden-state answer").
  TeacherAnswer answer = TeacherAnswer::kAuto;
  int64_t hidden_size = 0; // answer hidden: d_t, the width of the hidden states (0: unknown); sizes response slots
  // answer hidden: the teacher's output layer, published once per node beside the segment.
  struct HeadOptions {
    std::string weight = "lm_head.weight"; // its weight [V_t, d_t]: a parameter or buffer name of the model's state
    std::string bias; // its bias [V_t]: a name of the model's state ("" = no bias)
    double softcap = 0; // > 0: logits = softcap * tanh(logits / softcap); 0: none
    double scale = 1; // logits *= scale before the softcap; 1: none
    HeadOnChange on_change = HeadOnChange::kRefuse; // refuse | adopt: a restarted teacher's other head
  };
  HeadOptions head;
};

// The device teacher `teacher` (0 .. procs-1) of a node runs on: devices[teacher]
// when `devices` names one per teacher, devices[0] when it names one, else `device`.
std::string teacherDevice(const TeacherOptions& t, int teacher);

// student: the trainer side.
struct StudentOptions {
  int grad_acc_steps = 1; // micro-batches per optimizer step (>= 1)
  int in_flight = 2; // requests outstanding per student (1 .. transport.slots)
  std::string device = "cpu"; // cpu | cuda | cuda:N (the student's tensors)
  GroupBackend backend = GroupBackend::kAuto; // auto | gloo | nccl: the student group's backend
  double bucket_mb = 25; // gradient all-reduce bucket size in MiB (> 0)
};

// transport: the shared-memory rings between the students and the teacher of a node.
struct TransportOptions {
  int slots = 4; // slots per ring (>= 1)
  // Payload capacity of a request / response slot; 0 ("auto"): computed from the
  // teacher's keys (slotBytes in config.h).
  int64_t max_request_bytes = 0;
  int64_t max_response_bytes = 0;
  int heartbeat_ms = 100; // liveness period: a peer silent for ~2 of them is stalled (1 .. 60000)
  // A stalled peer (alive, no heartbeat: stopped, descheduled, paused) is an
  // error only after this long; a dead one is known from the kernel at once.
  double stall_timeout_s = 60; // (0.001 .. 2592000)
  int spin_us = 20; // spin this long before sleeping on the futex (0: never; .. 1000000)
  CudaIpc cuda_ipc = CudaIpc::kAuto; // auto | on | off: GPU tensors as CUDA IPC buffers
  // on: distill-run starts an MPS server of its own for the node's ranks (one GPU context
  // instead of time-sliced ones; docs/gpu.md) and stops it when the job ends.
  CudaMps cuda_mps = CudaMps::kOff;
};

// loss: the distillation loss.
struct LossOptions {
  LossKind kind = LossKind::kForwardKl; // forward_kl | reverse_kl | jsd | sampled_token (ids answers, losses.h)
  double temperature = 1.0; // softmax temperature T (> 0); KL is scaled by T^2
  double alpha = 0.5; // weight of the distillation term; 1-alpha on hard-label CE
  double jsd_beta = 0.5; // JSD mixture weight, in (0, 1)
  int64_t ignore_index = -100; // label value masked out of every term
  int64_t chunk_tokens = 4096; // tokens per chunk in the loss (bounds memory; >= 1)
  // A teacher vocabulary V_t larger than the student's V_s (docs/vocab.md):
  LossVocab vocab = LossVocab::kError; // error | truncate (drop teacher ids >= V_s, renormalise)
  double max_truncated_mass = 1e-4; // truncate: the most teacher probability one token may lose, in [0, 1]
  // error | skip_step: a step whose loss or summed gradient is not finite on some student stops the
  // job naming the step and the student, or (skip_step) no student applies its update; counted.
  LossOnNonfinite on_nonfinite = LossOnNonfinite::kError;
};

// checkpoint: student-only checkpoints.
struct CheckpointOptions {
  std::string dir; // checkpoint root ("" = checkpoints off)
  int64_t every_steps = 0; // save every N steps (0 = only when the trainer asks)
  int keep_last = 3; // complete checkpoints kept at most (>= 1)
  bool async = false; // write and publish in a background thread
  bool resume = true; // load the newest complete checkpoint at start
  OnSaveError on_error = OnSaveError::kStop; // stop | continue: what a failed save does
  OnCorrupt on_corrupt = OnCorrupt::kError; // error | restart: loadLatest when every checkpoint is corrupt
};

// trainer: the trainer's own keys (data file, model sizes, ...). distill checks
// only their shape — each value a scalar — and passes them through untouched;
// the trainer reads them with the getters, which name the key in a ConfigError
// when a value does not parse, and rejects keys it does not know with
// expectOnly(), so a typo there is as clear an error as in distill's sections.
// Getters are const and keep no state: call them from any thread.
struct TrainerOptions {
  std::map<std::string, std::string> values; // key -> the scalar as written ("2e-3", "yes", ...)
  std::string source; // where the config came from, for messages only

  bool has(const std::string& key) const { return values.count(key) > 0; }
  // The value of `key`; `fallback` when the config does not set it. A value
  // that does not parse as the type is a ConfigError naming trainer.<key>.
  std::string getString(const std::string& key, const std::string& fallback) const;
  int64_t getInt(const std::string& key, int64_t fallback) const;
  double getDouble(const std::string& key, double fallback) const;
  bool getBool(const std::string& key, bool fallback) const; // true/false (any case as YAML)
  // The same for a key the trainer requires: ConfigError when it is missing.
  std::string getString(const std::string& key) const;
  int64_t getInt(const std::string& key) const;
  double getDouble(const std::string& key) const;
  bool getBool(const std::string& key) const;
  // ConfigError listing every key set that is not in `known` (with the nearest
  // known key as a suggestion: one that begins the typo or is spelled inside
  // it first, `lrate` -> `lr`, then by edit distance), all at once, in the
  // format of parseConfig. distill::init calls it with InitOptions::trainerKeys.
  void expectOnly(const std::vector<std::string>& known) const;
};

struct Config {
  RunOptions run;
  TeacherOptions teacher;
  StudentOptions student;
  TransportOptions transport;
  LossOptions loss;
  CheckpointOptions checkpoint;
  TrainerOptions trainer; // the trainer's own section, passed through
  std::string source; // file it was loaded from ("" if from text)
};

} // namespace distill
