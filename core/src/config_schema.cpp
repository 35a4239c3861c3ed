// The keys distill knows: one table (schema()), and the names and suggestions
// of a key that is not in it. Shared declarations in config_impl.h.
#include <algorithm>
#include <climits>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "config_impl.h"
#include "distill/core/errors.h"
#include "distill/core/strings.h"

namespace distill::config_impl {

// The path and the field come from one spelling, so they cannot drift apart.
#define DISTILL_KEY(sec, key) KeySpec(#sec "." #key, [](Config& c) -> Field { return fieldOf(&c.sec.key); })

namespace {

// The run and teacher sections, in schema order.
std::vector<KeySpec> runAndTeacherKeys() {
  return {
      DISTILL_KEY(run, name).nonEmpty().runtime(),
      DISTILL_KEY(run, nproc_per_node).min(2).max(kMaxProcsPerNode),
      DISTILL_KEY(run, nnodes).min(1), // and nnodes x nproc_per_node fits an int, checked across fields
      // Each node's distill-run passes its own --node-rank: it differs between
      // nodes, so it cannot be part of the hash every rank compares on resume.
      DISTILL_KEY(run, node_rank).min(0).runtime(), // and < run.nnodes, checked across fields
      DISTILL_KEY(run, master_addr).nonEmpty().runtime(),
      DISTILL_KEY(run, master_port).min(0).max(65535).runtime(), // 0: a free port (single node, distill-run)
      DISTILL_KEY(run, log_dir).nonEmpty().runtime(),
      DISTILL_KEY(run, file_mode).runtime(), // who may read what a job writes, not what it trains
      DISTILL_KEY(run, startup_timeout_s).min(kMinTimeoutS).max(kMaxTimeoutS).runtime(),
      DISTILL_KEY(run, collective_timeout_s).min(kMinTimeoutS).max(kMaxTimeoutS).runtime(),
      DISTILL_KEY(run, hang_timeout_s).min(kMinTimeoutS).max(kMaxTimeoutS).runtime(),
      DISTILL_KEY(run, on_hang).runtime(),
      DISTILL_KEY(run, stop_grace_s).min(0).max(kMaxTimeoutS).runtime(),
      DISTILL_KEY(run, status_every_s).min(1).max(kMaxTimeoutS).runtime(),
      DISTILL_KEY(run, seed),
      DISTILL_KEY(run, steps).min(0),

      DISTILL_KEY(teacher, kind).mandatory(),
      DISTILL_KEY(teacher, path), // required by kind, checked across fields
      DISTILL_KEY(teacher, library), // idem
      DISTILL_KEY(teacher, module), // idem
      DISTILL_KEY(teacher, weights),
      DISTILL_KEY(teacher, method).nonEmpty(),
      DISTILL_KEY(teacher, inputs).nonEmpty(),
      DISTILL_KEY(teacher, output).nonEmpty(),
      DISTILL_KEY(teacher, hidden_states),
      DISTILL_KEY(teacher, device).oneOf({"cpu", "cuda", "cuda:N"}),
      // Runtime: how many processes serve the students changes how fast a job
      // runs, not what any student gets back.
      DISTILL_KEY(teacher, procs).min(1).max(kMaxTeachersPerNode).runtime(), // and < run.nproc_per_node, across fields
      DISTILL_KEY(teacher, devices).runtime(), // each a device; 0, 1 or teacher.procs of them, across fields
      DISTILL_KEY(teacher, autocast),
      DISTILL_KEY(teacher, max_batch_tokens).min(1).runtime(),
      DISTILL_KEY(teacher, topk).min(0),
      DISTILL_KEY(teacher, samples).min(0).max(32767), // int16 counts; against topk, loss.kind, ... across fields
      DISTILL_KEY(teacher, request_ids).min(0).max(1 << 20), // ids per position a request may carry
      DISTILL_KEY(teacher, payload_dtype),
      // Runtime: it sizes the response slots (and is checked at the first answer).
      DISTILL_KEY(teacher, vocab_size).min(0).runtime(),
      DISTILL_KEY(teacher, max_restarts).min(0).runtime(),
      DISTILL_KEY(teacher, threads).min(0).runtime(),
      DISTILL_KEY(teacher, on_nonfinite),
      // Runtime: a hit is bit-equal to the answer a miss gets, and with
      // cache.dtype float32 to the answer without the cache (float16, the
      // default, rounds float32 logits: CHANGELOG.md 0.5.0).
      DISTILL_KEY(teacher, cache.path).runtime(), // required unless mode is off, checked across fields
      DISTILL_KEY(teacher, cache.mode).runtime(),
      DISTILL_KEY(teacher, cache.max_bytes).byteSize().min(1 << 20).runtime(),
      DISTILL_KEY(teacher, cache.on_corrupt).runtime(),
      DISTILL_KEY(teacher, cache.keys).runtime(),
      // Not runtime: float16 rows round what the students train on (a cached run differs from an
      // uncached one); float32 rows do not.
      DISTILL_KEY(teacher, cache.dtype),
      // The answer kind (core/answer_kinds.h); hidden: the head below, checked across fields.
      DISTILL_KEY(teacher, answer),
      // Runtime: it sizes the response slots (and is checked against the head at start-up).
      DISTILL_KEY(teacher, hidden_size).min(0).runtime(),
      DISTILL_KEY(teacher, head.weight).nonEmpty(),
      DISTILL_KEY(teacher, head.bias),
      DISTILL_KEY(teacher, head.softcap).min(0),
      DISTILL_KEY(teacher, head.scale).above(0),
      // Runtime: what a student does if a restarted teacher publishes another head, not what it trains on.
      DISTILL_KEY(teacher, head.on_change).runtime(),
  };
}

// The student, transport, loss and checkpoint sections, in schema order.
std::vector<KeySpec> trainingKeys() {
  return {
      DISTILL_KEY(student, grad_acc_steps).min(1),
      DISTILL_KEY(student, in_flight).min(1).runtime(), // and <= transport.slots, checked across fields
      DISTILL_KEY(student, device).oneOf({"cpu", "cuda", "cuda:N"}),
      DISTILL_KEY(student, backend),
      DISTILL_KEY(student, bucket_mb).above(0).runtime(),

      DISTILL_KEY(transport, slots).min(1).runtime(),
      DISTILL_KEY(transport, max_request_bytes).byteSize().orAuto().min(0).runtime(), // auto = 0: computed
      DISTILL_KEY(transport, max_response_bytes).byteSize().orAuto().min(0).runtime(), // idem
      DISTILL_KEY(transport, heartbeat_ms).min(1).max(60000).runtime(),
      DISTILL_KEY(transport, stall_timeout_s).min(kMinTimeoutS).max(kMaxTimeoutS).runtime(),
      DISTILL_KEY(transport, spin_us).min(0).max(1000000).runtime(),
      DISTILL_KEY(transport, cuda_ipc).runtime(),
      DISTILL_KEY(transport, cuda_mps).runtime(),

      DISTILL_KEY(loss, kind),
      DISTILL_KEY(loss, temperature).above(0),
      DISTILL_KEY(loss, alpha).min(0).max(1),
      DISTILL_KEY(loss, jsd_beta).above(0).below(1),
      DISTILL_KEY(loss, ignore_index),
      DISTILL_KEY(loss, chunk_tokens).min(1),
      DISTILL_KEY(loss, vocab),
      DISTILL_KEY(loss, max_truncated_mass).min(0).max(1),
      DISTILL_KEY(loss, on_nonfinite),

      DISTILL_KEY(checkpoint, dir).runtime(),
      DISTILL_KEY(checkpoint, every_steps).min(0).runtime(),
      DISTILL_KEY(checkpoint, keep_last).min(1).runtime(),
      DISTILL_KEY(checkpoint, async).runtime(),
      DISTILL_KEY(checkpoint, resume).runtime(),
      DISTILL_KEY(checkpoint, on_error).runtime(),
      DISTILL_KEY(checkpoint, on_corrupt).runtime(),
  };
}

} // namespace

const std::vector<KeySpec>& schema() {
  static const std::vector<KeySpec> keys = [] {
    std::vector<KeySpec> k = runAndTeacherKeys();
    for (KeySpec& spec : trainingKeys()) k.push_back(std::move(spec));
    return k;
  }();
  return keys;
}

#undef DISTILL_KEY

int keyIndex(const std::string& path) {
  const auto& keys = schema();
  for (size_t i = 0; i < keys.size(); ++i) {
    if (keys[i].path == path) return static_cast<int>(i);
  }
  return -1;
}

size_t knownKey(const char* path) {
  const int i = keyIndex(path);
  DISTILL_INTERNAL_ASSERT(i >= 0, "no config key ", path);
  return static_cast<size_t>(i);
}

const std::string kTrainerSection = "trainer";

std::vector<std::string> sectionNames() {
  std::vector<std::string> out;
  for (const KeySpec& k : schema()) {
    if (out.empty() || out.back() != k.section()) out.push_back(k.section());
  }
  out.push_back(kTrainerSection);
  return out;
}

bool isSection(const std::string& name) {
  const auto s = sectionNames();
  return std::find(s.begin(), s.end(), name) != s.end();
}

size_t levenshtein(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1])});
      diag = up;
    }
  }
  return row[b.size()];
}

// Is `a` a subsequence of `b` (every character of a, in order, in b)?
bool isSubsequence(const std::string& a, const std::string& b) {
  size_t i = 0;
  for (size_t j = 0; i < a.size() && j < b.size(); ++j) i += a[i] == b[j] ? 1 : 0;
  return i == a.size();
}

// How near a mistyped name is to a known one: (tier, edit distance), lower is
// nearer; nullopt when they are unrelated. One name extending the other
// ("lrate" for "lr", "slot" for "slots") comes first, then one spelled inside
// the other ("temprature" for "temperature"), then any name within 3 edits.
// Plain edit distance alone ranks "lrate" as near "data" as "lr" (3 edits
// each): what a user who abbreviates means is the name they started to write.
// Both of the first two need the shorter name to have 2+ characters and the
// longer at most 4 times as many, so that "d" or "lr" do not match everything.
std::optional<std::pair<int, size_t>> nearness(const std::string& typo, const std::string& known) {
  const size_t d = levenshtein(typo, known);
  const std::string& shorter = typo.size() <= known.size() ? typo : known;
  const std::string& longer = typo.size() <= known.size() ? known : typo;
  if (shorter.size() >= 2 && longer.size() <= 4 * shorter.size()) {
    if (longer.compare(0, shorter.size(), shorter) == 0) return std::make_pair(0, d);
    if (isSubsequence(shorter, longer)) return std::make_pair(1, d);
  }
  if (d < 4) return std::make_pair(2, d);
  return std::nullopt;
}

std::string nearest(const std::string& typo, const std::vector<std::string>& known) {
  std::string best;
  std::optional<std::pair<int, size_t>> bestScore;
  for (const std::string& k : known) {
    const auto score = nearness(typo, k);
    if (score && (!bestScore || *score < *bestScore)) {
      bestScore = score;
      best = k;
    }
  }
  return best;
}

std::vector<std::string> groupKeys(const std::string& path) {
  std::vector<std::string> out;
  const std::string prefix = path + ".";
  for (const KeySpec& k : schema()) {
    if (k.path.compare(0, prefix.size(), prefix) == 0) out.push_back(k.path.substr(prefix.size()));
  }
  return out;
}

std::string unknownKey(const std::string& path) {
  const std::string section = path.substr(0, path.find('.'));
  const std::string name = path.substr(std::min(path.size(), section.size() + 1));
  // A key of the same section first: a typo rarely changes the section.
  std::vector<std::string> names;
  for (const KeySpec& k : schema()) {
    if (k.section() == section) names.push_back(k.name());
  }
  const std::string same = nearest(name, names);
  if (!same.empty()) return path + ": unknown key; did you mean " + section + "." + same + "?";
  // Another section's key only when the whole path is a few edits away: the same
  // name in another section ("student.temperature") is no typo of it.
  std::string best;
  size_t bestDist = 4;
  for (const KeySpec& k : schema()) {
    const size_t d = levenshtein(path, k.path);
    if (d < bestDist) {
      bestDist = d;
      best = k.path;
    }
  }
  if (!best.empty()) return path + ": unknown key; did you mean " + best + "?";
  if (!isSection(section)) return path + ": unknown key; valid sections: " + join(sectionNames());
  return path + ": unknown key; valid keys in " + section + ": " + join(names);
}

std::string unknownSection(const std::string& name) {
  // Section names are short: allow fewer edits, or "xyz" would suggest "run".
  const size_t limit = std::min<size_t>(3, name.size() / 2);
  for (const std::string& s : sectionNames()) {
    if (levenshtein(name, s) <= limit) return name + ": unknown section; did you mean " + s + "?";
  }
  return name + ": unknown section; valid sections: " + join(sectionNames());
}

} // namespace distill::config_impl
