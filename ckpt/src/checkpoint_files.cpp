// A rank's files of a checkpoint: the snapshot a save writes, and choosing and
// reading the one a load takes (checkpoint_impl.h).
#include "checkpoint_impl.h"

namespace distill::ckpt_impl {

std::vector<OutFile> CheckpointCore::snapshot(int64_t step, const ModelRef& state, const TrainState& train,
                                              const RankState& rs, std::mt19937_64* rng) {
  torch::NoGradGuard noGrad;
  std::vector<OutFile> files;
  OutFile rf{rankFile(rank), {}, std::make_shared<OutputArchive>()};
  auto& a = *rf.archive;
  a.write("format", c10::IValue(kRankFormat));
  a.write("step", c10::IValue(step));
  a.write("rank", c10::IValue(static_cast<int64_t>(rank)));
  a.write("world_size", c10::IValue(static_cast<int64_t>(world)));
  {
    auto gen = cpuGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    a.write("rng_cpu", gen.get_state(), true);
  }
  int64_t cudaGens = 0;
  auto dev = state.device();
  if (dev && dev->is_cuda()) {
    cudaGens = static_cast<int64_t>(at::getNumGPUs());
    for (int64_t i = 0; i < cudaGens; ++i) {
      auto gen = at::globalContext().defaultGenerator(torch::Device(torch::kCUDA, static_cast<int>(i)));
      std::lock_guard<std::mutex> lock(gen.mutex());
      a.write("rng_cuda_" + std::to_string(i), gen.get_state(), true);
    }
  }
  a.write("rng_cuda_count", c10::IValue(cudaGens));
  std::string mt;
  if (rng) {
    std::ostringstream os;
    os << *rng;
    mt = os.str();
  }
  a.write("has_mt19937_64", c10::IValue(static_cast<int64_t>(rng != nullptr)));
  a.write("mt19937_64", bytesTensor(mt), true);
  a.write("data_epoch", c10::IValue(rs.data.epoch));
  a.write("data_index", c10::IValue(rs.data.index));
  a.write("extra", bytesTensor(rs.extra), true);
  files.push_back(std::move(rf));
  if (rank != 0) return files;

  if (state.model) {
    OutFile mf{kModel, {}, std::make_shared<OutputArchive>()};
    if (opts.async) {
      snapshotModule(*state.model, *mf.archive);
    } else {
      state.model->save(*mf.archive);
    }
    files.push_back(std::move(mf));
  } else {
    files.push_back({kModel, *state.modelBytes, nullptr});
  }
  if (state.optimizer) {
    OutputArchive oa;
    state.optimizer->save(oa);
    files.push_back({kOptimizer, toBytes(oa), nullptr});
  } else {
    files.push_back({kOptimizer, *state.optimizerBytes, nullptr});
  }
  OutputArchive ta;
  ta.write("step", c10::IValue(train.step));
  ta.write("acc_step", c10::IValue(train.accStep));
  ta.write("tokens_seen", c10::IValue(train.tokensSeen));
  ta.write("data_epoch", c10::IValue(train.data.epoch));
  ta.write("data_index", c10::IValue(train.data.index));
  ta.write("extra", bytesTensor(train.extra), true);
  files.push_back({kTrain, toBytes(ta), nullptr});
  files.push_back({kConfig, configYaml, nullptr});
  return files;
}

std::optional<Manifest> CheckpointCore::choose() {
  CheckpointScan scan = scanCheckpoints(opts.dir, *fs);
  for (const auto& w : scan.skipped) DISTILL_LOG(kWarning) << "checkpoint: " << w;
  for (const auto& r : scan.rejected) DISTILL_LOG(kWarning) << "checkpoint: skipping corrupt checkpoint " << r;
  if (scan.chosen || scan.rejected.empty()) return scan.chosen;
  std::string all;
  for (const auto& r : scan.rejected) all += (all.empty() ? "" : "; ") + r;
  const std::string text = "no intact checkpoint in " + opts.dir + ": " + all;
  if (opts.on_corrupt == OnCorrupt::kRestart) {
    DISTILL_LOG(kWarning) << "checkpoint: " << text << "; checkpoint.on_corrupt=restart: training starts from scratch";
    return std::nullopt;
  }
  DISTILL_THROW(CheckpointError, text,
                "; nothing was loaded or removed (checkpoint.on_corrupt: restart starts from scratch instead)");
}

std::string CheckpointCore::configChange(const Manifest& m) {
  const std::string dir = path(stepName(m.step));
  if (!m.find(kConfig)) {
    return "its config hash differs (it records no " + std::string(kConfig) + ": saved by an older distill)";
  }
  try {
    auto changes = configChanges(readVerified(dir, m, kConfig), config);
    if (changes.empty()) {
      return "its config hash differs, but no training key does (hashed by another version of distill?)";
    }
    return join(changes);
  } catch (const Error& e) {
    return "its config hash differs (" + dir + "/" + kConfig + " cannot be compared: " + e.message() + ")";
  }
}

std::string CheckpointCore::readVerified(const std::string& dir, const Manifest& m, const std::string& name) {
  const std::string p = dir + "/" + name;
  const ManifestFile* f = m.find(name);
  DISTILL_CHECK_T(CheckpointError, f, "manifest of ", dir, " does not list ", name);
  std::string bytes = fs->readFile(p);
  DISTILL_CHECK_T(CheckpointError,
                  static_cast<int64_t>(bytes.size()) == f->size && crc32c(bytes.data(), bytes.size()) == f->crc32c,
                  "corrupt file ", p, ": size or CRC32C differ from the manifest");
  return bytes;
}

LoadedState CheckpointCore::loadStep(int64_t step, const ModelRef& state, std::mt19937_64* rng) {
  LoadedState out;
  out.step = step;
  out.path = path(stepName(step));
  const std::string& dir = out.path;
  Manifest m = parseManifest(fs->readFile(dir + "/" + kManifest), dir + "/" + kManifest);
  auto dev = state.device();
  auto open = [&](const std::string& name, InputArchive& a, std::optional<torch::Device> d) {
    std::string bytes = readVerified(dir, m, name);
    a.load_from(bytes.data(), bytes.size(), d);
  };
  InputArchive ma, oa, ta, ra;
  std::string modelBytes, optimizerBytes; // the bytes form: handed over only once everything verified
  if (state.model) {
    open(kModel, ma, dev);
  } else {
    modelBytes = readVerified(dir, m, kModel);
  }
  if (state.optimizer) {
    open(kOptimizer, oa, dev);
  } else {
    optimizerBytes = readVerified(dir, m, kOptimizer);
  }
  open(kTrain, ta, torch::Device(torch::kCPU));
  open(rankFile(rank), ra, torch::Device(torch::kCPU));
  DISTILL_CHECK_T(CheckpointError, readInt(ra, "rank") == rank && readInt(ra, "step") == step, dir, "/", rankFile(rank),
                  " is not rank ", rank, "'s file of step ", step);
  if (state.model) state.model->load(ma);
  if (state.optimizer) state.optimizer->load(oa);
  if (!state.model) *state.modelBytes = std::move(modelBytes);
  if (!state.optimizer) *state.optimizerBytes = std::move(optimizerBytes);
  out.train.step = readInt(ta, "step");
  out.train.accStep = readInt(ta, "acc_step");
  out.train.tokensSeen = readInt(ta, "tokens_seen");
  out.train.data = {readInt(ta, "data_epoch"), readInt(ta, "data_index")};
  out.train.extra = tensorBytes(readTensor(ta, "extra"));
  out.rank.data = {readInt(ra, "data_epoch"), readInt(ra, "data_index")};
  out.rank.extra = tensorBytes(readTensor(ra, "extra"));
  // RNG last: nothing above may fail after it is restored.
  bool hasMt = readInt(ra, "has_mt19937_64") != 0;
  if (rng && !hasMt) {
    DISTILL_LOG(kWarning) << "checkpoint " << dir << " holds no std::mt19937_64 state for rank " << rank
                          << "; the generator given to loadLatest is left as it is";
  } else if (rng) {
    std::istringstream is(tensorBytes(readTensor(ra, "mt19937_64")));
    std::mt19937_64 restored;
    is >> restored;
    DISTILL_CHECK_T(CheckpointError, !is.fail(), "bad std::mt19937_64 state in ", dir, "/", rankFile(rank));
    *rng = restored;
  }
  int64_t cudaGens = readInt(ra, "rng_cuda_count");
  if (cudaGens > 0 && static_cast<int64_t>(at::getNumGPUs()) == cudaGens) {
    for (int64_t i = 0; i < cudaGens; ++i) {
      auto gen = at::globalContext().defaultGenerator(torch::Device(torch::kCUDA, static_cast<int>(i)));
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(readTensor(ra, "rng_cuda_" + std::to_string(i)));
    }
  } else if (cudaGens > 0) {
    DISTILL_LOG(kWarning) << "checkpoint " << dir << " holds " << cudaGens << " CUDA generator states, "
                          << at::getNumGPUs() << " devices are visible: CUDA RNG not restored";
  }
  auto gen = cpuGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(readTensor(ra, "rng_cpu"));
  return out;
}

} // namespace distill::ckpt_impl
