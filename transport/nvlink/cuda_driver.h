// The CUDA driver API, loaded at run time: varcomm links no CUDA library and
// includes no CUDA header, so it builds without a CUDA include path and
// imports on machines with no GPU or driver. The few driver types, constants
// and entry points used here are declared below (the driver's C ABI is
// stable); every function is resolved with dlsym from libcuda.so.1, the
// driver that torch and every CUDA runtime share in a process.
// transport/nvlink/abi_check.cc checks these declarations against <cuda.h>.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

struct CUctx_st;     // as in <cuda.h>: opaque handles
struct CUstream_st;
struct CUmod_st;
struct CUfunc_st;
struct CUevent_st;

namespace varcomm {
namespace cu {

using CUresult = int;  // enum cudaError_enum
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = ::CUctx_st*;
using CUstream = ::CUstream_st*;
using CUmodule = ::CUmod_st*;
using CUfunction = ::CUfunc_st*;
using CUevent = ::CUevent_st*;
using CUdevice_attribute = int;
using CUpointer_attribute = int;
using CUstreamCaptureStatus = int;
using CUstreamCaptureMode = int;
using cuuint64_t = std::uint64_t;
struct CUipcMemHandle {
  char reserved[64];
};

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_NOT_READY = 600;
constexpr CUresult CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS = 122;
constexpr CUpointer_attribute CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2;
constexpr unsigned int CU_MEMORYTYPE_HOST = 1;
constexpr CUstreamCaptureStatus CU_STREAM_CAPTURE_STATUS_NONE = 0;
constexpr CUstreamCaptureMode CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1;
constexpr CUstreamCaptureMode CU_STREAM_CAPTURE_MODE_RELAXED = 2;
// CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED .. _WRONG_THREAD: a call refused
// because of a graph capture, not a failure of the work it asks about.
constexpr CUresult kCaptureErrorFirst = 900, kCaptureErrorLast = 908;
constexpr unsigned int CU_STREAM_NON_BLOCKING = 1;
constexpr unsigned int CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1;
// CU_MEMHOSTREGISTER_* are macros in <cuda.h>: other names here.
constexpr unsigned int kHostRegisterPortable = 1;
constexpr unsigned int kHostRegisterDeviceMap = 2;
constexpr unsigned int CU_STREAM_WRITE_VALUE_DEFAULT = 0;
constexpr unsigned int CU_STREAM_WAIT_VALUE_GEQ = 0;
constexpr unsigned int CU_EVENT_DISABLE_TIMING = 2;
// GPUDirect RDMA (rdma-gpu): whether the GPU orders a NIC's writes into its
// memory before a later consumer on it, else how to flush them (CUDA 11.3+).
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED = 116;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS = 117;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING = 118;
constexpr int CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST = 1;
constexpr int CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER = 100;
constexpr int CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX = 0;
constexpr int CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER = 100;

// X(member, return type, parameters, symbols to try in order). The symbols are
// the versioned names that <cuda.h>'s macros select (cuMemAlloc -> cuMemAlloc_v2).
#define VARCOMM_CU_FUNCTIONS(X)                                                                                   \
  X(Init, CUresult, (unsigned int flags), "cuInit")                                                               \
  X(DriverGetVersion, CUresult, (int* version), "cuDriverGetVersion")                                             \
  X(GetErrorName, CUresult, (CUresult error, const char** str), "cuGetErrorName")                                 \
  X(GetErrorString, CUresult, (CUresult error, const char** str), "cuGetErrorString")                             \
  X(DeviceGetCount, CUresult, (int* count), "cuDeviceGetCount")                                                   \
  X(DeviceGet, CUresult, (CUdevice * device, int ordinal), "cuDeviceGet")                                         \
  X(DeviceGetName, CUresult, (char* name, int len, CUdevice dev), "cuDeviceGetName")                              \
  X(DeviceGetAttribute, CUresult, (int* pi, CUdevice_attribute attrib, CUdevice dev), "cuDeviceGetAttribute")     \
  X(DeviceGetPCIBusId, CUresult, (char* bus, int len, CUdevice dev), "cuDeviceGetPCIBusId")                       \
  X(DeviceCanAccessPeer, CUresult, (int* can, CUdevice dev, CUdevice peer), "cuDeviceCanAccessPeer")              \
  X(DevicePrimaryCtxRetain, CUresult, (CUcontext * pctx, CUdevice dev), "cuDevicePrimaryCtxRetain")               \
  X(DevicePrimaryCtxRelease, CUresult, (CUdevice dev), "cuDevicePrimaryCtxRelease_v2",                            \
    "cuDevicePrimaryCtxRelease")                                                                                  \
  X(CtxGetCurrent, CUresult, (CUcontext * pctx), "cuCtxGetCurrent")                                               \
  X(CtxPushCurrent, CUresult, (CUcontext ctx), "cuCtxPushCurrent_v2")                                             \
  X(CtxPopCurrent, CUresult, (CUcontext * pctx), "cuCtxPopCurrent_v2")                                            \
  X(MemAlloc, CUresult, (CUdeviceptr * dptr, size_t bytesize), "cuMemAlloc_v2")                                   \
  X(MemFree, CUresult, (CUdeviceptr dptr), "cuMemFree_v2")                                                        \
  /* Stream-ordered (11.2+): a device send's staging copy, freed after its write. */                              \
  X(MemAllocAsync, CUresult, (CUdeviceptr * dptr, size_t bytesize, CUstream stream), "cuMemAllocAsync")           \
  X(MemFreeAsync, CUresult, (CUdeviceptr dptr, CUstream stream), "cuMemFreeAsync")                                \
  X(MemsetD8Async, CUresult, (CUdeviceptr dst, unsigned char uc, size_t n, CUstream stream), "cuMemsetD8Async")   \
  X(MemcpyAsync, CUresult, (CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream), "cuMemcpyAsync")        \
  X(MemHostRegister, CUresult, (void* p, size_t bytesize, unsigned int flags), "cuMemHostRegister_v2",            \
    "cuMemHostRegister")                                                                                          \
  X(MemHostUnregister, CUresult, (void* p), "cuMemHostUnregister")                                                \
  X(MemHostGetDevicePointer, CUresult, (CUdeviceptr * pdptr, void* p, unsigned int flags),                        \
    "cuMemHostGetDevicePointer_v2")                                                                               \
  X(PointerGetAttribute, CUresult, (void* data, CUpointer_attribute attribute, CUdeviceptr ptr),                  \
    "cuPointerGetAttribute")                                                                                      \
  X(IpcGetMemHandle, CUresult, (CUipcMemHandle * handle, CUdeviceptr dptr), "cuIpcGetMemHandle")                  \
  X(IpcOpenMemHandle, CUresult, (CUdeviceptr * pdptr, CUipcMemHandle handle, unsigned int flags),                 \
    "cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle")                                                                \
  X(IpcCloseMemHandle, CUresult, (CUdeviceptr dptr), "cuIpcCloseMemHandle")                                       \
  X(StreamCreate, CUresult, (CUstream * pstream, unsigned int flags), "cuStreamCreate")                           \
  X(StreamDestroy, CUresult, (CUstream stream), "cuStreamDestroy_v2")                                             \
  X(StreamSynchronize, CUresult, (CUstream stream), "cuStreamSynchronize")                                        \
  X(StreamQuery, CUresult, (CUstream stream), "cuStreamQuery")                                                    \
  X(StreamGetCtx, CUresult, (CUstream stream, CUcontext * pctx), "cuStreamGetCtx")                                \
  X(StreamIsCapturing, CUresult, (CUstream stream, CUstreamCaptureStatus * status), "cuStreamIsCapturing")        \
  X(ThreadExchangeStreamCaptureMode, CUresult, (CUstreamCaptureMode * mode), "cuThreadExchangeStreamCaptureMode") \
  /* Events: "the work enqueued so far on a stream ran", without keeping the */                                   \
  /* stream (its owner may destroy it) nor waiting for its later work. */                                         \
  X(EventCreate, CUresult, (CUevent * event, unsigned int flags), "cuEventCreate")                                \
  X(EventRecord, CUresult, (CUevent event, CUstream stream), "cuEventRecord")                                     \
  X(EventQuery, CUresult, (CUevent event), "cuEventQuery")                                                        \
  X(EventSynchronize, CUresult, (CUevent event), "cuEventSynchronize")                                            \
  X(EventDestroy, CUresult, (CUevent event), "cuEventDestroy_v2")                                                 \
  X(StreamWaitEvent, CUresult, (CUstream stream, CUevent event, unsigned int flags), "cuStreamWaitEvent")         \
  /* The _v2 stream memory operations (driver 11.7+) need no opt-in; the first */                                 \
  /* ones needed CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS. */                                                   \
  X(StreamWriteValue64, CUresult, (CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags),      \
    "cuStreamWriteValue64_v2", "cuStreamWriteValue64")                                                            \
  X(StreamWaitValue64, CUresult, (CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags),       \
    "cuStreamWaitValue64_v2", "cuStreamWaitValue64")                                                              \
  /* The small-message kernel (kernels.cu, embedded as a fatbin): no libcudart. */                                \
  X(ModuleLoadData, CUresult, (CUmodule * module, const void* image), "cuModuleLoadData")                         \
  X(ModuleUnload, CUresult, (CUmodule module), "cuModuleUnload")                                                  \
  X(ModuleGetFunction, CUresult, (CUfunction * fn, CUmodule module, const char* name), "cuModuleGetFunction")     \
  X(LaunchKernel, CUresult,                                                                                       \
    (CUfunction f, unsigned int gridX, unsigned int gridY, unsigned int gridZ, unsigned int blockX,               \
     unsigned int blockY, unsigned int blockZ, unsigned int sharedMemBytes, CUstream stream, void** kernelParams, \
     void** extra),                                                                                               \
    "cuLaunchKernel")

struct Driver {
#define VARCOMM_CU_MEMBER(member, ret, params, ...) ret(*member) params = nullptr;
  VARCOMM_CU_FUNCTIONS(VARCOMM_CU_MEMBER)
#undef VARCOMM_CU_MEMBER
  int version = 0;  // cuDriverGetVersion, e.g. 13000
  // Optional (null where the driver lacks it): makes a NIC's earlier writes
  // into this context's memory visible to its later work (GPUDirect RDMA).
  CUresult (*FlushGPUDirectRDMAWrites)(int target, int scope) = nullptr;
  // The CPU stand-in (transport/nvlink/fake_libcuda.cc), whose "device
  // memory" is host memory: a NIC registers it as such (rdma-gpu).
  bool stand_in = false;
};

// The loaded driver, or nullptr; `why` (may be null) gets the reason. Loads it
// and calls cuInit(0) once per process: do not call it in a process that
// forks CUDA-using children afterwards.
const Driver* driver(std::string* why = nullptr);

// Host memory registered with the driver (cuMemHostRegister, device-mapped)
// once per process, whoever asks first: nvlink and rdma-gpu may both need the
// same region, and the driver refuses a second registration of one range.
// Counted; the device address of `base`, or 0 with *why on failure (also when
// an earlier registration of `base` is shorter than len).
CUdeviceptr host_register(const Driver& d, void* base, size_t len, std::string* why);
void host_unregister(const Driver& d, void* base);

// "cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY (out of memory)".
std::string error_string(const Driver& d, CUresult r, const char* what);

// What every device transport (`who`: "nvlink", "rdma-gpu") requires of a
// caller's stream, throwing Error(Invalid) otherwise: a stream of our GPU
// (`ctx`, cuda:`ordinal`), not capturing a graph (sequence numbers and
// credits are host state, so a replay would repeat a message's slot and number).
void check_stream(const Driver& d, CUcontext ctx, int ordinal, CUstream s, const char* op, const char* who);

// Transport::copy_async for every device transport: n bytes between device
// and/or host memory (unified addressing) on `stream`, after its earlier
// work, in `ctx`; with `mark`, returns an event recorded after the copy
// (null when n is 0), for copied().
CUevent copy_async(const Driver& d, CUcontext ctx, int ordinal, const char* who, void* dst, const void* src,
                   size_t n, std::uintptr_t stream, bool mark);
// Transport::stage_async / unstage_async for every device transport: a copy
// of n bytes at src in stream-ordered memory (cuMemAllocAsync) made on
// `stream` now, and its stream-ordered free.
void* stage_async(const Driver& d, CUcontext ctx, const char* who, const void* src, size_t n, std::uintptr_t stream);
void unstage_async(const Driver& d, CUcontext ctx, void* staged, std::uintptr_t stream);
// Transport::copy_done: whether the copy `ev` marks ran (`wait`: blocks until
// it has); once true (also on a driver error: nothing more runs), `ev` is destroyed.
bool copied(const Driver& d, CUcontext ctx, CUevent ev, bool wait);
// What a cuEventQuery / cuEventSynchronize answer says of the work before the
// event: it ran (CUDA_SUCCESS), or never will (a sticky error). Not ready, or
// refused because of a graph capture, is not done: memory the work uses is
// not freed on that answer.
inline bool event_done(CUresult r) {
  return r != CUDA_ERROR_NOT_READY && (r < kCaptureErrorFirst || r > kCaptureErrorLast);
}

// This thread's graph-capture mode for the scope (cuThreadExchangeStreamCaptureMode).
class CaptureModeScope {
 public:
  CaptureModeScope(const Driver& d, CUstreamCaptureMode mode) : d_(d), mode_(mode) {
    d_.ThreadExchangeStreamCaptureMode(&mode_);
  }
  ~CaptureModeScope() { d_.ThreadExchangeStreamCaptureMode(&mode_); }
  CaptureModeScope(const CaptureModeScope&) = delete;
  CaptureModeScope& operator=(const CaptureModeScope&) = delete;

 private:
  const Driver& d_;
  CUstreamCaptureMode mode_;
};

// Makes `ctx` current for the scope when another (or none) is, and restores
// it. Within it this thread's capture mode is THREAD_LOCAL: its event
// queries, synchronizations and frees (progress on behalf of any caller) do
// not invalidate a graph another thread captures in GLOBAL mode (PyTorch's
// default), as PyTorch's own NCCL watchdog does; a capture on this very
// thread still refuses them, so callers check their stream first.
class CtxScope {
 public:
  CtxScope(const Driver& d, CUcontext ctx) : d_(d), mode_(d, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) {
    CUcontext cur = nullptr;
    d_.CtxGetCurrent(&cur);
    if (cur != ctx) pushed_ = d_.CtxPushCurrent(ctx) == CUDA_SUCCESS;
  }
  ~CtxScope() {
    if (pushed_) {
      CUcontext old;
      d_.CtxPopCurrent(&old);
    }
  }
  CtxScope(const CtxScope&) = delete;
  CtxScope& operator=(const CtxScope&) = delete;

 private:
  const Driver& d_;
  CaptureModeScope mode_;
  bool pushed_ = false;
};

}  // namespace cu
}  // namespace varcomm
