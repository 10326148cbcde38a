// cuda/src/runtime.cu — errors, device queries, buffers and copies of kvscore::cuda.
#include "common.cuh"

#include <stdexcept>

namespace kvscore::cuda {

namespace detail {

void throw_cuda(cudaError_t e, const char* call, const char* file, int line) {
  throw Error(std::string(call) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e) + " (" + file + ":" +
                  std::to_string(line) + ")",
              int(e));
}

void require_no_pending_error(const char* who) {
  const cudaError_t e = cudaPeekAtLastError();
  if (e == cudaSuccess) return;
  // Without a usable driver or device every CUDA call returns the runtime's initialisation error,
  // the peek included: that is nobody's stale error, so it is reported as what it is.
  int dev = 0;
  if (const cudaError_t u = cudaGetDevice(&dev); u != cudaSuccess)
    throw Error(std::string(who) + ": CUDA is not usable in this process: cudaGetDevice: " + cudaGetErrorName(u) +
                    ": " + cudaGetErrorString(u),
                int(u));
  throw Error(std::string(who) + ": a CUDA error was already pending before this call (" + cudaGetErrorName(e) +
                  ": " + cudaGetErrorString(e) +
                  "), left by an earlier CUDA call on this host thread; kvscore launched nothing and left the error "
                  "pending for its owner (take it with cudaGetLastError(); a sticky error such as "
                  "cudaErrorIllegalAddress cannot be taken: the context is unusable)",
              int(e));
}

void require_workspace(const Workspace& ws, std::size_t need, const char* who) {
  if (need == 0) return;
  if (ws.data == nullptr || ws.bytes < need)
    throw std::invalid_argument(std::string(who) + ": workspace of " + std::to_string(ws.data ? ws.bytes : 0) +
                                " bytes is smaller than the " + std::to_string(need) +
                                " bytes needed (see the *_workspace_bytes query)");
  require_device_pointer(ws.data, "workspace");
}

}  // namespace detail

int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device / no driver" error
    return 0;
  }
  return n;
}

std::string device_description() {
  int dev = 0;
  KVSCORE_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp p{};
  KVSCORE_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  return std::string(p.name) + ", sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
         std::to_string(p.multiProcessorCount) + " SMs";
}

void require_device_pointer(const void* p, const char* what) {
  if (p == nullptr) return;  // null with an empty shape is checked by the views
  cudaPointerAttributes a{};
  const cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    detail::throw_cuda(e, "cudaPointerGetAttributes", __FILE__, __LINE__);
  }
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
    throw std::invalid_argument(std::string("kvscore::cuda: ") + what + " is not device memory (cudaMemoryType " +
                                std::to_string(int(a.type)) + ")");
}

void synchronize(stream_t stream) { KVSCORE_CUDA_CHECK(cudaStreamSynchronize(stream)); }

DeviceBuffer::DeviceBuffer(std::size_t bytes) : n_(bytes) {
  if (bytes > 0) KVSCORE_CUDA_CHECK(cudaMalloc(&p_, bytes));
}
DeviceBuffer::~DeviceBuffer() {
  if (p_ != nullptr) (void)cudaFree(p_);
}

void copy_to_device(void* dst, const void* src, std::size_t bytes) {
  if (bytes > 0) KVSCORE_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}
void copy_to_host(void* dst, const void* src, std::size_t bytes) {
  if (bytes > 0) KVSCORE_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}
void copy_to_device_async(void* dst, const void* src, std::size_t bytes, stream_t stream) {
  if (bytes > 0) KVSCORE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
}
void copy_device_to_device(void* dst, const void* src, std::size_t bytes, stream_t stream) {
  if (bytes > 0) KVSCORE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
}
void zero_async(void* p, std::size_t bytes, stream_t stream) {
  if (bytes > 0) KVSCORE_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream));
}

}  // namespace kvscore::cuda
