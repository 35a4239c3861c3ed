#include "args.h"

#include <CLI/CLI.hpp>

#include <map>

#include "distill/core/errors.h"
#include "distill/core/options.h"
#include "distill/core/version.h"

namespace distill::launcher {
namespace {

constexpr const char* kUsage =
    "usage: distill-run [--nproc-per-node N] [--nnodes M --node-rank K --master-addr A --master-port P] "
    "--config F [--set key=value]... [--log-dir D] [--dry-run] [--stop-grace-s S] [--status-every-s S] "
    "-- TRAINER ARGS...   (distill-run --help explains each)";

constexpr const char* kFooter = R"(
TRAINER ARGS... (after --) is the trainer's command. With teacher.procs: K
(default 1), local ranks 0..N-K-1 run it as students and the last K local
ranks, N-K..N-1, run the teachers (bin/distill-teacher, or the trainer itself
when teacher.kind is self).

Each option but --config, --set and --dry-run stands for a run.* key of the
config (--nproc-per-node N is --set run.nproc_per_node=N): it is validated as
that key, and every rank gets it in DISTILL_SET. Later options win. The
defaults shown are the keys' defaults, used when the config file does not set
them. Example:

  distill-run --nproc-per-node 3 --config job.yaml --set run.steps=100 -- ./train --lr 3e-4)";

// An option that stands for a config key: `--nproc-per-node N` is
// `--set run.nproc_per_node=N`, validated by the schema like the key (its
// range, its type), with the option named in a problem.
struct KeyOption {
  const char* flag;
  const char* key;
  bool text; // a string key: the value is taken verbatim, not parsed as YAML
  const char* name;
  std::string byDefault;
};

std::vector<KeyOption> keyOptions() {
  const RunOptions d;
  auto num = [](double v) { return detail::str(v); };
  return {
      {"--nproc-per-node", "run.nproc_per_node", false, "N", num(d.nproc_per_node)},
      {"--nnodes", "run.nnodes", false, "M", num(d.nnodes)},
      {"--node-rank", "run.node_rank", false, "K", num(d.node_rank)},
      {"--master-addr", "run.master_addr", true, "A", d.master_addr},
      {"--master-port", "run.master_port", false, "P", num(d.master_port) + "; 0: a free port, one node"},
      {"--log-dir", "run.log_dir", true, "D", d.log_dir},
      {"--stop-grace-s", "run.stop_grace_s", false, "S", num(d.stop_grace_s)},
      {"--status-every-s", "run.status_every_s", false, "S", num(d.status_every_s)},
  };
}

// The help's usage line names the trainer's part, which CLI11 does not parse.
class Formatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App*, std::string) const override {
    return "Usage: distill-run [OPTIONS] --config F -- TRAINER ARGS...\n";
  }
};

// One value per occurrence (`--set a=1 b=2` is refused), every occurrence kept.
CLI::Option* oneValueEach(CLI::Option* o) {
  return o->expected(1)->allow_extra_args(false)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
}

[[noreturn]] void usage(const std::string& why) { DISTILL_THROW(ConfigError, why, "\n", kUsage); }

// `--set key value` (two words) reads as --set key and a stray value: say the right form.
void checkSetWords(const std::vector<std::string>& words) {
  for (size_t i = 0; i + 1 < words.size(); ++i) {
    if (words[i] != "--set" || words[i + 1].find('=') != std::string::npos) continue;
    const std::string& key = words[i + 1];
    const bool next = i + 2 < words.size() && words[i + 2].rfind("--", 0) != 0;
    usage("--set takes key=value as one word: --set " + key + "=" + (next ? words[i + 2] : "VALUE") + ", not --set " +
          key + (next ? " " + words[i + 2] : ""));
  }
}

} // namespace

std::optional<Args> parseArgs(int argc, char** argv) {
  Args a;
  // Everything after the first "--" is the trainer's, untouched.
  std::vector<std::string> words;
  int i = 1;
  for (; i < argc && std::string(argv[i]) != "--"; ++i) words.push_back(argv[i]);
  for (++i; i < argc; ++i) a.trainer.push_back(argv[i]);
  checkSetWords(words);

  CLI::App app("distill-run: starts the local ranks of one node of a distill job (students and teachers).",
               "distill-run");
  app.footer(kFooter);
  app.formatter(std::make_shared<Formatter>());
  app.get_formatter()->column_width(34);
  app.add_option("--config", a.config, "the job's YAML config (required)")->type_name("F");
  std::vector<std::string> sets;
  CLI::Option* set = oneValueEach(
      app.add_option("--set", sets, "override a config key (one word: key=value), repeatable")->type_name("KEY=VALUE"));
  app.add_flag("--dry-run", a.dryRun, "print the plan (ranks, commands, environment) and start nothing");
  // The loaded library's version (distill.__version__ and distill-teacher --version say the same).
  app.set_version_flag("--version", std::string("distill-run ") + version(), "print distill's version and exit");
  const std::vector<KeyOption> keys = keyOptions();
  std::map<const CLI::Option*, const KeyOption*> byOption;
  std::vector<std::vector<std::string>> values(keys.size());
  for (size_t k = 0; k < keys.size(); ++k) {
    const KeyOption& o = keys[k];
    CLI::Option* opt = oneValueEach(
        app.add_option(o.flag, values[k], std::string(o.key) + " (default " + o.byDefault + ")")->type_name(o.name));
    byOption[opt] = &o;
  }
  std::vector<const char*> cargs{argv[0]};
  for (auto& w : words) cargs.push_back(w.c_str());
  try {
    app.parse(static_cast<int>(cargs.size()), cargs.data());
  } catch (const CLI::CallForHelp&) {
    std::printf("%s", app.help().c_str());
    return std::nullopt;
  } catch (const CLI::CallForVersion& v) {
    std::printf("%s\n", v.what());
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    usage(e.what());
  }
  // The overrides in the order given, whatever the option (later ones win).
  std::map<const CLI::Option*, size_t> used;
  for (const CLI::Option* opt : app.parse_order()) {
    const size_t n = used[opt]++;
    if (opt == set) {
      a.overrides.push_back({sets.at(n), "--set"});
    } else if (auto it = byOption.find(opt); it != byOption.end()) {
      const KeyOption& o = *it->second;
      const std::string& v = opt->results().at(n);
      a.overrides.push_back({o.text ? stringOverride(o.key, v) : o.key + ("=" + v), o.flag});
    }
  }
  if (a.trainer.empty()) usage("no trainer command after --");
  if (a.config.empty()) usage("--config is required");
  return a;
}

} // namespace distill::launcher
