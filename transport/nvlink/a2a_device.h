// All-to-all with device-side splits over nvlink: the host never reads a
// count. Each rank keeps a workspace in GPU memory (one bound-sized slot per
// source, a control block per slot, a credit word per peer, an epoch),
// exported with CUDA IPC; a send kernel reads the splits on the device and
// writes each peer's rows, counts and a flag into that peer's slot, and a
// receive kernel waits for the flags, places the rows into a bound-sized
// output and writes the received counts and offsets on the device. Every
// sequence number lives in device memory and is advanced by the kernels, so
// the pair of launches can be captured in a CUDA graph and replayed with new
// routing. Errors go to a host-mapped record that the host reads at
// synchronize() or the next call. See transport/nvlink/README.md and
// a2a_kernels.cuh (the kernels, also run by the CPU stand-in driver).
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "engine.h"

namespace varcomm {

// A split of at least this many rows is moe_device.dispatch's marker for
// topk_ids outside [-1, E) (the marker plus their count, at most the input's
// rows), in expert 0's split: the send kernel refuses it as past the input,
// and the host names the ids (a user's split there is as wrong, and told so). Routing on the device cannot be checked on the host without a sync.
constexpr uint64_t kA2ABadIdsMarker = uint64_t(1) << 62;

// One call's arrays, as pointers (device memory, ordered on `stream`).
struct DeviceA2ACall {
  unsigned ne = 1;          // local experts per rank (1: all_to_all_vdev)
  unsigned in_layout = 0;   // a2a::kInPrefix / kInOffsets
  unsigned out_layout = 0;  // a2a::kOutExpertMajor / kOutRankMajor
  uint32_t dtype = 0;
  uint64_t row_bytes = 0;
  uintptr_t x = 0;
  uint64_t x_rows = 0;
  uintptr_t splits = 0;
  unsigned splits_bytes = 8;  // int64 (8) or int32 (4)
  uintptr_t out = 0;
  uint64_t out_rows = 0;
  uintptr_t out_splits_offsets = 0;  // int64 [2, world * ne]
  uintptr_t stream = 0;
  std::optional<double> timeout;  // seconds a kernel spins on a peer; none: until the host aborts
  // The host refused this rank's part (an argument error): the call runs
  // only to keep call numbers in step; every receiver gets 0 rows and
  // MessageMismatch naming this rank. x, splits and the outputs are unused.
  bool refused = false;
  // An autograd backward's call: a forward's chunk met by it (a rank ran no
  // backward and went on) is "out of step", not rows of the same shape taken.
  bool backward = false;
  // MoE (moe_device): an int64 in device memory. A dispatch (dispatch_set)
  // writes its call number there from its kernel; its combine and both
  // backwards carry and check it, so a handle of another dispatch than the
  // peers' fails every rank's call ("out of step"). 0: a plain all-to-all.
  uintptr_t dispatch = 0;
  bool dispatch_set = false;
};

class DeviceA2A {
 public:
  // Collective over every rank of `e` (through the engine's host path): the
  // workspace (`cap` payload bytes per source slot) is allocated on
  // `device`, exported, and every peer's is opened. Throws Invalid when the
  // build or driver cannot run it.
  // p2p: the handle of send_rows/recv_rows only (its errors speak of messages and row counts).
  DeviceA2A(Engine& e, int device, uint64_t cap, std::optional<double> timeout, bool p2p = false);
  ~DeviceA2A();
  DeviceA2A(const DeviceA2A&) = delete;
  DeviceA2A& operator=(const DeviceA2A&) = delete;

  // Raises an error recorded by an earlier call, then enqueues the two kernels.
  void launch(const DeviceA2ACall& c);
  // Point-to-point with a device-side row count, on a workspace set up for
  // it (its own DeviceA2A): one kernel. Send: c.splits points at the rows
  // to send (one int), x at them. Receive: out bound-sized, its rows
  // written to out_splits_offsets[0]. Per pair, calls must be ordered.
  void launch_p2p(bool send, int peer, const DeviceA2ACall& c);
  // Raises what the device recorded, if anything (no wait): the oldest
  // per-call error not raised yet (each is raised once, in call order; none
  // is dropped for a later one), else a hard error (timeout, abort,
  // overlapping calls), which stays.
  void check();
  // All-to-all calls launched so far (refused ones too): whether a call that
  // raised was enqueued before it did (then its peers are in step with it).
  uint64_t launches() const;
  // Waits (host) until `stream` ran everything enqueued so far (none: until
  // every call launched outside a capture ran, through events: the streams
  // themselves may be gone); a dead peer meanwhile aborts the kernels'
  // waits. Then check().
  void synchronize(std::optional<uintptr_t> stream, std::optional<double> timeout);
  // Waits for the calls launched (up to 10 s, less once a peer is dead),
  // then makes every spinning kernel give up, frees the workspace. Later
  // calls raise ClosedError.
  void close();
  // Device memory for outputs of callers that have no allocator of their own
  // (arrays that are not torch tensors): cuMemAlloc / cuMemFree on our GPU.
  uintptr_t alloc(uint64_t nbytes);
  // Frees p once `stream` has run what is enqueued on it now (a kernel may
  // still write an output its caller dropped): an event recorded now (the
  // stream must still exist; while it is capturing, at a later look), then
  // at a later launch, synchronize or close.
  void free(uintptr_t p, uintptr_t stream);
  // The same for what the caller keeps alive (arrays on a stream whose
  // allocator does not order their reuse): a mark that take_passed() returns
  // once `stream` ran what is enqueued on it now (close: at once).
  uint64_t mark(uintptr_t stream);
  std::vector<uint64_t> take_passed();
  uint64_t cap() const { return cap_; }
  std::string describe() const;

 private:
  struct Impl;
  // Polls `query` (cuStreamQuery or cuEventQuery) until it succeeds,
  // aborting the kernels' waits on a dead peer or past `timeout` from `start`.
  void wait_until(const std::function<int()>& query, const char* what, std::chrono::steady_clock::time_point start,
                  std::optional<double> timeout);
  std::unique_ptr<Impl> impl_;
  uint64_t cap_;
};

// Whether this build has the kernels (nvcc was found); loads nothing.
bool device_a2a_built();

// Empty when this build can run the device-split all-to-all, else why not.
std::string device_a2a_unavailable_reason();

}  // namespace varcomm
