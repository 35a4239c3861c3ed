#pragma once

// Experiment configuration: a YAML file of sections (run, teacher, student,
// transport, loss, checkpoint) whose keys are the fields of options.h, plus
// `--set section.key=value` overrides from the command line.
//
// Validation is complete before anything starts: every problem of a file (unknown
// keys with a suggestion, wrong types, values out of range, missing required keys,
// cross-field constraints) is collected and thrown as ONE ConfigError whose
// message() reads
//
//   config exp.yaml: 2 problem(s):
//   loss.temprature: unknown key; did you mean loss.temperature?
//   transport.slots: must be >= 1, found 0 (from --set)
//
// All functions are pure (no global state) and safe to call from any thread.

#include <cstdint>
#include <string>
#include <vector>

#include "distill/core/options.h"

namespace distill {

// Reads and validates the YAML file at `path`, then applies `overrides`
// ("section.key=value", as given to --set; later ones win). The result's
// `source` is `path`. Throws ConfigError (unreadable file: path and strerror;
// YAML syntax error: path, line and column; a second YAML document after a
// `---` line: path and line; otherwise the problem list).
Config loadConfig(const std::string& path, const std::vector<std::string>& overrides = {});

// As loadConfig, on YAML text; `sourceName` only names it in messages. An
// override value is parsed as a YAML scalar or flow value ("[a, b]") and
// validated exactly like a value of the file. An override is one line of
// printable text: a control character (a newline, a tab) in it is a problem
// naming its key. The result's `source` is "".
Config parseConfig(const std::string& yamlText, const std::vector<std::string>& overrides = {},
                   const std::string& sourceName = "<string>");

// An override and where it came from, for messages: {"run.master_port=70000",
// "--master-port"} is reported as "run.master_port: must be in [1, 65535],
// found 70000 (from --master-port)". distill-run turns each of its options into
// one, so that an option is validated exactly as its config key.
struct ConfigOverride {
  std::string setting; // "section.key=value"
  std::string origin = "--set"; // what the user typed it as
};
Config loadConfig(const std::string& path, const std::vector<ConfigOverride>& overrides);

// `value` as an override of `key` that reads back exactly that string: a YAML
// double-quoted scalar ("run.log_dir=\"/tmp/a: b\""), control characters
// escaped. For string options (distill-run's --log-dir, --master-addr).
std::string stringOverride(const std::string& key, const std::string& value);

// Every dotted key of the schema ("run.name", ...), in schema order.
std::vector<std::string> configKeys();

// Canonical YAML of every key, in schema order: deterministic, and parsed back
// by parseConfig into an equal Config. `source` is not part of it.
std::string dumpConfig(const Config& config);

// One key of a Config with its value as dumpConfig writes it. `training` is
// false for keys that cannot change what is trained (names, paths, ports,
// timeouts, transport sizes, checkpoint schedule): see the schema in config.cpp.
struct ConfigEntry {
  std::string key; // "section.key"; the trainer's own keys as "trainer.<key>"
  std::string value; // canonical text (strings quoted, doubles exact)
  bool training = true;
};

// Every key in schema order, then the trainer section's keys in key order.
std::vector<ConfigEntry> configEntries(const Config& config);

// The keys whose values differ between `a` and `b` (a trainer key set in only
// one of them counts), in schema order; with `trainingOnly`, only keys that
// can change what is trained.
std::vector<std::string> configDiff(const Config& a, const Config& b, bool trainingOnly = false);

// What a process publishes of its config for another to compare with its own
// (a student's, at attach; the teacher compares before admitting it): every
// configEntries() key with its value, one `"key": "value"` YAML line each, a
// value longer than 200 bytes as "#crc32c:<hex>" of it. Deterministic: equal
// configs give equal text; a config with few trainer keys takes ~3 KiB.
std::string configDescription(const Config& config);

// One key whose value differs between two processes' configs.
struct ConfigMismatch {
  std::string key; // "teacher.topk", "trainer.lr"
  std::string mine; // its value here as configEntries writes it; "(not set)" for a trainer key set only there
  std::string theirs; // its value in the description; "(not set)" likewise
};

// Every key whose value in `config` differs from the one `description` (another
// process's configDescription) gives: schema order, then trainer keys. Every
// key is compared, runtime ones too: under distill-run all processes of a node
// run one config (the node's distill-run hands its overrides to each), so no
// key may differ, and none is left out. ConfigError if `description` is no
// description at all.
std::vector<ConfigMismatch> compareConfig(const Config& config, const std::string& description);

// CRC32C (core/checksum.h) over the keys and values of the training keys only
// (configEntries with training == true), in the low 32 bits: what a checkpoint
// manifest records (as 16 hex digits). A checkpoint saved before issue 15
// (FNV-1a 64) resumes with the "saved under another config" warning only. Changing a log
// directory, a port or a timeout keeps the hash.
uint64_t configHash(const Config& config);

// Removes every `--set k=v` and `--set=k=v` from argv (updating argc, keeping
// argv[argc] == nullptr) and returns the k=v strings in order. Scanning stops
// at a bare `--`, so arguments meant for a child program are left alone.
// A `--set` with nothing after it is a ConfigError.
std::vector<std::string> extractSetOverrides(int& argc, char** argv);

// The config of a job as each of its processes sees it: the file named by
// `--config FILE` / `--config=FILE` (removed from argv) or else DISTILL_CONFIG;
// then overrides from DISTILL_SET (one `key=value` per line: an override holds
// no control character; distill-run passes its --set and its other options
// this way so that the trainer's argv stays its own), then
// the process's own --set options (removed from argv). ConfigError if no file.
Config jobConfig(int& argc, char** argv);

} // namespace distill
