#include "cuda_driver.h"

#include "errors.h"

#include <dlfcn.h>

#include <initializer_list>
#include <map>
#include <mutex>

namespace varcomm {
namespace cu {
namespace {

struct Loaded {
  Driver d;
  std::string why;  // empty when usable
};

// The first of `names` that the driver exports.
template <class F>
void resolve(void* lib, F& fn, std::initializer_list<const char*> names, std::string* missing) {
  for (const char* n : names) {
    if (void* p = dlsym(lib, n)) {
      fn = reinterpret_cast<F>(p);
      return;
    }
  }
  if (!missing->empty()) *missing += ", ";
  *missing += *names.begin();
}

Loaded load() {
  Loaded L;
  // Already in the process when torch (or any CUDA runtime) initialised CUDA.
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* e = dlerror();
    L.why = std::string("the NVIDIA driver library libcuda.so.1 cannot be loaded (") + (e ? e : "not found") +
            "): no NVIDIA driver on this machine";
    return L;
  }
  Driver& d = L.d;
  std::string missing;
#define VARCOMM_CU_RESOLVE(member, ret, params, ...) resolve(lib, d.member, {__VA_ARGS__}, &missing);
  VARCOMM_CU_FUNCTIONS(VARCOMM_CU_RESOLVE)
#undef VARCOMM_CU_RESOLVE
  if (!missing.empty()) {
    L.why = "the NVIDIA driver is too old for varcomm's nvlink transport (libcuda.so.1 lacks " + missing + ")";
    return L;
  }
  d.FlushGPUDirectRDMAWrites =
      reinterpret_cast<decltype(d.FlushGPUDirectRDMAWrites)>(dlsym(lib, "cuFlushGPUDirectRDMAWrites"));
  d.stand_in = dlsym(lib, "varcomm_fake_cuda_driver") != nullptr;
  if (d.DriverGetVersion(&d.version) != CUDA_SUCCESS) d.version = 0;
  CUresult r = d.Init(0);
  if (r != CUDA_SUCCESS) {
    L.why = error_string(d, r, "cuInit") + " (the NVIDIA driver is installed but no usable GPU was found)";
    return L;
  }
  int n = 0;
  if (d.DeviceGetCount(&n) != CUDA_SUCCESS || n == 0) L.why = "the NVIDIA driver reports no GPU";
  return L;
}

}  // namespace

const Driver* driver(std::string* why) {
  static std::once_flag once;
  static Loaded* loaded = nullptr;  // never freed: transports may outlive static destructors
  std::call_once(once, [] { loaded = new Loaded(load()); });
  if (why) *why = loaded->why;
  return loaded->why.empty() ? &loaded->d : nullptr;
}

namespace {
struct HostReg {
  size_t len;
  CUdeviceptr dev;
  int refs;
};
std::mutex g_reg_mu;
std::map<void*, HostReg> g_regs;  // guarded by g_reg_mu
}  // namespace

CUdeviceptr host_register(const Driver& d, void* base, size_t len, std::string* why) {
  std::lock_guard<std::mutex> g(g_reg_mu);
  auto it = g_regs.find(base);
  if (it != g_regs.end()) {
    if (it->second.len < len) {
      *why = "host memory already registered with the GPU with a smaller size (" + std::to_string(it->second.len) +
             " < " + std::to_string(len) + " bytes)";
      return 0;
    }
    it->second.refs++;
    return it->second.dev;
  }
  CUresult r = d.MemHostRegister(base, len, kHostRegisterDeviceMap | kHostRegisterPortable);
  if (r != CUDA_SUCCESS) {
    *why = "cannot register " + std::to_string(len) + " bytes of host memory with the GPU: " +
           error_string(d, r, "cuMemHostRegister");
    return 0;
  }
  CUdeviceptr dp = 0;
  r = d.MemHostGetDevicePointer(&dp, base, 0);
  if (r != CUDA_SUCCESS) {
    d.MemHostUnregister(base);
    *why = error_string(d, r, "cuMemHostGetDevicePointer");
    return 0;
  }
  g_regs[base] = {len, dp, 1};
  return dp;
}

void host_unregister(const Driver& d, void* base) {
  std::lock_guard<std::mutex> g(g_reg_mu);
  auto it = g_regs.find(base);
  if (it == g_regs.end() || --it->second.refs > 0) return;
  d.MemHostUnregister(base);
  g_regs.erase(it);
}

std::string error_string(const Driver& d, CUresult r, const char* what) {
  const char* name = nullptr;
  const char* desc = nullptr;
  if (d.GetErrorName) d.GetErrorName(r, &name);
  if (d.GetErrorString) d.GetErrorString(r, &desc);
  std::string s = std::string(what) + ": " + (name ? std::string(name) : "CUDA error " + std::to_string(r));
  if (desc) s += std::string(" (") + desc + ")";
  return s;
}

namespace {
void check(const Driver& d, CUresult r, const char* who, const char* what) {
  if (r != CUDA_SUCCESS) throw Error(ErrorKind::Invalid, std::string(who) + ": " + error_string(d, r, what));
}
}  // namespace

void check_stream(const Driver& d, CUcontext ctx, int ordinal, CUstream s, const char* op, const char* who) {
  CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
  CUresult r = d.StreamIsCapturing(s, &st);
  if (r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT || (r == CUDA_SUCCESS && st != CU_STREAM_CAPTURE_STATUS_NONE))
    throw Error(ErrorKind::Invalid, std::string("varcomm ") + op +
                                        " cannot be captured in a CUDA graph: sequence numbers and credits are "
                                        "host state, so a replay would repeat this message's slot and number");
  check(d, r, who, "cuStreamIsCapturing");
  CUcontext sc = nullptr;
  if (d.StreamGetCtx(s, &sc) == CUDA_SUCCESS && sc && sc != ctx)
    throw Error(ErrorKind::Invalid, std::string("varcomm ") + op + ": the tensor's CUDA stream belongs to another "
                                        "GPU than cuda:" + std::to_string(ordinal) + ", which this communicator's " +
                                        who + " transport uses; keep tensors on the device that was current at "
                                        "varcomm.init");
}

CUevent copy_async(const Driver& d, CUcontext ctx, int ordinal, const char* who, void* dst, const void* src,
                   size_t n, std::uintptr_t stream, bool mark) {
  if (!n) return nullptr;
  CtxScope scope(d, ctx);
  CUstream s = reinterpret_cast<CUstream>(stream);
  check_stream(d, ctx, ordinal, s, "all-to-all", who);
  // The event first: once the copy is enqueued it must be marked (the caller
  // holds src until the mark says the copy ran).
  CUevent ev = nullptr;
  if (mark) check(d, d.EventCreate(&ev, CU_EVENT_DISABLE_TIMING), who, "cuEventCreate (local copy)");
  CUresult r = d.MemcpyAsync(reinterpret_cast<CUdeviceptr>(dst), reinterpret_cast<CUdeviceptr>(src), n, s);
  if (r == CUDA_SUCCESS && ev) r = d.EventRecord(ev, s);
  if (r != CUDA_SUCCESS && ev) {
    // Not marked: nothing tells when a copy that was enqueued runs, so wait for it here.
    d.StreamSynchronize(s);
    d.EventDestroy(ev);
  }
  check(d, r, who, "cuMemcpyAsync / cuEventRecord (local copy)");
  return ev;
}

void* stage_async(const Driver& d, CUcontext ctx, const char* who, const void* src, size_t n, std::uintptr_t stream) {
  CtxScope scope(d, ctx);
  CUstream s = reinterpret_cast<CUstream>(stream);
  CUdeviceptr p = 0;
  check(d, d.MemAllocAsync(&p, n, s), who, "cuMemAllocAsync (isend: a copy of a send that waits for a slot)");
  CUresult r = d.MemcpyAsync(p, reinterpret_cast<CUdeviceptr>(src), n, s);
  if (r != CUDA_SUCCESS) d.MemFreeAsync(p, s);
  check(d, r, who, "cuMemcpyAsync (isend: a copy of a send that waits for a slot)");
  return reinterpret_cast<void*>(p);
}

void unstage_async(const Driver& d, CUcontext ctx, void* staged, std::uintptr_t stream) {
  CtxScope scope(d, ctx);
  // (an error, such as a stream destroyed meanwhile, leaves it to the pool)
  d.MemFreeAsync(reinterpret_cast<CUdeviceptr>(staged), reinterpret_cast<CUstream>(stream));
}

bool copied(const Driver& d, CUcontext ctx, CUevent ev, bool wait) {
  if (!ev) return true;
  CtxScope scope(d, ctx);
  CUresult r = wait ? d.EventSynchronize(ev) : d.EventQuery(ev);
  if (!event_done(r)) return false;
  d.EventDestroy(ev);
  return true;
}

}  // namespace cu
}  // namespace varcomm
