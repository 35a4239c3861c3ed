#pragma once

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include "distill/core/options.h"

namespace distill {

// teacher.autocast: float16/bfloat16 autocast around forward on the teacher's
// device type, cpu or cuda (restored on scope exit). torch's autocast state is
// per thread: a Python teacher's forward (distill.serve), called on this
// thread, runs under it as under torch.autocast(device_type, dtype).
class AutocastScope {
 public:
  AutocastScope(const TeacherOptions& o, const at::Device& device) : type_(device.type()) {
    if (o.autocast == Autocast::kNone) return;
    wasEnabled_ = at::autocast::is_autocast_enabled(type_);
    wasDtype_ = at::autocast::get_autocast_dtype(type_);
    active_ = true;
    at::autocast::set_autocast_enabled(type_, true);
    at::autocast::set_autocast_dtype(type_, o.autocast == Autocast::kFloat16 ? at::kHalf : at::kBFloat16);
  }
  ~AutocastScope() {
    if (!active_) return;
    at::autocast::set_autocast_enabled(type_, wasEnabled_);
    at::autocast::set_autocast_dtype(type_, wasDtype_);
    at::autocast::clear_cache();
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  at::DeviceType type_;
  bool active_ = false;
  bool wasEnabled_ = false;
  at::ScalarType wasDtype_ = at::kBFloat16;
};

} // namespace distill
