#pragma once

// The CUDA implementation of SlotMemory (slot_memory.h): the consumer's CUDA
// IPC buffer with its flag page, signalled by stream memory operations or by
// the producer's interprocess events (cuda_ipc.h), driven on the current CUDA
// streams. Compiled only when DISTILL_CUDA.

#include "../slot_memory.h"

namespace distill::ipc::cuda {

// See makeDeviceSlotMemory (slot_memory.h).
DeviceSlotMemory makeSlotMemory(const Port& port, const std::vector<RingSide>& in, const std::vector<RingSide>& out,
                                const EndpointOptions& options);

} // namespace distill::ipc::cuda
