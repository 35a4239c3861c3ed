#include "distill/student/teacher_head.h"

#include <ATen/ATen.h>

#include "distill/core/errors.h"
#include "distill/core/logging.h"

namespace distill {

namespace {

at::ScalarType scalarType(ipc::HeadDType d) {
  switch (d) {
    case ipc::HeadDType::kFloat32:
      return at::kFloat;
    case ipc::HeadDType::kFloat16:
      return at::kHalf;
    case ipc::HeadDType::kBFloat16:
      return at::kBFloat16;
  }
  DISTILL_INTERNAL_ASSERT(false, "head dtype ", uint32_t(d), " passed validation");
}

// A tensor over read-only mapped bytes; its deleter holds the mapping.
at::Tensor view(const void* data, at::IntArrayRef shape, at::ScalarType type, std::shared_ptr<const void> keep) {
  // from_blob wants void*: the memory is PROT_READ and only ever read (teacher_head.h).
  return at::from_blob(
      const_cast<void*>(data), shape, [keep = std::move(keep)](void*) mutable { keep.reset(); },
      at::TensorOptions().dtype(type).device(at::kCPU));
}

} // namespace

TeacherHead teacherHeadView(const ipc::SharedHead& shared) {
  const at::ScalarType type = scalarType(shared.dtype());
  TeacherHead h;
  h.weight = view(shared.weight(), {shared.vocab(), shared.dim()}, type, shared.keepAlive());
  if (shared.hasBias()) h.bias = view(shared.bias(), {shared.vocab()}, type, shared.keepAlive());
  h.softcap = shared.softcap();
  h.scale = shared.scale();
  validateTeacherHead(h);
  return h;
}

TeacherHead teacherHeadOn(const ipc::SharedHead& shared, const TeacherHead& mapped, const at::Device& device,
                          const std::string& segmentName, const ipc::HeadReader& reader, Deadline deadline) {
  if (device.is_cpu()) return mapped;
  if (device.is_cuda() && ipc::DeviceHead::available()) {
    const int ordinal = device.has_index() ? device.index() : 0;
    try {
      ipc::DeviceHead d = ipc::DeviceHead::share(segmentName, shared, ordinal, reader, deadline);
      const at::ScalarType type = scalarType(shared.dtype());
      const auto on = at::TensorOptions().dtype(type).device(at::Device(at::kCUDA, ordinal));
      TeacherHead h = mapped;
      h.weight = at::from_blob(
          d.weight(), {shared.vocab(), shared.dim()}, [keep = d.keepAlive()](void*) mutable { keep.reset(); }, on);
      if (shared.hasBias()) {
        h.bias = at::from_blob(d.bias(), {shared.vocab()}, [keep = d.keepAlive()](void*) mutable { keep.reset(); }, on);
      }
      DISTILL_LOG(kInfo) << reader.role << " rank " << reader.rank << " "
                         << (d.owner() ? "copied the teacher's head to " : "shares the teacher's head on ")
                         << device.str() << " (/dev/shm/" << d.recordName() << ", one copy per device)";
      return h;
    } catch (const std::exception& e) {
      const auto* de = dynamic_cast<const Error*>(&e); // its words, not its file and line
      DISTILL_LOG(kWarning) << reader.role << " rank " << reader.rank << ": the teacher's head is not shared on "
                            << device.str() << " (" << (de ? de->message() : std::string(e.what()))
                            << "): this student copies it there for itself";
    }
  }
  TeacherHead h = mapped;
  h.weight = mapped.weight.to(device);
  if (mapped.bias.defined()) h.bias = mapped.bias.to(device);
  return h;
}

MappedTeacherHead::MappedTeacherHead(std::string segmentName, ipc::HeadReader reader, HeadChange onChange,
                                     ipc::SharedHead shared)
    : segmentName_(std::move(segmentName)),
      reader_(std::move(reader)),
      onChange_(onChange),
      shared_(std::move(shared)),
      head_(teacherHeadView(shared_)) {}

MappedTeacherHead MappedTeacherHead::open(const std::string& segmentName, const ipc::HeadReader& reader,
                                          Deadline deadline, HeadChange onChange) {
  return MappedTeacherHead(segmentName, reader, onChange, ipc::SharedHead::open(segmentName, reader, deadline));
}

bool MappedTeacherHead::adopt(ipc::SharedHead next) {
  const bool changed = next.fingerprint() != shared_.fingerprint();
  if (changed && onChange_ == HeadChange::kRefuse)
    DISTILL_THROW(IpcError, reader_.role, " rank ", reader_.rank, ": the teacher's head '/dev/shm/", next.objectName(),
                  "' changed after a teacher restart: fingerprint ", shared_.fingerprint(), " (generation ",
                  shared_.generation(), ") became ", next.fingerprint(), " (generation ", next.generation(),
                  ", published by pid ", next.publisherPid(), "); a student may not change teachers mid-run");
  if (changed) {
    DISTILL_LOG(kWarning) << reader_.role << " rank " << reader_.rank << ": the teacher's head changed after a restart: "
                          << shared_.fingerprint() << " -> " << next.fingerprint() << " (generation "
                          << next.generation() << "); using the new one";
  }
  head_ = teacherHeadView(next);
  shared_ = std::move(next);
  return changed;
}

bool MappedTeacherHead::awaitRepublished(Deadline deadline) {
  return adopt(ipc::SharedHead::open(segmentName_, reader_, deadline, shared_.generation()));
}

bool MappedTeacherHead::checkForChange() {
  if (!shared_.replaced()) return false;
  try {
    return adopt(ipc::SharedHead::open(segmentName_, reader_, Deadline::after(Clock::duration::zero()),
                                       shared_.generation()));
  } catch (const TimeoutError&) {
    return false; // removed (the job ends): the head held stays valid
  }
}

} // namespace distill
