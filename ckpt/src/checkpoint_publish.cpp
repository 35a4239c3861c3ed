// A save's outcome across the ranks: rank 0 decides, makes room, publishes
// (manifest, rename, `latest`) and prunes; the async writer's run (checkpoint_impl.h).
#include "checkpoint_impl.h"

namespace distill::ckpt_impl {

int64_t CheckpointCore::committedStep() {
  const std::string p = path(kLatest);
  if (!fs->exists(p)) return -1;
  std::string text = fs->readFile(p);
  if (!text.empty() && text.back() == '\n') text.pop_back();
  bool tmp = false;
  const int64_t s = parseStepName(text, &tmp);
  return s >= 0 && !tmp && fs->exists(path(stepName(s))) ? s : -1;
}

int64_t CheckpointCore::keptStep() {
  try {
    int64_t s = committedStep();
    if (s >= 0) return s;
    for (const auto& name : fs->list(opts.dir)) {
      bool tmp = false;
      const int64_t n = parseStepName(name, &tmp);
      if (n >= 0 && !tmp) s = std::max(s, n);
    }
    return s;
  } catch (const std::exception&) {
    return -2;
  }
}

std::vector<std::string> CheckpointCore::makeRoom(int64_t step) {
  const int64_t committed = committedStep();
  std::vector<std::string> out;
  std::vector<int64_t> older;
  int64_t newest = -1;
  for (const auto& name : fs->list(opts.dir)) {
    bool tmp = false;
    const int64_t s = parseStepName(name, &tmp);
    if (s < 0) continue;
    if (tmp) {
      if (s != step) out.push_back(name);
    } else if (committed >= 0 && s > committed) {
      out.push_back(name);
    } else {
      newest = std::max(newest, s);
      if (s < step) older.push_back(s);
    }
  }
  const int64_t keep = committed >= 0 ? committed : newest;
  std::sort(older.begin(), older.end());
  for (int64_t s : older) {
    if (s != keep) {
      out.push_back(stepName(s));
      break;
    }
  }
  for (const auto& name : out) fs->removeAll(path(name));
  return out;
}

void CheckpointCore::prune(int64_t step) {
  try {
    std::vector<int64_t> older;
    for (const auto& name : fs->list(opts.dir)) {
      bool tmp = false;
      const int64_t s = parseStepName(name, &tmp);
      if (s < 0 || (s == step && !tmp)) continue;
      if (tmp) {
        fs->removeAll(path(name));
      } else if (s > step) {
        DISTILL_LOG(kWarning) << "checkpoint: removing " << path(name) << ": newer than step " << step
                              << ", which `latest` now names, so it can never be loaded";
        fs->removeAll(path(name));
      } else {
        older.push_back(s);
      }
    }
    std::sort(older.rbegin(), older.rend());
    for (size_t i = static_cast<size_t>(std::max(0, opts.keep_last - 1)); i < older.size(); ++i) {
      fs->removeAll(path(stepName(older[i])));
    }
  } catch (const std::exception& e) {
    DISTILL_LOG(kWarning) << "checkpoint: pruning old checkpoints in " << opts.dir << " failed: " << messageOf(e);
  }
}

void CheckpointCore::publish(int64_t step, const std::string& tmpDir, const WriteResult& mine,
                             const std::vector<RankReport>& reports) {
  auto start = Clock::now();
  Manifest m;
  m.step = step;
  m.studentWorldSize = world;
  m.configHash = cfgHash;
  m.teacherFingerprint = fingerprint;
  m.answerTeacher = answerTeacher.load();
  for (const auto& f : mine.files) {
    if (f.name.rfind("rank_", 0) != 0) m.files.push_back(f);
  }
  int64_t total = 0;
  for (int r = 0; r < world; ++r) m.files.push_back({rankFile(r), reports[r].size, reports[r].crc});
  for (const auto& f : m.files) total += f.size;
  // A step_N.tmp left by an interrupted earlier attempt may hold strays.
  for (const auto& name : fs->list(tmpDir)) {
    if (!m.find(name)) fs->removeAll(tmpDir + "/" + name);
  }
  fs->writeFile(tmpDir + "/" + kManifest, formatManifest(m));
  fs->syncDir(tmpDir);
  const std::string final = path(stepName(step));
  if (fs->exists(final)) {
    DISTILL_LOG(kWarning) << "checkpoint: replacing existing " << final;
    fs->removeAll(final);
  }
  fs->rename(tmpDir, final);
  fs->syncDir(opts.dir);
  // The commit point (layout.h): from here on loadLatest takes this one.
  fs->writeFile(path("latest.tmp"), stepName(step) + "\n");
  fs->rename(path("latest.tmp"), path(kLatest));
  fs->syncDir(opts.dir);
  DISTILL_LOG(kInfo) << "checkpoint step " << step << " published: " << final << " (" << m.files.size() << " files, "
                     << total << " bytes, publish " << toMs(Clock::now() - start) << " ms)";
  prune(step);
}

Verdict CheckpointCore::decide(int64_t step, int attempt, const std::string& tmpDir, const WriteResult& mine,
                               const std::vector<RankReport>& reports, std::string* publishError) {
  Verdict v;
  bool allNoSpace = true;
  for (int r = 0; r < world; ++r) {
    if (reports[r].state == RankReport::kFailed) {
      v.failed.push_back(r);
      allNoSpace = allNoSpace && reports[r].noSpace;
    } else if (reports[r].state == RankReport::kMissing) {
      v.missing.push_back(r);
    }
  }
  if (v.failed.empty() && v.missing.empty()) {
    try {
      publish(step, tmpDir, mine, reports);
      v.code = Verdict::kPublished;
      return v;
    } catch (const std::exception& e) {
      *publishError = messageOf(e);
      v.publishFailed = true;
    }
  } else if (v.missing.empty() && allNoSpace) {
    std::vector<std::string> removed;
    if (attempt == 0) {
      try {
        removed = makeRoom(step);
      } catch (const std::exception& e) {
        DISTILL_LOG(kWarning) << "checkpoint step " << step << ": could not make room in " << opts.dir << ": "
                              << messageOf(e);
      }
    }
    if (!removed.empty()) {
      std::string names;
      for (const auto& n : removed) names += (names.empty() ? "" : ", ") + n;
      DISTILL_LOG(kWarning) << "checkpoint step " << step << ": no space left in " << opts.dir << "; removed " << names
                            << " to make room (never the newest checkpoint) and writing it again";
      v.code = Verdict::kRetry;
      return v;
    }
    v.full = true;
  }
  v.code = Verdict::kFailed;
  v.kept = keptStep();
  return v;
}

std::string CheckpointCore::failureText(const Verdict& v, const std::string& mine) const {
  std::string err;
  if (!mine.empty()) {
    err = mine;
    if (v.failed.size() > 1) err += " (student rank(s) " + join(v.failed) + " failed)";
  } else if (v.publishFailed) {
    err = "student rank 0 could not publish it (its log says why)";
  } else if (!v.failed.empty()) {
    err = "student rank(s) " + join(v.failed) + " could not write their state (their logs say why)";
  }
  if (!v.missing.empty()) {
    err += std::string(err.empty() ? "" : "; ") + "student rank(s) " + join(v.missing) +
        " never reported their files within " + std::to_string(timeout.count()) + " ms (run.collective_timeout_s)";
  }
  if (v.full) {
    err += "; " + opts.dir +
        " is out of space: to make room distill removes partial checkpoints and the "
        "oldest complete one (once per save), never the newest before a newer one is published, so "
        "checkpoint.dir needs room for at least two checkpoints";
  }
  if (v.kept >= 0) {
    err += "; the newest checkpoint, " + path(stepName(v.kept)) + ", is left as it was";
  } else if (v.kept == -1) {
    err += "; there is no earlier checkpoint in " + opts.dir;
  } else {
    err += "; the earlier checkpoints in " + opts.dir + " are left as they were";
  }
  return err;
}

void CheckpointCore::removeTmp(const std::string& tmpDir) {
  try {
    fs->removeAll(tmpDir);
  } catch (const std::exception& e) {
    DISTILL_LOG(kWarning) << "checkpoint: could not remove " << tmpDir << ": " << messageOf(e);
  }
}

void CheckpointCore::runAsync(int64_t seq, int64_t step, const std::string& tmpDir, std::vector<OutFile>& files,
                              const std::string& snapError, AsyncResult& out) {
  auto key = [&](int attempt, const std::string& who) {
    return "s" + std::to_string(seq) + "/a" + std::to_string(attempt) + "/" + who;
  };
  std::vector<std::string> used; // rank 0 removes these at the end
  for (int attempt = 0; attempt < 2; ++attempt) {
    WriteResult mine;
    if (snapError.empty()) {
      mine = writeFiles(*fs, tmpDir, files);
    } else {
      mine.error = snapError;
    }
    const ManifestFile* own = nullptr;
    for (const auto& f : mine.files) {
      if (f.name == rankFile(rank)) own = &f;
    }
    const bool written = mine.error.empty() && own;
    if (rank != 0) {
      nlohmann::json note{{"written", written},
                          {"no_space", mine.noSpace},
                          {"size", written ? own->size : 0},
                          {"crc32c", written ? own->crc32c : 0}};
      notes->post(key(attempt, "r" + std::to_string(rank)), note.dump());
      const Millis patience = 2 * timeout; // rank 0's own writing, then its wait for every note
      auto got = notes->await({key(attempt, "verdict")}, patience);
      if (!got[0]) {
        out.error = "no verdict from student rank 0 within " + std::to_string(patience.count()) +
            " ms (2 x run.collective_timeout_s; awaited: its publication of " + tmpDir + ")";
        return;
      }
      Verdict v = Verdict::decode(*got[0]);
      if (v.code == Verdict::kRetry) continue;
      notes->post(key(attempt, "ack" + std::to_string(rank)), "1");
      out.ok = v.code == Verdict::kPublished;
      if (!out.ok) out.error = failureText(v, mine.error);
      return;
    }
    std::vector<RankReport> reports(world);
    reports[0].state = written ? RankReport::kWritten : RankReport::kFailed;
    reports[0].noSpace = mine.noSpace;
    if (written) {
      reports[0].size = own->size;
      reports[0].crc = own->crc32c;
    }
    std::vector<std::string> keys;
    for (int r = 1; r < world; ++r) keys.push_back(key(attempt, "r" + std::to_string(r)));
    auto got = notes->await(keys, timeout);
    std::vector<std::string> acks;
    for (int r = 1; r < world; ++r) {
      const auto& note = got[r - 1];
      if (!note) continue; // kMissing
      used.push_back(keys[r - 1]);
      auto j = nlohmann::json::parse(*note);
      auto& rep = reports[r];
      rep.state = j.at("written").get<bool>() ? RankReport::kWritten : RankReport::kFailed;
      rep.noSpace = j.at("no_space").get<bool>();
      rep.size = j.at("size").get<int64_t>();
      rep.crc = j.at("crc32c").get<uint32_t>();
      acks.push_back(key(attempt, "ack" + std::to_string(r)));
    }
    std::string publishError;
    Verdict v = decide(step, attempt, tmpDir, mine, reports, &publishError);
    notes->post(key(attempt, "verdict"), v.encode());
    used.push_back(key(attempt, "verdict"));
    if (v.code == Verdict::kRetry) continue;
    auto acked = notes->await(acks, timeout);
    for (size_t i = 0; i < acks.size(); ++i) {
      if (acked[i]) used.push_back(acks[i]);
    }
    for (const auto& k : used) notes->erase(k);
    out.ok = v.code == Verdict::kPublished;
    if (!out.ok) {
      if (v.missing.empty()) removeTmp(tmpDir); // nobody writes there any more
      out.error = failureText(v, mine.error.empty() ? publishError : mine.error);
    }
    return;
  }
  DISTILL_INTERNAL_ASSERT(false, "checkpoint step ", step, ": a retry verdict after the retry");
}

} // namespace distill::ckpt_impl
