// A CPU stand-in for the NVIDIA driver (libcuda.so.1), for testing the nvlink
// transport's protocol on machines without a GPU: "device memory" is shared
// host memory (memfd, so CUDA IPC handles work across processes), each stream
// is a worker thread running its operations in order, and stream memory
// operations are atomic loads and stores. Not part of the package build
// (setup.py compiles *.cpp and *.cu); tests/test_gpu.py builds it with
//   g++ -std=c++17 -O1 -shared -fPIC -Wl,-soname,libcuda.so.1 -o libcuda.so.1 fake_libcuda.cc -lpthread
// and loads it before varcomm does, so dlopen("libcuda.so.1") finds it.
// Only what transport/nvlink uses is here, with the driver's signatures
// (kernel launches: nvlink's kernels, their bodies run on CPU threads).
#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

// For tests that play a peer rewriting its header while the receiver reads
// it (fake_cuda_a2a_tamper): called before every read of a peer's control word.
namespace fake_tamper {
std::atomic<uintptr_t> addr{0};
std::atomic<long> after{0}, reads{0};
std::atomic<unsigned long long> value{0};
inline void on_read(const void* p) {
  if (uintptr_t(p) != addr.load()) return;
  if (reads.fetch_add(1) == after.load())  // reads 1 .. after saw the old value
    __atomic_store_n(reinterpret_cast<unsigned long long*>(uintptr_t(p)), value.load(), __ATOMIC_RELAXED);
}
}  // namespace fake_tamper
#define VC_HOST_CTL_READ(p) fake_tamper::on_read(p)

// The device-split all-to-all's kernel bodies, compiled as host C++: a launch
// runs the real algorithm (a2a_kernels.cuh) on the stream's thread.
#include "a2a_kernels.cuh"
#include "copy_signal.cuh"

namespace {

// FAKE_CUDA_DELAY_US: each stream operation starts this late (exposes races
// that real GPUs, slower than the host, would show).
const int g_delay_us = [] {
  const char* v = getenv("FAKE_CUDA_DELAY_US");
  return v ? atoi(v) : 0;
}();

using CUresult = int;
using CUdeviceptr = unsigned long long;
struct Ctx {};
Ctx g_ctx;

struct Stream {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> q;
  int busy = 0;
  bool stop = false;
  std::thread worker;
  // Between cuStreamBeginCapture and cuStreamEndCapture: operations are
  // recorded here instead of run (a graph), and cuGraphLaunch runs them again.
  std::vector<std::function<void()>>* capture = nullptr;
  // Who captures, how (CUstreamCaptureMode), and whether a prohibited call
  // invalidated it: guarded by g_capture_mu.
  int capture_mode = 0;
  std::thread::id capture_thread;
  bool invalidated = false;
  Stream() {
    worker = std::thread([this] {
      std::unique_lock<std::mutex> g(mu);
      for (;;) {
        cv.wait(g, [this] { return stop || !q.empty(); });
        if (q.empty()) return;
        auto op = std::move(q.front());
        q.pop_front();
        busy = 1;
        g.unlock();
        if (g_delay_us) usleep(g_delay_us);
        op();
        g.lock();
        busy = 0;
        cv.notify_all();
      }
    });
  }
  ~Stream() {
    {
      std::lock_guard<std::mutex> g(mu);
      stop = true;
    }
    cv.notify_all();
    worker.join();
  }
  void push(std::function<void()> op) {
    std::lock_guard<std::mutex> g(mu);
    if (capture) {
      capture->push_back(std::move(op));
      return;
    }
    q.push_back(std::move(op));
    cv.notify_all();
  }
  bool idle() {
    std::lock_guard<std::mutex> g(mu);
    return q.empty() && !busy;
  }
  void sync() {
    std::unique_lock<std::mutex> g(mu);
    cv.wait(g, [this] { return q.empty() && !busy; });
  }
};

struct Alloc {
  size_t size;
  int fd;          // memfd of our own allocations, -1 for opened ones
  bool device;     // false: registered host memory
};

std::mutex g_mu;
std::map<uintptr_t, Alloc> g_allocs;  // base -> allocation (device, opened, or registered host)
Stream* g_legacy = nullptr;
thread_local Ctx* t_ctx = nullptr;
thread_local std::deque<Ctx*> t_stack;

// Graph captures under way (cuStreamBeginCapture .. cuStreamEndCapture) and
// this thread's capture mode (cuThreadExchangeStreamCaptureMode; 0 GLOBAL, 1
// THREAD_LOCAL, 2 RELAXED), for the driver's rule on "potentially unsafe"
// calls (cuMemAlloc, cuMemFree, cuEventQuery, synchronizations): unless its
// mode is RELAXED, a thread that captures (a capture not begun RELAXED), or
// a thread in GLOBAL mode while another captures in GLOBAL mode, gets
// CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, and the capture is invalidated
// (cuStreamEndCapture fails). PyTorch captures in GLOBAL mode by default, so
// a library thread polling an event during a user's capture breaks it
// unless it switches its own mode.
std::mutex g_capture_mu;
std::set<Stream*> g_captures;
thread_local int t_capture_mode = 0;
CUresult unsafe_call() {
  std::lock_guard<std::mutex> g(g_capture_mu);
  CUresult r = 0;
  if (t_capture_mode == 2) return 0;
  for (Stream* x : g_captures) {
    const bool own = x->capture_thread == std::this_thread::get_id();
    if ((own && x->capture_mode != 2) || (!own && x->capture_mode == 0 && t_capture_mode == 0)) {
      x->invalidated = true;
      r = 900;
    }
  }
  return r;
}

// Destroyed streams: every later use of the handle fails with
// CUDA_ERROR_INVALID_HANDLE (as the real driver mostly reports it; a use
// after destroy is undefined there), so a test sees it instead of a crash.
std::set<void*> g_dead;
bool dead(void* s) {
  std::lock_guard<std::mutex> g(g_mu);
  return s && g_dead.count(s);
}
constexpr CUresult kInvalidHandle = 400;

Stream* stream_of(void* s) {
  if (s) return static_cast<Stream*>(s);
  std::lock_guard<std::mutex> g(g_mu);
  if (!g_legacy) g_legacy = new Stream();
  return g_legacy;
}

const Alloc* find(uintptr_t p, uintptr_t* base) {
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_allocs.upper_bound(p);
  if (it == g_allocs.begin()) return nullptr;
  --it;
  if (p >= it->first + it->second.size) return nullptr;
  if (base) *base = it->first;
  return &it->second;
}

struct IpcHandle {
  int32_t magic, pid, fd, pad;
  uint64_t size;
  char rest[40];
};
static_assert(sizeof(IpcHandle) == 64, "handle size");

}  // namespace

extern "C" {
#define API __attribute__((visibility("default")))
API CUresult cuInit(unsigned int) { return 0; }
API CUresult cuDriverGetVersion(int* v) { *v = 13000; return 0; }
API CUresult cuGetErrorName(CUresult e, const char** s) { *s = e ? "CUDA_ERROR_FAKE" : "CUDA_SUCCESS"; return 0; }
API CUresult cuGetErrorString(CUresult e, const char** s) { *s = e ? "fake driver error" : "no error"; return 0; }
API CUresult cuDeviceGetCount(int* n) { *n = 1; return 0; }
API CUresult cuDeviceGet(int* d, int ordinal) { if (ordinal != 0) return 101; *d = 0; return 0; }
API CUresult cuDeviceGetName(char* name, int len, int) { snprintf(name, len, "fake GPU (varcomm test driver)"); return 0; }
API CUresult cuDeviceGetAttribute(int* v, int attr, int) {
  // compute capability 9.0, UVA, 64-bit stream memops; GPUDirect RDMA
  // supported (116; FAKE_CUDA_NO_GDR=1 plays a GPU without it), flushed from
  // the host (117: option HOST), writes not ordered for the GPU (118: NONE),
  // so rdma-gpu takes its flushing path
  if (attr == 116 && getenv("FAKE_CUDA_NO_GDR")) {
    *v = 0;
    return 0;
  }
  *v = attr == 75 ? 9 : (attr == 41 || attr == 122 || attr == 116 || attr == 117) ? 1 : 0;
  return 0;
}
// Marks this library as the stand-in: its device memory is host memory, which
// a NIC (libfabric) registers as host memory (rdma-gpu's GPUDirect path).
API int varcomm_fake_cuda_driver = 1;
// A NIC's writes into host memory need no flush; counted so tests see the
// GPUDirect receive path call it before a stream consumes landed data.
std::atomic<long> g_gdr_flushes{0};
API CUresult cuFlushGPUDirectRDMAWrites(int target, int scope) {
  if (target != 0 || scope != 100) return 1;
  if (!t_ctx) return 201;  // CUDA_ERROR_INVALID_CONTEXT
  g_gdr_flushes++;
  return 0;
}
API long fake_cuda_gdr_flushes() { return g_gdr_flushes.load(); }
API CUresult cuDeviceGetPCIBusId(char* bus, int len, int) { snprintf(bus, len, "0000:00:00.0"); return 0; }
API CUresult cuDeviceCanAccessPeer(int* can, int, int) { *can = 1; return 0; }
API CUresult cuDevicePrimaryCtxRetain(Ctx** c, int) { *c = &g_ctx; return 0; }
API CUresult cuDevicePrimaryCtxRelease_v2(int) { return 0; }
API CUresult cuCtxGetCurrent(Ctx** c) { *c = t_ctx; return 0; }
API CUresult cuCtxPushCurrent_v2(Ctx* c) { t_stack.push_back(t_ctx); t_ctx = c; return 0; }
API CUresult cuCtxPopCurrent_v2(Ctx** c) {
  if (t_stack.empty()) return 201;
  if (c) *c = t_ctx;
  t_ctx = t_stack.back();
  t_stack.pop_back();
  return 0;
}
static CUresult need_ctx() { return t_ctx == &g_ctx ? 0 : 201; }  // CUDA_ERROR_INVALID_CONTEXT

// Device memory: shared host memory of its own (a memfd), filled with garbage
// like fresh device memory. (cuMemAlloc of 0 bytes fails; the async form's is
// a valid pointer, as a real pool's.)
static CUresult alloc_device(CUdeviceptr* p, size_t n) {
  int fd = memfd_create("fake-cuda", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, off_t(n)) != 0) return 2;
  void* m = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) return 2;
  std::memset(m, 0xa5, n);
  std::lock_guard<std::mutex> g(g_mu);
  g_allocs[uintptr_t(m)] = {n, fd, true};
  *p = uintptr_t(m);
  return 0;
}
// 1 where p is no allocation of ours (a registration, or nothing).
static CUresult free_device(CUdeviceptr p) {
  Alloc a;
  {
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_allocs.find(uintptr_t(p));
    if (it == g_allocs.end() || it->second.fd < 0) return 1;
    a = it->second;
    g_allocs.erase(it);
  }
  munmap(reinterpret_cast<void*>(p), a.size);
  close(a.fd);
  return 0;
}
API CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t n) {
  if (CUresult r = need_ctx()) return r;
  if (CUresult r = unsafe_call()) return r;
  return alloc_device(p, n);
}
API CUresult cuMemFree_v2(CUdeviceptr p) {
  if (CUresult r = unsafe_call()) return r;
  return free_device(p);
}
// Stream-ordered allocation: the memory exists at once here (a real pool's
// may be reused from the stream's earlier frees); its free runs in stream
// order, after the work enqueued before it (a copy out of it).
API CUresult cuMemAllocAsync(CUdeviceptr* p, size_t n, void* s) {
  if (dead(s)) return kInvalidHandle;
  if (CUresult r = need_ctx()) return r;
  return alloc_device(p, n ? n : 1);
}
API CUresult cuMemFreeAsync(CUdeviceptr p, void* s) {
  if (dead(s)) return kInvalidHandle;
  {
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_allocs.find(uintptr_t(p));
    if (it == g_allocs.end() || it->second.fd < 0) return 1;
  }
  stream_of(s)->push([=] { free_device(p); });
  return 0;
}
API CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, void* s) {
  if (dead(s)) return kInvalidHandle;
  if (CUresult r = need_ctx()) return r;
  stream_of(s)->push([=] { std::memset(reinterpret_cast<void*>(p), v, n); });
  return 0;
}
API CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, void* s) {
  if (dead(s)) return kInvalidHandle;
  if (CUresult r = need_ctx()) return r;
  if (n && (!find(dst, nullptr) || !find(src, nullptr))) {
    // Pageable host memory (neither allocated nor registered): the driver
    // first waits for the stream's earlier work, on the calling thread, and
    // copies before it returns (a D2H one completes; an H2D one is staged).
    Stream* x = stream_of(s);
    {
      std::lock_guard<std::mutex> g(g_capture_mu);
      if (g_captures.count(x)) {
        x->invalidated = true;
        return 900;
      }
    }
    x->sync();
    std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<void*>(src), n);
    return 0;
  }
  stream_of(s)->push([=] { std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<void*>(src), n); });
  return 0;
}
API CUresult cuMemHostRegister_v2(void* p, size_t n, unsigned int) {
  if (CUresult r = unsafe_call()) return r;
  std::lock_guard<std::mutex> g(g_mu);
  if (g_allocs.count(uintptr_t(p))) return 712;  // CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
  g_allocs[uintptr_t(p)] = {n, -1, false};
  return 0;
}
API CUresult cuMemHostUnregister(void* p) {
  if (CUresult r = unsafe_call()) return r;
  std::lock_guard<std::mutex> g(g_mu);
  return g_allocs.erase(uintptr_t(p)) ? 0 : 713;
}
API CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* d, void* p, unsigned int) {
  const Alloc* a = find(uintptr_t(p), nullptr);
  if (!a || a->device) return 1;
  *d = uintptr_t(p);
  return 0;
}
API CUresult cuPointerGetAttribute(void* data, int attr, CUdeviceptr p) {
  if (attr != 2) return 1;
  const Alloc* a = find(uintptr_t(p), nullptr);
  if (!a) return 1;  // unregistered host memory: CUDA_ERROR_INVALID_VALUE
  *static_cast<unsigned int*>(data) = a->device ? 2 : 1;
  return 0;
}
API CUresult cuIpcGetMemHandle(IpcHandle* h, CUdeviceptr p) {
  // FAKE_CUDA_NO_IPC=1: CUDA IPC unsupported (as under MIG or in some
  // containers), so nvlink cannot open while rdma-gpu still can.
  if (const char* no = getenv("FAKE_CUDA_NO_IPC"); no && *no == '1') return 801;  // CUDA_ERROR_NOT_SUPPORTED
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_allocs.find(uintptr_t(p));
  if (it == g_allocs.end() || it->second.fd < 0) return 1;
  std::memset(h, 0, sizeof *h);
  h->magic = 0x46414b45;
  h->pid = getpid();
  h->fd = it->second.fd;
  h->size = it->second.size;
  return 0;
}
API CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* p, IpcHandle h, unsigned int) {
  if (CUresult r = need_ctx()) return r;
  if (h.magic != 0x46414b45) return 400;
  if (h.pid == getpid()) return 201;  // as the real driver: not within one process
  std::string path = "/proc/" + std::to_string(h.pid) + "/fd/" + std::to_string(h.fd);
  int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return 400;
  void* m = mmap(nullptr, h.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) return 2;
  std::lock_guard<std::mutex> g(g_mu);
  g_allocs[uintptr_t(m)] = {h.size, -1, true};
  *p = uintptr_t(m);
  return 0;
}
API CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
  size_t n;
  {
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_allocs.find(uintptr_t(p));
    if (it == g_allocs.end()) return 1;
    n = it->second.size;
    g_allocs.erase(it);
  }
  munmap(reinterpret_cast<void*>(p), n);
  return 0;
}
API CUresult cuStreamCreate(void** s, unsigned int) {
  if (!t_ctx) return 201;  // as the driver: a stream belongs to the current context (CUDA_ERROR_INVALID_CONTEXT)
  *s = new Stream();
  std::lock_guard<std::mutex> g(g_mu);
  g_dead.erase(*s);  // a handle may come back (the real driver may reuse one too)
  return 0;
}
// As the real driver: work already enqueued still runs (the worker drains its queue).
API CUresult cuStreamDestroy_v2(void* s) {
  if (!s || dead(s)) return kInvalidHandle;
  {
    std::lock_guard<std::mutex> c(g_capture_mu);
    g_captures.erase(static_cast<Stream*>(s));
  }
  delete static_cast<Stream*>(s);
  std::lock_guard<std::mutex> g(g_mu);
  g_dead.insert(s);
  return 0;
}
API CUresult cuStreamSynchronize(void* s) {
  if (dead(s)) return kInvalidHandle;
  if (CUresult r = unsafe_call()) return r;
  stream_of(s)->sync();
  return 0;
}
API CUresult cuStreamQuery(void* s) {
  if (dead(s)) return kInvalidHandle;
  if (CUresult r = unsafe_call()) return r;
  return stream_of(s)->idle() ? 0 : 600;  // CUDA_ERROR_NOT_READY
}
API CUresult cuStreamGetCtx(void* s, Ctx** c) {
  if (dead(s)) return kInvalidHandle;
  *c = &g_ctx;
  return 0;
}
// Events: records counted, the stream marks each one complete when it gets
// there; a wait on an event waits for the records made before it.
struct Event {
  std::atomic<uint64_t> recorded{0}, completed{0};
};
API CUresult cuEventCreate(Event** e, unsigned int) {
  *e = new Event();
  return 0;
}
API CUresult cuEventDestroy_v2(Event* e) {
  delete e;  // only after its completion in the tests' use (varcomm waits for it first)
  return 0;
}
API CUresult cuEventRecord(Event* e, void* s) {
  if (dead(s)) return kInvalidHandle;
  const uint64_t gen = ++e->recorded;
  stream_of(s)->push([e, gen] {
    uint64_t c = e->completed.load();
    while (c < gen && !e->completed.compare_exchange_weak(c, gen)) {
    }
  });
  return 0;
}
API CUresult cuEventQuery(Event* e) {
  if (CUresult r = unsafe_call()) return r;
  return e->completed.load() >= e->recorded.load() ? 0 : 600;
}
API CUresult cuEventSynchronize(Event* e) {
  if (CUresult r = unsafe_call()) return r;
  const uint64_t want = e->recorded.load();
  for (int i = 0; e->completed.load() < want; ++i) i < 100 ? (void)sched_yield() : (void)usleep(20);
  return 0;
}
API CUresult cuStreamWaitEvent(void* s, Event* e, unsigned int) {
  if (dead(s)) return kInvalidHandle;
  const uint64_t want = e->recorded.load();
  stream_of(s)->push([e, want] {
    for (int i = 0; e->completed.load() < want; ++i) i < 100 ? (void)sched_yield() : (void)usleep(20);
  });
  return 0;
}
static std::set<void*> g_capturing;  // streams fake_cuda_set_capturing marked
API CUresult cuStreamIsCapturing(void* s, int* st) {
  if (dead(s)) return kInvalidHandle;
  Stream* x = stream_of(s);
  std::lock_guard<std::mutex> g(x->mu);
  std::lock_guard<std::mutex> c(g_capture_mu);
  *st = x->capture || g_capturing.count(s) ? 1 : 0;  // CU_STREAM_CAPTURE_STATUS_ACTIVE
  return 0;
}
// For tests: make `s` report an active graph capture (on != 0) without recording
// it, to check that a path that cannot be replayed refuses capture.
API void fake_cuda_set_capturing(void* s, int on) {
  std::lock_guard<std::mutex> g(g_capture_mu);
  if (on) g_capturing.insert(s);
  else g_capturing.erase(s);
}
// CUDA graphs, as far as tests capture them: one stream's operations in order.
struct Graph {
  std::vector<std::function<void()>> ops;
};
API CUresult cuStreamBeginCapture_v2(void* s, int mode) {
  if (dead(s)) return kInvalidHandle;
  if (!s) return 1;  // the legacy stream cannot capture
  Stream* x = stream_of(s);
  std::lock_guard<std::mutex> g(x->mu);
  if (x->capture) return 900;  // CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
  x->capture = &(new Graph())->ops;
  std::lock_guard<std::mutex> c(g_capture_mu);
  x->capture_mode = mode;
  x->capture_thread = std::this_thread::get_id();
  x->invalidated = false;
  g_captures.insert(x);
  return 0;
}
API CUresult cuThreadExchangeStreamCaptureMode(int* mode) {
  std::swap(*mode, t_capture_mode);
  return 0;
}
API CUresult cuStreamEndCapture(void* s, Graph** graph) {
  if (dead(s)) return kInvalidHandle;
  Stream* x = stream_of(s);
  std::lock_guard<std::mutex> g(x->mu);
  if (!x->capture) return 901;  // CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
  Graph* made = reinterpret_cast<Graph*>(reinterpret_cast<char*>(x->capture) - offsetof(Graph, ops));
  x->capture = nullptr;
  std::lock_guard<std::mutex> c(g_capture_mu);
  g_captures.erase(x);
  if (x->invalidated) {
    delete made;
    return 901;
  }
  *graph = made;
  return 0;
}
API CUresult cuGraphInstantiateWithFlags(Graph** exec, Graph* graph, unsigned long long) {
  *exec = new Graph(*graph);
  return 0;
}
API CUresult cuGraphLaunch(Graph* exec, void* s) {
  if (dead(s)) return kInvalidHandle;
  for (auto& op : exec->ops) stream_of(s)->push(op);
  return 0;
}
API CUresult cuGraphDestroy(Graph* g) { delete g; return 0; }
API CUresult cuGraphExecDestroy(Graph* g) { delete g; return 0; }
API CUresult cuStreamWriteValue64_v2(void* s, CUdeviceptr addr, uint64_t v, unsigned int) {
  if (dead(s)) return kInvalidHandle;
  if (CUresult r = need_ctx()) return r;
  if (!find(uintptr_t(addr), nullptr)) return 1;  // must be device or registered memory
  stream_of(s)->push([=] { __atomic_store_n(reinterpret_cast<uint64_t*>(addr), v, __ATOMIC_RELEASE); });
  return 0;
}
API CUresult cuStreamWaitValue64_v2(void* s, CUdeviceptr addr, uint64_t v, unsigned int) {
  if (dead(s)) return kInvalidHandle;
  if (CUresult r = need_ctx()) return r;
  if (!find(uintptr_t(addr), nullptr)) return 1;
  // A GPU waits without a host core; a stream thread spinning here would take
  // one from the threads it waits for, so after a short spin it sleeps.
  stream_of(s)->push([=] {
    for (int i = 0; int64_t(__atomic_load_n(reinterpret_cast<uint64_t*>(addr), __ATOMIC_ACQUIRE) - v) < 0; ++i)
      if (i < 100)
        sched_yield();
      else
        usleep(20);
  });
  return 0;
}
// The kernels (kernels.cu): a module is accepted when it is a fatbin (magic
// 0xBA55ED50), and a launch runs the kernel's own body (copy_signal.cuh,
// a2a_kernels.cuh, compiled here as host C++) on the stream's thread.
// FAKE_CUDA_NO_MODULES=1: cuModuleLoadData fails as on a GPU without an image.
struct Module {};
struct Function { int which; };
Function g_copy_signal{1}, g_a2a_send{2}, g_a2a_recv{3}, g_p2p_send{4}, g_p2p_recv{5};
std::atomic<unsigned long long> g_launches{0};
API CUresult cuModuleLoadData(Module** m, const void* image) {
  if (CUresult r = need_ctx()) return r;
  const char* no = getenv("FAKE_CUDA_NO_MODULES");
  if (no && *no && *no != '0') return 209;  // CUDA_ERROR_NO_BINARY_FOR_GPU
  uint32_t magic;
  std::memcpy(&magic, image, 4);
  if (magic != 0xBA55ED50u) return 200;  // CUDA_ERROR_INVALID_IMAGE
  *m = new Module();
  return 0;
}
API CUresult cuModuleUnload(Module* m) { delete m; return 0; }
API CUresult cuModuleGetFunction(Function** f, Module*, const char* name) {
  if (!std::strcmp(name, "varcomm_copy_signal")) *f = &g_copy_signal;
  else if (!std::strcmp(name, "varcomm_a2a_send")) *f = &g_a2a_send;
  else if (!std::strcmp(name, "varcomm_a2a_recv")) *f = &g_a2a_recv;
  else if (!std::strcmp(name, "varcomm_p2p_send")) *f = &g_p2p_send;
  else if (!std::strcmp(name, "varcomm_p2p_recv")) *f = &g_p2p_recv;
  else return 500;  // CUDA_ERROR_NOT_FOUND
  return 0;
}
static varcomm::a2a::Args g_last_a2a{};  // the last all-to-all launch's arguments, for fake_cuda_a2a_slot
API CUresult cuLaunchKernel(Function* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                            unsigned bz, unsigned shmem, void* s, void** params, void** extra) {
  if (dead(s)) return kInvalidHandle;
  if (CUresult r = need_ctx()) return r;
  if ((f == &g_p2p_send || f == &g_p2p_recv) && params && !extra) {
    namespace a2a = varcomm::a2a;
    const a2a::Args a = *static_cast<const a2a::Args*>(params[0]);
    if (gx != 1 || gy != 1 || gz != 1 || bx < 1 || bx > 1024 || by != 1 || bz != 1 || shmem) return 1;
    if (a.peer >= a.world || !find(uintptr_t(a.ws), nullptr) || !find(uintptr_t(a.err), nullptr) ||
        !find(uintptr_t(a.peer_ws[a.peer]), nullptr))
      return 700;
    g_launches.fetch_add(1);
    const bool send = f == &g_p2p_send;
    stream_of(s)->push([a, send, bx] { send ? a2a::host_p2p_send(a, bx) : a2a::host_p2p_recv(a, bx); });
    return 0;
  }
  if ((f == &g_a2a_send || f == &g_a2a_recv) && params && !extra) {
    // The real kernel bodies, one block after another on the stream's thread
    // (each block's phases for every thread index in turn): a2a_kernels.cuh.
    namespace a2a = varcomm::a2a;
    const a2a::Args a = *static_cast<const a2a::Args*>(params[0]);
    if (gx != a.world || gy != 1 || gz != 1 || bx < 1 || bx > 1024 || by != 1 || bz != 1 || shmem) return 1;
    if (!find(uintptr_t(a.ws), nullptr) || !find(uintptr_t(a.err), nullptr)) return 700;
    for (unsigned q = 0; q < a.world; ++q)
      if (!find(uintptr_t(a.peer_ws[q]), nullptr)) return 700;
    g_launches.fetch_add(1);
    {
      std::lock_guard<std::mutex> g(g_mu);
      g_last_a2a = a;
    }
    const bool send = f == &g_a2a_send;
    stream_of(s)->push([a, send, bx] {
      for (unsigned b = 0; b < a.world; ++b) send ? a2a::host_send_block(a, b, bx) : a2a::host_recv_block(a, b, bx);
    });
    return 0;
  }
  if (f != &g_copy_signal || !params || extra) return 1;
  if (gx != 1 || gy != 1 || gz != 1 || bx < 1 || bx > 1024 || by != 1 || bz != 1 || shmem) return 1;
  CUdeviceptr dst = *static_cast<CUdeviceptr*>(params[0]), src = *static_cast<CUdeviceptr*>(params[1]);
  size_t n = *static_cast<size_t*>(params[2]);
  CUdeviceptr flag = *static_cast<CUdeviceptr*>(params[3]);
  unsigned long long seq = *static_cast<unsigned long long*>(params[4]);
  if (!find(uintptr_t(dst), nullptr) || !find(uintptr_t(dst + n - 1), nullptr) || !find(uintptr_t(src), nullptr) ||
      !find(uintptr_t(flag), nullptr) || flag % 8)
    return 700;  // CUDA_ERROR_ILLEGAL_ADDRESS (the real driver reports it later)
  g_launches.fetch_add(1);
  stream_of(s)->push([=] {  // the kernel's own body (copy_signal.cuh), one block of bx threads
    varcomm::copy_signal::host_block(reinterpret_cast<unsigned char*>(dst), reinterpret_cast<const unsigned char*>(src),
                                     n, reinterpret_cast<unsigned long long*>(flag), seq, bx);
  });
  return 0;
}
// For tests that play a buggy peer: the address, as mapped in this process,
// of rank dst's slot for source src in the last all-to-all launch's
// workspaces (0 before one).
API unsigned long long fake_cuda_a2a_slot(unsigned dst, unsigned src) {
  std::lock_guard<std::mutex> g(g_mu);
  const varcomm::a2a::Args& a = g_last_a2a;
  if (!a.world || dst >= a.world || src >= a.world) return 0;
  return uintptr_t(a.peer_ws[dst]) + varcomm::a2a::ws_slot(int(a.world), a.cap, int(src));
}
// For tests: the control word at `addr` (a slot's, as mapped here) becomes
// `value` once the kernels have read it `after` times (addr 0: off). Returns
// the reads counted since the last call.
API long fake_cuda_a2a_tamper(unsigned long long addr, long after, unsigned long long value) {
  fake_tamper::addr.store(0);
  const long n = fake_tamper::reads.exchange(0);
  fake_tamper::after.store(after);
  fake_tamper::value.store(value);
  fake_tamper::addr.store(uintptr_t(addr));
  return n;
}
// For tests: how many kernels were launched in this process.
API unsigned long long fake_cuda_launches() { return g_launches.load(); }
// For tests: copies between "device" and host memory, synchronously.
API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) { std::memcpy(reinterpret_cast<void*>(dst), src, n); return 0; }
API CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) { std::memcpy(dst, reinterpret_cast<void*>(src), n); return 0; }
API CUresult cuCtxSetCurrent(Ctx* c) { t_ctx = c; return 0; }
}
