#include "slot_memory.h"

#include <cstring>

#include "distill/build_config.h"
#include "distill/core/errors.h"
#include "distill/ipc/channel.h"
#include "port.h"
#if DISTILL_CUDA
#include "cuda/cuda_slot_memory.h"
#endif

namespace distill::ipc {

void HostSlotMemory::write(uint64_t seq, uint64_t offset, const at::Tensor& t) {
  std::memcpy(data(seq, offset), t.data_ptr(), t.nbytes());
}

DeviceSlotMemory makeDeviceSlotMemory(const Port& port, const std::vector<RingSide>& in,
                                      const std::vector<RingSide>& out, const EndpointOptions& options) {
#if DISTILL_CUDA
  return cuda::makeSlotMemory(port, in, out, options);
#else
  (void)in;
  (void)out;
  DISTILL_CHECK_T(IpcError, options.cudaIpc != CudaIpc::kOn, port.describeSelf(),
                  ": transport.cuda_ipc=on but distill was built without CUDA (DISTILL_CUDA=0)");
  return {};
#endif
}

} // namespace distill::ipc
