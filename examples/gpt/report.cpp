#include "report.h"

#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "demo_support.h"
#include "png.h"

namespace distill::examples {
namespace {

struct PhaseResult {
  std::string name;
  std::map<std::string, std::string> done;                 // done.json ({} if missing)
  std::vector<std::pair<double, double>> val;              // (step, val_loss) of the last launch per step
  double valLoss() const { return jsonNumber(done, "val_loss", NAN); }
  double seconds() const { return jsonNumber(done, "seconds", 0); }
};

PhaseResult readPhase(const std::string& logDir, const std::string& name) {
  PhaseResult r;
  r.name = name;
  const std::string dir = logDir + "/" + name;
  const std::string done = readText(dir + "/done.json");
  if (!done.empty()) r.done = parseJson(done);
  std::map<double, double> byStep;
  std::istringstream in(readText(dir + "/metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    auto rec = parseJson(line);
    if (rec.count("val_loss")) byStep[jsonNumber(rec, "step", 0)] = jsonNumber(rec, "val_loss", NAN);
  }
  r.val.assign(byStep.begin(), byStep.end());
  return r;
}

}  // namespace

int report(const Config& cfg) {
  const std::string& logDir = cfg.run.log_dir;
  PhaseResult teacher = readPhase(logDir, "teacher");
  PhaseResult labelOnly = readPhase(logDir, "label_only");
  PhaseResult distilled = readPhase(logDir, "distilled");
  for (const PhaseResult* p : {&teacher, &labelOnly, &distilled}) {
    if (p->done.empty()) {
      std::fprintf(stderr, "report: phase %s is not finished (%s/%s/done.json missing)\n", p->name.c_str(),
                   logDir.c_str(), p->name.c_str());
      return 1;
    }
  }
  const int64_t steps = static_cast<int64_t>(jsonNumber(distilled.done, "steps", 0));
  if (static_cast<int64_t>(jsonNumber(labelOnly.done, "steps", -1)) != steps) {
    std::fprintf(stderr, "report: label-only ran %lld steps, the distilled run %lld: not comparable\n",
                 static_cast<long long>(jsonNumber(labelOnly.done, "steps", -1)), static_cast<long long>(steps));
    return 1;
  }

  // The plot.
  std::vector<Series> series;
  Series d{"distilled student", distilled.val, 0x1f77b4, false};
  Series l{"label-only student", labelOnly.val, 0xff7f0e, false};
  Series t{"teacher", {{0.0, teacher.valLoss()}, {static_cast<double>(steps), teacher.valLoss()}}, 0x555555, true};
  ChartOptions o;
  o.title = "validation loss, " + std::to_string(steps) + " steps, same data and seed";
  o.xLabel = "step";
  o.yLabel = "validation loss (nats/byte)";
  const std::string png = logDir + "/val_loss.png";
  writePng(png, renderChart({d, l, t}, o));

  const double seconds = teacher.seconds() + labelOnly.seconds() + distilled.seconds();
  const std::string summary = JsonLine()
                                  .add("teacher_val_loss", teacher.valLoss())
                                  .add("label_only_val_loss", labelOnly.valLoss())
                                  .add("distilled_val_loss", distilled.valLoss())
                                  .add("steps", steps)
                                  .add("seconds", seconds)
                                  .str();
  writeTextAtomic(logDir + "/summary.json", summary + "\n");

  auto params = [](const PhaseResult& p) { return jsonNumber(p.done, "parameters", 0) / 1e6; };
  std::printf("\n%-22s %12s %12s %10s\n", "model", "parameters", "val loss", "train s");
  std::printf("%-22s %11.2fM %12.4f %10.1f\n", "teacher", params(teacher), teacher.valLoss(), teacher.seconds());
  std::printf("%-22s %11.2fM %12.4f %10.1f\n", "label-only student", params(labelOnly), labelOnly.valLoss(),
              labelOnly.seconds());
  std::printf("%-22s %11.2fM %12.4f %10.1f\n", "distilled student", params(distilled), distilled.valLoss(),
              distilled.seconds());
  const double gain = labelOnly.valLoss() - distilled.valLoss();
  std::printf("\nvalidation loss in nats per byte on the held-out %s; %lld student steps.\n",
              "tail of the data", static_cast<long long>(steps));
  if (gain > 0) {
    std::printf("the distilled student beats the label-only one by %.4f nats/byte (%.1f%%).\n", gain,
                100 * gain / labelOnly.valLoss());
  } else {
    std::printf("the distilled student does NOT beat the label-only one (%+.4f nats/byte).\n", -gain);
  }
  std::printf("plot: %s\nsummary: %s/summary.json\n", png.c_str(), logDir.c_str());
  return 0;
}

}  // namespace distill::examples
