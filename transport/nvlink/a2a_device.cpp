// The device-split all-to-all over CUDA IPC (a2a_device.h). Host side only:
// set-up (workspace, IPC exchange through the engine's host path, the error
// record), launches, error reporting. The protocol is the kernels'
// (a2a_kernels.cuh).
#include "a2a_device.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "a2a_kernels.cuh"
#include "collectives.h"
#include "cuda_driver.h"
#include "dtypes.h"
#include "errors.h"
#include "kernels.h"

namespace varcomm {
namespace {

using namespace cu;
using Clock = std::chrono::steady_clock;

constexpr size_t kDescBytes = 256;  // fixed, so every rank posts an exact-size receive
constexpr uint32_t kU8 = (1u << 16) | (8u << 8) | 1u;

std::string hex(const void* p, size_t n) {
  static const char* d = "0123456789abcdef";
  const auto* b = static_cast<const unsigned char*>(p);
  std::string s;
  for (size_t i = 0; i < n; ++i) s += d[b[i] >> 4], s += d[b[i] & 15];
  return s;
}
bool unhex(const std::string& s, void* out, size_t n) {
  if (s.size() != 2 * n) return false;
  auto nib = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1; };
  auto* b = static_cast<unsigned char*>(out);
  for (size_t i = 0; i < n; ++i) {
    int hi = nib(s[2 * i]), lo = nib(s[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    b[i] = static_cast<unsigned char>(hi << 4 | lo);
  }
  return true;
}

using Ctx = cu::CtxScope;

}  // namespace

bool device_a2a_built() {
#ifdef VARCOMM_HAVE_FATBIN
  return true;
#else
  return false;
#endif
}

std::string device_a2a_unavailable_reason() {
#ifndef VARCOMM_HAVE_FATBIN
  return "varcomm was built without nvcc: the device-split all-to-all needs its kernels (rebuild with CUDA's nvcc)";
#else
  std::string why;
  if (!cu::driver(&why)) return why;
  return "";
#endif
}

struct DeviceA2A::Impl {
  Engine& e;
  const Driver& d;
  int rank, world;
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  bool retained = false;
  CUmodule module = nullptr;
  CUfunction send = nullptr, recv = nullptr, p2p_send = nullptr, p2p_recv = nullptr;
  CUdeviceptr ws = 0;
  uint64_t ws_bytes = 0;
  std::vector<CUdeviceptr> peer_ws, opened;
  a2a::ErrorRecord* err = nullptr;  // host memory, registered (device-mapped)
  CUdeviceptr err_dev = 0;
  std::mutex mu;
  // Per stream launched on outside a capture: an event recorded after its
  // last call. Waits (synchronize without a stream, close, the next call on
  // another stream) use it, never the stream: its owner may destroy a stream
  // once its work is enqueued (CUDA allows it; a later use of the handle is
  // undefined), and the event waits for our calls only, not its later work.
  std::map<uintptr_t, CUevent> ran;
  std::optional<uintptr_t> last;  // the stream of the last all-to-all launch
  bool last_captured = false;     // ... which was captured (it runs at replay: nothing to wait for now)
  uint64_t launches = 0;          // all-to-all calls launched (refused ones too)
  bool closed = false;
  // setup_p2p's handle makes only send_rows/recv_rows calls: its errors
  // speak of messages and row counts, not chunks and splits.
  bool p2p = false;  // (set by the constructor, before any thread)
  const char* path() const { return p2p ? "device point-to-point" : "device all-to-all"; }
  struct Pending {
    uintptr_t p, stream;
    CUevent ev;  // recorded on stream at free(); null: it was capturing then (recorded once it is not)
    uint64_t mark = 0;  // p 0: a mark() whose stream passed goes to `passed` instead of a free
  };
  std::vector<Pending> pending;  // allocations to free (and marks) once their stream ran what was enqueued before
  uint64_t marks = 0;
  std::vector<uint64_t> passed;  // marks whose stream passed, for take_passed()
  // A dead peer never writes its flag or credit, and the caller may wait on
  // the stream without ever calling synchronize (torch.cuda.synchronize, a
  // later kernel): this thread aborts the kernels' waits once the engine
  // finds a peer dead, so that wait ends within seconds, not at the timeout.
  std::thread watcher;
  std::mutex watch_mu;
  std::condition_variable watch_cv;
  bool watch_stop = false;

  void watch() {
    std::unique_lock<std::mutex> g(watch_mu);
    while (!watch_cv.wait_for(g, std::chrono::milliseconds(100), [this] { return watch_stop; })) {
      g.unlock();
      const bool dead = abort_if_a_peer_died();
      g.lock();
      if (dead) return;
    }
  }
  void stop_watching() {
    if (!watcher.joinable()) return;
    {
      std::lock_guard<std::mutex> g(watch_mu);
      watch_stop = true;
    }
    watch_cv.notify_all();
    watcher.join();
  }

  // Frees what free() deferred, where its event completed (a stream that was
  // capturing at free() gets its event once it is not: querying a capturing
  // stream would invalidate the capture). Not called while the caller's
  // stream captures: the driver refuses a query or free on that thread then
  // (and the capture with it).
  void sweep(bool all = false) {
    for (size_t i = 0; i < pending.size();) {
      Pending& q = pending[i];
      if (!q.ev && !all) q.ev = event_on(q.stream);
      if (all || (q.ev && event_done(d.EventQuery(q.ev)))) {
        if (q.p)
          d.MemFree(CUdeviceptr(q.p));
        else
          passed.push_back(q.mark);
        if (q.ev) d.EventDestroy(q.ev);
        pending[i] = pending.back();
        pending.pop_back();
      } else {
        ++i;
      }
    }
  }

  // A new event recorded on `stream` now; null while it is capturing (or on an error).
  CUevent event_on(uintptr_t stream) {
    CUstream s = reinterpret_cast<CUstream>(stream);
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    if (d.StreamIsCapturing(s, &st) != CUDA_SUCCESS || st != CU_STREAM_CAPTURE_STATUS_NONE) return nullptr;
    CUevent ev = nullptr;
    if (d.EventCreate(&ev, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) return nullptr;
    if (d.EventRecord(ev, s) != CUDA_SUCCESS) {
      d.EventDestroy(ev);
      return nullptr;
    }
    return ev;
  }

  // After a launch on `stream` outside a capture: its event moves on.
  void ran_on(uintptr_t stream) {
    auto it = ran.find(stream);
    if (it == ran.end()) {
      CUevent ev = nullptr;
      check(d.EventCreate(&ev, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
      it = ran.emplace(stream, ev).first;
    }
    check(d.EventRecord(it->second, reinterpret_cast<CUstream>(stream)), "cuEventRecord");
  }

  Impl(Engine& e, const Driver& d) : e(e), d(d), rank(e.rank()), world(e.world()) {}

  void check(CUresult r, const char* what) const {
    if (r != CUDA_SUCCESS) throw Error(ErrorKind::Invalid, std::string(path()) + ": " + cu::error_string(d, r, what));
  }

  // What the host raised of the ring so far: per-call errors 1 .. next_err - 1.
  uint64_t next_err = 1;

  // Ring entry next_err, if the device wrote it (and it was not overwritten
  // while being read: its number is checked after the fields).
  bool next_entry(a2a::ErrorEntry* out, uint64_t* lapped) const {
    a2a::ErrorEntry& e = err->ring[(next_err - 1) % a2a::kErrRing];
    const uint64_t n = __atomic_load_n(&e.seq, __ATOMIC_ACQUIRE);
    *lapped = 0;
    if (n == a2a::kEntryBusy || n < next_err) return false;  // not yet (or being written): the next look sees it
    if (n > next_err) {  // kErrRing later errors were recorded before the host looked: some are gone
      *lapped = n;
      return false;
    }
    out->code = e.code;
    out->call = e.call;
    out->a = e.a;
    out->b = e.b;
    out->c = e.c;
    out->d = e.d;
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(&e.seq, __ATOMIC_RELAXED) != n) return false;  // overwritten meanwhile: read it again
    out->seq = n;
    return true;
  }

  // The recorded error as the exception the host raises.
  Error describe(const a2a::ErrorEntry& r) const {
    const std::string me = "rank " + std::to_string(rank), call = " (" + std::string(path()) + " call " +
                                                                      std::to_string(r.call) + ")";
    const std::string part = p2p ? "message" : "chunk";
    auto rk = [](uint64_t v) { return "rank " + std::to_string(v); };
    switch (r.code) {
      case a2a::kErrTooLarge:
        return Error(ErrorKind::TooLarge, me + "'s " + part + " for " + rk(r.a) + " has " + std::to_string(r.b) + " rows (" +
                                              std::to_string(r.c) + " bytes), over the device slot capacity of " +
                                              std::to_string(r.d) + " bytes" + call +
                                              ": nothing of it was sent; raise the bound (VARCOMM_BOUND)",
                     int(r.a));
      case a2a::kErrPeerTooLarge:  // on every rank, as on the host path
        return Error(ErrorKind::TooLarge, rk(r.a) + "'s " + part + " for " + me + " had " + std::to_string(r.b) + " rows (" +
                                             std::to_string(r.c) + " bytes), over the device slot capacity of " +
                                             std::to_string(r.d) + " bytes" + call + ": it received 0 rows from it",
                     int(r.a));
      case a2a::kErrMismatch:
        return Error(ErrorKind::Mismatch,
                     rk(r.a) + " sent rows of " + dtype_name(uint32_t(r.b)) + ", " + std::to_string(r.c) +
                         " bytes each, but " + me + " receives " + dtype_name(uint32_t(r.d >> 32)) + ", " +
                         std::to_string(r.d & 0xffffffffu) + " bytes each" + call + ": its " + part + " was dropped (0 rows); " +
                         (p2p ? "recv_rows' out must have the sender's dtype and row shape"
                              : "every rank must pass the same dtype and trailing shape"),
                     int(r.a));
      case a2a::kErrOutFull:
        if (p2p)  // (the receive kernel's c is 0: one message per call)
          return Error(ErrorKind::TooLarge, rk(r.a) + "'s " + std::to_string(r.b) + " rows do not fit out's " +
                                                std::to_string(r.d) + " rows" + call +
                                                ": dropped (0 rows from it); pass a larger out",
                       int(r.a));
        return Error(ErrorKind::TooLarge, rk(r.a) + "'s " + std::to_string(r.b) + " rows do not fit out after " +
                                              std::to_string(r.c) + " rows of " + std::to_string(r.d) + call +
                                              ": dropped (0 rows from it); pass a larger out (in a MoE combine, "
                                              "whose out its dispatch sized: a rank passed the handle of another "
                                              "dispatch, or the ranks are out of step)",
                     int(r.a));
      case a2a::kErrBadSplits:
        if (p2p)  // (b is 0 and c the rows: send_rows sends x[:rows])
          return Error(ErrorKind::Invalid, me + "'s row count for " + rk(r.a) + " is " +
                                               std::to_string(int64_t(r.c)) + ", for an input of " +
                                               std::to_string(r.d) + " rows" + call +
                                               ": negative, or past the input; nothing sent to it");
        // The marker sits in expert 0's split (rows from 0) and counts at most the input's rows.
        if (r.b == 0 && r.c > kA2ABadIdsMarker && r.c - kA2ABadIdsMarker <= r.d)
          return Error(ErrorKind::Invalid, "moe.dispatch on " + me + ": " + std::to_string(r.c - kA2ABadIdsMarker) +
                                               " topk_ids lie outside [0, num_experts) and are not -1 (a masked "
                                               "pair)" + call + ": nothing was sent (0 rows to every rank); fix the "
                                               "router's expert ids");
        return Error(ErrorKind::Invalid, me + "'s send_splits for " + rk(r.a) + " give rows [" +
                                             std::to_string(int64_t(r.b)) + ", " +
                                             std::to_string(int64_t(r.b + r.c)) + ") of an input of " +
                                             std::to_string(r.d) + " rows" + call +
                                             ": negative, or past the input; nothing sent to it");
      case a2a::kErrPeerCounts:
        return Error(ErrorKind::Mismatch, rk(r.a) + "'s chunk for " + me + " says " + std::to_string(r.b) +
                                             " rows but its per-expert counts add up to " + std::to_string(r.c) +
                                             call + ": it received 0 rows from it (a peer of another build, or "
                                             "memory corrupted on the way)",
                     int(r.a));
      case a2a::kErrPeerCall: {
        auto what = [](uint64_t k) {
          const unsigned in = unsigned(k & 15), out = unsigned(k >> 4 & 15), ne = unsigned(k >> 8 & 0xff);
          std::string name = in == a2a::kInOffsets ? "all_to_all_vdev_2d_offset (a MoE combine)"
                             : ne > 1             ? "all_to_all_vdev_2d (a MoE dispatch)"
                                                  : "all_to_all_vdev (or a MoE dispatch with 1 expert per rank)";
          if (out != (in == a2a::kInOffsets ? unsigned(a2a::kOutRankMajor) : unsigned(a2a::kOutExpertMajor)))
            name += " (layout " + std::to_string(out) + ")";
          return std::string(k >> 16 & 1 ? "an autograd backward's " : "") + name + ", " + std::to_string(ne) +
                 " expert" + (ne == 1 ? "" : "s") + " per rank";
        };
        auto handle = [](uint64_t k) {  // (0: a plain all_to_all_vdev_2d_offset, with no MoE handle)
          return k >> 32 ? "the handle of dispatch call " + std::to_string(k >> 32) : std::string("no MoE handle");
        };
        if ((r.b & 0xffffffffu) == (r.c & 0xffffffffu))  // the same call, undoing another dispatch (call_kind)
          return Error(ErrorKind::Mismatch,
                       rk(r.a) + " passed " + handle(r.b) + " to " + what(r.b) + " where " + me + " passed " +
                           handle(r.c) + call +
                           ": a rank combined with the handle of another dispatch (each combine, and each "
                           "backward, takes the handle its own dispatch returned, in this step), or the ranks are "
                           "out of step (0 rows from it)",
                       int(r.a));
        return Error(ErrorKind::Mismatch, rk(r.a) + " ran " + what(r.b) + " where " + me + " ran " + what(r.c) +
                                             call + ": the ranks are out of step (0 rows from it). Every rank must "
                                             "make the same device calls in the same order, after an error too: a "
                                             "call that raised was still made (a refused one empty), unless the "
                                             "error says the device path failed",
                     int(r.a));
      }
      case a2a::kErrPeerRefused:  // the host path's words (AllToAll::refuse)
        return Error(ErrorKind::Mismatch, rk(r.a) + " refused its part of this call before it started (its own "
                                             "error says why)" + call + ": 0 rows from it",
                     int(r.a));
      case a2a::kErrPeerSplits:  // a call the peer refused (the host path's MessageMismatch too)
        if (p2p)
          return Error(ErrorKind::Mismatch, rk(r.a) + "'s row count was negative or past its input" + call +
                                               ": 0 rows from it (its own error says more)",
                       int(r.a));
        return Error(ErrorKind::Mismatch, rk(r.a) + " passed send_splits outside its input (or, in a MoE "
                                             "dispatch, topk_ids outside [-1, num_experts))" + call +
                                             ": 0 rows from it",
                     int(r.a));
      case a2a::kErrTimeout:
        return Error(ErrorKind::Timeout, me + "'s " + path() + " kernel timed out waiting for " + rk(r.a) +
                                             (r.b ? "'s data" : "'s credit (it has not consumed the last call)") +
                                             call +
                                             (p2p ? "; is " + rk(r.a) + " calling " +
                                                        (r.b ? "send_rows" : "recv_rows") + " for " + me + "?"
                                                  : std::string("; is every rank calling it?")) +
                                             " The device path of this communicator stays failed",
                     int(r.a));
      case a2a::kErrOverlap:
        return Error(ErrorKind::Invalid, me + ": a device all-to-all call started before the previous call had "
                                             "ended" + call +
                                             ": two calls of one communicator ran at once, so they could pair up "
                                             "the wrong chunks. A CUDA graph of device all-to-all calls must be "
                                             "replayed on the stream it was captured on (or on one ordered after "
                                             "every stream of earlier calls). The device path of this "
                                             "communicator stays failed");
      case a2a::kErrAborted:
        if (host_timeout_ms.load(std::memory_order_acquire) >= 0)  // this rank's own wait gave up, no peer failed
          return Error(ErrorKind::Timeout,
                       me + "'s " + path() + " did not finish within the " + seconds(host_timeout_ms.load()) +
                           " the host waited (synchronize's timeout), still waiting for " + rk(r.a) + call +
                           (p2p ? "; is " + rk(r.a) + " calling send_rows/recv_rows for " + me + "?"
                                : std::string("; is every rank calling it?")) +
                           " Its kernels were aborted, so the device path of this communicator stays failed",
                       int(r.a));
        if (const int gone = dead_peer.load(std::memory_order_acquire); gone >= 0)
          return Error(ErrorKind::PeerFailure, me + "'s " + path() + " was aborted" + call + ": " +
                                                   e.peer_error(gone) + " (the kernel was waiting for " + rk(r.a) +
                                                   "); the device path of this communicator stays failed",
                       gone);
        return Error(ErrorKind::PeerFailure, me + "'s " + path() + " was aborted while waiting for " + rk(r.a) +
                                                 call + " (a peer failed or the communicator closed); the "
                                                 "device path of this communicator stays failed",
                     int(r.a));
      default:
        return Error(ErrorKind::Invalid, std::string(path()) + ": unknown error code " + std::to_string(r.code));
    }
  }

  // Per-call errors in the order they happened (one per look: each call
  // raises the oldest not raised yet), then a hard error, for good (per-call
  // errors of later calls than the hard one's stay behind it: the path is failed).
  void raise_recorded() {
    const uint64_t hard = __atomic_load_n(&err->hard, __ATOMIC_ACQUIRE);  // written once: no clearing, no tearing
    a2a::ErrorEntry snap{};
    uint64_t lapped = 0;
    if (next_entry(&snap, &lapped) && (!hard || snap.call <= err->hard_call)) {
      ++next_err;
      throw describe(snap);
    }
    if (lapped) {
      // The newest entry tells which kErrRing errors the ring may still hold.
      for (const a2a::ErrorEntry& e : err->ring) {
        const uint64_t n = __atomic_load_n(&e.seq, __ATOMIC_ACQUIRE);
        if (n != a2a::kEntryBusy && n > lapped) lapped = n;
      }
      const uint64_t lost = lapped - a2a::kErrRing + 1 - next_err;
      next_err = lapped - a2a::kErrRing + 1;
      throw Error(ErrorKind::Invalid,
                  std::string(path()) + ": " + std::to_string(lost) +
                      (lost == 1 ? " error of earlier calls was" : " errors of earlier calls were") +
                      " overwritten before it could be raised (more than " + std::to_string(a2a::kErrRing) +
                      " were not raised yet: synchronize more often); the later ones follow");
    }
    if (hard) {
      snap = {};
      snap.code = hard;
      snap.call = err->hard_call;
      snap.a = err->hard_a;
      snap.b = err->hard_b;
      throw describe(snap);
    }
  }

  static std::string seconds(int64_t ms) {
    char b[32];
    std::snprintf(b, sizeof b, "%g s", double(ms) / 1000.0);
    return b;
  }
  void abort() { __atomic_store_n(&err->abort, 1ull, __ATOMIC_RELEASE); }
  // A dead peer never writes its flag or credit: end the kernels' waits now,
  // naming it (dead_peer, set first).
  bool abort_if_a_peer_died() {
    for (int q = 0; q < world; ++q)
      if (q != rank && !e.peer_error(q).empty()) {
        int none = -1;
        dead_peer.compare_exchange_strong(none, q, std::memory_order_acq_rel);
        abort();
        return true;
      }
    return false;
  }
  // Set (before abort()) when a host wait ran past its timeout: the kernels'
  // kErrAborted then means a timeout here, not a peer's failure.
  std::atomic<int64_t> host_timeout_ms{-1};
  // Set (before abort()) by the watcher: the peer found dead. A kernel then
  // names the rank it was waiting for, which may be alive and waiting too.
  std::atomic<int> dead_peer{-1};

  void release() {
    stop_watching();
    if (!retained) return;
    {
      Ctx scope(d, ctx);
      // Calls still on their streams finish first (peers may be in the same
      // call); after 10 s, or once a peer is gone, their waits are aborted.
      const auto deadline = Clock::now() + std::chrono::seconds(10);
      for (bool busy = true; busy && err;) {
        busy = false;
        for (auto& kv : ran) busy |= !event_done(d.EventQuery(kv.second));
        bool dead = false;
        for (int q = 0; q < world && busy; ++q) dead |= q != rank && !e.peer_error(q).empty();
        if (busy && (dead || Clock::now() > deadline)) break;
        if (busy) std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      if (err) abort();
      for (auto& kv : ran) {
        d.EventSynchronize(kv.second);
        d.EventDestroy(kv.second);
      }
      ran.clear();
      for (auto& q : pending)
        if (q.ev) d.EventSynchronize(q.ev);
      sweep(true);
      for (CUdeviceptr p : opened)
        if (p) d.IpcCloseMemHandle(p);
      if (ws) d.MemFree(ws);
      if (module) d.ModuleUnload(module);
      if (err_dev) d.MemHostUnregister(err);
    }
    std::free(err);
    err = nullptr;
    d.DevicePrimaryCtxRelease(dev);
    retained = false;
  }
};

DeviceA2A::DeviceA2A(Engine& e, int device, uint64_t cap, std::optional<double> timeout, bool p2p) : cap_(cap) {
  const std::string path = p2p ? "device point-to-point" : "device all-to-all";
  const std::string why = device_a2a_unavailable_reason();
  if (!why.empty()) throw Error(ErrorKind::Invalid, path + " unavailable: " + why);
  const Driver& d = *cu::driver();
  impl_ = std::make_unique<Impl>(e, d);
  Impl& m = *impl_;
  m.p2p = p2p;
  if (m.world > a2a::kMaxRanks)
    throw Error(ErrorKind::Invalid, path + ": at most " + std::to_string(a2a::kMaxRanks) + " ranks, not " +
                                        std::to_string(m.world));
  if (cap == 0 || cap % 16) throw Error(ErrorKind::Invalid, path + ": the slot capacity (the bound, "
                                                            "VARCOMM_BOUND) must be a positive multiple of 16 bytes");
  int count = 0;
  d.DeviceGetCount(&count);
  if (device < 0 || device >= count)
    throw Error(ErrorKind::Invalid, path + ": CUDA device " + std::to_string(device) + " does not exist");
  // A call refused because a graph is being captured: set-up (GPU memory, a
  // kernel module, every peer's handle: a collective) cannot be captured.
  auto refused_by_capture = [&](CUresult r, const char* what) {
    if (r >= cu::kCaptureErrorFirst && r <= cu::kCaptureErrorLast)
      throw Error(ErrorKind::Invalid, path + ": its first call on a communicator sets it up (GPU memory, "
                                      "and every peer's handle to it: a collective), which a CUDA graph capture "
                                      "refuses (" + cu::error_string(d, r, what) + "): make one call before "
                                      "capturing, as a warm-up");
  };
  try {
    m.check(d.DeviceGet(&m.dev, device), "cuDeviceGet");
    m.check(d.DevicePrimaryCtxRetain(&m.ctx, m.dev), "cuDevicePrimaryCtxRetain");
    m.retained = true;
    Ctx scope(d, m.ctx);
#ifdef VARCOMM_HAVE_FATBIN
    CUresult r = d.ModuleLoadData(&m.module, varcomm_fatbin);
    if (r != CUDA_SUCCESS) {
      m.module = nullptr;
      refused_by_capture(r, "cuModuleLoadData");
      throw Error(ErrorKind::Invalid, path + ": " + cu::error_string(d, r, "cuModuleLoadData") +
                                          " (this build has kernels for " + varcomm_fatbin_archs +
                                          "; rebuild with VARCOMM_CUDA_ARCHS including this GPU)");
    }
#endif
    m.check(d.ModuleGetFunction(&m.send, m.module, VARCOMM_KERNEL_A2A_SEND), "cuModuleGetFunction(send)");
    m.check(d.ModuleGetFunction(&m.recv, m.module, VARCOMM_KERNEL_A2A_RECV), "cuModuleGetFunction(recv)");
    m.check(d.ModuleGetFunction(&m.p2p_send, m.module, VARCOMM_KERNEL_P2P_SEND), "cuModuleGetFunction(p2p send)");
    m.check(d.ModuleGetFunction(&m.p2p_recv, m.module, VARCOMM_KERNEL_P2P_RECV), "cuModuleGetFunction(p2p recv)");
    m.ws_bytes = a2a::ws_bytes(m.world, cap);
    CUresult ra = d.MemAlloc(&m.ws, m.ws_bytes);
    if (ra != CUDA_SUCCESS) {
      m.ws = 0;
      refused_by_capture(ra, "cuMemAlloc");
      throw Error(ErrorKind::Invalid, path + ": cannot allocate its " + std::to_string(m.ws_bytes) +
                                          " bytes of GPU memory (world_size x bound): " +
                                          cu::error_string(d, ra, "cuMemAlloc") + "; lower the bound");
    }
    CUstream s = nullptr;
    m.check(d.StreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    // Every flag, credit and the epoch start at 0 (calls count from 1).
    CUresult rz = d.MemsetD8Async(m.ws, 0, m.ws_bytes, s);
    if (rz == CUDA_SUCCESS) rz = d.StreamSynchronize(s);
    d.StreamDestroy(s);
    m.check(rz, "cuMemsetD8Async");
    void* host = std::aligned_alloc(4096, 4096);
    if (!host) throw Error(ErrorKind::Invalid, path + ": out of host memory");
    std::memset(host, 0, 4096);
    m.err = static_cast<a2a::ErrorRecord*>(host);
    m.check(d.MemHostRegister(host, 4096, cu::kHostRegisterDeviceMap | cu::kHostRegisterPortable),
            "cuMemHostRegister");
    CUresult rp = d.MemHostGetDevicePointer(&m.err_dev, host, 0);
    if (rp != CUDA_SUCCESS) {
      d.MemHostUnregister(host);
      m.err_dev = 0;
      m.check(rp, "cuMemHostGetDevicePointer");
    }
    CUipcMemHandle h;
    m.check(d.IpcGetMemHandle(&h, m.ws), "cuIpcGetMemHandle");

    // Every rank's descriptor to every other, over the engine's host path.
    std::ostringstream o;
    o << "a2adev1 " << getpid() << ' ' << m.ws_bytes << ' ' << cap << ' ' << hex(&h, sizeof h);
    std::string mine = o.str();
    mine.resize(kDescBytes, ' ');
    std::vector<std::string> theirs(m.world, std::string(kDescBytes, ' '));
    A2APlan p;
    p.op = A2AOp::List;
    p.send.resize(m.world);
    p.outs.resize(m.world);
    for (int q = 0; q < m.world; ++q) {
      A2AChunk& c = p.send[q];
      c.data = mine.data();
      c.nbytes = kDescBytes;
      c.dtype = kU8;
      c.ndim = 1;
      c.shape[0] = kDescBytes;
      A2AChunk& oc = p.outs[q];
      oc = c;
      oc.data = theirs[q].data();
    }
    {
      AllToAll x(e, std::move(p));
      x.start();
      const auto deadline = timeout ? Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                         std::chrono::duration<double>(*timeout))
                                    : Clock::time_point::max();
      if (!x.wait_headers(deadline) || !x.wait_done(deadline)) x.timeout(timeout ? *timeout : 0);
      if (auto er = x.error()) throw *er;
    }
    m.peer_ws.assign(m.world, 0);
    m.opened.assign(m.world, 0);
    for (int q = 0; q < m.world; ++q) {
      if (q == m.rank) {
        m.peer_ws[q] = m.ws;
        continue;
      }
      std::istringstream in(theirs[q]);
      std::string magic, handle;
      int pid = 0;
      uint64_t bytes = 0, pcap = 0;
      in >> magic >> pid >> bytes >> pcap >> handle;
      CUipcMemHandle ph;
      if (!in || magic != "a2adev1" || !unhex(handle, &ph, sizeof ph))
        throw Error(ErrorKind::Invalid, path + ": bad descriptor from rank " + std::to_string(q));
      if (pcap != cap || bytes != m.ws_bytes)
        throw Error(ErrorKind::Invalid, path + ": rank " + std::to_string(q) + " has a slot capacity of " +
                                            std::to_string(pcap) + " bytes, this rank " + std::to_string(cap) +
                                            ": set the same bound on every rank");
      CUresult ro = d.IpcOpenMemHandle(&m.opened[q], ph, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
      if (ro != CUDA_SUCCESS) {
        m.opened[q] = 0;
        throw Error(ErrorKind::Invalid, path + ": cannot open rank " + std::to_string(q) +
                                            "'s GPU memory: " + cu::error_string(d, ro, "cuIpcOpenMemHandle") +
                                            " (every rank must be on this host, with peer access between the GPUs)",
                    q);
      }
      m.peer_ws[q] = m.opened[q];
    }
    m.watcher = std::thread([&m] { m.watch(); });
  } catch (...) {
    m.release();
    throw;
  }
}

DeviceA2A::~DeviceA2A() {
  if (impl_) impl_->release();
}

void DeviceA2A::check() {
  std::lock_guard<std::mutex> g(impl_->mu);
  if (impl_->closed) throw Error(ErrorKind::Closed, std::string(impl_->path()) + ": the communicator is closed");
  impl_->raise_recorded();
}

namespace {

a2a::Args args_of(const DeviceA2ACall& c, int rank, int world, uint64_t cap, CUdeviceptr ws,
                  const std::vector<CUdeviceptr>& peer_ws, CUdeviceptr err) {
  a2a::Args a{};
  a.rank = unsigned(rank);
  a.world = unsigned(world);
  a.ne = c.ne;
  a.in_layout = c.in_layout;
  a.out_layout = c.out_layout;
  a.splits_bytes = c.splits_bytes;
  a.refused = c.refused;
  a.backward = c.backward;
  a.dispatch = reinterpret_cast<a2a::u64*>(c.dispatch);
  a.dispatch_set = c.dispatch_set;
  a.dtype = c.dtype;
  a.cap = cap;
  a.row_bytes = c.row_bytes;
  a.x_rows = c.x_rows;
  a.out_rows = c.out_rows;
  a.timeout_ns = c.timeout ? uint64_t(*c.timeout * 1e9) : 0;
  if (c.timeout && !a.timeout_ns) a.timeout_ns = 1;
  a.x = reinterpret_cast<const unsigned char*>(c.x);
  a.splits = reinterpret_cast<const void*>(c.splits);
  a.out = reinterpret_cast<unsigned char*>(c.out);
  a.out_splits_offsets = reinterpret_cast<a2a::i64*>(c.out_splits_offsets);
  a.ws = reinterpret_cast<unsigned char*>(ws);
  for (int q = 0; q < world; ++q) a.peer_ws[q] = reinterpret_cast<unsigned char*>(peer_ws[q]);
  a.err = reinterpret_cast<a2a::ErrorRecord*>(err);
  return a;
}

}  // namespace

void DeviceA2A::launch_p2p(bool send, int peer, const DeviceA2ACall& c) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  if (m.closed) throw Error(ErrorKind::Closed, "device point-to-point: the communicator is closed");
  if (__atomic_load_n(&m.err->hard, __ATOMIC_ACQUIRE)) m.raise_recorded();
  if (peer < 0 || peer >= m.world)
    throw Error(ErrorKind::Invalid, "peer " + std::to_string(peer) + " out of range [0, " +
                                        std::to_string(m.world) + ")");
  if (c.splits_bytes != 4 && c.splits_bytes != 8)
    throw Error(ErrorKind::Invalid, "device point-to-point: the row count must be int32 or int64");
  a2a::Args a = args_of(c, m.rank, m.world, cap_, m.ws, m.peer_ws, m.err_dev);
  a.ne = 1;
  a.peer = unsigned(peer);
  // What earlier kernels recorded is raised once this one is enqueued, as for the all-to-all (launch).
  a2a::ErrorEntry peek{};
  uint64_t lapped = 0;
  const bool earlier = m.next_entry(&peek, &lapped) || lapped;
  Ctx scope(m.d, m.ctx);
  CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
  m.check(m.d.StreamIsCapturing(reinterpret_cast<CUstream>(c.stream), &cs), "cuStreamIsCapturing");
  if (!m.pending.empty() && cs == CU_STREAM_CAPTURE_STATUS_NONE) m.sweep();
  void* params[] = {&a};
  m.check(m.d.LaunchKernel(send ? m.p2p_send : m.p2p_recv, 1, 1, 1, a2a::kThreads, 1, 1, 0,
                           reinterpret_cast<CUstream>(c.stream), params, nullptr),
          send ? "cuLaunchKernel(p2p send)" : "cuLaunchKernel(p2p recv)");
  if (cs == CU_STREAM_CAPTURE_STATUS_NONE) m.ran_on(c.stream);
  if (earlier) m.raise_recorded();
}

void DeviceA2A::launch(const DeviceA2ACall& c) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  if (m.closed) throw Error(ErrorKind::Closed, std::string(m.path()) + ": the communicator is closed");
  // Failed for good (a timeout, an abort): no call numbers to keep in step.
  // Otherwise what earlier calls recorded is raised once this call is
  // enqueued (below): raised first, this rank's call never ran while its
  // peers' did, and every later call paired with their next.
  if (__atomic_load_n(&m.err->hard, __ATOMIC_ACQUIRE)) {
    if (c.refused) return;  // (the caller raises its own error)
    m.raise_recorded();
  }
  // Only what was recorded before this launch: this call's own errors
  // (recorded as soon as its kernels ran) wait for the next look, however
  // fast they ran.
  a2a::ErrorEntry peek{};
  uint64_t lapped = 0;
  const bool earlier = !c.refused && (m.next_entry(&peek, &lapped) || lapped);
  if (c.ne < 1 || c.ne > unsigned(a2a::kMaxLocal))
    throw Error(ErrorKind::Invalid, "device all-to-all: experts per rank must be in [1, " +
                                        std::to_string(a2a::kMaxLocal) + "], not " + std::to_string(c.ne));
  if (c.splits_bytes != 4 && c.splits_bytes != 8)
    throw Error(ErrorKind::Invalid, "device all-to-all: splits must be int32 or int64");
  a2a::Args a = args_of(c, m.rank, m.world, cap_, m.ws, m.peer_ws, m.err_dev);
  Ctx scope(m.d, m.ctx);
  CUstream s = reinterpret_cast<CUstream>(c.stream);
  // A call reads its number from the epoch the last call's receive kernel
  // advances, so it must not start before that kernel ended: the stream
  // first waits for the event recorded after the last call (NCCL serializes
  // a communicator's kernels the same way; the old stream itself is not
  // touched: it may be gone). Also on the same handle: a destroyed stream's
  // handle may come back as a new stream. Not while this stream is being
  // captured, nor after a captured call: the graph's own edges order those,
  // and a captured call only runs at replay. What the host cannot order (a
  // graph replayed on another stream) the send kernel detects (kErrOverlap).
  CUstreamCaptureStatus sn = CU_STREAM_CAPTURE_STATUS_NONE;
  m.check(m.d.StreamIsCapturing(s, &sn), "cuStreamIsCapturing");
  const bool capturing = sn != CU_STREAM_CAPTURE_STATUS_NONE;
  if (!m.pending.empty() && !capturing) m.sweep();
  if (m.last && !m.last_captured && !capturing) {
    auto it = m.ran.find(*m.last);
    if (it != m.ran.end()) m.check(m.d.StreamWaitEvent(s, it->second, 0), "cuStreamWaitEvent");
  }
  void* params[] = {&a};
  m.check(m.d.LaunchKernel(m.send, unsigned(m.world), 1, 1, a2a::kThreads, 1, 1, 0, s, params, nullptr),
          "cuLaunchKernel(send)");
  ++m.launches;  // (counted once its send is enqueued: a refusal after this would be a second call)
  m.check(m.d.LaunchKernel(m.recv, unsigned(m.world), 1, 1, a2a::kThreads, 1, 1, 0, s, params, nullptr),
          "cuLaunchKernel(recv)");
  if (!capturing) m.ran_on(c.stream);
  m.last = c.stream;
  m.last_captured = capturing;
  if (earlier) m.raise_recorded();  // (a refusal raises its own error: these wait for the next look)
}

uint64_t DeviceA2A::launches() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->launches;
}

void DeviceA2A::synchronize(std::optional<uintptr_t> stream, std::optional<double> timeout) {
  Impl& m = *impl_;
  std::vector<CUevent> events;
  {
    std::lock_guard<std::mutex> g(m.mu);
    if (m.closed) throw Error(ErrorKind::Closed, std::string(m.path()) + ": the communicator is closed");
    if (!stream)
      for (auto& kv : m.ran) events.push_back(kv.second);
  }
  Ctx scope(m.d, m.ctx);
  const auto start = Clock::now();
  if (stream) {
    CUstream s = reinterpret_cast<CUstream>(*stream);
    wait_until([&] { return m.d.StreamQuery(s); }, "cuStreamQuery", start, timeout);
  }
  for (CUevent ev : events) wait_until([&] { return m.d.EventQuery(ev); }, "cuEventQuery", start, timeout);
  {
    std::lock_guard<std::mutex> g(m.mu);
    if (!m.pending.empty()) m.sweep();
  }
  check();
}

void DeviceA2A::wait_until(const std::function<int()>& query, const char* what,
                           std::chrono::steady_clock::time_point start, std::optional<double> timeout) {
  Impl& m = *impl_;
  for (int i = 0;; ++i) {
    CUresult r = query();
    if (r == CUDA_SUCCESS) break;
    if (r != CUDA_ERROR_NOT_READY) m.check(r, what);
    if (i % 256 == 255) {
      m.abort_if_a_peer_died();
      if (timeout && Clock::now() - start > std::chrono::duration<double>(*timeout) &&
          !__atomic_load_n(&m.err->abort, __ATOMIC_ACQUIRE)) {  // (a dead peer's abort stays a PeerFailure)
        m.host_timeout_ms.store(int64_t(*timeout * 1000), std::memory_order_release);
        m.abort();
      }
    }
    if (i > 64) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void DeviceA2A::close() {
  std::lock_guard<std::mutex> g(impl_->mu);
  if (impl_->closed) return;
  impl_->closed = true;
  impl_->release();
}

uintptr_t DeviceA2A::alloc(uint64_t nbytes) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  if (m.closed) throw Error(ErrorKind::Closed, std::string(m.path()) + ": the communicator is closed");
  Ctx scope(m.d, m.ctx);
  CUdeviceptr p = 0;
  // An output allocated while the caller captures (the call being captured):
  // as PyTorch's allocator does then, in RELAXED mode, which lets it through;
  // the graph keeps using that address, and free() does not free it while
  // its stream captures.
  CUresult r;
  {
    CaptureModeScope relaxed(m.d, CU_STREAM_CAPTURE_MODE_RELAXED);
    r = m.d.MemAlloc(&p, nbytes ? nbytes : 1);
  }
  if (r != CUDA_SUCCESS)
    throw Error(ErrorKind::Invalid, "device all-to-all: cannot allocate " + std::to_string(nbytes) +
                                        " bytes of GPU memory for an output: " + cu::error_string(m.d, r, "cuMemAlloc"));
  return uintptr_t(p);
}

void DeviceA2A::free(uintptr_t p, uintptr_t stream) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  if (!m.retained) return;  // closed: the driver frees it with the process
  Ctx scope(m.d, m.ctx);
  // Freed at a later launch or synchronize (sweep): this thread may be
  // capturing another stream, where a query or free would break the capture.
  m.pending.push_back({p, stream, m.event_on(stream)});
}

uint64_t DeviceA2A::mark(uintptr_t stream) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  const uint64_t id = ++m.marks;
  if (!m.retained) {  // closed: nothing runs any more
    m.passed.push_back(id);
    return id;
  }
  Ctx scope(m.d, m.ctx);
  m.pending.push_back({0, stream, m.event_on(stream), id});
  return id;
}

std::vector<uint64_t> DeviceA2A::take_passed() {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> g(m.mu);
  return std::move(m.passed);
}

std::string DeviceA2A::describe() const {
  return "device all-to-all over CUDA IPC: " + std::to_string(impl_->world) + " slots of " + std::to_string(cap_) +
         " bytes, kernels " VARCOMM_KERNEL_A2A_SEND " / " VARCOMM_KERNEL_A2A_RECV;
}

}  // namespace varcomm
