// cuda/src/runtime.cu — errors, device queries, buffers and copies of kvscore::cuda.
#include "common.cuh"

#include <cctype>
#include <stdexcept>

#ifndef KVSCORE_CUDA_ARCHS
#define KVSCORE_CUDA_ARCHS ""  // cuda/CMakeLists.txt defines it from CMAKE_CUDA_ARCHITECTURES
#endif

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

DeviceGuard::DeviceGuard(int device) {
  int current = 0;
  if (const cudaError_t e = cudaGetDevice(&current); e != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error(std::string("kvscore::cuda::DeviceGuard: CUDA is not usable in this process: cudaGetDevice: ") +
                    cudaGetErrorName(e) + ": " + cudaGetErrorString(e),
                int(e));
  }
  if (current == device) return;
  KVSCORE_CUDA_CHECK(cudaSetDevice(device));
  previous_ = current;
}
DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0 && cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();
}

bool architecture_supported(const std::string& architectures, int major, int minor) {
  const int cc = major * 10 + minor;
  std::string item;
  auto check = [&](const std::string& a) {
    if (a.empty()) return false;
    if (a == "native" || a == "all" || a == "all-major") return true;
    std::size_t i = 0;
    while (i < a.size() && std::isdigit(static_cast<unsigned char>(a[i]))) ++i;
    if (i == 0) return false;
    const int v = std::stoi(a.substr(0, i));
    const std::string rest = a.substr(i);
    const bool specific = !rest.empty() && (rest[0] == 'a' || rest[0] == 'f');  // 90a, 100f: this GPU only
    const bool real = rest.find("-virtual") == std::string::npos;
    const bool virt = rest.find("-real") == std::string::npos;
    if (specific) return v == cc;
    if (real && v / 10 == major && v % 10 <= minor) return true;  // SASS: same major, minor up
    return virt && v <= cc;                                        // PTX: JIT on later GPUs
  };
  for (char c : architectures + ",") {
    if (c == ',' || c == ';' || c == ' ') {
      if (check(item)) return true;
      item.clear();
    } else {
      item += c;
    }
  }
  return false;
}

RuntimeStatus runtime_status() {
  RuntimeStatus s;
  s.built_architectures = KVSCORE_CUDA_ARCHS;
  (void)cudaRuntimeGetVersion(&s.runtime_version);
  const auto version = [](int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); };
  if (cudaDriverGetVersion(&s.driver_version) != cudaSuccess) s.driver_version = 0;
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  (void)cudaGetLastError();
  if (s.driver_version == 0) {
    s.reason = "no_driver";
    s.message = "no NVIDIA driver (libcuda) in this process; kvscore's CUDA runtime is " + version(s.runtime_version);
    return s;
  }
  if (e == cudaErrorInsufficientDriver) {
    s.reason = "driver_too_old";
    s.message = "the NVIDIA driver supports CUDA " + version(s.driver_version) + ", older than the CUDA " +
                version(s.runtime_version) + " runtime kvscore was built with";
    return s;
  }
  if (e == cudaErrorNoDevice || (e == cudaSuccess && n == 0)) {
    s.reason = "no_device";
    s.message = "the NVIDIA driver (CUDA " + version(s.driver_version) + ") sees no CUDA device";
    return s;
  }
  if (e != cudaSuccess) {
    s.reason = "error";
    s.message = std::string("cudaGetDeviceCount: ") + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
    return s;
  }
  bool any = false;
  std::string names;
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) {
      (void)cudaGetLastError();
      continue;
    }
    RuntimeStatus::Device d;
    d.name = p.name;
    d.major = p.major;
    d.minor = p.minor;
    d.supported = architecture_supported(s.built_architectures, p.major, p.minor);
    any = any || d.supported;
    names += (names.empty() ? "" : "; ") + d.name + " (sm_" + std::to_string(p.major) + std::to_string(p.minor) +
             (d.supported ? ")" : ", not built for)");
    s.devices.push_back(d);
  }
  s.reason = any ? "available" : "arch_not_built";
  s.message = std::to_string(n) + " device(s): " + names + "; built for " +
              (s.built_architectures.empty() ? std::string("(unknown)") : s.built_architectures) + "; CUDA " +
              version(s.runtime_version) + " runtime, driver " + version(s.driver_version);
  return s;
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
