// The device-split all-to-all's kernels (transport/nvlink/a2a_device.h), as
// bodies that compile both as CUDA (kernels.cu wraps them in __global__
// functions) and as host C++ (fake_libcuda.cc runs them on CPU threads for
// cuLaunchKernel), so CI checks the real algorithm: slot layout, counts,
// flags, credits, clamping and errors.
//
// A block is written as phases separated by __syncthreads(): each phase is a
// function of (block, thread) plus the block's shared state. The GPU runs
// the phases with a barrier between them; the host runs, per block, each
// phase for every thread index in turn, which is the same program. Spin waits
// are only on words other ranks' kernels (or this rank's earlier kernels)
// write, never on another block of the same grid, so any block order
// terminates; the one cross-block step (the last block to finish publishes
// the credits and the epoch) is a counter, not a wait.
//
// Workspace of each rank (device memory, exported with CUDA IPC), offsets in
// bytes (a2a_ws_* below):
//   [state: epoch | blocks done | last call with an error | broken | (unused) |
//    errors numbered | send blocks started]
//   [credits: one u64 per peer] [per source s: slot s]
//   slot s = [ctl: flag, rows, dtype, row_bytes, status, (40, 48: point-to-point counters), call kind | counts[kA2AMaxLocal]] [payload: cap bytes]
// Rank d's slot s is where rank s writes its chunk for d; rank s's credits[d]
// is where d says it consumed that chunk. All words only grow by call
// number (the epoch), so nothing is ever reset between calls and a captured
// CUDA graph replays them correctly.
#pragma once
#include <cstddef>
#include <cstdint>

#ifdef __CUDACC__
#include <cuda/atomic>
#define VC_HD __host__ __device__
#else
#include <sched.h>
#include <time.h>
#define VC_HD
#endif

namespace varcomm {
namespace a2a {

using u64 = unsigned long long;
using i64 = long long;

constexpr int kMaxRanks = 64;        // peers one launch addresses (the args struct holds their pointers)
constexpr int kMaxLocal = 128;       // experts per rank of the 2-D (MoE) form
constexpr u64 kCtlBytes = 64 + 8 * kMaxLocal;  // a slot's control block
constexpr u64 kStateBytes = 64;
constexpr int kThreads = 256;        // threads per block of both kernels

// Slot status, written by the sender with the flag.
// kRefused: the sender's host refused its part of the call (an argument
// error) and launched it only to keep every rank's call numbers in step.
enum : u64 { kOk = 0, kOverCapacity = 1, kBadSplits = 2, kSenderFailed = 3, kRefused = 4 };

// The error record (host-mapped memory, one page per communicator). Codes
// below kHard are per call: the exchange itself completed (every flag and
// credit moved), so the host reports it once and goes on. The first of a call
// wins (a word in the workspace), then takes the next entry of a ring: the
// host may not look before later calls record theirs (launches are
// asynchronous), so one record that each error overwrote lost the earlier
// ones. The host raises entries in order, one per check; an entry's seq
// (its error number, from 1) is written last, so a torn read shows as a
// changed seq. kHard and above (a timeout, an abort, overlapping calls):
// sequence numbers may disagree between ranks, so the device path of that
// communicator stays failed. Those have fields of their own, written once
// by the first (a per-call error earlier in the same call must not hide
// one: the host would report it and go on).
enum : u64 {
  kErrNone = 0,
  kErrTooLarge = 2,   // a: dst (sender side) or src (receiver side), b: rows, c: bytes, d: capacity
  kErrMismatch = 3,   // a: src, b: its dtype word, c: its row bytes, d: ours (dtype << 32 | row bytes)
  kErrOutFull = 4,    // a: src, b: rows it sent, c: rows already placed, d: out rows
  kErrBadSplits = 5,  // a: dst, b: first row, c: rows, d: x rows (negative or past x)
  kErrPeerSplits = 6, // a: src whose splits were bad (receiver side)
  kErrPeerTooLarge = 7,  // a: src, b: rows, c: bytes, d: capacity (receiver side)
  kErrPeerCounts = 8,    // a: src, b: its rows, c: its per-expert counts' sum (saturated)
  kErrPeerRefused = 9,   // a: src whose host refused the call (receiver side)
  kErrPeerCall = 10,     // a: src, b: its call_kind, c: ours (another kind of call: out of step)
  kHard = 16,
  kErrTimeout = 16,   // a: peer, b: 0 waiting for its credit (send) / 1 for its data (recv)
  kErrAborted = 17,   // the host aborted the wait (a dead peer, close)
  kErrOverlap = 18,   // a: the call number the kernel read, b: the calls' send blocks started before it
};

constexpr int kErrRing = 32;  // per-call errors the host may not have raised yet
struct ErrorEntry {
  u64 seq;  // the error's number (from 1); 0: never written; kEntryBusy: being written
  u64 code, call, a, b, c, d;
  u64 pad;
};
constexpr u64 kEntryBusy = ~0ull;
struct ErrorRecord {
  u64 abort;  // set by the host: every spin gives up with kErrAborted
  u64 hard, hard_call, hard_a, hard_b;  // the first hard error: code (last written), call, a, b
  u64 pad[3];
  ErrorEntry ring[kErrRing];  // entry (n - 1) % kErrRing holds error n
};
static_assert(sizeof(ErrorRecord) <= 4096, "the error record is one page");

// Workspace offsets.
VC_HD inline u64 ws_state() { return 0; }
VC_HD inline u64 ws_credit(int peer) { return kStateBytes + 8 * u64(peer); }
VC_HD inline u64 ws_slots(int world) { return (kStateBytes + 8 * u64(world) + 63) / 64 * 64; }
VC_HD inline u64 slot_bytes(u64 cap) { return kCtlBytes + (cap + 63) / 64 * 64; }
VC_HD inline u64 ws_slot(int world, u64 cap, int src) { return ws_slots(world) + u64(src) * slot_bytes(cap); }
VC_HD inline u64 ws_bytes(int world, u64 cap) { return ws_slot(world, cap, world); }
// In a slot's control block.
constexpr u64 kFlag = 0, kRows = 8, kDtype = 16, kRowBytes = 24, kStatus = 32, kCounts = 64;
// Which call wrote the chunk (call_kind): its layouts and experts per rank,
// so a rank out of step (its combine met by a peer's dispatch) is told, not
// taken for rows. (40 and 48 are the point-to-point workspace's counters.)
constexpr u64 kKind = 56;

// Input and output layouts of the pieces (rank, local expert) of the 2-D form.
enum : unsigned {
  kInPrefix = 0,   // splits[d * ne + e]: rows in order, offsets are the prefix sums
  kInOffsets = 1,  // splits_offsets[0][e * world + d] rows at splits_offsets[1][e * world + d] (combine)
  kOutExpertMajor = 0,  // out index e * world + s (dispatch; ne = 1 is all_to_all_vdev)
  kOutRankMajor = 1,    // out index s * ne + e (combine: back in the sender's order)
};

// One launch's arguments, passed by value (the same struct to both kernels).
struct Args {
  unsigned rank, world, ne;            // ne: local experts per rank (1: plain all_to_all_vdev)
  unsigned peer;                       // point-to-point kernels: the other rank
  unsigned in_layout, out_layout;
  unsigned splits_bytes;               // 4 or 8: int32 or int64 splits
  unsigned refused;                    // 1: this rank's host refused the call: x, splits, out and
                                       // out_splits_offsets are not touched, every receiver gets kRefused
  unsigned dtype;                      // dtype word of x and out
  unsigned backward;                   // 1: an autograd backward's call (its kind differs from a forward's)
  unsigned dispatch_set;               // 1: this call is a MoE dispatch: it writes its number to *dispatch
  u64 cap;                             // payload bytes of every slot (same on every rank)
  u64 row_bytes;
  u64 x_rows, out_rows;
  u64 timeout_ns;                      // 0: no limit (the host's abort still ends a spin)
  const unsigned char* x;
  const void* splits;                  // [world * ne] or, kInOffsets, [2, world * ne]
  unsigned char* out;
  i64* out_splits_offsets;             // [2, world * ne]: rows, then row offsets, in the out layout's order
  u64* dispatch;                       // MoE (moe_device): the number of the dispatch a combine or backward
                                       // undoes, in device memory (its kernels write it: graph replays too);
                                       // null for the plain all-to-alls
  unsigned char* ws;                   // this rank's workspace
  unsigned char* peer_ws[kMaxRanks];   // every rank's workspace as mapped here (ours at [rank])
  ErrorRecord* err;                    // host-mapped
};

// ---- memory operations, host and device ------------------------------------

VC_HD inline u64 load_acquire(const u64* p) {
#ifdef __CUDA_ARCH__
  return cuda::atomic_ref<u64, cuda::thread_scope_system>(*const_cast<u64*>(p)).load(cuda::memory_order_acquire);
#else
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}
VC_HD inline void store_release(u64* p, u64 v) {
#ifdef __CUDA_ARCH__
  cuda::atomic_ref<u64, cuda::thread_scope_system>(*p).store(v, cuda::memory_order_release);
#else
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}
// A coherent load without ordering (control words other GPUs write; never a stale L1 line).
VC_HD inline u64 load_relaxed(const u64* p) {
#ifdef __CUDA_ARCH__
  return cuda::atomic_ref<u64, cuda::thread_scope_system>(*const_cast<u64*>(p)).load(cuda::memory_order_relaxed);
#else
  return __atomic_load_n(p, __ATOMIC_RELAXED);
#endif
}
VC_HD inline bool cas(u64* p, u64 expect, u64 v) {
#ifdef __CUDA_ARCH__
  return cuda::atomic_ref<u64, cuda::thread_scope_system>(*p).compare_exchange_strong(expect, v);
#else
  return __atomic_compare_exchange_n(p, &expect, v, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
#endif
}
VC_HD inline u64 fetch_add(u64* p, u64 v) {
#ifdef __CUDA_ARCH__
  return cuda::atomic_ref<u64, cuda::thread_scope_device>(*p).fetch_add(v);
#else
  return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
#endif
}
// Every store of this thread is visible system-wide (peer GPUs, the host) before later ones.
VC_HD inline void fence_system() {
#ifdef __CUDA_ARCH__
  __threadfence_system();
#else
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}
VC_HD inline u64 now_ns() {
#ifdef __CUDA_ARCH__
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#else
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return u64(ts.tv_sec) * 1000000000ull + u64(ts.tv_nsec);
#endif
}
VC_HD inline void pause() {
#ifdef __CUDA_ARCH__
  __nanosleep(200);
#else
  sched_yield();
#endif
}

VC_HD inline u64 sat_add(u64 x, u64 y) { return y > ~0ull - x ? ~0ull : x + y; }
VC_HD inline u64 sat_mul(u64 x, u64 y) { return y && x > ~0ull / y ? ~0ull : x * y; }

VC_HD inline u64* word(unsigned char* base, u64 off) { return reinterpret_cast<u64*>(base + off); }

// The workspace's "broken" word: set (for good) by the first hard error.
VC_HD inline u64* broken_word(const Args& a) { return reinterpret_cast<u64*>(a.ws + ws_state() + 24); }

// Workspace state words (a2a_ws_*): the last call with a per-call error, the
// errors numbered so far, the send blocks started so far.
VC_HD inline u64* err_call_word(const Args& a) { return reinterpret_cast<u64*>(a.ws + ws_state() + 16); }
VC_HD inline u64* err_count_word(const Args& a) { return reinterpret_cast<u64*>(a.ws + ws_state() + 40); }
VC_HD inline u64* sends_started_word(const Args& a) { return reinterpret_cast<u64*>(a.ws + ws_state() + 48); }

// The first error of a call wins a word in device memory (atomics on host
// memory are not portable: PCIe) and a number, then writes its ring entry
// with plain stores: busy, the fields, the number. The first hard error wins
// the broken word and writes the hard fields, whatever the call recorded before.
VC_HD inline void report(const Args& a, u64 code, u64 call, u64 x, u64 y, u64 z, u64 w) {
  if (code >= kHard) {
    if (!cas(broken_word(a), 0, 1)) return;  // the path is failed already: the first cause is what the host says
    a.err->hard_call = call;
    a.err->hard_a = x;
    a.err->hard_b = y;
    fence_system();
    store_release(&a.err->hard, code);
    return;
  }
  u64* seq = err_call_word(a);
  for (;;) {
    const u64 v = load_relaxed(seq);
    if (v >= call) return;  // this call's error is recorded already
    if (cas(seq, v, call)) break;
  }
  const u64 n = fetch_add(err_count_word(a), 1) + 1;
  ErrorEntry& e = a.err->ring[(n - 1) % kErrRing];
  store_release(&e.seq, kEntryBusy);
  fence_system();
  e.code = code;
  e.call = call;
  e.a = x;
  e.b = y;
  e.c = z;
  e.d = w;
  fence_system();
  store_release(&e.seq, n);
}

// Waits until *p >= v. False (and the error reported) at the deadline or on the host's abort.
VC_HD inline bool wait_geq(const Args& a, const u64* p, u64 v, u64 call, int peer, u64 what) {
  const u64 start = a.timeout_ns ? now_ns() : 0;
  for (unsigned i = 0;; ++i) {
    if (static_cast<i64>(load_acquire(p) - v) >= 0) return true;
    if ((i & 63) == 63) {
      if (load_acquire(&a.err->abort)) {
        report(a, kErrAborted, call, u64(peer), what, 0, 0);
        return false;
      }
      if (a.timeout_ns && now_ns() - start > a.timeout_ns) {
        report(a, kErrTimeout, call, u64(peer), what, 0, 0);
        return false;
      }
    }
    pause();
  }
}

// Copy n bytes, thread t of nt, in the widest words src, dst and n allow.
// `coherent`: src was written by another GPU during this call (a slot), so
// the GPU reads it at L2 (ld.cg), never from a stale L1 line.
template <class W>
VC_HD inline void copy_words(unsigned char* dst, const unsigned char* src, u64 n, unsigned t, unsigned nt,
                             bool coherent) {
  W* d = reinterpret_cast<W*>(dst);
  const W* s = reinterpret_cast<const W*>(src);
#ifdef __CUDA_ARCH__
  if (coherent) {
    for (u64 i = t; i < n / sizeof(W); i += nt) d[i] = __ldcg(s + i);
    return;
  }
#endif
  for (u64 i = t; i < n / sizeof(W); i += nt) d[i] = s[i];
}
#ifdef __CUDA_ARCH__
using Word16 = uint4;
#else
struct alignas(16) Word16 {
  u64 lo, hi;
};
#endif
VC_HD inline void copy_bytes(unsigned char* dst, const unsigned char* src, u64 n, unsigned t, unsigned nt,
                             bool coherent = false) {
  const u64 mis = reinterpret_cast<u64>(dst) | reinterpret_cast<u64>(src) | n;
  if (!(mis & 15))
    copy_words<Word16>(dst, src, n, t, nt, coherent);
  else if (!(mis & 7))
    copy_words<u64>(dst, src, n, t, nt, coherent);
  else if (!(mis & 3))
    copy_words<unsigned>(dst, src, n, t, nt, coherent);
  else
    copy_words<unsigned char>(dst, src, n, t, nt, coherent);
}

// The top half: the dispatch a MoE combine or backward undoes (the dispatch's
// call number, the same on every rank), so a rank passing the handle of
// another dispatch than its peers' is out of step even where the row counts
// agree.
VC_HD inline u64 call_kind(const Args& a) {
  const u64 undoes = a.dispatch && !a.dispatch_set ? *a.dispatch & 0xffffffffu : 0;
  return u64(a.in_layout) | u64(a.out_layout) << 4 | u64(a.ne) << 8 | u64(a.backward != 0) << 16 | undoes << 32;
}

VC_HD inline i64 split_at(const Args& a, u64 i) {
  return a.splits_bytes == 4 ? i64(static_cast<const int*>(a.splits)[i]) : static_cast<const i64*>(a.splits)[i];
}

// ---- send: block d writes this rank's chunk for rank d into d's slot for us --

struct SendShared {
  u64 call;     // this call's number (epoch + 1)
  int go;       // 0: nothing to copy (failed wait, refused chunk)
  u64 status;
  u64 rows;
  u64 src_row[kMaxLocal];   // first input row of each piece
  u64 dst_row[kMaxLocal];   // its row in the slot
  u64 cnt[kMaxLocal];
};

// Thread 0: wait for d's credit of the last call, find and check the pieces.
VC_HD inline void send_phase0(const Args& a, SendShared& sh, unsigned d) {
  unsigned char* ws = a.ws;
  sh.call = load_acquire(word(ws, ws_state())) + 1;
  sh.go = 0;
  sh.status = kOk;
  sh.rows = 0;
  // (block 0 only: one writer; this call's combine, later on the stream, reads it)
  if (a.dispatch_set && a.dispatch && d == 0) *a.dispatch = sh.call;
  // Calls must run one after another (the number read above is the last
  // call's, advanced at its very end). Every send block counts itself: while
  // they do, world blocks start per call, so another number here means a
  // second call started before the last ended (a graph replayed on another
  // stream than its capture's, streams the host could not order): two calls
  // with one number would pair up the wrong chunks.
  const u64 started = fetch_add(sends_started_word(a), 1);
  if (started / a.world != sh.call - 1) {
    report(a, kErrOverlap, sh.call, sh.call, started, 0, 0);
    sh.status = kSenderFailed;
    return;
  }
  if (!wait_geq(a, word(ws, ws_credit(int(d))), sh.call - 1, sh.call, int(d), 0)) {
    sh.status = kSenderFailed;
    return;
  }
  if (a.refused) {
    sh.status = kRefused;
    return;
  }
  const u64 W = a.world, ne = a.ne;
  u64 rows = 0;
  i64 next = 0;  // kInPrefix: the first row of piece (d, e)
  // Every split is checked before it is added (next stays in [0, x_rows]):
  // a sum of huge ones would overflow, and a wrapped prefix can look valid.
  if (a.in_layout == kInPrefix)
    for (u64 i = 0; i < d * ne; ++i) {
      const i64 v = split_at(a, i);
      if (v < 0 || u64(v) > a.x_rows - u64(next)) {
        report(a, kErrBadSplits, sh.call, i / ne, u64(next), u64(v), a.x_rows);
        sh.status = kBadSplits;
        return;
      }
      next += v;
    }
  for (u64 e = 0; e < ne; ++e) {
    i64 first, cnt;
    if (a.in_layout == kInPrefix) {
      first = next;
      cnt = split_at(a, d * ne + e);
    } else {
      cnt = split_at(a, e * W + d);
      first = split_at(a, W * ne + e * W + d);
    }
    if (cnt < 0 || first < 0 || u64(cnt) > a.x_rows || u64(first) > a.x_rows - u64(cnt)) {
      report(a, kErrBadSplits, sh.call, d, u64(first), u64(cnt), a.x_rows);
      sh.status = kBadSplits;
      return;
    }
    if (a.in_layout == kInPrefix) next = first + cnt;
    sh.src_row[e] = u64(first);
    sh.dst_row[e] = rows;
    sh.cnt[e] = u64(cnt);
    rows += u64(cnt);
  }
  sh.rows = rows;
  if (rows * a.row_bytes > a.cap) {
    report(a, kErrTooLarge, sh.call, d, rows, rows * a.row_bytes, a.cap);
    sh.status = kOverCapacity;
    return;
  }
  sh.go = 1;
}

VC_HD inline void send_phase1(const Args& a, const SendShared& sh, unsigned d, unsigned t, unsigned nt) {
  if (!sh.go) return;
  unsigned char* slot = a.peer_ws[d] + ws_slot(int(a.world), a.cap, int(a.rank));
  for (unsigned e = 0; e < a.ne; ++e)
    copy_bytes(slot + kCtlBytes + sh.dst_row[e] * a.row_bytes, a.x + sh.src_row[e] * a.row_bytes,
               sh.cnt[e] * a.row_bytes, t, nt);
  fence_system();
}

// Thread 0, after every thread's bytes: the control block, then the flag.
VC_HD inline void send_phase2(const Args& a, const SendShared& sh, unsigned d) {
  if (sh.status == kSenderFailed) return;  // our sequence is broken: the receiver times out or is aborted
  unsigned char* slot = a.peer_ws[d] + ws_slot(int(a.world), a.cap, int(a.rank));
  *word(slot, kRows) = sh.rows;
  *word(slot, kDtype) = a.dtype;
  *word(slot, kRowBytes) = a.row_bytes;
  *word(slot, kStatus) = sh.status;
  *word(slot, kKind) = call_kind(a);
  for (unsigned e = 0; e < a.ne; ++e) *word(slot, kCounts + 8 * e) = sh.go ? sh.cnt[e] : 0;
  fence_system();
  store_release(word(slot, kFlag), sh.call);
}

// ---- recv: block s places source s's pieces into out --------------------------

struct RecvShared {
  u64 call;
  int go;
  u64 src_row[kMaxLocal];  // row of each piece in our slot for s
  u64 dst_row[kMaxLocal];  // its row in out
  u64 cnt[kMaxLocal];
  u64 col[kMaxLocal];      // phase 0: rows of every taken source for expert e
  u64 pre[kMaxLocal];      // phase 0: the same, of the taken sources before s
};

VC_HD inline const unsigned char* slot_of(const Args& a, int s) {
  return a.ws + ws_slot(int(a.world), a.cap, s);
}
// A word of a peer's control block, read once per use site and kept: the
// sender's header is not trusted, so what was checked must be what is used.
VC_HD inline u64 ctl(const Args& a, int s, u64 off) {
  const u64* p = reinterpret_cast<const u64*>(slot_of(a, s) + off);
#if !defined(__CUDA_ARCH__) && defined(VC_HOST_CTL_READ)
  VC_HOST_CTL_READ(p);  // tests (fake_libcuda.cc): a peer that rewrites its header while it is read
#endif
  return load_relaxed(p);
}

// Thread 0: wait for every source's flag (acquire: the control block it
// covers is complete), then read each source's control block exactly once
// (a second read could see other words than the ones checked: a peer
// writing its slot out of turn would then make this block copy past the
// slot or out). In source order decide which chunks are taken (while out
// has room) and place s's pieces.
VC_HD inline void recv_phase0(const Args& a, RecvShared& sh, unsigned s) {
  sh.call = load_acquire(word(a.ws, ws_state())) + 1;
  sh.go = 0;
  const unsigned W = a.world, ne = a.ne;
  for (unsigned q = 0; q < W; ++q)
    if (!wait_geq(a, reinterpret_cast<const u64*>(slot_of(a, int(q)) + kFlag), sh.call, sh.call, int(q), 1)) {
      for (unsigned e = 0; e < ne && !a.refused; ++e) {
        const u64 i = a.out_layout == kOutExpertMajor ? u64(e) * W + s : u64(s) * ne + e;
        a.out_splits_offsets[i] = 0;
        a.out_splits_offsets[u64(W) * ne + i] = 0;
      }
      return;
    }
  if (a.refused) return;  // every chunk was waited for (its credit goes back): nothing is placed, nothing reported
  u64* c = sh.src_row;  // source q's counts while q is looked at (src_row is written at the end)
  for (unsigned e = 0; e < ne; ++e) sh.col[e] = sh.pre[e] = sh.cnt[e] = 0;
  u64 placed = 0, before_s = 0;  // rows taken so far; of the taken sources before s
  bool mine_taken = false;
  const u64 mine = u64(a.dtype) << 32 | a.row_bytes, my_kind = call_kind(a);
  for (unsigned q = 0; q < W; ++q) {
    const u64 st = ctl(a, int(q), kStatus), rows = ctl(a, int(q), kRows);
    const u64 dt = ctl(a, int(q), kDtype), rb = ctl(a, int(q), kRowBytes);
    bool ok = st == kOk;
    if (q == s) {  // each source's problem is reported by its own block
      if (st == kOverCapacity) report(a, kErrPeerTooLarge, sh.call, q, rows, sat_mul(rows, rb), a.cap);
      if (st == kBadSplits) report(a, kErrPeerSplits, sh.call, q, 0, 0, 0);
      if (st == kRefused) report(a, kErrPeerRefused, sh.call, q, 0, 0, 0);
    }
    if (ok) {
      const u64 kind = ctl(a, int(q), kKind);
      if (kind != my_kind) {
        if (q == s) report(a, kErrPeerCall, sh.call, q, kind, my_kind, 0);
        ok = false;
      }
    }
    if (ok && (dt != a.dtype || rb != a.row_bytes)) {
      if (q == s) report(a, kErrMismatch, sh.call, q, dt, rb, mine);
      ok = false;
    }
    // Its rows must fit the slot and its counts add up to them, or nothing
    // is read from the slot nor written to out for it.
    if (ok && a.row_bytes && rows > a.cap / a.row_bytes) {
      if (q == s) report(a, kErrPeerTooLarge, sh.call, q, rows, sat_mul(rows, rb), a.cap);
      ok = false;
    }
    if (ok) {
      u64 sum = 0;
      for (unsigned e = 0; e < ne; ++e) sum = sat_add(sum, c[e] = ctl(a, int(q), kCounts + 8 * u64(e)));
      if (sum != rows) {
        if (q == s) report(a, kErrPeerCounts, sh.call, q, rows, sum, 0);
        ok = false;
      }
    }
    if (ok && placed + rows > a.out_rows) {
      if (q == s) report(a, kErrOutFull, sh.call, q, rows, placed, a.out_rows);
      ok = false;
    }
    if (!ok) continue;
    placed += rows;
    for (unsigned e = 0; e < ne; ++e) {
      sh.col[e] += c[e];
      if (q < s) sh.pre[e] += c[e];
      if (q == s) sh.cnt[e] = c[e];
    }
    if (q < s) before_s += rows;
    if (q == s) mine_taken = true;
  }
  // Offsets in the out layout's order over the taken pieces: expert-major,
  // (s, e) comes after every taken piece of experts before e and those of
  // expert e from sources before s; rank-major, after the taken sources
  // before s and s's own pieces before e.
  u64 run = 0, in_slot = 0;
  for (unsigned e = 0; e < ne; ++e) {
    if (a.out_layout == kOutExpertMajor) {
      sh.dst_row[e] = run + sh.pre[e];
      run += sh.col[e];
    } else {
      sh.dst_row[e] = before_s + in_slot;
    }
    sh.src_row[e] = in_slot;
    in_slot += sh.cnt[e];
    const u64 i = a.out_layout == kOutExpertMajor ? u64(e) * W + s : u64(s) * ne + e;
    a.out_splits_offsets[i] = i64(sh.cnt[e]);
    a.out_splits_offsets[u64(W) * ne + i] = i64(sh.dst_row[e]);
  }
  sh.go = mine_taken;
}

VC_HD inline void recv_phase1(const Args& a, const RecvShared& sh, unsigned s, unsigned t, unsigned nt) {
  if (!sh.go) return;
  const unsigned char* slot = slot_of(a, int(s)) + kCtlBytes;
  for (unsigned e = 0; e < a.ne; ++e)
    copy_bytes(a.out + sh.dst_row[e] * a.row_bytes, slot + sh.src_row[e] * a.row_bytes, sh.cnt[e] * a.row_bytes, t,
               nt, true);
  fence_system();
}

// Thread 0: the last block to finish gives every source its credit (no slot
// is reused while any block may still read its counts) and ends the call.
VC_HD inline void recv_phase2(const Args& a, const RecvShared& sh, unsigned s) {
  u64* done = word(a.ws, ws_state() + 8);
  if (fetch_add(done, 1) != a.world - 1) return;
  *done = 0;
  // Broken (a block timed out or was aborted, this call or before): no
  // credits, no new epoch, for chunks that may not have arrived.
  if (load_acquire(broken_word(a))) return;
  for (unsigned q = 0; q < a.world; ++q) store_release(word(a.peer_ws[q], ws_credit(int(a.rank))), sh.call);
  store_release(word(a.ws, ws_state()), sh.call);
}

// ---- point-to-point with a device-side row count (one block each) --------------
// A workspace of its own (same layout, set up by its own DeviceA2A), where
// every pair counts its messages: the sender's count for d in the spare word
// kP2PSent of our slot for d (d writes only the other words of that slot),
// the receiver's count for s in kP2PRecvd of our slot for s. The epoch word
// numbers this rank's point-to-point kernels (error records, one per kernel).
// splits: the rows to send (one int); out_splits_offsets[0]: the rows received.
constexpr u64 kP2PRecvd = 40, kP2PSent = 48;

VC_HD inline void p2p_send_phase0(const Args& a, SendShared& sh) {
  const unsigned d = a.peer;
  sh.call = fetch_add(word(a.ws, ws_state()), 1) + 1;
  u64* sent = word(a.ws, ws_slot(int(a.world), a.cap, int(d)) + kP2PSent);
  const u64 seq = load_relaxed(sent) + 1;
  sh.go = 0;
  sh.status = kOk;
  sh.rows = 0;
  sh.src_row[0] = seq;  // the pair's sequence number, for phase 2
  if (!wait_geq(a, word(a.ws, ws_credit(int(d))), seq - 1, sh.call, int(d), 0)) {
    sh.status = kSenderFailed;
    return;
  }
  const i64 rows = split_at(a, 0);
  if (rows < 0 || u64(rows) > a.x_rows) {
    report(a, kErrBadSplits, sh.call, d, 0, u64(rows), a.x_rows);
    sh.status = kBadSplits;
    return;
  }
  sh.rows = u64(rows);
  if (sh.rows * a.row_bytes > a.cap) {
    report(a, kErrTooLarge, sh.call, d, sh.rows, sh.rows * a.row_bytes, a.cap);
    sh.status = kOverCapacity;
    return;
  }
  sh.cnt[0] = sh.rows;
  sh.go = 1;
}

VC_HD inline void p2p_send_phase1(const Args& a, const SendShared& sh, unsigned t, unsigned nt) {
  if (!sh.go) return;
  unsigned char* slot = a.peer_ws[a.peer] + ws_slot(int(a.world), a.cap, int(a.rank));
  copy_bytes(slot + kCtlBytes, a.x, sh.rows * a.row_bytes, t, nt);
  fence_system();
}

VC_HD inline void p2p_send_phase2(const Args& a, const SendShared& sh) {
  if (sh.status == kSenderFailed) return;
  const unsigned d = a.peer;
  unsigned char* slot = a.peer_ws[d] + ws_slot(int(a.world), a.cap, int(a.rank));
  *word(slot, kRows) = sh.rows;
  *word(slot, kDtype) = a.dtype;
  *word(slot, kRowBytes) = a.row_bytes;
  *word(slot, kStatus) = sh.status;
  fence_system();
  store_release(word(slot, kFlag), sh.src_row[0]);
  store_release(word(a.ws, ws_slot(int(a.world), a.cap, int(d)) + kP2PSent), sh.src_row[0]);
}

VC_HD inline void p2p_recv_phase0(const Args& a, RecvShared& sh) {
  const unsigned s = a.peer;
  sh.call = fetch_add(word(a.ws, ws_state()), 1) + 1;
  u64* got = word(a.ws, ws_slot(int(a.world), a.cap, int(s)) + kP2PRecvd);
  const u64 seq = load_relaxed(got) + 1;
  sh.go = 0;
  sh.src_row[1] = seq;
  sh.cnt[0] = 0;
  a.out_splits_offsets[0] = 0;
  if (!wait_geq(a, reinterpret_cast<const u64*>(slot_of(a, int(s)) + kFlag), seq, sh.call, int(s), 1)) {
    sh.src_row[1] = 0;  // broken: no credit
    return;
  }
  const u64 st = ctl(a, int(s), kStatus), rows = ctl(a, int(s), kRows);
  const u64 dt = ctl(a, int(s), kDtype), rb = ctl(a, int(s), kRowBytes);
  if (st == kOverCapacity) report(a, kErrPeerTooLarge, sh.call, s, rows, rows * rb, a.cap);
  if (st == kBadSplits) report(a, kErrPeerSplits, sh.call, s, 0, 0, 0);
  if (st != kOk) return;
  if (dt != a.dtype || rb != a.row_bytes) {
    report(a, kErrMismatch, sh.call, s, dt, rb, u64(a.dtype) << 32 | a.row_bytes);
    return;
  }
  if (a.row_bytes && rows > a.cap / a.row_bytes) {  // the header is not trusted: never read past the slot
    report(a, kErrPeerTooLarge, sh.call, s, rows, sat_mul(rows, rb), a.cap);
    return;
  }
  if (rows > a.out_rows) {
    report(a, kErrOutFull, sh.call, s, rows, 0, a.out_rows);
    return;
  }
  sh.cnt[0] = rows;
  a.out_splits_offsets[0] = i64(rows);
  sh.go = 1;
}

VC_HD inline void p2p_recv_phase1(const Args& a, const RecvShared& sh, unsigned t, unsigned nt) {
  if (!sh.go) return;
  copy_bytes(a.out, slot_of(a, int(a.peer)) + kCtlBytes, sh.cnt[0] * a.row_bytes, t, nt, true);
  fence_system();
}

// Thread 0: the slot goes back to the sender, the pair's count moves on.
VC_HD inline void p2p_recv_phase2(const Args& a, const RecvShared& sh) {
  const u64 seq = sh.src_row[1];
  if (!seq) return;
  const unsigned s = a.peer;
  store_release(word(a.peer_ws[s], ws_credit(int(a.rank))), seq);
  store_release(word(a.ws, ws_slot(int(a.world), a.cap, int(s)) + kP2PRecvd), seq);
}

// ---- whole blocks on the host (fake_libcuda.cc) --------------------------------

#ifndef __CUDA_ARCH__
inline void host_send_block(const Args& a, unsigned d, unsigned nt) {
  SendShared sh;
  send_phase0(a, sh, d);
  for (unsigned t = 0; t < nt; ++t) send_phase1(a, sh, d, t, nt);
  send_phase2(a, sh, d);
}
inline void host_recv_block(const Args& a, unsigned s, unsigned nt) {
  RecvShared sh;
  recv_phase0(a, sh, s);
  for (unsigned t = 0; t < nt; ++t) recv_phase1(a, sh, s, t, nt);
  recv_phase2(a, sh, s);
}
inline void host_p2p_send(const Args& a, unsigned nt) {
  SendShared sh;
  p2p_send_phase0(a, sh);
  for (unsigned t = 0; t < nt; ++t) p2p_send_phase1(a, sh, t, nt);
  p2p_send_phase2(a, sh);
}
inline void host_p2p_recv(const Args& a, unsigned nt) {
  RecvShared sh;
  p2p_recv_phase0(a, sh);
  for (unsigned t = 0; t < nt; ++t) p2p_recv_phase1(a, sh, t, nt);
  p2p_recv_phase2(a, sh);
}
#endif

}  // namespace a2a
}  // namespace varcomm
