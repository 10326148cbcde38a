// kvscore/cuda/device.hpp — device-memory views, streams, errors and buffers of the CUDA path.
//
// This header needs no CUDA headers: it compiles with any C++20 compiler, and the functions it
// declares live in the compiled library kvscore::cuda (built with -DKVSCORE_CUDA=ON, cuda/).
//
// The memory space is part of the type: DeviceKeysView<T>, DeviceMutKeysView<T> and
// DeviceScoresView are distinct from the CPU views and do not model KeyCacheView (no
// for_each_run), so a device view can never reach a CPU kernel, and a CPU view never reaches a
// GPU kernel. Shape and stride rules are the CPU ones (they are checked by the same code); the
// CUDA entry points also ask the driver where each pointer lives and reject host memory.
//
// Errors: a failing CUDA call throws kvscore::cuda::Error (a std::runtime_error) whose message
// holds the call, cudaGetErrorName and cudaGetErrorString; bad arguments throw
// std::invalid_argument naming the value, before anything is launched.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvscore/core/dtype.hpp"
#include "kvscore/core/view.hpp"

struct CUstream_st;  // = cudaStream_t's pointee (driver_types.h: typedef struct CUstream_st* cudaStream_t)

namespace kvscore::cuda {

/// A CUDA stream (cudaStream_t is CUstream_st*). nullptr = the legacy default stream.
using stream_t = CUstream_st*;

/// Where a view's memory lives (a view type's `space`).
enum class MemorySpace {
  host,    ///< host memory
  device,  ///< CUDA device (or managed) memory
};

/// A CUDA runtime failure; what() = "<call>: <cudaGetErrorName>: <cudaGetErrorString>".
class Error : public std::runtime_error {
 public:
  /// An error carrying the CUDA call's message and its cudaError_t `code`.
  Error(const std::string& what, int code) : std::runtime_error(what), code_(code) {}
  /// The cudaError_t value.
  int code() const noexcept { return code_; }

 private:
  int code_;
};

// ---------------------------------------------------------------- runtime (kvscore::cuda library)

/// Number of CUDA devices usable by this process (0 when there is no driver or no GPU; never throws).
int device_count() noexcept;
/// "<name>, sm_XY, N SMs" of the current device; throws Error without one.
std::string device_description();
/// Throws std::invalid_argument unless `p` is device (or managed) memory; `what` names it in the message.
void require_device_pointer(const void* p, const char* what);
/// cudaStreamSynchronize(stream), errors as Error.
void synchronize(stream_t stream = nullptr);

/// Makes `device` the calling thread's current device for the guard's lifetime and restores the
/// previous one after (cudaGetDevice / cudaSetDevice; nothing is set when it is already current).
/// Every kvscore::cuda call launches on the current device: a caller holding data of another
/// device (torch's cuda:1 while cuda:0 is current) takes a guard first. Throws Error.
class DeviceGuard {
 public:
  /// Makes `device` current (throws Error for a bad device).
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;  // -1: nothing to restore
};

/// Why the CUDA path can or cannot run in this process: what kvscore.cuda_status() reports.
struct RuntimeStatus {
  /// "available", "no_driver" (no libcuda), "driver_too_old" (older than the runtime linked in),
  /// "no_device", "arch_not_built" (no device runs this library's machine code or PTX), "error"
  std::string reason;
  std::string message;              ///< one line for a person, naming what was found
  int driver_version = 0;           ///< cudaDriverGetVersion (0: no driver)
  int runtime_version = 0;          ///< cudaRuntimeGetVersion of the runtime linked in
  std::string built_architectures;  ///< CMAKE_CUDA_ARCHITECTURES of the build, comma-separated
  /// One CUDA device as the driver reports it.
  struct Device {
    std::string name;  ///< the device's name
    int major = 0;  ///< compute capability, major
    int minor = 0;  ///< compute capability, minor
    bool supported = false;  ///< the library holds machine code or PTX this device runs
  };
  std::vector<Device> devices;  ///< every device the driver reports
};
/// Asks the driver without creating a context (device properties only); never throws CUDA errors.
RuntimeStatus runtime_status();
/// Whether a device of compute capability major.minor runs code built for `architectures`
/// (CMAKE_CUDA_ARCHITECTURES items, ',' or ';' separated: "80", "90-real", "90-virtual", "90a",
/// "native", "all"): a real architecture runs on its major version from its minor up (an "a"/"f"
/// one on itself only), PTX on its version and later ones; "native"/"all"/"all-major" count as
/// supported. Pure function (host tests pin it).
bool architecture_supported(const std::string& architectures, int major, int minor);

/// Owning device allocation (cudaMalloc / cudaFree). Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  /// `bytes` of device memory (throws Error when cudaMalloc fails).
  explicit DeviceBuffer(std::size_t bytes);
  ~DeviceBuffer();
  /// Takes `o`'s allocation; `o` is left empty.
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  /// Frees this allocation and takes `o`'s.
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      DeviceBuffer tmp(std::move(*this));
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const noexcept { return p_; }  ///< the device pointer (nullptr when empty)
  /// The device pointer as a T*.
  template <class T>
  T* as() const noexcept { return static_cast<T*>(p_); }
  std::size_t bytes() const noexcept { return n_; }  ///< bytes allocated

 private:
  void* p_ = nullptr;
  std::size_t n_ = 0;
};

/// Synchronous copies (cudaMemcpy), errors as Error.
void copy_to_device(void* dst, const void* src, std::size_t bytes);
/// Synchronous copy of `bytes` from device `src` to host `dst` (cudaMemcpy), errors as Error.
void copy_to_host(void* dst, const void* src, std::size_t bytes);
/// cudaMemcpyAsync host -> device on `stream`. From pageable memory the call returns once `src` has
/// been staged, so `src` may be freed right after (CUDA's documented behaviour).
void copy_to_device_async(void* dst, const void* src, std::size_t bytes, stream_t stream = nullptr);
/// cudaMemcpyAsync device -> device on `stream`.
void copy_device_to_device(void* dst, const void* src, std::size_t bytes, stream_t stream = nullptr);
/// cudaMemsetAsync(p, 0, bytes, stream).
void zero_async(void* p, std::size_t bytes, stream_t stream = nullptr);

// ---------------------------------------------------------------- views

/// Read-only device view of keys [heads][tokens][head_dim], inner stride 1 (KeysView's rules).
template <class T>
class DeviceKeysView {
  static_assert(is_element_type_v<T>, "DeviceKeysView<T>: T must be float, kvscore::half or kvscore::bfloat16");

 public:
  using value_type = T;  ///< the element type: float, kvscore::half or kvscore::bfloat16
  static constexpr MemorySpace space = MemorySpace::device;  ///< the memory this view's data lives in

  DeviceKeysView() = default;
  /// Element (h, t, j) at data[h*head_stride + t*token_stride + j]; `data` is device memory.
  DeviceKeysView(const T* data, std::int64_t heads, std::int64_t tokens, std::int64_t head_dim,
                 std::int64_t head_stride, std::int64_t token_stride)
      : v_(data, heads, tokens, head_dim, head_stride, token_stride) {}
  /// One batch row of an HF cache [batch, kv_heads, seq, head_dim] in device memory.
  static DeviceKeysView hf(const T* layer, std::int64_t batch_index, std::int64_t batch, std::int64_t kv_heads,
                           std::int64_t seq, std::int64_t head_dim, std::int64_t capacity = -1) {
    return DeviceKeysView(KeysView<T>::hf(layer, batch_index, batch, kv_heads, seq, head_dim, capacity));
  }
  /// Token-major cache [tokens, kv_heads, head_dim] in device memory.
  static DeviceKeysView token_major(const T* data, std::int64_t tokens, std::int64_t kv_heads,
                                    std::int64_t head_dim) {
    return DeviceKeysView(KeysView<T>::token_major(data, tokens, kv_heads, head_dim));
  }

  const T* data() const noexcept { return v_.data(); }  ///< the first element (device memory)
  std::int64_t heads() const noexcept { return v_.heads(); }  ///< heads of the view
  std::int64_t tokens() const noexcept { return v_.tokens(); }  ///< tokens of each head
  std::int64_t head_dim() const noexcept { return v_.head_dim(); }  ///< elements per key row (contiguous)
  std::int64_t head_stride() const noexcept { return v_.head_stride(); }  ///< elements between two heads
  std::int64_t token_stride() const noexcept { return v_.token_stride(); }  ///< elements between two tokens of a head
  bool empty() const noexcept { return v_.empty(); }  ///< true when there is nothing to read

 private:
  explicit DeviceKeysView(const KeysView<T>& v) : v_(v) {}
  KeysView<T> v_;  // validation and arithmetic only: never dereferenced on the host
};

/// Writable device view of keys or values [heads][tokens][head_dim] (compaction).
template <class T>
class DeviceMutKeysView : public kvscore::detail::WritableShell<DeviceKeysView<T>> {
  using Shell = kvscore::detail::WritableShell<DeviceKeysView<T>>;

 public:
  static constexpr MemorySpace space = MemorySpace::device;  ///< the memory this view's data lives in

  DeviceMutKeysView() = default;
  /// Element (h, t, j) at data[h*head_stride + t*token_stride + j], device memory (DeviceKeysView's checks).
  DeviceMutKeysView(T* data, std::int64_t heads, std::int64_t tokens, std::int64_t head_dim,
                    std::int64_t head_stride, std::int64_t token_stride)
      : Shell(DeviceKeysView<T>(data, heads, tokens, head_dim, head_stride, token_stride), data) {}
  /// One batch row of an HF cache [batch, kv_heads, seq, head_dim] in device memory, writable.
  static DeviceMutKeysView hf(T* layer, std::int64_t batch_index, std::int64_t batch, std::int64_t kv_heads,
                              std::int64_t seq, std::int64_t head_dim, std::int64_t capacity = -1) {
    const DeviceKeysView<T> v = DeviceKeysView<T>::hf(layer, batch_index, batch, kv_heads, seq, head_dim, capacity);
    return DeviceMutKeysView(const_cast<T*>(v.data()), v.heads(), v.tokens(), v.head_dim(), v.head_stride(),
                             v.token_stride());
  }
  /// Token-major cache [tokens, kv_heads, head_dim] in device memory, writable.
  static DeviceMutKeysView token_major(T* data, std::int64_t tokens, std::int64_t kv_heads, std::int64_t head_dim) {
    const DeviceKeysView<T> v = DeviceKeysView<T>::token_major(data, tokens, kv_heads, head_dim);
    return DeviceMutKeysView(data, v.heads(), v.tokens(), v.head_dim(), v.head_stride(), v.token_stride());
  }
};

/// Device fp32 scores [heads][tokens], token stride 1 (ScoresView's rules).
class DeviceScoresView {
 public:
  static constexpr MemorySpace space = MemorySpace::device;  ///< the memory this view's data lives in
  DeviceScoresView() = default;
  /// `heads` rows of `tokens` fp32 scores in device memory, `head_stride` apart (-1: `tokens`); ScoresView's
  /// checks.
  DeviceScoresView(float* data, std::int64_t heads, std::int64_t tokens, std::int64_t head_stride = -1)
      : v_(data, heads, tokens, head_stride) {}
  float* data() const noexcept { return v_.data(); }  ///< the first score (device memory)
  std::int64_t heads() const noexcept { return v_.heads(); }  ///< rows (heads)
  std::int64_t tokens() const noexcept { return v_.tokens(); }  ///< scores per row (tokens)
  std::int64_t head_stride() const noexcept { return v_.head_stride(); }  ///< elements between two rows

 private:
  ScoresView v_;  // validation only: never dereferenced on the host
};

/// Caller-owned device scratch memory (any alignment; the kernels align it to 256 bytes).
struct Workspace {
  void* data = nullptr;  ///< the device memory (nullptr with 0 bytes)
  std::size_t bytes = 0;  ///< its size in bytes
};

}  // namespace kvscore::cuda
