// The protocol engine: slots, sequence numbers, credits, matching, waits and
// errors, over any Transport. One Engine per communicator.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <tuple>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "errors.h"
#include "options.h"
#include "protocol.h"
#include "region.h"
#include "transport.h"

namespace varcomm {

// Header of a matched message as seen by the caller.
struct MsgInfo {
  int src = -1;
  int64_t tag = 0;
  uint64_t nbytes = 0;
  uint32_t dtype = 0;
  std::vector<int64_t> shape;
  uint64_t flags = 0;  // kDevicePayload: the payload is in device memory; kDescriptor: no payload
};

enum class ReqKind : uint8_t { Send, Recv };

// Where a request's buffer lives: host memory, or device memory ordered on a
// CUDA stream (an opaque handle; the core never calls CUDA itself).
struct Mem {
  bool device = false;
  uintptr_t stream = 0;
};
// Streaming: a recv whose rendezvous data arrives in chunks (protocol.h kChunk).
enum class ReqState : uint8_t { Free, Queued, InFlight, Posted, Matched, Streaming, Done, Failed };

struct Request {
  ReqKind kind = ReqKind::Send;
  ReqState state = ReqState::Free;
  uint32_t gen = 0;
  int peer = -1;
  int64_t tag = 0;
  // send
  const void* data = nullptr;
  uint64_t nbytes = 0;
  uint32_t dtype = 0;
  uint32_t ndim = 0;
  int64_t shape[kMaxDims] = {};
  uint64_t ticket = 0;
  uint64_t hflags = 0;  // header flags the sender sets (kDescriptor, the array kind)
  Mem mem;
  // rendezvous send (protocol.h kRendezvous): the head's slot and seq, once
  // written; then, when the receiver asks for a stream, bytes written as
  // chunks and the chunk writes the transport still reads
  bool rndv = false;
  bool streaming = false;
  int head_slot = -1;
  uint64_t head_seq = 0;
  uint64_t sent = 0;
  std::vector<uint64_t> tickets;
  // A held chunk its receiver asked us to write into its output (kRawCredit):
  // 0 not yet, kPushWritten (our part is done), kPushRefused (it reads it).
  uint8_t push = 0;
  // The data, copied, once the caller stopped waiting (Engine::move_rendezvous):
  // `data` points here then, and the caller's buffer is the caller's again.
  std::unique_ptr<char[]> own;
  // A device send's copy made when it had to wait for a slot (Transport::
  // stage_async): `data` points here until it is written, then it is freed.
  void* staged = nullptr;
  // recv
  void* out = nullptr;  // nullptr: caller allocates after the match
  uint64_t out_cap = 0;
  uint32_t out_dtype = 0;
  int slot = -1;
  // A rendezvous message landed in this landing block (kPushCredit): the
  // result is there, at + kPayloadOff, until copy_out, release or a loan.
  size_t land = 0;
  MsgHeader hdr{};
  // failure
  ErrorKind err = ErrorKind::None;
  std::string error;
  bool detached = false;  // nobody will wait: recycle when terminal
  bool reported = false;  // detached with a buffer kept alive by the caller: report its recycling
  bool copied = false;    // a recv streaming into copy_out's dst: recycled when waited
  // A rendezvous head that the receiver can copy straight out of its sender
  // (CMA) waits matched until copy_out names where: an all-to-all places its
  // output once every count is in, and the one copy goes there.
  bool hold = false;
  // Its output will be device memory (known to the caller, not yet placed):
  // a head over our bound cannot be pulled through a slot into it, so it
  // takes the host path (landing block or memory of its own) first.
  bool hold_device = false;
};

class Engine {
 public:
  Engine(int rank, int world, const Options& opt);
  ~Engine();

  int rank() const { return rank_; }
  int world() const { return world_; }
  const Layout& layout() const { return layout_; }
  Region& region() { return *region_; }
  const Options& options() const { return opt_; }

  // Set-up: csrc/routes.cpp (Setup) chooses and connects each peer's transport.
  void set_transport(int peer, std::shared_ptr<Transport> t, const Layout& peer_layout);
  // A second transport for device-memory messages to the same peer (nvlink).
  void set_device_transport(int peer, std::shared_ptr<Transport> t);
  std::string transport_describe(int peer) const;
  std::map<std::string, std::string> transport_properties(int peer) const;
  void connected();

  // Requests; ids encode (index, generation) so stale ids are rejected.
  // array: the sender's array kind for the header (protocol.h, kArrayShift).
  // A host message over the receiver's bound (or over Options::eager_max
  // where the pair copies once) goes by rendezvous (protocol.h kRendezvous);
  // `eager`: a collective's chunk (the receive is held until the caller
  // places its output), by rendezvous only where the receiver copies
  // straight out of us (Engine::rendezvous), or over the receiver's bound.
  // `pull`: held, it may go by rendezvous at all (false: a device chunk
  // staged through host memory, whose receiver would free the head only once
  // its stream copied it on; over the bound it is MessageTooLarge).
  // `waited`: the caller blocks until it is written (a blocking send), so a
  // device send that must wait for a slot needs no copy of its source.
  uint64_t isend(int peer, int64_t tag, const void* data, uint64_t nbytes, uint32_t dtype,
                 const int64_t* shape, uint32_t ndim, Mem mem = {}, uint32_t array = 0, bool eager = false,
                 bool pull = true, uint64_t flags = 0, bool waited = false);
  // A descriptor message (kDescriptor): the header alone, describing `nbytes`
  // of data that is not in it, so `nbytes` is not held to the bound.
  uint64_t isend_descriptor(int peer, int64_t tag, uint64_t nbytes, uint32_t dtype, const int64_t* shape,
                            uint32_t ndim, uint64_t flags = 0);
  uint64_t irecv(int peer, int64_t tag, void* out, uint64_t out_cap, uint32_t out_dtype, Mem mem = {},
                 bool hold = false, bool hold_device = false);
  // Blocks (without the GIL; the binding layer slices it) until done, failed
  // or `deadline`. Returns true when terminal. Throws on failure.
  bool wait(uint64_t id, std::chrono::steady_clock::time_point deadline);
  // Request-free fast paths for blocking calls (the ping-pong case).
  // send_now: 0 when it cannot take the shortcut (a send queued ahead, no free
  // slot): nothing was written, post an isend. kSentDone when complete. Else
  // the id of a request to wait on (written, transport still reading source).
  static constexpr uint64_t kSentDone = 1;
  uint64_t send_now(int peer, int64_t tag, const void* data, uint64_t nbytes, uint32_t dtype, const int64_t* shape,
                    uint32_t ndim, Mem mem = {}, uint32_t array = 0);
  // Blocks until a message from `peer` with `tag` is copied into out (1), or
  // the deadline passes (0); -1 at once when irecvs from `peer` are posted
  // (FIFO: the caller must queue an irecv behind them).
  // With `claim` set (and no out), the message is claimed instead, as an
  // irecv without out is matched: *claim is its slot; then consume_claimed()
  // copies it out and frees the slot, or unclaim() gives it back.
  int recv_direct(int peer, int64_t tag, void* out, uint64_t out_cap, uint32_t out_dtype, MsgHeader* hdr,
                   std::chrono::steady_clock::time_point deadline, Mem mem = {}, int* claim = nullptr);
  void consume_claimed(int peer, int slot, const MsgHeader& hdr, void* dst);
  void unclaim(int peer, uint64_t seq);
  // A claimed message read in place (copy=False) is done with: free its slot.
  // After close() it does nothing. A slot <= kLandedSlot names a landing block
  // instead (take_claim, landing_buffer): its reference is dropped.
  void release_claimed(int peer, int slot, uint64_t seq);
  static constexpr int kLandedSlot = -2;
  static int landed_slot(size_t off) { return kLandedSlot - int(off >> 12); }
  static size_t landed_off(int slot) { return size_t(kLandedSlot - slot) << 12; }
  // A receive buffer of nbytes in this rank's landing area (comm.empty): a
  // rendezvous message received into it is written there by its sender, the
  // one copy. Returns its slot code for slot_payload/release_claimed (the
  // caller holds one reference), or 0 when the area has no room, or when
  // lend_cap is set and the blocks lent this way would then hold more than
  // lend_cap bytes. The cap counts lent blocks only, not the transient ones
  // that messages land in, so whether a collective's output is lent does not
  // depend on how far its peers' chunks have got.
  int landing_buffer(uint64_t nbytes, uint64_t lend_cap = 0);
  // Whether matched recv `id` landed in a landing block (take_claim lends it).
  bool landed(uint64_t id) {
    std::lock_guard<std::mutex> g(mu_);
    return get(id).land != 0;
  }
  // (bytes free, blocks in use, bytes lent by landing_buffer) of the landing area.
  std::tuple<uint64_t, uint64_t, uint64_t> landing_stats();
  // A recv matched without out becomes a claim on its slot (returned, its
  // header in *hdr, its sender in *peer) and the request is recycled; release_claimed ends it.
  // Host payloads only (device messages and descriptors are refused).
  int take_claim(uint64_t id, MsgHeader* hdr, int* peer);
  // Where a claimed message's payload is in our region (or a landing block's, slot <= kLandedSlot).
  const char* slot_payload(int peer, int slot) const;
  bool test(uint64_t id);
  // Throws the request's error where it failed (its peer is looked at, at
  // most every kPeerCheck), recycling it as wait() does; else nothing.
  void raise_if_failed(uint64_t id);
  // Drive every transport once (waits outside the engine, e.g. store barriers,
  // call this so incoming writes and held credits keep moving).
  void progress();
  // Empty while `peer` is usable, else why not (asks the transport now).
  std::string peer_error(int peer);
  // A recv matched without an output buffer: its header, then copy or view.
  MsgInfo info(uint64_t id);
  // A receive's timeout text when nothing came: "; nothing arrived (...)",
  // naming the slots of peer's this rank still holds.
  std::string nothing_arrived(int peer);
  // Tags of the messages from `peer` that arrived and match no receive (each once per message).
  std::vector<int64_t> unreceived_tags(int peer);
  // Copies the payload and frees the slot: true. False when the message is a
  // rendezvous whose data streams in (protocol.h kChunk): wait(id) then.
  bool copy_out(uint64_t id, void* dst, Mem mem = {});
  void release(uint64_t id);  // drop the matched message unread
  // Give up on a request that has not started (send not written, recv not
  // matched): nothing is half-written and no message is lost. A send the
  // transport still reads (in flight) goes on detached: true then, and with
  // `report` its id comes back from take_recycled() once the engine is done
  // with its buffer (as for detach), so the caller keeps the buffer until then.
  // kKept: detached with `report`; kMoved: a rendezvous send's data was
  // copied (Engine::move_rendezvous), nothing of the caller's needs keeping;
  // kCompleted: it completed meanwhile; kDropped: nothing left in flight.
  enum class Cancelled { kDropped, kKept, kMoved, kCompleted };
  Cancelled cancel(uint64_t id, bool report = false);
  // The caller stops waiting for send `id`, whose message must still go: a
  // rendezvous whose head is out moves its data into memory of the core's
  // own (its receiver copies from there) and goes on detached; true then, and
  // the caller's buffer is its own again. False: wait on (not written yet, not
  // a rendezvous, or completed or failed meanwhile).
  bool let_go(uint64_t id);
  // The same for a send not written yet (queued) of host memory: its data is
  // copied into memory of the core's own, which it is sent from later; true
  // then. False: not queued, device memory, or its own already.
  bool own_queued(uint64_t id);
  // Why `id` timed out, for the TimeoutError (and its peer); the caller cancels it.
  std::string timeout_message(uint64_t id, double seconds, int* peer);
  // The caller drops it: finish in the background, recycle. True when it goes
  // on (the engine still touches its buffer); with `report`, its id then comes
  // back from take_recycled() once the engine is done with that buffer, so the
  // caller knows when it may let the buffer go. False: done with it already.
  bool detach(uint64_t id, bool report = false);
  // A blocking receive into `out` timed out: was it waiting for a given-up
  // receive's landing into out (a comm.empty buffer) rather than a message?
  bool out_unsettled(const void* out, Mem mem);
  static std::string unsettled_text();
  // Ids of reported detached requests recycled since the last call.
  void take_recycled(std::vector<uint64_t>& ids);
  // Drives every transport once; the peers whose queued or in-flight sends
  // are not done yet (close() flushes until none, or its deadline).
  std::vector<int> unflushed();
  // This rank is closing: each connected peer gets a kGoodbye after what was
  // sent to it before (written by this call, unflushed() or progress() once
  // that has gone out; never while the peer's ring is full), so its
  // receives from us fail at once. Best effort: one that is never written
  // leaves the peer to notice our exit, as before. failing: this process
  // is exiting after an uncaught exception (the peers' errors say so).
  void goodbye(bool failing = false);
  // Bytes with no memory behind them: a pointer into the first 64 KiB, which
  // Linux never maps (vm.mmap_min_addr). torch's efficient zero tensor has
  // data_ptr 0, and a view of one a small offset from 0.
  static bool no_memory(const void* p, uint64_t nbytes) { return nbytes && reinterpret_cast<uintptr_t>(p) < 65536; }
  // Every request not complete fails with ClosedError; a recv whose message
  // arrived keeps it, a completed one stays completed.
  void close();
  // The per-pair tags every header carries (routes.cpp, pair_tag): `out` on
  // what we write to `peer`, `in` on what it writes to us. Set before traffic.
  void set_pair_tags(int peer, uint64_t out, uint64_t in);
  // Headers discarded because their pair tag was wrong (forged or stray
  // writes into our region), since init.
  uint64_t forged_headers();
  // Bytes this rank copied straight out of its peers' memory (single-copy
  // reads: rendezvous messages and collective chunks), since init.
  uint64_t pulled_bytes() {
    std::lock_guard<std::mutex> g(mu_);
    return pulled_;
  }
  // Bytes of collective chunks this rank's peers wrote straight into its
  // outputs in the landing area (protocol.h kRawCredit), since init.
  uint64_t pushed_bytes() {
    std::lock_guard<std::mutex> g(mu_);
    return pushed_;
  }
  // Bytes from which a collective's host output is placed in the landing
  // area (0: never), for torch outputs or others.
  uint64_t landed_output_min(bool torch);
  // Whether device-memory messages to and from `peer` travel GPU to GPU (a
  // device transport connects the pair); else they are staged through host memory.
  bool device_route(int peer) {
    std::lock_guard<std::mutex> g(mu_);
    return bool(peers_.at(peer).tdev);
  }
  // A copy from src to dst (device or host memory) on mem.stream, through
  // this rank's local device transport: an all-to-all's chunk to itself.
  void copy_local(void* dst, const void* src, uint64_t n, Mem mem);
  // The device transport that makes this rank's local copies (any of them
  // can, whatever route the pair to itself has); `why_none` says why there
  // is none, for the error when one is needed.
  void set_local_device(std::shared_ptr<Transport> t, const std::string& why_none);
  // The receive bound of `peer` (what a message to it may carry).
  uint64_t peer_bound(int peer) const { return peers_.at(peer).layout.bound; }
  // MessageTooLarge for a message of nbytes over peer's bound (held to it:
  // device memory, or a two-phase collective's payload).
  Error over_bound(int peer, uint64_t nbytes, bool device) const;
  // Whether a message of nbytes is over this rank's Options::max_message
  // (refused whatever the receiver's bound), and that MessageTooLarge.
  bool over_max_message(uint64_t nbytes) const { return opt_.max_message && nbytes > opt_.max_message; }
  Error max_message_error(int peer, uint64_t nbytes) const;
  // The largest message a send to `peer` may carry: a device payload goes
  // into one slot (its bound); host memory is held only to Options::max_message.
  uint64_t send_limit(int peer, bool device) const;
  // Collective number n of this communicator (every rank calls collectives
  // in the same order, so n names the same collective everywhere).
  uint64_t next_collective() { return coll_seq_.fetch_add(1); }
  // Collectives started (or refused) so far: a call that fails before it
  // took its number must refuse, so the ranks stay in step (AllToAll::refuse).
  uint64_t collectives() const { return coll_seq_.load(); }

 private:
  Request& get(uint64_t id);
  uint64_t alloc(ReqKind kind);
  void recycle(uint64_t id);
  void progress_locked();
  // Every peer's queued sends (a blocking receive's turn to move them); caller holds mu_.
  void drive_sends();
  // write=false: only completions and answers of what is already written;
  // a queued send stays queued (check_goodbye: its receiver closed).
  void progress_sends(int peer, bool write = true);
  void progress_recvs(int peer);
  bool try_write(int peer, Request& r);
  void free_slot(int peer, int slot, uint64_t seq);
  // Frees the slots of staged copies that ran (`wait`: waits for each).
  void free_staged(bool wait);
  void check_peer(int peer, bool force);
  void fail_peer(int peer, const std::string& why);
  void fail_request(uint64_t id, ErrorKind kind, const std::string& why);
  void fail_queue(std::deque<uint64_t>& q, ErrorKind kind, const std::string& why);
  void throw_if_failed(Request& r, uint64_t id);
  void release_locked(uint64_t id);
  // Rendezvous ownership (protocol.h kRvStateOff).
  enum class Await { kAnswered, kGone, kLate };
  uint64_t* rv_word_at(int peer, int slot, size_t off);
  uint64_t claim_source(int peer, int slot, const MsgHeader& h);
  void fail_claim(int peer, int slot, uint64_t seq);
  Await await_head_credit(uint64_t id, std::chrono::steady_clock::time_point deadline, std::string* why);
  Cancelled move_rendezvous(uint64_t id);
  void withdraw_heads(int peer);
  void try_goodbye(int peer);
  // Notices what arrived from `peer` and moves it to p.ready in seq order.
  void deliver(int peer);
  void check_goodbye(int peer);
  std::string copy_failed_text(int peer, uint64_t nbytes) const;
  void check_send(int peer, uint64_t nbytes, uint32_t ndim, Mem mem, bool eager = false, bool pull = true);
  void check_fits(int peer, const Transport& t, const Layout& pl) const;
  uint64_t queue_send(int peer, int64_t tag, const void* data, uint64_t nbytes, uint32_t dtype, const int64_t* shape,
                      uint32_t ndim, Mem mem, uint64_t hflags, bool rndv);
  // 1: message copied into out; 0: none yet; throws when it does not fit.
  int match_direct(int peer, int64_t tag, void* out, uint64_t out_cap, uint32_t out_dtype, MsgHeader* hdr,
                   Mem mem, int* claim);
  // Empty when a message fits a recv's out; else why not (and *kind).
  // (device: out is device memory.)
  std::string misfit(int peer, const MsgHeader& h, uint64_t out_cap, uint32_t out_dtype, ErrorKind* kind,
                     bool device = false);
  // False, with the peer failed, when a header it wrote cannot be trusted.
  bool sane(int peer, const MsgHeader& h, uint64_t seq);
  // An arrival in slot k whose header has the wrong pair tag: not delivered.
  void discard_forged(int peer, int k, uint64_t ready);
  // Copy a message out of our slot (or, a rendezvous, out of the sender's
  // memory) into dst and give the slot back: 1. 0: a rendezvous whose data
  // now streams into dst for request `id`. -1: the copy failed, *why says why
  // (the caller fails the peer).
  int consume(int peer, int slot, const MsgHeader& h, void* dst, Mem mem, uint64_t id = 0, std::string* why = nullptr);
  // A receive into device memory whose stream the device transport refuses
  // (being captured, another GPU's) or that has no device route: throws
  // Invalid before the message is claimed or taken off p.ready (it stays for
  // the next receive; nothing was pulled, counted or credited).
  void refuse_device_recv(int peer, const MsgHeader& h, Mem mem);
  // A rendezvous head this rank cannot copy from the sender itself: its data
  // must stream in, which needs a request (the request-free paths step aside).
  bool streams_in(int peer, const MsgHeader& h) const;
  // Route arrived kChunk messages into their streams.
  bool route_chunks(int peer);
  void fail_streams(int peer, ErrorKind kind, const std::string& why);
  // The landing area (protocol.h kPushCredit): blocks of whole pages, the
  // lowest free fit first so the same few stay hot in cache; each counts its
  // references (a result or loan, a landing still to come). 0: no room.
  size_t land_alloc(uint64_t nbytes);
  void land_unref(size_t off);
  // The landing block whose payload holds p (p anywhere in it), or 0.
  size_t block_holding(const void* p) const;
  // The landing block whose payload starts at dst and holds nbytes, or 0.
  size_t landing_block(const void* dst, uint64_t nbytes) const;
  // False for an out that a given-up receive's landing may still write (a
  // comm.empty buffer whose block is pending), after progress; why, for the error.
  bool out_settled(const void* out, Mem mem);
  // Receiver: asks rendezvous head h's sender to write the data into a
  // landing block (a new one, or `block`, dst's own) for request id: true,
  // with the landing registered as a stream (dst: where the data goes once
  // landed; nullptr: the request's result stays in the block). False: no room,
  // or the pair cannot land.
  bool try_land(int peer, int slot, const MsgHeader& h, uint64_t id, char* dst, size_t block = 0);
  // Completes the landings from `peer` that arrived; false when the peer failed.
  bool check_landings(int peer);
  // Whether a send of nbytes to peer goes by rendezvous (protocol.h kRendezvous).
  // `held`: a collective's chunk (isend's `eager`).
  bool rendezvous(int peer, uint64_t nbytes, Mem mem, bool held = false) const;
  // Receiver: asks the sender of held chunk h to write it into dst, which
  // lies in a landing block of ours (kRawCredit); false where it cannot.
  bool offer_push(int peer, int slot, const MsgHeader& h, uint64_t id, char* dst);
  // Receiver: the landing block holding [d, d + n), or 0.
  size_t block_holding(const char* d, uint64_t n) const;
  // Sender: the receiver asked for r's data at its region's offset raw_off(c):
  // sets r.push. False when that made us fail the pair.
  static constexpr uint8_t kPushWritten = 1, kPushRefused = 2;
  // A collective's chunk from this size goes by rendezvous where CMA is allowed only for chunks (rendezvous()).
  static constexpr uint64_t kChunkPull = 128 << 10;
  bool push_raw(int peer, Request& r, uint64_t c);
  // Receiver: a raw push's landing block is settled (written, or revoked).
  void raw_settled(size_t blk);
  // Whether a collective's chunks from peer are copied once, by peer into
  // an output in our landing area (offer_push) or else by us out of peer's
  // memory: CMA is allowed (even where the set-up probe prefers two memcpys
  // for point-to-point: it copies 4 MiB in cache, while chunks cycle through
  // slots and outputs far larger than the cache).
  bool pulls_held(int peer) const {
    const Peer& p = peers_[peer];
    return p.pulls || p.pulls_chunks;
  }
  // A host rendezvous message's data is read by us out of peer's memory (CMA):
  // where the pair pulls, or where CMA is allowed and its sender's slot writes
  // are slow right now (protocol.h kSlowSlots: one CMA read then beats a slow
  // copy in and a copy out). Else it streams through the slots.
  bool pulls_message(int peer, const MsgHeader& h) const {
    const Peer& p = peers_[peer];
    return p.pulls || (p.pulls_chunks && (h.flags & kSlowSlots));
  }
  Transport& device_transport(int peer);
  Transport& local_device();
  template <class F>
  bool spin(F&& done, std::chrono::steady_clock::time_point deadline);

  struct Arrival {
    uint64_t seq;
    int slot;
    bool claimed;
  };
  struct Peer {
    std::shared_ptr<Transport> t;
    std::shared_ptr<Transport> tdev;  // device-memory messages, when the pair has one
    Layout layout;  // the peer's region layout (where we write)
    // this rank as sender to peer
    uint64_t next_seq = 1;
    std::vector<uint64_t> written;  // seq last written per slot of the peer's ring
    int next_slot = 0;
    std::deque<uint64_t> sendq;     // queued or in-flight sends, FIFO
    // this rank as receiver from peer
    std::vector<uint64_t> seen;     // ready value already noticed per slot
    std::vector<Arrival> early;     // arrived ahead of a gap (unordered providers)
    std::deque<Arrival> ready;      // deliverable, in seq order
    uint64_t next_deliver = 1;
    std::deque<uint64_t> posted;    // recvs in posting order
    std::string dead;               // why the peer is unusable, empty while fine
    // kGoodbye (Engine::goodbye): ours to write (kByeWanted), written with
    // bye_ticket still in flight (kByeWritten), done; and whether the
    // peer's arrived (its posted recvs fail once nothing streams in).
    uint8_t bye = 0;
    uint64_t bye_ticket = 0;
    bool bye_seen = false;
    bool bye_failing = false;  // its goodbye said it exits after an uncaught exception
    std::chrono::steady_clock::time_point last_check{};
    int64_t next_send_check = 0;  // coarse_ns() at which a send next looks at the peer (check_send)
    uint64_t auth_out = 0, auth_in = 0;  // pair tags (set_pair_tags)
    uint64_t forged = 0;                 // discarded arrivals with a wrong tag
    // rendezvous messages from peer streaming in, by head seq: the request
    // (0: given up, the rest is dropped), where the bytes go, how far
    struct Stream {
      uint64_t id;
      char* dst;
      uint64_t got, total;
      size_t landing = 0;  // the landing block the sender writes it into (kPushCredit), else chunks
      int slot = -1;       // a landing's head slot (its rendezvous word says whether the sender withdrew)
      // A held chunk its sender writes straight into dst (kRawCredit): the
      // landing block dst is in (referenced until then), where to read it
      // from ourselves if the sender is late (kPushGrace), and since when.
      size_t raw = 0;
      uint64_t src = 0;
      std::chrono::steady_clock::time_point asked{};
    };
    std::map<uint64_t, Stream> streams;
    // Landed messages a receive matched and then gave back (cancel: its
    // caller refused it, e.g. an array kind that cannot hold the dtype), in
    // seq order: a landed message has no slot to go back to, so the next
    // receive with its tag takes it from here (take_returned), in turn with
    // the arrivals.
    struct Returned {
      MsgHeader hdr;
      size_t land;
    };
    std::deque<Returned> returned;
    bool pulls = false;  // this rank can copy straight out of peer's memory (Transport::read_refused)
    bool pulls_chunks = false;  // the same for a collective's chunks (chunk_read_refused)
    uint64_t lands = 0;  // Transport::landing_write_max: the largest message written into a landing area
  };
  // Receiver: a raw push that is done (or revoked and copied here); false
  // while it is pending. Sets *failed where the CMA read failed.
  bool push_settled(int peer, uint64_t seq, Peer::Stream& st, std::string* failed);
  // Receiver: a pending raw push given up on with its pair (close, failure).
  void drop_raw(int peer, uint64_t seq, Peer::Stream& st);
  // Receiver: a landing (kPushCredit) whose sender will not write: its block's
  // pending mark and the stream's reference go.
  void drop_landing(Peer::Stream& st);
  std::string nothing_arrived_locked(int peer);
  std::vector<int64_t> unreceived_tags_locked(int peer);
  // Posted receive `id` takes a given-back landed message (Peer::returned).
  void take_returned(int peer, uint64_t id, std::deque<Peer::Returned>::iterator ret);

  int rank_, world_;
  Options opt_;
  Layout layout_;
  std::unique_ptr<Region> region_;
  std::vector<Peer> peers_;
  std::vector<std::shared_ptr<Transport>> transports_;  // distinct, for progress
  std::shared_ptr<Transport> local_dev_;  // set_local_device
  // Staged messages copied into device memory on a stream: each slot is
  // freed once its copy's mark (Transport::copy_async) says the copy ran.
  struct Staged {
    std::shared_ptr<Transport> t;
    uintptr_t mark;
    int peer, slot;
    uint64_t seq;
  };
  std::vector<Staged> staged_;
  std::string no_local_dev_ = "no GPU transport was opened";
  std::vector<Request> reqs_;
  std::vector<uint32_t> free_reqs_;
  std::vector<uint64_t> recycled_;  // reported detached requests recycled, for take_recycled
  // Sends in every sendq: a blocking recv drives them only when there are any.
  size_t sending_ = 0;
  Request scratch_;              // send_now's request, never queued
  int byes_wanted_ = 0;          // peers whose kGoodbye is still to be written
  bool leaving_ = false;         // goodbye() was called: close() follows
  bool failing_ = false;         // ... at an exit after an uncaught exception (kByeFailing in our goodbyes)
  std::mutex mu_;
  bool closed_ = false;
  std::atomic<uint64_t> coll_seq_{0};
  uint64_t forged_ = 0;
  uint64_t pulled_ = 0;
  uint64_t pushed_ = 0;
  // Copies of rendezvous data a receiver claimed and had not answered when
  // this rank let go of the send (Engine::withdraw_heads): it may still read
  // them, so they live as long as the engine.
  std::vector<std::unique_ptr<char[]>> graveyard_;
  struct Block {
    size_t len;
    int refs;
    bool pending;  // a landing into it is still to come
    bool lent;     // made by landing_buffer: counted in land_lent_
    int raw = 0;   // held chunks its senders were asked to write into it (kRawCredit), not yet settled
  };
  uint64_t land_lent_ = 0;
  std::map<size_t, size_t> land_free_;  // offset -> bytes
  std::map<size_t, Block> land_used_;
};

}  // namespace varcomm
