#include "engine.h"

#include "dtypes.h"

#include <sched.h>
#include <unistd.h>
#include <time.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <thread>

namespace varcomm {

namespace {
using Clock = std::chrono::steady_clock;

// How often a waiter asks the transport whether its peer is still there: often
// enough to report a dead peer within a second, rare enough to stay off the
// fast path (it reads /proc or a socket).
constexpr auto kPeerCheck = std::chrono::milliseconds(200);

// Monotonic nanoseconds at the kernel's tick (a few ms coarse), for checks
// made on every send where steady_clock's read would show in the latency.
int64_t coarse_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// The longest close() waits for messages still streaming in from live peers.
constexpr auto kCloseStreams = std::chrono::seconds(5);
// ... and for one whose sender wrote nothing more for this long.
constexpr auto kCloseStreamStall = std::chrono::seconds(1);
// How long a sender waits for a receiver that claimed a rendezvous head to
// answer (its copy takes a syscall's time: 1 GiB in well under a second).
constexpr auto kClaimWait = std::chrono::seconds(5);
// How long a receiver waits for the sender of a chunk it asked to write
// itself into the output (protocol.h kRawCredit) before it reads the chunk
// by CMA instead: a sender that is not in a varcomm call (an async
// all-to-all's caller, computing) does not progress.
constexpr auto kPushGrace = std::chrono::milliseconds(5);
// Yielding covers a peer that shares our core; after that a wait sleeps.
// (Busy polling before it, Options::spin_us, covers a ping-pong round trip.)
constexpr auto kYieldFor = std::chrono::milliseconds(5);

inline uint64_t load_acquire(const char* p) {
  return __atomic_load_n(reinterpret_cast<const uint64_t*>(p), __ATOMIC_ACQUIRE);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

std::string peer_str(int peer) { return "rank " + std::to_string(peer); }

// Peer::bye
constexpr uint8_t kByeWanted = 1, kByeWritten = 2, kByeDone = 3;

// Why a pair whose peer said goodbye is failed (peer_str(peer) first).
std::string closed_text(const std::string& who, bool failing) {
  return who + (failing ? " failed: its process exits after an uncaught exception (its output says which), and closed "
                          "its communicator"
                        : " closed its communicator") +
         ": it sends and receives nothing more";
}

const char* const kWithdrawn =
    "its sender withdrew it before this rank received it (the sender closed, or gave up on this pair); nothing "
    "was written";
}  // namespace

Engine::Engine(int rank, int world, const Options& opt) : rank_(rank), world_(world), opt_(opt) {
  if (world < 1) throw Error(ErrorKind::Invalid, "world_size must be >= 1");
  if (rank < 0 || rank >= world) throw Error(ErrorKind::Invalid, "rank out of range");
  if (opt.slots < 1 || opt.slots > 1024)
    throw Error(ErrorKind::Invalid, "slots must be in [1, 1024] (slots= / VARCOMM_SLOTS)");
  layout_.world = world;
  layout_.nslots = opt.slots;
  layout_.bound = opt.bound;
  layout_.landing = align_up(opt.landing, 4096);
  region_ = std::make_unique<Region>(layout_.region_bytes());
  auto* ctl = reinterpret_cast<RegionCtl*>(region_->base());
  ctl->magic = kMagic;
  ctl->rank = rank;
  ctl->world = world;
  ctl->nslots = opt.slots;
  ctl->pid = int32_t(getpid());
  ctl->bound = opt.bound;
  ctl->landing = layout_.landing;
  if (layout_.landing) land_free_[layout_.landing_off()] = layout_.landing;
  peers_.resize(world);
  for (auto& p : peers_) p.seen.assign(opt.slots, 0);
  reqs_.reserve(256);
}

Engine::~Engine() {
  close();
  // A staged copy may still read our region (unmapped with region_ next).
  std::lock_guard<std::mutex> g(mu_);
  free_staged(true);
}

std::vector<int> Engine::unflushed() {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<int> peers;
  if (closed_) return peers;
  progress_locked();
  for (int q = 0; q < world_; ++q) {
    Peer& p = peers_[q];
    if (p.bye == kByeWritten) {
      // A peer that died never completes the goodbye (the fallback's frame
      // stays unacknowledged): its failure ends the wait, not close()'s timeout.
      if (p.dead.empty()) check_peer(q, false);
      if (p.dead.empty() && p.t && !p.t->complete(q, p.bye_ticket)) {
        peers.push_back(q);
        continue;
      }
      p.bye = kByeDone;
    }
    if (p.sendq.empty() && (!p.tdev || p.tdev->flushed(q))) continue;
    check_peer(q, false);  // a dead peer's sends fail here instead
    if (!p.sendq.empty() || (p.dead.empty() && p.tdev && !p.tdev->flushed(q))) peers.push_back(q);
  }
  return peers;
}

void Engine::goodbye(bool failing) {
  std::lock_guard<std::mutex> g(mu_);
  if (closed_) return;
  failing_ = failing;
  // First: a peer's goodbye seen from here on leaves our posted receives to
  // fail with the close (ClosedError), not with that peer (check_goodbye).
  leaving_ = true;
  // Messages still streaming in (a dropped irecv(out=) is filled only so)
  // are taken to their end first, not failed with their receives: until
  // their sender's goodbye (which it writes after every chunk; past it only
  // while chunks still move, as their completions may be read after its
  // own) or its failure, for at most kCloseStreams. A sender whose own send
  // had completed may have closed before all its chunks were processed here.
  auto got = [this] {
    uint64_t n = 0;
    for (auto& p : peers_)
      for (auto& kv : p.streams) n += kv.second.got + 1;  // (+1: a stream that ends counts as progress)
    return n;
  };
  const auto until = Clock::now() + kCloseStreams;
  auto last_moved = Clock::now();
  for (;;) {
    const uint64_t before = got();
    progress_locked();
    const bool moved = got() != before;
    if (moved) last_moved = Clock::now();
    // A sender that stopped (computing, not in a varcomm call) moves nothing:
    // do not hold close for it.
    if (Clock::now() - last_moved > kCloseStreamStall) break;
    bool waiting = false;
    for (int q = 0; q < world_; ++q) {
      Peer& p = peers_[q];
      if (p.streams.empty() || !p.dead.empty()) continue;
      if (!p.bye_seen) check_peer(q, false);
      waiting |= p.dead.empty() && !p.streams.empty() && (!p.bye_seen || moved);
    }
    if (!waiting || Clock::now() > until) break;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  for (int q = 0; q < world_; ++q) {
    Peer& p = peers_[q];
    if (q == rank_ || !p.t || p.bye) continue;
    p.bye = kByeWanted;
    byes_wanted_++;
    try_goodbye(q);
  }
}

// Written only once nothing sent before it still moves: a rendezvous head
// still to be answered would stream its chunks after it, which the receiver
// (done with us at the goodbye) would never take.
void Engine::try_goodbye(int peer) {
  Peer& p = peers_[peer];
  if (p.bye != kByeWanted) return;
  if (p.dead.empty()) {
    if (!p.sendq.empty() || (p.tdev && !p.tdev->flushed(peer))) return;
    Request r;
    r.hflags = kGoodbye;
    r.tag = failing_ ? kByeFailing : 0;  // (a goodbye's tag is never matched)
    try {
      if (!try_write(peer, r)) return;  // the ring is full: retried by progress
    } catch (const Error&) {
      p.bye = kByeDone;  // best effort: close() goes on, the peer learns of it by its transport
      byes_wanted_--;
      return;
    }
    p.bye = kByeWritten;
    p.bye_ticket = r.ticket;
  } else {
    p.bye = kByeDone;  // it hears nothing from us anyway
  }
  byes_wanted_--;
}

void Engine::close() {
  std::vector<std::shared_ptr<Transport>> devices;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_) return;
    closed_ = true;
    // What has not completed fails now, as close() documents; a recv whose
    // message arrived keeps it (it is in our region, which stays mapped).
    for (int q = 0; q < world_; ++q) withdraw_heads(q);
    for (auto& p : peers_) {
      fail_queue(p.sendq, ErrorKind::Closed,
                 "communicator closed before this send completed (a send still queued was never written; "
                 "one in flight may or may not have arrived)");
      fail_queue(p.posted, ErrorKind::Closed, "communicator closed before a message arrived for this recv");
    }
    for (int q = 0; q < world_; ++q)
      fail_streams(q, ErrorKind::Closed, "communicator closed while this message was streaming in");
    sending_ = 0;
    auto add = [&](const std::shared_ptr<Transport>& t) {
      if (t && std::find(devices.begin(), devices.end(), t) == devices.end()) devices.push_back(t);
    };
    for (auto& t : transports_) add(t);
    add(local_dev_);
    for (auto& p : peers_) add(p.tdev);
    transports_.clear();
    local_dev_.reset();
    for (auto& p : peers_) {
      p.t.reset();
      p.tdev.reset();
    }
  }
  // Device messages already on streams: their copies and flags run before
  // this process may exit (bounded; a peer that exited lets its go). Not
  // under mu_: another thread's call would wait on it holding the GIL, and
  // that may be what lets the stream go on. (closed_ keeps calls out.)
  const auto until = Clock::now() + std::chrono::seconds(10);
  for (auto& t : devices) t->settle(until);
}

void Engine::set_transport(int peer, std::shared_ptr<Transport> t, const Layout& pl) {
  std::lock_guard<std::mutex> g(mu_);
  if (pl.world != world_)
    throw Error(ErrorKind::Invalid, peer_str(peer) + " reports world_size " + std::to_string(pl.world) +
                                        ", this rank " + std::to_string(world_));
  check_fits(peer, *t, pl);
  auto& p = peers_.at(peer);
  if (std::find(transports_.begin(), transports_.end(), t) == transports_.end()) transports_.push_back(t);
  p.pulls = t->read_refused(peer).empty();
  p.pulls_chunks = t->chunk_read_refused(peer).empty();
  p.lands = t->landing_write_max();
  p.t = std::move(t);
  p.layout = pl;
  p.written.assign(pl.nslots, 0);
}

void Engine::set_pair_tags(int peer, uint64_t out, uint64_t in) {
  std::lock_guard<std::mutex> g(mu_);
  peers_.at(peer).auth_out = out;
  peers_.at(peer).auth_in = in;
}

uint64_t Engine::forged_headers() {
  std::lock_guard<std::mutex> g(mu_);
  return forged_;
}

// Every offset we write at comes from the peer's published layout: a layout
// that claims more than its region holds is refused here, before any write
// could land past the mapping (and crash us) or outside its registration.
void Engine::check_fits(int peer, const Transport& t, const Layout& pl) const {
  size_t have = t.peer_bytes(peer);
  if (pl.region_bytes() > have)
    throw Error(ErrorKind::PeerFailure,
                peer_str(peer) + " published a layout of " + std::to_string(pl.region_bytes()) + " bytes (bound " +
                    std::to_string(pl.bound) + ", slots " + std::to_string(pl.nslots) + ", landing " +
                    std::to_string(pl.landing) + ") but its " + t.name() +
                    " region holds " + std::to_string(have) + ": refused (a forged or corrupt set-up record)",
                peer);
}

std::string Engine::transport_describe(int peer) const {
  auto& p = peers_.at(peer);
  return p.t ? p.t->describe() : "";
}

std::map<std::string, std::string> Engine::transport_properties(int peer) const {
  auto& p = peers_.at(peer);
  auto info = p.t ? p.t->properties() : std::map<std::string, std::string>{};
  if (p.tdev && p.tdev != p.t)  // the device route's own facts (rdma-gpu: "device_gpudirect", ...)
    for (auto& [k, v] : p.tdev->properties()) info["device_" + k] = v;
  return info;
}

void Engine::connected() {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& p : peers_)
    if (p.t) p.t->connected();
}

// ---- request pool ---------------------------------------------------------

uint64_t Engine::alloc(ReqKind kind) {
  uint32_t idx;
  if (!free_reqs_.empty()) {
    idx = free_reqs_.back();
    free_reqs_.pop_back();
  } else {
    idx = uint32_t(reqs_.size());
    reqs_.emplace_back();
  }
  Request& r = reqs_[idx];
  uint32_t gen = r.gen + 1;
  r = Request{};
  r.gen = gen;
  r.kind = kind;
  return (uint64_t(gen) << 32) | idx;
}

Request& Engine::get(uint64_t id) {
  uint32_t idx = uint32_t(id);
  if (idx >= reqs_.size() || reqs_[idx].gen != uint32_t(id >> 32) || reqs_[idx].state == ReqState::Free)
    throw Error(ErrorKind::Invalid, "unknown or already completed request");
  return reqs_[idx];
}

void Engine::recycle(uint64_t id) {
  Request& r = reqs_[uint32_t(id)];
  if (r.staged) {  // a staged send that was never written (failed, cancelled)
    if (Transport* t = peers_[r.peer].tdev.get()) t->unstage_async(r.staged, r.mem.stream);
    r.staged = nullptr;
  }
  if (r.reported) recycled_.push_back(id);
  r.state = ReqState::Free;
  r.own.reset();
  r.land = 0;
  free_reqs_.push_back(uint32_t(id));
}

// ---- posting --------------------------------------------------------------

Error Engine::over_bound(int peer, uint64_t nbytes, bool device) const {
  return Error(ErrorKind::TooLarge,
               "message of " + std::to_string(nbytes) + " bytes exceeds the receive bound of " +
                   std::to_string(peers_[peer].layout.bound) + " bytes on " + peer_str(peer) +
                   (device ? " (GPU memory is sent into one slot)" : "") +
                   "; raise it with varcomm.init(bound=...) or VARCOMM_BOUND on the receiver",
               peer);
}

Error Engine::max_message_error(int peer, uint64_t nbytes) const {
  return Error(ErrorKind::TooLarge,
               "message of " + std::to_string(nbytes) + " bytes is over this rank's max_message of " +
                   std::to_string(opt_.max_message) +
                   " bytes (varcomm.init(max_message=...) / VARCOMM_MAX_MESSAGE); nothing was sent",
               peer);
}

// Refused before anything is read or written (Engine::no_memory).
static void check_memory(const void* p, uint64_t nbytes, const char* what) {
  if (Engine::no_memory(p, nbytes))
    throw Error(ErrorKind::Invalid, std::string(what) + " has no memory: data pointer " +
                                        std::to_string(reinterpret_cast<uintptr_t>(p)) + " for " +
                                        std::to_string(nbytes) + " bytes (a torch efficient zero tensor?): use a "
                                        "materialized array (x.clone() makes one)");
}

void Engine::check_send(int peer, uint64_t nbytes, uint32_t ndim, Mem mem, bool eager, bool pull) {
  if (closed_) throw Error(ErrorKind::Closed, "communicator is closed");
  // close() has begun (on another thread): a message written now would go
  // behind our goodbye, which ends the pair at the receiver: lost, though
  // its send returned (rdma completes the write locally).
  if (leaving_) throw Error(ErrorKind::Closed, "communicator is closing (close() was called, on another thread): "
                                               "nothing was sent");
  if (peer < 0 || peer >= world_)
    throw Error(ErrorKind::Invalid, "dst " + std::to_string(peer) + " out of range [0, " + std::to_string(world_) + ")");
  Peer& p = peers_[peer];
  if (!p.t) throw Error(ErrorKind::Invalid, "no transport to " + peer_str(peer) + " (not connected)");
  if (over_max_message(nbytes)) throw max_message_error(peer, nbytes);
  // Host messages of any size travel (by rendezvous over the bound), a
  // collective's chunk too; device payloads are still held to the slot they
  // are copied into, and so is a device chunk's host copy (`pull` false).
  if ((mem.device || (eager && !pull)) && nbytes > p.layout.bound) throw over_bound(peer, nbytes, mem.device);
  if (ndim > uint32_t(kMaxDims))
    throw Error(ErrorKind::Invalid, "tensors of more than " + std::to_string(kMaxDims) + " dimensions are not supported");
  if (mem.device) device_transport(peer);  // refuse before queueing: nothing half-sent
  // A send that finds a free slot never waits, so it looks at the peer itself
  // once its last look is kPeerCheck old: a send to a peer that died a
  // second ago fails, rather than succeeding until the ring is full. By the
  // coarse clock (the kernel's last tick from the vDSO, no TSC read), cheap
  // on every send.
  if (int64_t now = coarse_ns(); now >= p.next_send_check) {
    p.next_send_check = now + std::chrono::nanoseconds(kPeerCheck).count();
    check_peer(peer, true);
  }
  if (!p.dead.empty()) throw Error(ErrorKind::PeerFailure, p.dead, peer);
}

uint64_t Engine::send_now(int peer, int64_t tag, const void* data, uint64_t nbytes, uint32_t dtype,
                          const int64_t* shape, uint32_t ndim, Mem mem, uint32_t array) {
  check_memory(data, nbytes, "the array to send");
  std::lock_guard<std::mutex> g(mu_);
  check_send(peer, nbytes, ndim, mem);
  Peer& p = peers_[peer];
  if (!p.sendq.empty() || rendezvous(peer, nbytes, mem)) return 0;
  Request& r = scratch_;
  r.mem = mem;
  r.hflags = (uint64_t(array) << kArrayShift) & kArrayMask;
  r.tag = tag;
  r.data = data;
  r.nbytes = nbytes;
  r.dtype = dtype;
  r.ndim = ndim;
  std::copy(shape, shape + ndim, r.shape);
  if (!try_write(peer, r)) return 0;
  if ((r.mem.device ? *p.tdev : *p.t).complete(peer, r.ticket)) return kSentDone;
  // The transport still reads the source: track it like an isend.
  uint64_t id = alloc(ReqKind::Send);
  Request& q = reqs_[uint32_t(id)];
  q = std::move(r);
  q.gen = uint32_t(id >> 32);
  q.kind = ReqKind::Send;
  q.peer = peer;
  p.sendq.push_back(id);
  sending_++;
  return id;
}

uint64_t Engine::isend(int peer, int64_t tag, const void* data, uint64_t nbytes, uint32_t dtype,
                       const int64_t* shape, uint32_t ndim, Mem mem, uint32_t array, bool eager, bool pull,
                       uint64_t flags, bool waited) {
  check_memory(data, nbytes, "the array to send");
  std::lock_guard<std::mutex> g(mu_);
  check_send(peer, nbytes, ndim, mem, eager, pull);
  uint64_t id = queue_send(peer, tag, data, nbytes, dtype, shape, ndim, mem,
                           ((uint64_t(array) << kArrayShift) & kArrayMask) | flags,
                           (pull || !eager) && rendezvous(peer, nbytes, mem, eager));
  Request& q = reqs_[uint32_t(id)];
  Peer& p = peers_[peer];
  // Not written yet (no free slot): it is written later, when the caller may
  // have enqueued work that changes its source on the stream (an isend's
  // buffer reused in stream order, as NCCL allows). Its bytes are copied
  // now, in stream order, and written from the copy.
  if (!waited && q.state == ReqState::Queued && q.mem.device && q.nbytes && p.tdev) {
    if (void* copy = p.tdev->stage_async(q.data, q.nbytes, q.mem.stream)) {
      q.staged = copy;
      q.data = copy;
    }
  }
  return id;
}

uint64_t Engine::isend_descriptor(int peer, int64_t tag, uint64_t nbytes, uint32_t dtype, const int64_t* shape,
                                  uint32_t ndim, uint64_t flags) {
  std::lock_guard<std::mutex> g(mu_);
  check_send(peer, 0, ndim, Mem{});
  return queue_send(peer, tag, nullptr, nbytes, dtype, shape, ndim, Mem{}, kDescriptor | flags, false);
}

// Every queued send goes through here: sending_ counts what is in the sendqs
// (a blocking recv drives them only while it is nonzero).
uint64_t Engine::queue_send(int peer, int64_t tag, const void* data, uint64_t nbytes, uint32_t dtype,
                            const int64_t* shape, uint32_t ndim, Mem mem, uint64_t hflags, bool rndv) {
  Peer& p = peers_[peer];
  uint64_t id = alloc(ReqKind::Send);
  Request& r = reqs_[uint32_t(id)];
  r.peer = peer;
  r.tag = tag;
  r.data = data;
  r.nbytes = nbytes;
  r.dtype = dtype;
  r.ndim = ndim;
  r.mem = mem;
  r.hflags = hflags;
  r.rndv = rndv;
  std::copy(shape, shape + ndim, r.shape);
  r.state = ReqState::Queued;
  p.sendq.push_back(id);
  sending_++;
  progress_sends(peer);
  throw_if_failed(reqs_[uint32_t(id)], id);  // refused at once: raised here, as before it was queued
  return id;
}

uint64_t Engine::irecv(int peer, int64_t tag, void* out, uint64_t out_cap, uint32_t out_dtype, Mem mem, bool hold,
                       bool hold_device) {
  check_memory(out, out_cap, "out");
  std::lock_guard<std::mutex> g(mu_);
  if (closed_) throw Error(ErrorKind::Closed, "communicator is closed");
  if (peer < 0 || peer >= world_)
    throw Error(ErrorKind::Invalid, "src " + std::to_string(peer) + " out of range [0, " + std::to_string(world_) + ")");
  Peer& p = peers_[peer];
  if (!p.t) throw Error(ErrorKind::Invalid, "no transport to " + peer_str(peer) + " (not connected)");
  if (mem.device) device_transport(peer);  // refuse before posting: no message is consumed
  if (!out_settled(out, mem)) throw Error(ErrorKind::Invalid, unsettled_text());  // irecv never waits
  uint64_t id = alloc(ReqKind::Recv);
  Request& r = reqs_[uint32_t(id)];
  r.peer = peer;
  r.tag = tag;
  r.out = out;
  r.out_cap = out_cap;
  r.out_dtype = out_dtype;
  r.mem = mem;
  r.hold = hold && !out;
  r.hold_device = r.hold && hold_device;
  r.state = ReqState::Posted;
  p.posted.push_back(id);
  if (p.t) p.t->progress();
  progress_recvs(peer);
  // A dead peer's already-delivered messages are still received above.
  if (r.state == ReqState::Posted) check_peer(peer, !p.dead.empty());
  return id;
}

std::string Engine::misfit(int peer, const MsgHeader& h, uint64_t out_cap, uint32_t out_dtype, ErrorKind* kind,
                           bool device) {
  // Every receive into an out asks; the words are built only for a refusal.
  const bool exact = out_dtype & kOutExact;
  out_dtype &= ~kOutExact;
  if ((!out_dtype || out_dtype == h.dtype) && h.nbytes <= out_cap && (!exact || h.nbytes == out_cap) &&
      !(h.flags & kDescriptor) && !(device && (h.flags & kRendezvous)))
    return "";
  std::string head = "recv from " + peer_str(peer) + " tag " + std::to_string(h.tag) + ": ";
  const char* kept = "; the message was kept for the next recv";
  if (out_dtype && out_dtype != h.dtype) {
    *kind = ErrorKind::Mismatch;
    return head + "message dtype " + dtype_name(h.dtype) + " does not match out's dtype " + dtype_name(out_dtype) +
           " (pass an out of the message's dtype, or none)" + kept;
  }
  if (h.nbytes > out_cap) {
    *kind = ErrorKind::TooLarge;
    std::string what = (h.flags & kDescriptor) ? " (a descriptor: the data, dtype " + dtype_name(h.dtype) +
                                                     ", travels in separate messages)"
                                               : "";
    return head + "message of " + std::to_string(h.nbytes) + " bytes" + what + " does not fit out (" +
           std::to_string(out_cap) + " bytes)" + kept;
  }
  if (exact && h.nbytes < out_cap && !(h.flags & kDescriptor)) {
    *kind = ErrorKind::Mismatch;
    return head + "message of " + std::to_string(h.nbytes) + " bytes does not fill out (" + std::to_string(out_cap) +
           " bytes) exactly, as this receive asks (pass an out of the message's size, or receive without out)" + kept;
  }
  // A rendezvous message reaches GPU memory through its head's host slot
  // (copied there once, then by the device transport): within the bound, and
  // where this rank copies from the sender itself.
  if (device && (h.flags & kRendezvous) && (h.nbytes > layout_.bound || !peers_[peer].pulls)) {
    *kind = h.nbytes > layout_.bound ? ErrorKind::TooLarge : ErrorKind::Invalid;
    return head + "a rendezvous message of " + std::to_string(h.nbytes) + " bytes from host memory cannot land in "
           "GPU memory " + (h.nbytes > layout_.bound ? "over this rank's bound (" + std::to_string(layout_.bound) +
           " bytes): receive it into host memory, or raise the bound"
                                       : std::string("on a pair that streams it (no single-copy read): receive it "
                                                     "into host memory, or raise the sender's eager_max "
                                                     "(VARCOMM_EAGER_MAX) to its size")) +
           kept;
  }
  if (h.flags & kDescriptor) {
    *kind = ErrorKind::Mismatch;
    return head + "the message is a descriptor of " + std::to_string(h.nbytes) +
           " bytes that travel separately (it carries no data); receive it without out" + kept;
  }
  return "";
}

// A message's shape and dtype must account for its nbytes exactly: a receiver
// sizes its new array by them and copies nbytes into it (a header that
// understated them wrote past the array's end: a forged or lying one). Not
// for headers whose nbytes describes other data (descriptors, chunks) or none.
static bool shape_says_nbytes(const MsgHeader& h) {
  if (h.flags & (kDescriptor | kChunk | kGoodbye)) return true;
  // A zero dimension makes it 0 bytes whatever the others are: (2**62, 0)
  // is a legal empty tensor, whose running product would overflow first.
  bool empty = false;
  for (uint32_t i = 0; i < h.ndim; ++i) {
    if (h.shape[i] < 0) return false;
    empty |= h.shape[i] == 0;
  }
  if (empty) return h.nbytes == 0;
  uint64_t n = dtype_bytes(h.dtype);
  for (uint32_t i = 0; i < h.ndim; ++i)
    if (__builtin_mul_overflow(n, uint64_t(h.shape[i]), &n)) return false;
  return n == h.nbytes;
}

// A header is copied out of the slot once and checked before anything uses
// it: the peer writes our region (mapped, or by the fallback's frames), so a
// header that would make us read past its slot or past a new array sized by
// its shape, build a shape longer than kMaxDims, or lose track of the slot
// fails the peer instead.
bool Engine::sane(int peer, const MsgHeader& h, uint64_t seq) {
  if (h.ndim <= uint32_t(kMaxDims) && payload_bytes(h) <= layout_.bound && h.seq == seq &&
      h.auth == peers_[peer].auth_in && shape_says_nbytes(h))
    return true;
  // A message left from a peer that closed since: say what is wrong with it.
  Peer& q = peers_[peer];
  if (q.bye_seen && q.dead == "peer failure: " + closed_text(peer_str(peer), q.bye_failing)) q.dead.clear();
  if (h.auth != peers_[peer].auth_in) {
    // Noticed as genuine, then overwritten in place: that message is lost.
    forged_++;
    peers_[peer].forged++;
    fail_peer(peer, "the message from " + peer_str(peer) + " in this rank's slot was overwritten by a write with "
                        "the wrong pair tag (not from this job: a forged one-sided write, or a rank with another "
                        "VARCOMM_JOB_KEY); the pair is treated as failed");
    return false;
  }
  fail_peer(peer, peer_str(peer) + " wrote a malformed message header into this rank's slot (seq " +
                      std::to_string(h.seq) + " in the slot marked " + std::to_string(seq) + ", " +
                      std::to_string(h.nbytes) + " bytes against a bound of " + std::to_string(layout_.bound) +
                      ", ndim " + std::to_string(h.ndim) + ", " + dtype_name(h.dtype) + " of shape " +
                      tuple_str(h.shape, std::min<uint32_t>(h.ndim, kMaxDims)) +
                      "); it is treated as failed (a different varcomm version on that rank, or memory corruption)");
  return false;
}

uint64_t Engine::send_limit(int peer, bool device) const {
  uint64_t b = peers_.at(peer).layout.bound;
  uint64_t cap = opt_.max_message ? opt_.max_message : UINT64_MAX;
  return device ? std::min(b, cap) : cap;
}

bool Engine::rendezvous(int peer, uint64_t nbytes, Mem mem, bool held) const {
  if (mem.device) return false;
  const Peer& p = peers_[peer];
  // A collective's chunk (held to the bound): by rendezvous only where the
  // receiver copies it once (pulls_held) into the output it places once
  // every count is in (Request::hold), or has us write it there.
  // From 32 KiB, where one CMA copy plus its system call beats two memcpys
  // on the hosts measured (bench/results/issue11-2026-12-02-s6.md), and one
  // memcpy by the sender beats them everywhere.
  // (4 ranks on a 2-core AMD EPYC, 256 KiB-4 MiB per rank, outputs in the
  // landing area: 0.89-4.98x MPI by sender writes, 0.34-2.07x by two memcpys
  // and CMA; bench/results/issue11-2026-12-05-s8.md.)
  uint64_t eager = opt_.eager_max ? opt_.eager_max : p.t ? p.t->eager_max() : UINT64_MAX;
  // Where the probe prefers two memcpys (pulls_chunks only), from
  // kChunkPull: into an ordinary output (a caller's out=) smaller chunks
  // lose by CMA (4 ranks, AMD EPYC, out= a torch.empty: 64 KiB chunks
  // 240 us by two memcpys, 333 us by CMA, medians of 5; 128 KiB even; 256
  // KiB 574 against 236 us; bench/results/issue11-2026-12-05-s8.md).
  // Over the bound it cannot go eager: whatever the receiver can do (pull,
  // have us push into its landing area, or take it streamed through the slots).
  if (held)
    return nbytes > p.layout.bound ||
           (p.pulls ? nbytes > std::min<uint64_t>(eager, 32 << 10) : p.pulls_chunks && nbytes >= kChunkPull);
  // (Not where a device route exists: a host message streamed to a GPU out
  // cannot land there, see misfit.)
  uint64_t sc = p.t && !p.tdev ? p.t->stream_chunk() : 0;
  // Over eager_max the data is copied once where the pair can: the receiver
  // reads it from us (CMA), or we write it into its landing area.
  bool once = p.pulls || (p.lands && p.layout.landing);
  return nbytes > p.layout.bound || (nbytes > eager && once) || (sc && nbytes > 2 * sc);
}

bool Engine::streams_in(int peer, const MsgHeader& h) const {
  return (h.flags & kRendezvous) && !pulls_message(peer, h);
}

// ---- the landing area -----------------------------------------------------

size_t Engine::land_alloc(uint64_t nbytes) {
  if (nbytes > layout_.landing) return 0;  // (and align_up below cannot wrap)
  size_t want = align_up(kPayloadOff + nbytes, 4096);
  for (auto it = land_free_.begin(); it != land_free_.end(); ++it) {
    if (it->second < want) continue;
    size_t off = it->first, left = it->second - want;
    land_free_.erase(it);
    if (left) land_free_[off + want] = left;
    land_used_[off] = {want, 1, false, false};
    return off;
  }
  return 0;
}

void Engine::land_unref(size_t off) {
  auto u = land_used_.find(off);
  if (u == land_used_.end() || --u->second.refs > 0) return;
  size_t len = u->second.len;
  if (u->second.lent) land_lent_ -= len;
  land_used_.erase(u);
  // Merge with the free neighbours, so large blocks stay possible.
  auto next = land_free_.lower_bound(off);
  if (next != land_free_.end() && next->first == off + len) {
    len += next->second;
    next = land_free_.erase(next);
  }
  if (next != land_free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      prev->second += len;
      return;
    }
  }
  land_free_[off] = len;
}

size_t Engine::block_holding(const void* p) const {
  const char* base = region_->base();
  const char* d = static_cast<const char*>(p);
  if (!layout_.landing || d < base + layout_.landing_off() + kPayloadOff || d >= base + layout_.region_bytes())
    return 0;
  const size_t at = size_t(d - base);
  auto u = land_used_.upper_bound(at - kPayloadOff);
  if (u == land_used_.begin()) return 0;
  --u;
  return at < u->first + u->second.len ? u->first : 0;
}

size_t Engine::landing_block(const void* dst, uint64_t nbytes) const {
  size_t b = block_holding(dst);
  return b && static_cast<const char*>(dst) == region_->base() + b + kPayloadOff &&
                 land_used_.at(b).len >= kPayloadOff + nbytes
             ? b
             : 0;
}

bool Engine::out_settled(const void* out, Mem mem) {
  // The block out is in, at its start or not (a view into the middle of a
  // comm.empty buffer): a late write covers the whole block.
  size_t b = out && !mem.device ? block_holding(out) : 0;
  auto settled = [&] { return !land_used_.at(b).pending && !land_used_.at(b).raw; };
  if (!b || settled()) return true;
  for (int q = 0; q < world_; ++q) {  // it may have landed since
    Peer& p = peers_[q];
    if (p.streams.empty() || !p.t) continue;
    p.t->progress();
    check_landings(q);
  }
  return settled();
}

bool Engine::out_unsettled(const void* out, Mem mem) {
  std::lock_guard<std::mutex> g(mu_);
  return !out_settled(out, mem);
}

std::string Engine::unsettled_text() {
  return "out (a comm.empty buffer, or a view into one) is still to be written by the sender of a message that an "
         "earlier receive into it took and then gave up on (a timeout or cancel), or whose sender failed where this "
         "transport cannot tell that it stopped writing (rdma: such a buffer is never written into again), so its "
         "bytes may still change; a blocking recv waits for that write within its timeout: retry with a longer one, "
         "or receive into another buffer";
}

int Engine::landing_buffer(uint64_t nbytes, uint64_t lend_cap) {
  std::lock_guard<std::mutex> g(mu_);
  if (closed_) throw Error(ErrorKind::Closed, "communicator is closed");
  if (lend_cap && (nbytes > lend_cap || land_lent_ + align_up(kPayloadOff + nbytes, 4096) > lend_cap)) return 0;
  size_t off = land_alloc(nbytes);
  if (!off) return 0;
  Block& b = land_used_.at(off);
  b.lent = true;
  land_lent_ += b.len;
  return landed_slot(off);
}

std::tuple<uint64_t, uint64_t, uint64_t> Engine::landing_stats() {
  std::lock_guard<std::mutex> g(mu_);
  uint64_t free = 0;
  for (auto& kv : land_free_) free += kv.second;
  return {free, land_used_.size(), land_lent_};
}

bool Engine::try_land(int peer, int slot, const MsgHeader& h, uint64_t id, char* dst, size_t block) {
  Peer& p = peers_[peer];
  if (!p.lands || h.nbytes > p.lands || !p.dead.empty() || !p.t) return false;
  size_t off = block;
  if (off) {
    Block& b = land_used_.at(off);
    if (b.pending || b.raw) return false;  // posted twice: the second takes the other paths (CMA or the stream)
    b.refs++;
  } else if (!(off = land_alloc(h.nbytes))) {
    return false;
  }
  land_used_.at(off).pending = true;
  // Cleared before the answer (a release store) lets the sender write.
  __atomic_store_n(reinterpret_cast<uint64_t*>(region_->base() + off), 0, __ATOMIC_RELAXED);
  p.streams[h.seq] = {id, dst, 0, h.nbytes, off, slot};
  p.t->write_u64(peer, p.layout.credit_off(rank_, slot), push_credit(h.seq, off));
  return true;
}

bool Engine::check_landings(int peer) {
  Peer& p = peers_[peer];
  const char* base = region_->base();
  for (auto s = p.streams.begin(); s != p.streams.end();) {
    Peer::Stream& st = s->second;
    const char* blk = base + st.landing;
    if (st.raw) {
      std::string err;
      if (!push_settled(peer, s->first, st, &err)) {
        ++s;
        continue;
      }
      raw_settled(st.raw);
      if (!err.empty()) {
        st.raw = 0;  // settled: fail_peer's fail_streams must not settle (and unref) its block again
        fail_claim(peer, st.slot, s->first);
        fail_peer(peer, "its message of " + std::to_string(st.total) + " bytes could not be copied: " + err);
        return false;
      }
      free_slot(peer, st.slot, s->first);  // its send completes
      if (st.id) {
        Request& r = reqs_[uint32_t(st.id)];
        r.state = ReqState::Done;
        if (r.detached) recycle(st.id);
      }
      s = p.streams.erase(s);
      continue;
    }
    if (!st.landing) {
      ++s;
      continue;
    }
    if (load_acquire(blk) != s->first) {
      // A sender that closes instead of writing withdraws the head (shm: the
      // word is in our region; its slot is not reused before it wrote).
      if (rv_word_at(peer, st.slot, kRvStateOff) &&
          load_acquire(base + layout_.slot_off(peer, st.slot) + kRvStateOff) == rv_word(s->first, kRvWithdrawn)) {
        drop_landing(st);  // nothing will be written there
        fail_peer(peer, "its message of " + std::to_string(st.total) + " bytes could not be copied: " + kWithdrawn);
        return false;
      }
      ++s;
      continue;
    }
    const auto* lh = reinterpret_cast<const MsgHeader*>(blk + kHeaderOff);
    if (lh->auth != p.auth_in || lh->seq != s->first || lh->nbytes != st.total) {
      fail_peer(peer, peer_str(peer) + " wrote a landing block that does not hold the message it was asked for (seq " +
                          std::to_string(s->first) + ", " + std::to_string(st.total) + " bytes); it is treated as failed");
      return false;
    }
    land_used_.at(st.landing).pending = false;
    if (!st.id) {
      land_unref(st.landing);  // its receive gave up: the block is free again
    } else {
      Request& r = reqs_[uint32_t(st.id)];
      if (st.dst) {  // into the receive's out: copied from the block (nothing to copy: out is the block)
        if (st.dst != blk + kPayloadOff) std::memcpy(st.dst, blk + kPayloadOff, st.total);
        land_unref(st.landing);
        r.state = ReqState::Done;
        if (r.detached) recycle(st.id);
      } else {  // the result is the block
        r.land = st.landing;
        r.state = ReqState::Matched;
        if (r.detached) release_locked(st.id);
      }
    }
    s = p.streams.erase(s);
  }
  return true;
}

int Engine::match_direct(int peer, int64_t tag, void* out, uint64_t out_cap, uint32_t out_dtype, MsgHeader* hdr,
                         Mem mem, int* claim) {
  Peer& p = peers_[peer];
  const char* base = region_->base();
  for (auto& x : p.returned)
    if (x.hdr.tag == tag) return -1;  // a given-back message may come first: the irecv path orders them
  for (auto a = p.ready.begin(); a != p.ready.end(); ++a) {
    if (a->claimed) continue;
    const auto* h = reinterpret_cast<const MsgHeader*>(base + layout_.slot_off(peer, a->slot) + kHeaderOff);
    if (h->tag != tag || (h->flags & kChunk)) continue;
    *hdr = *h;
    if (!sane(peer, *hdr, a->seq))
      throw Error(ErrorKind::PeerFailure, "recv from " + peer_str(peer) + " failed: " + p.dead, peer);
    if (streams_in(peer, *hdr)) return -1;  // its data streams into a request: the irecv path
    // Where it lands (a new array, or a comm.empty out), the irecv path too.
    if ((hdr->flags & kRendezvous) && !mem.device && p.lands && layout_.landing &&
        (claim || landing_block(out, hdr->nbytes)))
      return -1;
    if (claim) {
      a->claimed = true;
      *claim = a->slot;
      return 1;
    }
    ErrorKind kind;
    std::string why = misfit(peer, *hdr, out_cap, out_dtype, &kind, mem.device);
    if (!why.empty()) throw Error(kind, why, peer);
    // A device receive refused for its stream keeps the message, claimed and
    // pulled nothing: refused before consume.
    refuse_device_recv(peer, *hdr, mem);
    int k = a->slot;
    p.ready.erase(a);
    if (consume(peer, k, *hdr, out, mem, 0, &why) < 0) {
      fail_peer(peer, why);
      throw Error(ErrorKind::PeerFailure, "recv from " + peer_str(peer) + " failed: " + p.dead, peer);
    }
    return 1;
  }
  return 0;
}

int Engine::recv_direct(int peer, int64_t tag, void* out, uint64_t out_cap, uint32_t out_dtype, MsgHeader* hdr,
                        Clock::time_point deadline, Mem mem, int* claim) {
  check_memory(out, out_cap, "out");
  if (peer < 0 || peer >= world_)
    throw Error(ErrorKind::Invalid, "src " + std::to_string(peer) + " out of range [0, " + std::to_string(world_) + ")");
  if (mem.device) {
    std::lock_guard<std::mutex> g(mu_);
    device_transport(peer);  // refuse before matching: no message is consumed
  }

  int result = 0;
  bool got = spin(
      [&](bool slow) {
        if (closed_) throw Error(ErrorKind::Closed, "communicator is closed");
        Peer& p = peers_[peer];
        if (!p.t) throw Error(ErrorKind::Invalid, "no transport to " + peer_str(peer) + " (not connected)");
        if (!staged_.empty()) free_staged(false);  // a sender may wait for one of those slots
        // (A comm.empty out that a given-up receive's landing may still write:
        // waited for, within this receive's timeout.)
        if (!out_settled(out, mem)) {
          drive_sends();  // (while we wait, as below)
          return false;
        }
        if (!p.posted.empty()) {
          result = -1;  // FIFO: queue behind the posted irecvs
          return true;
        }
        if (sending_) {
          for (auto& t : transports_) t->progress();
        } else {
          p.t->progress();
        }
        progress_recvs(peer);
        if (int m = match_direct(peer, tag, out, out_cap, out_dtype, hdr, mem, claim)) {
          result = m;
          // Our queued sends go on before the caller gets its message: else
          // a rank whose receives always match at once never moves them.
          if (m > 0) drive_sends();
          return true;
        }
        // Queued isends (to any peer) must keep moving while we block, or a
        // peer waiting for them before it answers us never does. After our
        // receive had its turn: it may have answered a rendezvous head (a
        // landing offset), so the peer copies into us while we copy into it.
        // The other way round, a rank's copy out held back its answer, and
        // both directions of a bidirectional stream took turns (16 MiB on shm:
        // 1.41 ms per message against 1.24 ms by CMA).
        drive_sends();
        if (slow) check_peer(peer, false);
        // (Also without a check: the peer's goodbye, seen by progress_recvs.)
        if (!p.dead.empty()) {
          // What the check delivered before the peer failed is still ours.
          if (int m = match_direct(peer, tag, out, out_cap, out_dtype, hdr, mem, claim)) {
            result = m;
            return true;
          }
          throw Error(ErrorKind::PeerFailure, "recv from " + peer_str(peer) + " failed: " + p.dead, peer);
        }
        return false;
      },
      deadline);
  return got ? result : 0;
}

std::string Engine::peer_error(int peer) {
  std::lock_guard<std::mutex> g(mu_);
  if (peer < 0 || peer >= world_ || !peers_[peer].t) return "";
  check_peer(peer, true);
  return peers_[peer].dead;
}


// Spin first (ping-pong latency), then yield (more ranks than cores: let the
// peer we wait for run), then sleep with a growing interval so an idle wait
// costs no core. `done(slow)` runs under the lock; `slow` is true once the
// spinning is over (time for rarer checks such as peer liveness).
template <class F>
bool Engine::spin(F&& done, Clock::time_point deadline) {
  Clock::time_point start{};
  long sleep_ns = 2000;
  bool slow = false;
  for (uint32_t i = 0;; ++i) {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (done(slow)) return true;
    }
    if (deadline == Clock::time_point::min()) return false;  // a single try
    if (i % 64 != 63) {
      cpu_relax();
      continue;
    }
    auto now = Clock::now();
    if (start == Clock::time_point{}) start = now;
    if (now >= deadline) return false;
    auto waited = now - start;
    if (waited < std::chrono::microseconds(opt_.spin_us)) continue;
    slow = true;
    if (waited < kYieldFor) {
      sched_yield();
      continue;
    }
    timespec ts{0, sleep_ns};
    nanosleep(&ts, nullptr);
    sleep_ns = std::min(sleep_ns * 2, 200000L);
  }
}

// ---- progress -------------------------------------------------------------

// Writes r's next message into a free slot of the peer's ring: r's own (eager,
// or a rendezvous head), or, while r streams, its next chunk.
bool Engine::try_write(int peer, Request& r) {
  Peer& p = peers_[peer];
  const Layout& L = p.layout;
  const char* credits = region_->base();
  int k = p.next_slot;
  for (int i = 0; i < L.nslots; ++i, k = (k + 1) % L.nslots) {
    if (load_acquire(credits + layout_.credit_off(peer, k)) != p.written[k]) continue;
    MsgHeader h{};
    h.seq = p.next_seq;
    h.auth = p.auth_out;
    uint64_t ticket;
    if (r.streaming) {
      h.flags = kChunk;
      h.tag = int64_t(r.head_seq);
      uint64_t piece = p.t->stream_chunk() ? std::min<uint64_t>(L.bound, p.t->stream_chunk()) : L.bound;
      h.nbytes = std::min<uint64_t>(piece, r.nbytes - r.sent);
      ticket = p.t->write_message(peer, L.slot_off(rank_, k), &h, sizeof(h),
                                  static_cast<const char*>(r.data) + r.sent, h.nbytes, h.seq);
      if (!ticket) return false;
      r.sent += h.nbytes;
      r.tickets.push_back(ticket);
      p.written[k] = h.seq;
      p.next_seq++;
      p.next_slot = (k + 1) % L.nslots;
      return true;
    }
    h.nbytes = r.nbytes;
    h.tag = r.tag;
    h.dtype = r.dtype;
    h.ndim = r.ndim;
    h.flags = r.hflags;
    std::copy(r.shape, r.shape + r.ndim, h.shape);
    if (r.rndv) {
      h.flags |= kRendezvous;
      if (!r.mem.device && p.t->slot_writes_slow()) h.flags |= kSlowSlots;
      h.src = uint64_t(uintptr_t(r.data));
      // Ordered before the head by write_message's release of the ready word.
      // (Whether the receiver can copy from us is its to know, not ours.)
      if (uint64_t* w = rv_word_at(peer, k, kRvStateOff)) __atomic_store_n(w, rv_word(h.seq, kRvOffered), __ATOMIC_RELAXED);
    }
    if (r.mem.device) {
      h.flags |= kDevicePayload;
      Transport& dev = device_transport(peer);
      ticket = dev.write_message_async(peer, L.slot_off(rank_, k), &h, sizeof(h), r.data, r.nbytes, h.seq,
                                       r.mem.stream);
      if (ticket && r.staged) {  // read by the write enqueued on the same stream: freed after it
        dev.unstage_async(r.staged, r.mem.stream);
        r.staged = nullptr;
      }
    } else {
      ticket = p.t->write_message(peer, L.slot_off(rank_, k), &h, sizeof(h), r.data, payload_bytes(h), h.seq);
    }
    if (!ticket) return false;
    p.written[k] = h.seq;
    p.next_seq++;
    p.next_slot = (k + 1) % L.nslots;
    r.ticket = ticket;
    r.head_slot = k;
    r.head_seq = h.seq;
    r.state = ReqState::InFlight;
    return true;
  }
  return false;
}

void Engine::progress_sends(int peer, bool write) {
  Peer& p = peers_[peer];
  // Order per peer is the send order: a later send never overtakes a queued one.
  for (auto it = p.sendq.begin(); it != p.sendq.end();) {
    Request& r = reqs_[uint32_t(*it)];
    if (r.state == ReqState::Queued) {
      if (!write) break;  // (what follows is queued too)
      bool wrote;
      try {
        wrote = try_write(peer, r);
      } catch (const Error& e) {
        // The transport refused this send (a CUDA stream of another GPU, one
        // being captured): it fails alone, unwritten; left queued it would
        // throw again from every later progress and stop the sends behind it.
        uint64_t id = *it;
        it = p.sendq.erase(it);
        sending_--;
        fail_request(id, e.kind, e.what());
        continue;
      }
      if (!wrote) break;
    }
    if (r.state == ReqState::InFlight && r.rndv && !r.streaming) {
      // The receiver answers a head through its slot's credit: the seq when
      // it has copied the data (or dropped the message), seq | kStreamCredit
      // when the data is to stream through the ring.
      uint64_t c = load_acquire(region_->base() + layout_.credit_off(peer, r.head_slot));
      if (c == (r.head_seq | kStreamCredit)) {
        p.written[r.head_slot] = c;  // the head's slot is free again
        r.streaming = true;
      } else if (c == (r.head_seq | kFailCredit)) {
        p.written[r.head_slot] = c;
        uint64_t id = *it;
        it = p.sendq.erase(it);
        sending_--;
        fail_request(id, ErrorKind::PeerFailure, copy_failed_text(peer, r.nbytes));
        continue;
      } else if (is_push_credit(c, r.head_seq)) {
        if (!write) {
          ++it;
          continue;
        }
        // Write it ourselves into the receiver's landing block: one write
        // of header and data, whose ready word is the block's first.
        size_t off = push_block(c);
        if (off < p.layout.landing_off() || !p.layout.landing || r.nbytes > p.lands ||
            off + kPayloadOff + r.nbytes > p.layout.region_bytes()) {
          fail_peer(peer, peer_str(peer) + " asked for a message of " + std::to_string(r.nbytes) +
                              " bytes at offset " + std::to_string(off) +
                              ", outside its landing area; it is treated as failed");
          return;
        }
        MsgHeader h{};
        h.seq = r.head_seq;
        h.nbytes = r.nbytes;
        h.tag = int64_t(r.head_seq);
        h.flags = kChunk;
        h.auth = p.auth_out;
        uint64_t tk = p.t->write_message(peer, off, &h, sizeof h, r.data, r.nbytes, r.head_seq);
        if (!tk) break;  // no send resources: retried at the next progress, in order
        p.written[r.head_slot] = c;  // the head's slot is free again
        r.streaming = true;  // like a stream whose one chunk is written: done once the write is
        r.sent = r.nbytes;
        r.tickets.push_back(tk);
      } else if (is_raw_credit(c, r.head_seq)) {
        if (!r.push && !write) {
          ++it;
          continue;
        }
        if (!r.push && !push_raw(peer, r, c)) return;
        if (r.push == kPushWritten) {
          // Done with our buffer. The receiver frees the head's slot with
          // its seq (p.written stays the head's: not reused before that).
          uint64_t id = *it;
          it = p.sendq.erase(it);
          sending_--;
          r.state = ReqState::Done;
          if (r.detached) recycle(id);
          continue;
        }
        ++it;  // refused: the receiver reads it and answers with the seq, as for a pull
        continue;
      } else if (c != r.head_seq) {
        ++it;
        continue;
      }
    }
    if (r.streaming) {
      while (write && r.sent < r.nbytes && try_write(peer, r)) {
      }
      auto& t = *p.t;
      r.tickets.erase(std::remove_if(r.tickets.begin(), r.tickets.end(),
                                     [&](uint64_t tk) { return t.complete(peer, tk); }),
                      r.tickets.end());
      if (r.sent < r.nbytes) break;  // the ring is full: what follows waits behind it
      if (!r.tickets.empty()) {
        ++it;
        continue;
      }
    }
    if (r.state == ReqState::InFlight && (r.mem.device ? *p.tdev : *p.t).complete(peer, r.ticket)) {
      r.state = ReqState::Done;
      if (r.detached) recycle(*it);
      it = p.sendq.erase(it);
      sending_--;
      continue;
    }
    ++it;
  }
}

Transport& Engine::device_transport(int peer) {
  Peer& p = peers_[peer];
  if (!p.tdev)
    throw Error(ErrorKind::Invalid, "no device (GPU) route to " + peer_str(peer) +
                                        " (nvlink on one host, rdma-gpu across hosts; describe_transport(" +
                                        std::to_string(peer) + ") says why this pair has none): move the tensor "
                                        "to CPU");
  return *p.tdev;
}

Transport& Engine::local_device() {
  if (!local_dev_)
    throw Error(ErrorKind::Invalid, "this rank has no GPU transport for device memory (" + no_local_dev_ +
                                        "): move the tensor to CPU");
  return *local_dev_;
}

void Engine::set_local_device(std::shared_ptr<Transport> t, const std::string& why_none) {
  std::lock_guard<std::mutex> g(mu_);
  no_local_dev_ = why_none;
  if (t && std::find(transports_.begin(), transports_.end(), t) == transports_.end()) transports_.push_back(t);
  local_dev_ = std::move(t);
}

void Engine::copy_local(void* dst, const void* src, uint64_t n, Mem mem) {
  std::lock_guard<std::mutex> g(mu_);
  if (closed_) throw Error(ErrorKind::Closed, "communicator is closed");
  local_device().copy_async(dst, src, n, mem.stream, false);
}


uint64_t* Engine::rv_word_at(int peer, int slot, size_t off) {
  Peer& p = peers_[peer];
  return p.t ? p.t->peer_word(peer, p.layout.slot_off(rank_, slot) + off) : nullptr;
}

// Receiver: takes a rendezvous head's data for copying (protocol.h
// kRvStateOff): where to copy it from, or 0 when its sender withdrew it.
// Once it returned an address, the sender waits for this rank's answer in
// the head's credit: the seq, or seq | kFailCredit (answer_claim).
uint64_t Engine::claim_source(int peer, int slot, const MsgHeader& h) {
  auto* w = reinterpret_cast<uint64_t*>(region_->base() + layout_.slot_off(peer, slot) + kRvStateOff);
  uint64_t want = rv_word(h.seq, kRvOffered);
  const uint64_t claimed = rv_word(h.seq, kRvClaimed);
  if (__atomic_compare_exchange_n(w, &want, claimed, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) return h.src;
  if (want == rv_word(h.seq, kRvMoved)) {
    // The sender's copy: its address was stored before the state changed.
    uint64_t src = __atomic_load_n(w + (kRvMovedOff - kRvStateOff) / 8, __ATOMIC_ACQUIRE);
    if (__atomic_compare_exchange_n(w, &want, claimed, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) return src;
  }
  return 0;  // withdrawn (or a value no sender writes: the same to us)
}

size_t Engine::block_holding(const char* d, uint64_t n) const {
  const char* base = region_->base();
  if (!layout_.landing || d < base + layout_.landing_off() || d >= base + layout_.region_bytes()) return 0;
  size_t at = size_t(d - base);
  auto u = land_used_.upper_bound(at);
  if (u == land_used_.begin()) return 0;
  --u;
  size_t in = at - u->first;
  return in >= kPayloadOff && in <= u->second.len && n <= u->second.len - in ? u->first : 0;
}

bool Engine::offer_push(int peer, int slot, const MsgHeader& h, uint64_t id, char* dst) {
  Peer& p = peers_[peer];
  if (!h.nbytes || !p.t || !p.t->raw_writes() || !p.dead.empty()) return false;
  size_t blk = block_holding(dst, h.nbytes);
  size_t off = size_t(dst - region_->base());
  if (!blk || land_used_.at(blk).pending || off % 64 || off > kRawOffMax) return false;
  // Claimed as for a pull, so a sender that gives up waiting keeps its
  // buffer for us (move_rendezvous) and one that closes cannot withdraw it.
  auto* w = reinterpret_cast<uint64_t*>(region_->base() + layout_.slot_off(peer, slot) + kRvStateOff);
  uint64_t want = rv_word(h.seq, kRvOffered);
  if (!__atomic_compare_exchange_n(w, &want, rv_word(h.seq, kRvClaimed), false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
    return false;  // moved or withdrawn: the pull sorts it out
  land_used_.at(blk).refs++;  // the sender may write there until it says it has: never reused before
  land_used_.at(blk).raw++;
  Peer::Stream st{id, dst, 0, h.nbytes};
  st.slot = slot;
  st.raw = blk;
  st.src = h.src;
  st.asked = Clock::now();
  p.streams[h.seq] = st;
  p.t->write_u64(peer, p.layout.credit_off(rank_, slot), raw_credit(h.seq, off));
  return true;
}

bool Engine::push_settled(int peer, uint64_t seq, Peer::Stream& st, std::string* failed) {
  auto* w = reinterpret_cast<uint64_t*>(region_->base() + layout_.slot_off(peer, st.slot) + kRvPushOff);
  uint64_t v = __atomic_load_n(w, __ATOMIC_ACQUIRE);
  if (v == push_word(seq, kPushed)) {
    pushed_ += st.total;
    return true;
  }
  if (v == push_word(seq, kPushing) || Clock::now() - st.asked < kPushGrace) return false;
  if (!__atomic_compare_exchange_n(w, &v, push_word(seq, kPushRevoked), false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
    return false;  // it has just begun
  // Revoked: the buffer is still claimed, so still the sender's data.
  if (st.dst) {
    *failed = peers_[peer].t->read_peer(peer, st.src, st.dst, st.total);
    if (failed->empty()) pulled_ += st.total;
  }
  return true;
}

bool Engine::push_raw(int peer, Request& r, uint64_t c) {
  r.push = kPushRefused;
  Peer& p = peers_[peer];
  size_t off = raw_off(c), end = p.layout.region_bytes();
  uint64_t* w = rv_word_at(peer, r.head_slot, kRvPushOff);
  if (!w || !p.t->raw_writes() || !p.layout.landing || off < p.layout.landing_off() || off > end ||
      r.nbytes > end - off) {
    fail_peer(peer, peer_str(peer) + " asked for a message of " + std::to_string(r.nbytes) + " bytes at offset " +
                        std::to_string(off) + ", outside its landing area; it is treated as failed");
    return false;
  }
  uint64_t v = __atomic_load_n(w, __ATOMIC_ACQUIRE);
  if (v == push_word(r.head_seq, kPushRevoked) ||
      !__atomic_compare_exchange_n(w, &v, push_word(r.head_seq, kPushing), false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
    return true;  // revoked: the receiver reads it itself
  p.t->write_into(peer, off, r.data, r.nbytes);
  __atomic_store_n(w, push_word(r.head_seq, kPushed), __ATOMIC_RELEASE);
  r.push = kPushWritten;
  return true;
}

void Engine::raw_settled(size_t blk) {
  land_used_.at(blk).raw--;
  land_unref(blk);
}

void Engine::drop_raw(int peer, uint64_t seq, Peer::Stream& st) {
  Peer& p = peers_[peer];
  auto* w = reinterpret_cast<uint64_t*>(region_->base() + layout_.slot_off(peer, st.slot) + kRvPushOff);
  uint64_t v = __atomic_load_n(w, __ATOMIC_ACQUIRE);
  for (auto until = Clock::now() + kPeerCheck; v == push_word(seq, kPushing) && Clock::now() < until;
       v = __atomic_load_n(w, __ATOMIC_ACQUIRE)) {
    timespec ts{0, 20000};
    nanosleep(&ts, nullptr);
  }
  bool revoked = v != push_word(seq, kPushing) && v != push_word(seq, kPushed) &&
                 __atomic_compare_exchange_n(w, &v, push_word(seq, kPushRevoked), false, __ATOMIC_ACQ_REL,
                                             __ATOMIC_ACQUIRE);
  // A sender still writing (or one that began just now) keeps the block referenced: never reused under it,
  // unless its process is gone (then nothing writes there any more; a pair failed for another reason, its
  // process alive, keeps it).
  bool gone = v == push_word(seq, kPushing) && p.t && p.t->peer_exited(peer);
  if (revoked || v == push_word(seq, kPushed) || gone) raw_settled(st.raw);
  // Revoked: its send fails (nothing will read it); written: its slot is free.
  if (p.dead.empty() && p.t) p.t->write_u64(peer, p.layout.credit_off(rank_, st.slot), revoked ? seq | kFailCredit : seq);
}

uint64_t Engine::landed_output_min(bool torch) {
  std::lock_guard<std::mutex> g(mu_);
  // Where a peer writes its chunks into such an output (kRawCredit): from
  // 256 KiB (4 ranks on a 2-core AMD EPYC, 256 KiB-4 MiB per rank: 0.89-4.98x
  // MPI this way, 0.34-2.07x by two memcpys or CMA into an ordinary output;
  // bench/results/issue11-2026-12-05-s8.md). Elsewhere only large torch
  // outputs, whose fresh pages torch would fault in and zero on every call
  // (8 MiB, 4 ranks: 2.2-2.9 ms into fresh tensors, 1.7 ms into the area;
  // 4 MiB and under, and numpy, whose heap reuses its pages: no gain;
  // bench/results/issue11-2026-12-02-s6.md).
  if (!layout_.landing) return 0;
  for (int q = 0; q < world_; ++q)
    if (q != rank_ && peers_[q].t && peers_[q].t->raw_writes() && pulls_held(q)) return 256 << 10;
  return torch ? (4 << 20) + 1 : 0;
}

// Receiver: a claimed head whose copy failed is answered all the same, so
// its sender stops waiting (and fails that send) instead of holding on.
void Engine::fail_claim(int peer, int slot, uint64_t seq) {
  Peer& p = peers_[peer];
  if (p.dead.empty() && p.t) p.t->write_u64(peer, p.layout.credit_off(rank_, slot), seq | kFailCredit);
}

// Sender: a head the receiver claimed is answered within a copy's time; wait
// for the answer until `deadline`. kAnswered, kGone (the peer failed: *why),
// or kLate.
Engine::Await Engine::await_head_credit(uint64_t id, Clock::time_point deadline, std::string* why) {
  Request& r = reqs_[uint32_t(id)];
  int peer = r.peer;
  const char* credit = region_->base() + layout_.credit_off(peer, r.head_slot);
  for (auto last = Clock::now();;) {
    uint64_t c = load_acquire(credit);
    if (c == r.head_seq || c == (r.head_seq | kFailCredit)) return Await::kAnswered;
    if (is_raw_credit(c, r.head_seq)) {
      if (!r.push && !push_raw(peer, r, c)) {
        *why = peers_[peer].dead;
        return Await::kGone;
      }
      if (r.push == kPushWritten) return Await::kAnswered;  // the caller finishes it (progress_sends)
    }
    auto now = Clock::now();
    if (!peers_[peer].dead.empty() || now - last > kPeerCheck) {
      last = now;
      *why = peers_[peer].dead.empty() && peers_[peer].t ? peers_[peer].t->peer_error(peer) : peers_[peer].dead;
      if (!why->empty()) return Await::kGone;
    }
    if (now >= deadline) return Await::kLate;
    timespec ts{0, 20000};
    nanosleep(&ts, nullptr);
  }
}

// Sender: the caller stops waiting for rendezvous send `id` (a timeout, an
// interrupt), and its buffer must be the caller's again. The data moves to
// memory the request owns, so the receiver still gets the message, from
// there (kMoved); a receiver copying the buffer right now is waited for
// (kCompleted, or kKept if it is late: the buffer stays in use; also kKept
// without memory for the copy); kDropped: the peer failed meanwhile.
Engine::Cancelled Engine::move_rendezvous(uint64_t id) {
  Request& r = reqs_[uint32_t(id)];
  Peer& p = peers_[r.peer];
  std::unique_ptr<char[]> own(new (std::nothrow) char[r.nbytes]);
  if (!own) return Cancelled::kKept;
  // Chunk writes in flight may still read the caller's buffer.
  while (!r.tickets.empty()) {
    auto& t = *p.t;
    t.progress();
    r.tickets.erase(std::remove_if(r.tickets.begin(), r.tickets.end(),
                                   [&](uint64_t tk) { return t.complete(r.peer, tk); }),
                    r.tickets.end());
    std::string why = r.tickets.empty() ? "" : t.peer_error(r.peer);
    if (!why.empty()) {
      fail_peer(r.peer, why);
      return Cancelled::kDropped;
    }
  }
  std::memcpy(own.get(), r.data, r.nbytes);
  if (uint64_t* w = r.streaming ? nullptr : rv_word_at(r.peer, r.head_slot, kRvStateOff)) {
    __atomic_store_n(rv_word_at(r.peer, r.head_slot, kRvMovedOff), uint64_t(uintptr_t(own.get())), __ATOMIC_RELAXED);
    uint64_t want = rv_word(r.head_seq, kRvOffered);
    if (!__atomic_compare_exchange_n(w, &want, rv_word(r.head_seq, kRvMoved), false, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE)) {
      // Claimed: the receiver copies (or has copied) the caller's buffer.
      std::string why;
      switch (await_head_credit(id, Clock::now() + kClaimWait, &why)) {
        case Await::kAnswered:
          progress_sends(r.peer);
          return r.state == ReqState::Done ? Cancelled::kCompleted : Cancelled::kDropped;
        case Await::kGone:
          fail_peer(r.peer, why);
          return Cancelled::kDropped;
        case Await::kLate:
          return Cancelled::kKept;
      }
    }
  }
  r.data = own.get();
  r.own = std::move(own);
  return Cancelled::kMoved;
}

bool Engine::own_queued(uint64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  Request& r = get(id);
  if (r.state != ReqState::Queued || r.kind != ReqKind::Send || r.mem.device || r.own || !r.data || !r.nbytes)
    return false;
  std::unique_ptr<char[]> own(new (std::nothrow) char[r.nbytes]);
  if (!own) return false;  // (the caller keeps the send reading its buffer instead)
  std::memcpy(own.get(), r.data, r.nbytes);
  r.data = own.get();
  r.own = std::move(own);
  return true;
}

bool Engine::let_go(uint64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  Request& r = get(id);
  if (r.state != ReqState::InFlight || !r.rndv || r.own || closed_) return false;
  // Its receiver is copying it right now: no copy of ours, and no wait under
  // the lock (move_rendezvous's) for that copy to end.
  if (uint64_t* w = r.streaming ? nullptr : rv_word_at(r.peer, r.head_slot, kRvStateOff))
    if (__atomic_load_n(w, __ATOMIC_ACQUIRE) == rv_word(r.head_seq, kRvClaimed)) return false;
  // Completed or dropped (its peer failed) instead: the next wait says which.
  if (move_rendezvous(id) != Cancelled::kMoved) return false;
  r.detached = true;
  return true;
}

// Sender, at close() or when it fails the pair: the unanswered rendezvous
// heads to `peer` are withdrawn, so their receiver never copies from memory
// whose owner is told the send failed. One being copied right now is waited
// for (briefly) and completes instead; if its receiver is late, a copy of
// ours is kept until this engine goes (the caller's buffer cannot be).
void Engine::withdraw_heads(int peer) {
  Peer& p = peers_[peer];
  for (uint64_t id : std::vector<uint64_t>(p.sendq.begin(), p.sendq.end())) {
    Request& r = reqs_[uint32_t(id)];
    if (r.state != ReqState::InFlight || !r.rndv || r.streaming) continue;
    uint64_t* w = rv_word_at(peer, r.head_slot, kRvStateOff);
    if (!w) return;  // not a shm pair: nobody copies out of our memory
    // Offered, or moved (move_rendezvous) after it went out; a send whose
    // data was ours before it went out (own_queued) is offered with r.own set.
    auto withdraw = [&](uint64_t& want) {
      return __atomic_compare_exchange_n(w, &want, rv_word(r.head_seq, kRvWithdrawn), false, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE);
    };
    uint64_t want = rv_word(r.head_seq, kRvOffered);
    if (withdraw(want)) continue;  // the caller fails it
    if (want == rv_word(r.head_seq, kRvMoved) && withdraw(want)) continue;
    if (want != rv_word(r.head_seq, kRvClaimed)) continue;  // answered already
    std::string why;
    if (await_head_credit(id, Clock::now() + kClaimWait, &why) != Await::kAnswered) {
      if (r.own) graveyard_.push_back(std::move(r.own));
      continue;
    }
    if (r.push == kPushWritten) {  // written into the receiver's output: done (its slot stays the head's)
      p.sendq.erase(std::find(p.sendq.begin(), p.sendq.end(), id));
      sending_--;
      r.state = ReqState::Done;
      if (r.detached) recycle(id);
      continue;
    }
    uint64_t c = load_acquire(region_->base() + layout_.credit_off(peer, r.head_slot));
    p.written[r.head_slot] = c;
    p.sendq.erase(std::find(p.sendq.begin(), p.sendq.end(), id));
    sending_--;
    if (c == r.head_seq) {
      r.state = ReqState::Done;
      if (r.detached) recycle(id);
    } else {
      fail_request(id, ErrorKind::PeerFailure, copy_failed_text(peer, r.nbytes));
    }
  }
}

std::string Engine::copy_failed_text(int peer, uint64_t nbytes) const {
  return "send to " + peer_str(peer) + " failed: it could not copy this message of " + std::to_string(nbytes) +
         " bytes out of this rank's memory, and failed the pair (its own error says why)";
}

int Engine::consume(int peer, int slot, const MsgHeader& h, void* dst, Mem mem, uint64_t id, std::string* why) {
  if (h.flags & kRendezvous) {
    Peer& p = peers_[peer];
    // Whether we read it straight out of the sender (a collective's chunk: pulls_held).
    bool held = id && reqs_[uint32_t(id)].hold;
    bool pull = held ? pulls_held(peer) : mem.device ? p.pulls : pulls_message(peer, h);
    if (mem.device) {
      // misfit() let it through: within our bound, and we pull. Into the
      // head's own slot, then the device transport takes it from there as
      // any host payload (and its credit, the seq, completes the send).
      char* slot_payload = region_->base() + layout_.slot_off(peer, slot) + kPayloadOff;
      uint64_t src = h.nbytes <= layout_.bound && pull ? claim_source(peer, slot, h) : 0;
      std::string err = h.nbytes > layout_.bound || !pull ? "over this rank's bound, it cannot land in GPU memory"
                        : src                                 ? p.t->read_peer(peer, src, slot_payload, h.nbytes)
                                                              : kWithdrawn;
      if (!err.empty()) {
        if (src) fail_claim(peer, slot, h.seq);
        if (why) *why = "its message of " + std::to_string(h.nbytes) + " bytes could not be copied: " + err;
        return -1;
      }
      pulled_ += h.nbytes;
      try {
        if (!p.tdev && local_dev_) {  // no device route (the sender staged it): as an eager staged message below
          if (uintptr_t mark = local_dev_->copy_async(dst, slot_payload, h.nbytes, mem.stream, true))
            staged_.push_back({local_dev_, mark, peer, slot, h.seq});
          else
            free_slot(peer, slot, h.seq);
          return 1;
        }
        device_transport(peer).read_and_free_async(peer, layout_.slot_off(peer, slot) + kPayloadOff, dst, h.nbytes,
                                                   h.seq, p.layout.credit_off(rank_, slot), mem.stream);
      } catch (...) {
        fail_claim(peer, slot, h.seq);
        throw;
      }
      return 1;
    }
    // Into out's own landing block (comm.empty): the one copy is the sender's.
    // (Not for a held receive: its caller needs the data at return, and a
    // pull gives it one copy too.)
    size_t own = held ? 0 : landing_block(dst, h.nbytes);
    if (own && try_land(peer, slot, h, id, static_cast<char*>(dst), own)) return 0;
    // A collective's chunk whose output is in our landing area: its sender
    // copies it there, at memcpy speed (kRawCredit).
    if (held && pull && offer_push(peer, slot, h, id, static_cast<char*>(dst))) return 0;
    if (pull) {
      uint64_t src = claim_source(peer, slot, h);
      std::string err = src ? p.t->read_peer(peer, src, dst, h.nbytes) : kWithdrawn;
      if (!err.empty()) {
        if (src) fail_claim(peer, slot, h.seq);
        if (why) *why = "its message of " + std::to_string(h.nbytes) + " bytes could not be copied: " + err;
        return -1;
      }
      pulled_ += h.nbytes;
      free_slot(peer, slot, h.seq);  // the sender's send completes
      return 1;
    }
    p.streams[h.seq] = {id, static_cast<char*>(dst), 0, h.nbytes};
    if (p.dead.empty() && p.t) p.t->write_u64(peer, p.layout.credit_off(rank_, slot), h.seq | kStreamCredit);
    return 0;
  }
  Peer& p = peers_[peer];
  if (mem.device && !(h.flags & kDevicePayload) && !p.tdev && local_dev_) {
    // A host message from a peer with no device route (staged by its sender),
    // into device memory: through our local device transport, on the stream.
    // The slot is ours to free from the CPU once the copy ran: progress frees
    // it when the copy's mark says so (a wait here, under mu_, would stall
    // every thread of this rank for the stream's earlier GPU work).
    uintptr_t mark = 0;
    if (uint64_t n = payload_bytes(h))
      mark = local_dev_->copy_async(dst, region_->base() + layout_.slot_off(peer, slot) + kPayloadOff, n, mem.stream,
                                    true);
    if (mark) staged_.push_back({local_dev_, mark, peer, slot, h.seq});
    else free_slot(peer, slot, h.seq);
    return 1;
  }
  if ((h.flags & kDevicePayload) || mem.device) {
    device_transport(peer).read_and_free_async(peer, layout_.slot_off(peer, slot) + kPayloadOff, dst, h.nbytes,
                                               h.seq, p.layout.credit_off(rank_, slot), mem.stream);
    return 1;
  }
  if (uint64_t n = payload_bytes(h)) std::memcpy(dst, region_->base() + layout_.slot_off(peer, slot) + kPayloadOff, n);
  free_slot(peer, slot, h.seq);
  return 1;
}

void Engine::refuse_device_recv(int peer, const MsgHeader& h, Mem mem) {
  if (!mem.device || !h.nbytes) return;  // (an empty message takes no stream work to refuse)
  Peer& p = peers_[peer];
  // The transport consume() enqueues on: the pair's device route, else (a
  // host message, staged by its sender) our local one.
  Transport* t = p.tdev ? p.tdev.get() : (h.flags & kDevicePayload) ? nullptr : local_dev_.get();
  if (!t) device_transport(peer);  // throws: no device route
  t->refuse_stream(mem.stream, "recv");
}

void Engine::set_device_transport(int peer, std::shared_ptr<Transport> t) {
  std::lock_guard<std::mutex> g(mu_);
  check_fits(peer, *t, peers_.at(peer).layout);
  if (std::find(transports_.begin(), transports_.end(), t) == transports_.end()) transports_.push_back(t);
  peers_.at(peer).tdev = std::move(t);
}

void Engine::free_slot(int peer, int slot, uint64_t seq) {
  Peer& p = peers_[peer];
  // The slot is in our region; the credit that frees it lives in the sender's
  // (gone once closed: a message received after close() frees nothing).
  if (!p.dead.empty() || !p.t) return;
  p.t->write_u64(peer, p.layout.credit_off(rank_, slot), seq);
  // At least half of peer's ring still holds messages: peer is sending ahead
  // of us and may be out of slots, so the credit goes now, not with our next
  // call (rdma holds it to ride along with a reply, which a receiver that now
  // computes for seconds does not send: the sender would wait that long).
  // Ping-pong keeps one message in flight and its credits ride along.
  if (2 * (p.ready.size() + p.early.size() + 1) >= size_t(layout_.nslots)) p.t->send_credits_now(peer);
}

void Engine::deliver(int peer) {
  Peer& p = peers_[peer];
  const char* base = region_->base();
  for (int k = 0; k < layout_.nslots; ++k) {
    uint64_t s = load_acquire(base + layout_.slot_off(peer, k));
    if (s == 0 || s == p.seen[k]) continue;
    const auto* h = reinterpret_cast<const MsgHeader*>(base + layout_.slot_off(peer, k) + kHeaderOff);
    if (__builtin_expect(h->auth != p.auth_in, 0)) {
      discard_forged(peer, k, s);
      continue;
    }
    p.seen[k] = s;
    p.early.push_back({s, k, false});
  }
  // Deliver in sequence order only, so providers that complete out of order
  // still give per-tag FIFO.
  for (bool moved = true; moved && !p.early.empty();) {
    moved = false;
    for (size_t i = 0; i < p.early.size(); ++i) {
      if (p.early[i].seq == p.next_deliver) {
        const auto* h = reinterpret_cast<const MsgHeader*>(base + layout_.slot_off(peer, p.early[i].slot) + kHeaderOff);
        if (h->flags & kGoodbye) {
          // Its slot is never freed: the sender writes nothing more to us.
          p.bye_seen = true;
          p.bye_failing = h->tag == kByeFailing;
          p.early.erase(p.early.begin() + i);
          p.next_deliver++;
          moved = true;
          break;
        }
        p.ready.push_back(p.early[i]);
        p.early.erase(p.early.begin() + i);
        p.next_deliver++;
        moved = true;
        break;
      }
    }
  }
}

// Everything the peer sent before its goodbye is delivered (and none of it
// still streams in): what waits for more from it would wait in vain.
// Not while this rank closes too: what it still waits for fails with
// ClosedError then, as close() documents, whoever closed first.
void Engine::check_goodbye(int peer) {
  Peer& p = peers_[peer];
  if (!p.bye_seen || !p.dead.empty() || !p.streams.empty() || leaving_) return;
  // A message of ours already written may have been received before the
  // peer closed: its send completes (its write's completion), not fails;
  // one whose completion arrived but is not yet processed, too. One still
  // queued is not written now (it would complete, its message lost): it fails.
  if (!p.sendq.empty()) progress_sends(peer, false);
  if (!p.dead.empty()) return;
  for (uint64_t id : p.sendq) {
    const Request& r = reqs_[uint32_t(id)];
    if (r.state == ReqState::InFlight && !r.rndv) return;
  }
  // A malformed message before the goodbye fails the pair for what it is.
  const char* base = region_->base();
  for (const Arrival& a : p.ready)
    if (!sane(peer, *reinterpret_cast<const MsgHeader*>(base + layout_.slot_off(peer, a.slot) + kHeaderOff), a.seq))
      return;
  fail_peer(peer, closed_text(peer_str(peer), p.bye_failing));
}

void Engine::progress_recvs(int peer) {
  Peer& p = peers_[peer];
  const char* base = region_->base();
  deliver(peer);
  if (!p.streams.empty() && (!route_chunks(peer) || !check_landings(peer))) return;
  for (auto it = p.posted.begin(); it != p.posted.end();) {
    Request& r = reqs_[uint32_t(*it)];
    auto m = p.ready.end();
    for (auto a = p.ready.begin(); a != p.ready.end(); ++a) {
      if (a->claimed) continue;
      const auto* h = reinterpret_cast<const MsgHeader*>(base + layout_.slot_off(peer, a->slot) + kHeaderOff);
      if (h->tag == r.tag && !(h->flags & kChunk)) {
        m = a;
        break;
      }
    }
    if (!p.returned.empty()) {
      auto ret = std::find_if(p.returned.begin(), p.returned.end(),
                              [&](const Peer::Returned& x) { return x.hdr.tag == r.tag; });
      if (ret != p.returned.end() && (m == p.ready.end() || ret->hdr.seq < m->seq)) {
        take_returned(peer, *it, ret);
        it = p.posted.erase(it);
        continue;
      }
    }
    if (m == p.ready.end()) {
      ++it;
      continue;
    }
    r.hdr = *reinterpret_cast<const MsgHeader*>(base + layout_.slot_off(peer, m->slot) + kHeaderOff);
    if (!sane(peer, r.hdr, m->seq)) return;  // the peer is failed, and with it every posted recv
    if (r.out) {
      // Refuse without consuming: the message stays for the next receive.
      r.error = misfit(peer, r.hdr, r.out_cap, r.out_dtype, &r.err, r.mem.device);
      if (!r.error.empty()) {
        r.state = ReqState::Failed;
        if (r.detached) recycle(*it);  // nobody will read the error
        it = p.posted.erase(it);
        continue;
      }
      // Refused for its stream (being captured, another GPU's): this receive
      // fails as a misfit does, before anything is claimed or pulled, and the
      // message stays for the next one (dropped, the receive left posted took
      // the one after it; a rendezvous one's claim and pull failed the pair).
      try {
        refuse_device_recv(peer, r.hdr, r.mem);
      } catch (const Error& e) {
        if (e.kind != ErrorKind::Invalid) throw;
        r.error = e.what();
        r.err = e.kind;
        r.state = ReqState::Failed;
        if (r.detached) recycle(*it);
        it = p.posted.erase(it);
        continue;
      }
      int k = m->slot;
      p.ready.erase(m);
      std::string why;
      int got = consume(peer, k, r.hdr, r.out, r.mem, *it, &why);
      if (got < 0) {
        fail_peer(peer, why);  // this recv with it: it is still posted
        return;
      }
      if (got == 0) {
        r.state = ReqState::Streaming;  // finished (or failed) through p.streams
        it = p.posted.erase(it);
        if (!route_chunks(peer)) return;
        continue;
      }
      r.state = ReqState::Done;
    } else if ((r.hdr.flags & kRendezvous) && !r.mem.device && r.hold && pulls_held(peer) &&
               !(r.hold_device && r.hdr.nbytes > layout_.bound)) {
      r.slot = m->slot;  // copy_out reads it from the sender into its dst
      m->claimed = true;
      r.state = ReqState::Matched;
    } else if ((r.hdr.flags & kRendezvous) && !r.mem.device && try_land(peer, m->slot, r.hdr, *it, nullptr)) {
      // Written by its sender into a landing block, which becomes the result
      // (check_landings): one copy in all.
      p.ready.erase(m);
      r.slot = -1;
      r.state = ReqState::Streaming;
      it = p.posted.erase(it);
      continue;
    } else if ((r.hdr.flags & kRendezvous) && !r.mem.device) {
      // A receive without out that matched a rendezvous head takes the data
      // now, into memory of its own (one copy more, at copy_out): its sender
      // waits for this answer, and the caller may be waiting on its own
      // send to that sender before it waits here (torch pipelining's
      // schedules, Megatron's p2p), which would deadlock until the timeout.
      std::unique_ptr<char[]> buf(new (std::nothrow) char[r.hdr.nbytes ? r.hdr.nbytes : 1]);
      if (!buf) {  // no memory now: the old way, answered when it is copied out
        r.slot = m->slot;
        m->claimed = true;
        r.state = ReqState::Matched;
      } else {
        int k = m->slot;
        p.ready.erase(m);
        std::string why;
        int got = consume(peer, k, r.hdr, buf.get(), Mem{}, *it, &why);
        if (got < 0) {
          fail_peer(peer, why);  // this recv with it: it is still posted
          return;
        }
        r.own = std::move(buf);
        r.slot = -1;  // no slot: the data is in r.own (copy_out, release_locked)
        if (got == 0) {
          r.state = ReqState::Streaming;  // Matched once every chunk is in (route_chunks)
          it = p.posted.erase(it);
          if (!route_chunks(peer)) return;
          continue;
        }
        r.state = ReqState::Matched;
      }
    } else {
      r.slot = m->slot;
      m->claimed = true;
      r.state = ReqState::Matched;
    }
    if (r.detached) {
      if (r.state == ReqState::Matched) {
        // Nobody will read it: drop the message but keep the stream moving.
        uint64_t id = *it;
        it = p.posted.erase(it);
        release_locked(id);
        continue;
      }
      recycle(*it);
    }
    it = p.posted.erase(it);
  }
  check_goodbye(peer);
}

bool Engine::route_chunks(int peer) {
  Peer& p = peers_[peer];
  const char* base = region_->base();
  for (auto a = p.ready.begin(); a != p.ready.end();) {
    const char* slot = base + layout_.slot_off(peer, a->slot);
    const auto* hp = reinterpret_cast<const MsgHeader*>(slot + kHeaderOff);
    if (!(hp->flags & kChunk)) {
      ++a;
      continue;
    }
    MsgHeader h = *hp;
    if (!sane(peer, h, a->seq)) return false;
    auto s = p.streams.find(uint64_t(h.tag));
    if (s == p.streams.end() || s->second.landing || s->second.raw || h.nbytes > s->second.total - s->second.got) {
      fail_peer(peer, peer_str(peer) + " wrote a chunk of " + std::to_string(h.nbytes) +
                          " bytes for a rendezvous message this rank did not ask it to stream (seq " +
                          std::to_string(h.tag) + "); it is treated as failed");
      return false;
    }
    Peer::Stream& st = s->second;
    if (st.dst) std::memcpy(st.dst + st.got, slot + kPayloadOff, h.nbytes);
    st.got += h.nbytes;
    int k = a->slot;
    a = p.ready.erase(a);
    free_slot(peer, k, h.seq);
    if (st.got == st.total) {
      if (st.id) {
        Request& r = reqs_[uint32_t(st.id)];
        // Into memory of its own (a receive without out): ready to copy out.
        r.state = r.own && r.slot < 0 && r.kind == ReqKind::Recv && !r.copied ? ReqState::Matched : ReqState::Done;
        if (r.detached) recycle(st.id);
      }
      p.streams.erase(s);
    }
  }
  return true;
}

// A request fails with `why`; a detached one (nobody will read the error) is recycled instead.
void Engine::fail_request(uint64_t id, ErrorKind kind, const std::string& why) {
  Request& r = reqs_[uint32_t(id)];
  if (r.detached) {
    recycle(id);
    return;
  }
  r.state = ReqState::Failed;
  r.err = kind;
  r.error = why;
}

void Engine::drop_landing(Peer::Stream& st) {
  if (!st.landing) return;
  land_used_.at(st.landing).pending = false;
  land_unref(st.landing);
  st.landing = 0;
}

void Engine::take_returned(int peer, uint64_t id, std::deque<Peer::Returned>::iterator ret) {
  Peer& p = peers_[peer];
  Request& r = reqs_[uint32_t(id)];
  r.hdr = ret->hdr;
  if (!r.out) {  // the block is the result, as when it landed
    r.land = ret->land;
    r.slot = -1;
    r.state = ReqState::Matched;
    p.returned.erase(ret);
    if (r.detached) release_locked(id);
    return;
  }
  // Refused without consuming, as any message: it stays for the next receive.
  r.error = misfit(peer, r.hdr, r.out_cap, r.out_dtype, &r.err, r.mem.device);
  if (r.error.empty()) {
    const char* src = region_->base() + ret->land + kPayloadOff;
    if (r.mem.device) {
      Transport& t = local_device();
      t.copy_done(t.copy_async(r.out, src, r.hdr.nbytes, r.mem.stream, true), true);
    } else {
      std::memcpy(r.out, src, r.hdr.nbytes);
    }
    land_unref(ret->land);
    p.returned.erase(ret);
  }
  r.state = r.error.empty() ? ReqState::Done : ReqState::Failed;
  if (r.detached) recycle(id);
}

void Engine::fail_streams(int peer, ErrorKind kind, const std::string& why) {
  Peer& p = peers_[peer];
  // A landing block peer was asked to write keeps its reference (never
  // reused under a late write) unless nothing of peer's writes any more:
  // its process is gone (shm knows; rdma's failures may leave it writing).
  // Then a comm.empty out is usable again at once.
  const bool gone = p.t && p.t->peer_exited(peer);
  for (auto& kv : p.streams) {
    const bool landing = kv.second.landing;  // (before drop_landing clears it)
    if (kv.second.raw) drop_raw(peer, kv.first, kv.second);
    else if (gone) drop_landing(kv.second);
    if (kv.second.id)
      fail_request(kv.second.id, kind,
                   why + (landing
                              ? " (its sender was writing the " + std::to_string(kv.second.total) +
                                    " bytes straight into the output: any part of it may have been written)"
                              : " (" + std::to_string(kv.second.got) + " of " + std::to_string(kv.second.total) +
                                    " bytes had arrived)"));
  }
  p.streams.clear();
}

void Engine::discard_forged(int peer, int k, uint64_t ready) {
  Peer& p = peers_[peer];
  // Give the ready word back its last genuine value, so the sender's next
  // write to this slot is noticed (unless one has landed meanwhile).
  uint64_t want = ready;
  __atomic_compare_exchange_n(reinterpret_cast<uint64_t*>(region_->base() + layout_.slot_off(peer, k)), &want,
                              p.seen[k], false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  forged_++;
  // Reported on the 1st, 2nd, 4th, ... one per peer: visible, not a flood.
  uint64_t n = ++p.forged;
  if ((n & (n - 1)) == 0)
    fprintf(stderr,
            "varcomm rank %d: discarded a message in %s's slot %d whose pair tag is wrong (a forged one-sided write "
            "into this rank's region, or a rank with another VARCOMM_JOB_KEY); %llu so far, not delivered\n",
            rank_, peer_str(peer).c_str(), k, (unsigned long long)n);
}

void Engine::free_staged(bool wait) {
  for (size_t i = 0; i < staged_.size();) {
    Staged& s = staged_[i];
    if (!s.t->copy_done(s.mark, wait)) {
      ++i;
      continue;
    }
    free_slot(s.peer, s.slot, s.seq);
    staged_.erase(staged_.begin() + long(i));
  }
}

void Engine::progress_locked() {
  if (!staged_.empty()) free_staged(false);
  // Every transport, not only those of the peers we wait for: rdma over tcp
  // needs the target's progress for incoming writes, and holds our outgoing
  // credits until its next call, so a peer blocked on us can move on.
  for (auto& t : transports_) t->progress();
  // Receives first: answering a peer's rendezvous head lets it copy into us
  // while we copy into it (see recv_direct).
  for (int peer = 0; peer < world_; ++peer) {
    Peer& p = peers_[peer];
    if (p.t && (!p.posted.empty() || !p.streams.empty())) progress_recvs(peer);
  }
  for (int peer = 0; peer < world_; ++peer) {
    Peer& p = peers_[peer];
    if (p.t && !p.sendq.empty()) progress_sends(peer);
  }
  if (byes_wanted_)
    for (int peer = 0; peer < world_; ++peer) try_goodbye(peer);
}

void Engine::progress() {
  std::lock_guard<std::mutex> g(mu_);
  if (!closed_) progress_locked();
}

// ---- failure --------------------------------------------------------------

void Engine::check_peer(int peer, bool force) {
  Peer& p = peers_[peer];
  if (!p.dead.empty()) {
    fail_peer(peer, "");  // fail whatever was posted since
    return;
  }
  if (!p.t || peer == rank_) return;
  auto now = Clock::now();
  if (!force && now - p.last_check < kPeerCheck) return;
  p.last_check = now;
  // A sender blocked on a full ring to a peer that closed learns it here.
  // Posted receives match what is delivered before the goodbye fails them.
  progress_recvs(peer);
  if (!p.dead.empty()) return;
  std::string why = p.t->peer_error(peer);
  if (!why.empty()) fail_peer(peer, why);
}

void Engine::fail_peer(int peer, const std::string& why) {
  Peer& p = peers_[peer];
  // Every text names the rank (a copy that failed said only "its message of N bytes ...").
  const std::string who = peer_str(peer);
  bool named = false;  // (as a word: "rank 1" is not in "rank 12")
  for (size_t at = why.find(who); at != std::string::npos && !named; at = why.find(who, at + 1))
    named = at + who.size() == why.size() || !std::isdigit(static_cast<unsigned char>(why[at + who.size()]));
  if (p.dead.empty()) p.dead = "peer failure: " + (named ? why : who + ": " + why);
  withdraw_heads(peer);  // the peer may be alive, and copy from us, when we fail the pair
  sending_ -= p.sendq.size();
  fail_queue(p.sendq, ErrorKind::PeerFailure, "send to " + peer_str(peer) + " failed: " + p.dead);
  fail_queue(p.posted, ErrorKind::PeerFailure, "recv from " + peer_str(peer) + " failed: " + p.dead);
  fail_streams(peer, ErrorKind::PeerFailure, "recv from " + peer_str(peer) + " failed mid-message: " + p.dead);
}

// Every request in `q` fails with `why`; detached ones (nobody will read the
// error) are recycled instead.
void Engine::fail_queue(std::deque<uint64_t>& q, ErrorKind kind, const std::string& why) {
  for (uint64_t id : q) fail_request(id, kind, why);
  q.clear();
}

void Engine::throw_if_failed(Request& r, uint64_t id) {
  if (r.state != ReqState::Failed) return;
  Error e(r.err, r.error, r.peer);
  recycle(id);
  throw e;
}

std::string Engine::timeout_message(uint64_t id, double seconds, int* peer) {
  std::lock_guard<std::mutex> g(mu_);
  Request& r = get(id);
  *peer = r.peer;
  std::string op = r.kind == ReqKind::Send ? "send to " : "recv from ";
  char secs[32];
  snprintf(secs, sizeof secs, "%.3g", seconds);
  std::string msg = op + peer_str(r.peer) + " (tag " + std::to_string(r.tag) + ") timed out after " + secs + " s";
  if (r.kind == ReqKind::Send && r.rndv && r.state == ReqState::InFlight && !r.streaming)
    msg += "; the receiver has not received it (a message of " + std::to_string(r.nbytes) +
           " bytes goes by rendezvous: the send completes when the receiver has copied it; is it receiving?" +
           (r.peer == rank_ ? " This rank sent it to itself: post the irecv first, or isend, unless another thread "
                              "receives it)"
                            : " Two ranks that each send such a message to the other before receiving wait for "
                              "each other: isend, or post the irecv first)");
  else if (r.kind == ReqKind::Send)
    msg += "; the receiver has not freed a slot (is it receiving, with this tag? every slot it has for us holds a "
           "message it has not received yet)";
  else if (r.state == ReqState::Streaming) {
    auto& st = peers_[r.peer].streams;
    for (auto& kv : st)
      if (kv.second.id == id && kv.second.raw)
        msg += " with its chunk of " + std::to_string(kv.second.total) +
               " bytes asked of its sender, to be written into the output (it is read from the sender instead "
               "if that does not happen within milliseconds; the channel stays usable)";
      else if (kv.second.id == id && kv.second.landing)
        msg += " with its message of " + std::to_string(kv.second.total) +
               " bytes taken: its sender was told where to write it and has not yet; that message is dropped when it "
               "lands, and its send completes (the channel stays usable; a receive that must not lose it needs a "
               "timeout longer than its sender's gaps between calls into varcomm)";
      else if (kv.second.id == id)
        msg += " mid-message: " + std::to_string(kv.second.got) + " of " + std::to_string(kv.second.total) +
               " bytes had arrived; that message is dropped, the rest of it as it arrives, and its send completes "
               "(the channel stays usable)";
  } else
    msg += nothing_arrived_locked(r.peer);
  return msg;
}

std::string Engine::nothing_arrived(int peer) {
  std::lock_guard<std::mutex> g(mu_);
  return nothing_arrived_locked(peer);
}

std::vector<int64_t> Engine::unreceived_tags(int peer) {
  std::lock_guard<std::mutex> g(mu_);
  return unreceived_tags_locked(peer);
}

std::vector<int64_t> Engine::unreceived_tags_locked(int peer) {
  std::vector<int64_t> tags;
  const char* base = region_->base();
  for (auto& a : peers_[peer].ready) {
    if (a.claimed) continue;
    const auto* h = reinterpret_cast<const MsgHeader*>(base + layout_.slot_off(peer, a.slot) + kHeaderOff);
    if (!(h->flags & kChunk)) tags.push_back(h->tag);
  }
  for (auto& x : peers_[peer].returned) tags.push_back(x.hdr.tag);
  return tags;
}

std::string Engine::nothing_arrived_locked(int peer) {
  std::string msg = "; nothing arrived (is the peer sending with this tag?";
  // Messages of the peer that did arrive but match no receive: the usual
  // cause is a tag (or call order) that differs between the two sides, and
  // saying which tags they carry points at it.
  std::map<int64_t, size_t> other;
  size_t coll = 0;  // parts of collective calls: their tags are no user's
  for (int64_t t : unreceived_tags_locked(peer)) {
    if (t >= kCollTagBase)
      ++coll;
    else
      ++other[t];
  }
  if (coll)
    msg += " " + std::to_string(coll) +
           (coll == 1 ? " part of a collective call from " : " parts of collective calls from ") + peer_str(peer) +
           (coll == 1 ? " waits" : " wait") +
           " here unreceived: it is in a collective (an all-to-all, MoE dispatch or combine) where this rank "
           "receives point-to-point; every rank must make the same collective calls in the same order.";
  if (!other.empty()) {
    size_t n = 0, i = 0;
    std::string tags;
    for (auto& kv : other) {
      n += kv.second;
      if (i++ < 8) tags += (tags.empty() ? "" : ", ") + std::to_string(kv.first);
    }
    if (other.size() > 8) tags += ", ...";
    msg += " " + std::to_string(n) + (n == 1 ? " message" : " messages") + " from " + peer_str(peer) +
           " wait here unreceived, with tag" + (other.size() == 1 ? " " : "s ") + tags +
           ": the two sides disagree on tags, or on how many messages go between them.";
  }
  size_t held = 0;
  for (auto& a : peers_[peer].ready) held += a.claimed;
  if (held)
    msg += " This rank holds " + std::to_string(held) + " of the " + std::to_string(layout_.nslots) + " slots " +
           peer_str(peer) + " writes into, in copy=False views, matched receives or all-to-alls (async_op) not yet "
           "waited for" + (held >= size_t(layout_.nslots) ? ": it cannot send more until they are dropped or waited"
                                                           : "") + ".";
  if (msg.back() == '.') msg.pop_back();
  return msg + ")";
}

// ---- waiting --------------------------------------------------------------

bool Engine::test(uint64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  Request& r = get(id);
  if (r.state == ReqState::Queued || r.state == ReqState::InFlight || r.state == ReqState::Posted ||
      r.state == ReqState::Streaming) {
    progress_locked();
    check_peer(r.peer, false);
  }
  return r.state == ReqState::Done || r.state == ReqState::Matched || r.state == ReqState::Failed;
}

void Engine::raise_if_failed(uint64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  Request& r = get(id);
  if (r.state == ReqState::Done || r.state == ReqState::Matched) return;
  check_peer(r.peer, false);
  throw_if_failed(r, id);
}

bool Engine::wait(uint64_t id, Clock::time_point deadline) {
  return spin(
      [&](bool slow) {
        // A request that completed before close() stays completed; close()
        // failed every other one (ClosedError), so it is terminal too.
        Request& r = get(id);
        if (closed_ && r.state != ReqState::Done && r.state != ReqState::Matched && r.state != ReqState::Failed)
          throw Error(ErrorKind::Closed, "communicator is closed");
        if (r.state == ReqState::Queued || r.state == ReqState::InFlight || r.state == ReqState::Posted ||
            r.state == ReqState::Streaming)
          progress_locked();
        if (r.state == ReqState::Done || r.state == ReqState::Matched) {
          if (r.kind == ReqKind::Send || r.copied) recycle(id);
          return true;
        }
        throw_if_failed(r, id);
        if (slow) {
          check_peer(r.peer, false);
          throw_if_failed(r, id);
        }
        return false;
      },
      deadline);
}

MsgInfo Engine::info(uint64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  Request& r = get(id);
  if (r.kind != ReqKind::Recv || (r.state != ReqState::Done && r.state != ReqState::Matched))
    throw Error(ErrorKind::Invalid, "request is not a completed recv");
  MsgInfo m;
  m.src = r.peer;
  m.tag = r.hdr.tag;
  m.nbytes = r.hdr.nbytes;
  m.dtype = r.hdr.dtype;
  m.shape.assign(r.hdr.shape, r.hdr.shape + std::min<uint32_t>(r.hdr.ndim, kMaxDims));
  m.flags = r.hdr.flags;
  if (r.state == ReqState::Done) recycle(id);
  return m;
}

void Engine::consume_claimed(int peer, int slot, const MsgHeader& hdr, void* dst) {
  std::lock_guard<std::mutex> g(mu_);
  if (closed_) throw Error(ErrorKind::Closed, "communicator is closed");
  Peer& p = peers_[peer];
  for (auto a = p.ready.begin(); a != p.ready.end(); ++a)
    if (a->seq == hdr.seq) {
      p.ready.erase(a);
      break;
    }
  std::string why;
  if (consume(peer, slot, hdr, dst, Mem{}, 0, &why) < 0) {  // never 0: match_direct leaves streams to irecv
    fail_peer(peer, why);
    throw Error(ErrorKind::PeerFailure, "recv from " + peer_str(peer) + " failed: " + p.dead, peer);
  }
}

void Engine::drive_sends() {
  if (sending_)
    for (int q = 0; q < world_; ++q)
      if (!peers_[q].sendq.empty()) progress_sends(q);
}

void Engine::release_claimed(int peer, int slot, uint64_t seq) {
  std::lock_guard<std::mutex> g(mu_);
  if (slot <= kLandedSlot) {
    land_unref(landed_off(slot));
    return;
  }
  if (closed_) return;  // the transports are gone: there is no sender to give the slot back to
  Peer& p = peers_[peer];
  for (auto a = p.ready.begin(); a != p.ready.end(); ++a)
    if (a->seq == seq) {
      p.ready.erase(a);
      break;
    }
  free_slot(peer, slot, seq);
}

int Engine::take_claim(uint64_t id, MsgHeader* hdr, int* peer) {
  std::lock_guard<std::mutex> g(mu_);
  Request& r = get(id);
  if (r.state != ReqState::Matched) throw Error(ErrorKind::Invalid, "recv has no message to view");
  if (r.hdr.flags & kDevicePayload)
    throw Error(ErrorKind::Invalid, "copy=False is not supported for device (GPU) messages; receive with copy=True");
  if (r.hdr.flags & kDescriptor) throw Error(ErrorKind::Invalid, "a descriptor message has no payload to view");
  if (r.land) {  // the block is the view's now (release_claimed frees it)
    *hdr = r.hdr;
    *peer = r.peer;
    int slot = landed_slot(r.land);
    r.land = 0;
    recycle(id);
    return slot;
  }
  if (r.hdr.flags & kRendezvous) return -1;  // its data is not in the slot: the caller copies it out
  *hdr = r.hdr;
  *peer = r.peer;
  int slot = r.slot;
  recycle(id);  // the arrival stays claimed: release_claimed or unclaim ends it
  return slot;
}

const char* Engine::slot_payload(int peer, int slot) const {
  if (slot <= kLandedSlot) return region_->base() + landed_off(slot) + kPayloadOff;
  return region_->base() + layout_.slot_off(peer, slot) + kPayloadOff;
}

void Engine::unclaim(int peer, uint64_t seq) {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& a : peers_[peer].ready)
    if (a.seq == seq) a.claimed = false;
}

bool Engine::copy_out(uint64_t id, void* dst, Mem mem) {
  std::lock_guard<std::mutex> g(mu_);
  Request& r = get(id);
  if (r.state != ReqState::Matched) throw Error(ErrorKind::Invalid, "recv has no message to copy");
  if (closed_ && (r.hdr.flags & kDevicePayload))
    throw Error(ErrorKind::Closed, "communicator closed before this device message was copied out");
  if (closed_ && (r.hdr.flags & kRendezvous) && !r.land && !(r.own && r.slot < 0))  // its data is still its sender's
    throw Error(ErrorKind::Closed, "communicator closed before this message was copied out of its sender");
  Peer& p = peers_[r.peer];
  if (r.land) {  // landed in a block of ours
    const char* src = region_->base() + r.land + kPayloadOff;
    if (mem.device) {
      Transport& t = local_device();
      t.copy_done(t.copy_async(dst, src, r.hdr.nbytes, mem.stream, true), true);  // the block is freed next
    } else {
      std::memcpy(dst, src, r.hdr.nbytes);
    }
    land_unref(r.land);
    recycle(id);
    return true;
  }
  if (r.own && r.slot < 0) {  // taken early (progress_recvs): the data is ours already
    if (mem.device)
      local_device().copy_async(dst, r.own.get(), r.hdr.nbytes, mem.stream, true);
    else
      std::memcpy(dst, r.own.get(), r.hdr.nbytes);
    recycle(id);
    return true;
  }
  for (auto a = p.ready.begin(); a != p.ready.end(); ++a)
    if (a->seq == r.hdr.seq) {
      p.ready.erase(a);
      break;
    }
  std::string why;
  int got = consume(r.peer, r.slot, r.hdr, dst, mem, id, &why);
  if (got < 0) {
    int peer = r.peer;
    recycle(id);
    fail_peer(peer, why);
    throw Error(ErrorKind::PeerFailure, "recv from " + peer_str(peer) + " failed: " + peers_[peer].dead, peer);
  }
  if (got == 0) {
    r.state = ReqState::Streaming;
    r.out = dst;
    r.copied = true;
    return false;
  }
  recycle(id);
  return true;
}

void Engine::release(uint64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  Request& r = get(id);
  if (r.state != ReqState::Matched) throw Error(ErrorKind::Invalid, "recv has no message to release");
  release_locked(id);
}

void Engine::release_locked(uint64_t id) {
  Request& r = reqs_[uint32_t(id)];
  if (r.land) land_unref(r.land);
  if (r.land || (r.own && r.slot < 0)) {  // landed or taken early: no slot to give back
    recycle(id);
    return;
  }
  Peer& p = peers_[r.peer];
  uint64_t seq = r.hdr.seq;
  for (auto a = p.ready.begin(); a != p.ready.end(); ++a)
    if (a->seq == seq) {
      p.ready.erase(a);
      break;
    }
  if (!closed_) {
    if ((r.hdr.flags & kDevicePayload) && p.tdev && p.dead.empty())
      // Dropped unread: the sender's copy into the slot may still be in
      // flight, so the credit goes back only after its data flag (n = 0).
      p.tdev->read_and_free_async(r.peer, layout_.slot_off(r.peer, r.slot) + kPayloadOff, nullptr, 0, seq,
                                  p.layout.credit_off(rank_, r.slot), 0);
    else
      free_slot(r.peer, r.slot, seq);
  }
  recycle(id);
}

Engine::Cancelled Engine::cancel(uint64_t id, bool report) {
  std::lock_guard<std::mutex> g(mu_);
  Request& r = get(id);
  Peer& p = peers_[r.peer];
  if (r.state == ReqState::Queued) {
    p.sendq.erase(std::find(p.sendq.begin(), p.sendq.end(), id));
    sending_--;
  } else if (r.state == ReqState::Posted) {
    p.posted.erase(std::find(p.posted.begin(), p.posted.end(), id));
  } else if (r.state == ReqState::Matched) {
    // Matched but unread: put the message back for the next receive (one
    // taken early into memory of its own cannot go back, and is dropped).
    for (auto& a : p.ready)
      if (a.seq == r.hdr.seq) a.claimed = false;
    if (r.land) {  // landed: its block waits in p.returned
      auto at = std::find_if(p.returned.begin(), p.returned.end(),
                             [&](const Peer::Returned& x) { return x.hdr.seq > r.hdr.seq; });
      p.returned.insert(at, {r.hdr, r.land});
      r.land = 0;
    }
  } else if (r.state == ReqState::Streaming) {
    // Part of its data is in the caller's buffer: the rest is dropped as it
    // arrives (never written there), and the pair goes on.
    for (auto& kv : p.streams)
      if (kv.second.id == id) kv.second.id = 0, kv.second.dst = nullptr;
  } else if (r.state != ReqState::InFlight) {
    // Done or failed already: nothing to give up, but nobody will read it.
    recycle(id);
    return Cancelled::kDropped;
  } else {
    // In flight: the transport still reads the source; finish in the background.
    if (closed_) {
      r.detached = true;
      return Cancelled::kDropped;  // the transports are gone: nothing reads the source any more
    }
    Cancelled how = Cancelled::kKept;
    if (r.rndv && !r.own) {
      how = move_rendezvous(id);
      if (how == Cancelled::kCompleted || how == Cancelled::kDropped) {  // received, or its peer failed
        recycle(id);
        return how;
      }
    }
    r.detached = true;
    // Moved: the caller's buffer is free, nothing of it needs keeping.
    r.reported = report && how == Cancelled::kKept;
    return r.reported ? Cancelled::kKept : how == Cancelled::kMoved ? Cancelled::kMoved : Cancelled::kDropped;
  }
  recycle(id);
  return Cancelled::kDropped;
}

bool Engine::detach(uint64_t id, bool report) {
  std::lock_guard<std::mutex> g(mu_);
  uint32_t idx = uint32_t(id);
  if (idx >= reqs_.size() || reqs_[idx].gen != uint32_t(id >> 32)) return false;
  Request& r = reqs_[idx];
  switch (r.state) {
    case ReqState::Free:
      return false;
    case ReqState::Done:
    case ReqState::Failed:
      recycle(id);
      return false;
    case ReqState::Matched:
      release_locked(id);
      return false;
    default:
      r.detached = true;
      // Closed: the transports are gone, nothing touches the buffer any more.
      r.reported = report && !closed_;
      return r.reported;
  }
}

void Engine::take_recycled(std::vector<uint64_t>& ids) {
  std::lock_guard<std::mutex> g(mu_);
  ids.swap(recycled_);
  recycled_.clear();
}

}  // namespace varcomm
