// Checks transport/nvlink/cuda_driver.h's hand-written driver declarations
// against the real <cuda.h> (not part of the build: setup.py compiles *.cpp
// and *.cu only). Run from the repository root:
//   g++ -std=c++17 -fsyntax-only -I/usr/local/cuda/include -Itransport/nvlink transport/nvlink/abi_check.cc
#include <cuda.h>

#include <type_traits>

#include "cuda_driver.h"

namespace real {
// The table again, with <cuda.h>'s own types.
using CUresult = ::CUresult;
using CUdevice = ::CUdevice;
using CUdeviceptr = ::CUdeviceptr;
using CUcontext = ::CUcontext;
using CUstream = ::CUstream;
using CUmodule = ::CUmodule;
using CUfunction = ::CUfunction;
using CUevent = ::CUevent;
using CUdevice_attribute = ::CUdevice_attribute;
using CUpointer_attribute = ::CUpointer_attribute;
using CUstreamCaptureStatus = ::CUstreamCaptureStatus;
using CUstreamCaptureMode = ::CUstreamCaptureMode;
using CUipcMemHandle = ::CUipcMemHandle;
using cuuint64_t = ::cuuint64_t;
#define VARCOMM_CU_REAL(member, ret, params, ...) using member = ret(*) params;
VARCOMM_CU_FUNCTIONS(VARCOMM_CU_REAL)
#undef VARCOMM_CU_REAL
}  // namespace real

// Every entry's signature, in <cuda.h>'s types, is that of the symbol <cuda.h> names.
#define CHECK_FN(member, sym)                                                                       \
  static_assert(std::is_same<real::member, decltype(&::sym)>::value, #sym " signature differs");
CHECK_FN(Init, cuInit)
CHECK_FN(DriverGetVersion, cuDriverGetVersion)
CHECK_FN(GetErrorName, cuGetErrorName)
CHECK_FN(GetErrorString, cuGetErrorString)
CHECK_FN(DeviceGetCount, cuDeviceGetCount)
CHECK_FN(DeviceGet, cuDeviceGet)
CHECK_FN(DeviceGetName, cuDeviceGetName)
CHECK_FN(DeviceGetAttribute, cuDeviceGetAttribute)
CHECK_FN(DeviceGetPCIBusId, cuDeviceGetPCIBusId)
CHECK_FN(DeviceCanAccessPeer, cuDeviceCanAccessPeer)
CHECK_FN(DevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain)
CHECK_FN(DevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease_v2)
CHECK_FN(CtxGetCurrent, cuCtxGetCurrent)
CHECK_FN(CtxPushCurrent, cuCtxPushCurrent_v2)
CHECK_FN(CtxPopCurrent, cuCtxPopCurrent_v2)
CHECK_FN(MemAlloc, cuMemAlloc_v2)
CHECK_FN(MemFree, cuMemFree_v2)
CHECK_FN(MemsetD8Async, cuMemsetD8Async)
CHECK_FN(MemcpyAsync, cuMemcpyAsync)
CHECK_FN(MemHostRegister, cuMemHostRegister_v2)
CHECK_FN(MemHostUnregister, cuMemHostUnregister)
CHECK_FN(MemHostGetDevicePointer, cuMemHostGetDevicePointer_v2)
CHECK_FN(PointerGetAttribute, cuPointerGetAttribute)
CHECK_FN(IpcGetMemHandle, cuIpcGetMemHandle)
CHECK_FN(IpcOpenMemHandle, cuIpcOpenMemHandle_v2)
CHECK_FN(IpcCloseMemHandle, cuIpcCloseMemHandle)
CHECK_FN(StreamCreate, cuStreamCreate)
CHECK_FN(StreamDestroy, cuStreamDestroy_v2)
CHECK_FN(EventCreate, cuEventCreate)
CHECK_FN(EventRecord, cuEventRecord)
CHECK_FN(EventQuery, cuEventQuery)
CHECK_FN(EventSynchronize, cuEventSynchronize)
CHECK_FN(EventDestroy, cuEventDestroy_v2)
CHECK_FN(StreamWaitEvent, cuStreamWaitEvent)
CHECK_FN(StreamSynchronize, cuStreamSynchronize)
CHECK_FN(StreamQuery, cuStreamQuery)
CHECK_FN(StreamGetCtx, cuStreamGetCtx)
CHECK_FN(StreamIsCapturing, cuStreamIsCapturing)
CHECK_FN(ThreadExchangeStreamCaptureMode, cuThreadExchangeStreamCaptureMode)
CHECK_FN(StreamWriteValue64, cuStreamWriteValue64_v2)
CHECK_FN(StreamWaitValue64, cuStreamWaitValue64_v2)
CHECK_FN(ModuleLoadData, cuModuleLoadData)
CHECK_FN(ModuleUnload, cuModuleUnload)
CHECK_FN(ModuleGetFunction, cuModuleGetFunction)
CHECK_FN(LaunchKernel, cuLaunchKernel)

// Our types are ABI-identical to <cuda.h>'s.
namespace mine = varcomm::cu;
static_assert(std::is_same<mine::CUcontext, ::CUcontext>::value, "CUcontext");
static_assert(std::is_same<mine::CUstream, ::CUstream>::value, "CUstream");
static_assert(std::is_same<mine::CUmodule, ::CUmodule>::value, "CUmodule");
static_assert(std::is_same<mine::CUfunction, ::CUfunction>::value, "CUfunction");
static_assert(std::is_same<mine::CUevent, ::CUevent>::value, "CUevent");
static_assert(std::is_same<mine::CUdeviceptr, ::CUdeviceptr>::value, "CUdeviceptr");
static_assert(std::is_same<mine::CUdevice, ::CUdevice>::value, "CUdevice");
static_assert(std::is_same<mine::cuuint64_t, ::cuuint64_t>::value, "cuuint64_t");
static_assert(sizeof(mine::CUresult) == sizeof(::CUresult), "CUresult size");
static_assert(sizeof(mine::CUdevice_attribute) == sizeof(::CUdevice_attribute), "CUdevice_attribute size");
static_assert(sizeof(mine::CUpointer_attribute) == sizeof(::CUpointer_attribute), "CUpointer_attribute size");
static_assert(sizeof(mine::CUstreamCaptureStatus) == sizeof(::CUstreamCaptureStatus), "capture status size");
static_assert(sizeof(mine::CUstreamCaptureMode) == sizeof(::CUstreamCaptureMode), "capture mode size");
static_assert(sizeof(mine::CUipcMemHandle) == sizeof(::CUipcMemHandle), "CUipcMemHandle size");
static_assert(alignof(mine::CUipcMemHandle) == alignof(::CUipcMemHandle), "CUipcMemHandle alignment");

// And so are the constants.
#define CHECK_EQ(name) static_assert(long(mine::name) == long(::name), #name);
CHECK_EQ(CUDA_SUCCESS)
CHECK_EQ(CUDA_ERROR_NOT_READY)
CHECK_EQ(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
CHECK_EQ(CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)
CHECK_EQ(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
CHECK_EQ(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
CHECK_EQ(CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS)
CHECK_EQ(CU_POINTER_ATTRIBUTE_MEMORY_TYPE)
CHECK_EQ(CU_MEMORYTYPE_HOST)
CHECK_EQ(CU_STREAM_CAPTURE_STATUS_NONE)
CHECK_EQ(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
CHECK_EQ(CU_STREAM_CAPTURE_MODE_RELAXED)
static_assert(mine::kCaptureErrorFirst == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED &&
                  mine::kCaptureErrorLast == CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, "capture errors");
CHECK_EQ(CU_STREAM_NON_BLOCKING)
CHECK_EQ(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
static_assert(mine::kHostRegisterPortable == CU_MEMHOSTREGISTER_PORTABLE, "portable");
static_assert(mine::kHostRegisterDeviceMap == CU_MEMHOSTREGISTER_DEVICEMAP, "devicemap");
CHECK_EQ(CU_STREAM_WRITE_VALUE_DEFAULT)
CHECK_EQ(CU_STREAM_WAIT_VALUE_GEQ)
CHECK_EQ(CU_EVENT_DISABLE_TIMING)
CHECK_EQ(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED)
CHECK_EQ(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS)
CHECK_EQ(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING)
CHECK_EQ(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST)
CHECK_EQ(CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER)
CHECK_EQ(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX)
CHECK_EQ(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER)
// The optional flush, declared with ints for <cuda.h>'s two enums.
static_assert(std::is_same<decltype(&::cuFlushGPUDirectRDMAWrites),
                           ::CUresult (*)(::CUflushGPUDirectRDMAWritesTarget, ::CUflushGPUDirectRDMAWritesScope)>::value,
              "cuFlushGPUDirectRDMAWrites signature differs");
static_assert(sizeof(::CUflushGPUDirectRDMAWritesTarget) == sizeof(int) &&
                  sizeof(::CUflushGPUDirectRDMAWritesScope) == sizeof(int),
              "flush enums are not int-sized");
