#pragma once

// The demo's closing step: from the finished phases under run.log_dir it writes
// summary.json
//   {"teacher_val_loss":…, "label_only_val_loss":…, "distilled_val_loss":…, "steps":…, "seconds":…}
// (seconds: the three phases' training time, summed over interruptions) and
// prints the closing table; then examples/gpt/plot.py (matplotlib) draws
// val_loss.png (validation loss against step, distilled and label-only
// students, the teacher as a dashed line). Returns 0, or 1 naming a phase that
// is not finished or the plot that was not drawn.

#include "distill/core/options.h"

namespace distill::examples {

int report(const Config& cfg);

} // namespace distill::examples
