// What a transport must provide; everything else (slots, headers, sequence
// numbers, credits, ordering, errors) lives in the Engine above it.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>

namespace varcomm {

class Transport {
 public:
  virtual ~Transport() = default;
  virtual std::string name() const = 0;
  // Why this transport was chosen / how it is configured; shown by transport_for().
  virtual std::string describe() const { return name(); }
  // The same facts as describe(), as key/value pairs for programs (benchmarks
  // pick their raw baseline from them): never parse describe() text.
  virtual std::map<std::string, std::string> properties() const { return {}; }

  // Make the local region [base, base+size) writable by peers; returns an
  // opaque descriptor that peers pass to connect(). Called once.
  virtual std::string expose(void* base, size_t size) = 0;
  // Import a peer's descriptor so write_*(peer, ...) can reach its region.
  virtual void connect(int peer, const std::string& descriptor) = 0;
  // Bytes of `peer`'s region that connect() mapped or was told are
  // registered: the engine holds the peer's published layout to it once, so
  // no write goes past it (SIZE_MAX: the transport checks each write itself).
  virtual size_t peer_bytes(int /*peer*/) const { return SIZE_MAX; }
  // Every peer has connected to us: drop set-up state (e.g. close segment fds).
  virtual void connected() {}

  // Copy hdr (hdr_len bytes) then payload (n bytes) to peer region offset
  // `ready_off + kHeaderOff` (contiguous), and make the receiver's ready word at
  // `ready_off` equal to `seq` only once both are visible there. A transport
  // whose completions carry an immediate sends `ready_off >> 8` (slot offsets
  // are 256-aligned, so 32 bits cover a 1 TiB region) and the receiver's
  // progress() stores the landed header's seq into the ready word.
  // Returns 0 when no send resources are free (the caller retries after
  // progress()), else a ticket: the source buffers may be reused once
  // complete(peer, ticket) is true.
  virtual uint64_t write_message(int peer, size_t ready_off, const void* hdr, size_t hdr_len,
                                 const void* payload, size_t n, uint64_t seq) = 0;
  virtual bool complete(int /*peer*/, uint64_t /*ticket*/) { return true; }
  // Nothing this transport accepted for `peer` is still waiting to go out
  // (a device transport whose sends complete at enqueue, stream-ordered, may
  // still hold their data: close() keeps flushing until this is true).
  virtual bool flushed(int /*peer*/) { return true; }
  // close(): lets the work this transport put on callers' streams for
  // messages already sent or received (copies into a peer's memory, flags,
  // credits) run before the communicator goes, until `deadline`; the caller
  // may exit right after, and a dead process's stream work never runs.
  virtual void settle(std::chrono::steady_clock::time_point /*deadline*/) {}
  // One-sided store of an 8-byte value into the peer's region (credits).
  virtual void write_u64(int peer, size_t off, uint64_t value) = 0;
  // Puts the credits write_u64 holds for `peer` on the wire now (a transport
  // that holds them until its next call, rdma, for them to ride along with a
  // reply): the engine asks when the peer may be out of slots.
  virtual void send_credits_now(int /*peer*/) {}
  // A large message that streams through the slots (protocol.h kRendezvous)
  // moves best as a pipeline of chunks of this many bytes: the receiver
  // copies one out of its slot while the next is on the wire (or, on shm,
  // being copied in by the sender); 0: in bound-sized pieces.
  virtual uint64_t stream_chunk() const { return 0; }
  // The largest host message sent eagerly where the pair can copy once (the
  // receiver reads by CMA, or the sender writes into its landing area), when
  // Options::eager_max leaves it to the transport: past it a rendezvous round
  // trip costs less than the copy out of the slot. 256 KiB is where one CMA
  // copy beats two memcpys on shm (bench/results/issue11-2026-12-02-s6.md).
  virtual uint64_t eager_max() const { return 256u << 10; }
  // The largest write_message this transport makes at any 256-aligned offset
  // of the peer's region, not only its slots: where a rendezvous sender may
  // write a message straight into the receiver's landing area (protocol.h
  // kPushCredit). 0: only into slots.
  virtual uint64_t landing_write_max() const { return 0; }
  // Copy n bytes into `peer`'s region at `off` (in its landing area) with
  // ordinary stores, which the caller's next release store to a peer_word()
  // publishes: a collective's chunk written straight into the receiver's
  // output (protocol.h kRawCredit). Only where raw_writes() is true.
  virtual bool raw_writes() const { return false; }
  virtual void write_into(int /*peer*/, size_t /*off*/, const void* /*data*/, size_t /*n*/) {
    throw std::logic_error(name() + " transport cannot write into a peer's region");
  }
  // Single-copy reads of a peer's memory (rendezvous, protocol.h kRendezvous):
  // empty when this rank can copy straight out of `peer`'s address space, else
  // why not (then rendezvous data streams through the slots, unless its
  // head says the sender's slot writes are slow: slot_writes_slow).
  virtual std::string read_refused(int /*peer*/) const { return "this transport has no single-copy read"; }
  // The same for a collective's large chunks (Engine::kChunkPull): empty
  // where single-copy reads of `peer` are allowed at all, even where they
  // lose to two in-cache memcpys (read_refused then says so).
  virtual std::string chunk_read_refused(int peer) const { return read_refused(peer); }
  // This rank's copies into peers' slots are slow right now (shm: the VM
  // spell of csrc/hostmem.h copy_to_peer, measured on recent copies, or
  // shm_stores=streaming): its rendezvous heads ask for a single-copy read
  // where chunk_read_refused allows one (protocol.h kSlowSlots).
  virtual bool slot_writes_slow() const { return false; }
  // Copy n bytes at address `src` of `peer`'s address space into dst; empty
  // when done, else why not (the peer is gone, or the address is not mapped).
  virtual std::string read_peer(int /*peer*/, uint64_t /*src*/, void* /*dst*/, size_t /*n*/) {
    return "this transport has no single-copy read";
  }
  // An 8-byte word of `peer`'s region at `off` that this process shares with
  // it (a mapping both can use atomically: the rendezvous ownership word,
  // protocol.h kRvStateOff), or nullptr. Where read_refused() is empty it is
  // not nullptr.
  virtual uint64_t* peer_word(int /*peer*/, size_t /*off*/) { return nullptr; }
  // Drive completions; a transport whose peers write memory directly does nothing.
  virtual void progress() {}
  // Empty when the peer is reachable; otherwise why not (process gone, link down).
  virtual std::string peer_error(int peer) = 0;
  // Whether the peer's process has exited, so nothing of its can write into
  // our memory any more (peer_error also covers a link down, a failed write:
  // a live peer may still write). False where that cannot be known.
  virtual bool peer_exited(int /*peer*/) { return false; }

  // ---- device memory (GPU transports; see transport/nvlink) ----------------
  // A device transport keeps slot payloads in device memory at the same
  // offsets as the host region, while headers, ready words and credits stay
  // in the host region: the header is visible as soon as a send is enqueued.
  virtual bool device() const { return false; }
  // write_message with `payload` in device memory, ordered on `stream` (the
  // caller's current CUDA stream): the copy, then a data-ready signal for
  // `seq` that the receiver's stream can wait on. The ready word (header
  // visible) is set at once. Returns a ticket as write_message does.
  virtual uint64_t write_message_async(int peer, size_t ready_off, const void* hdr, size_t hdr_len,
                                       const void* payload, size_t n, uint64_t seq, uintptr_t stream) {
    throw std::logic_error(name() + " transport cannot send device memory");
  }
  // Receiver: refuses `stream` for a receive into device memory (it is being
  // captured, or is another GPU's) by throwing Invalid; called before the
  // message is claimed or taken off the ready list, so a refusal consumes nothing.
  virtual void refuse_stream(uintptr_t stream, const char* op) {}
  // Receiver: on `stream`, wait for message `seq`'s data in our own slot at
  // `payload_off` (local region offset), copy n bytes to dst (device or
  // host), then write `seq` to the sender's credit word at `credit_off` of
  // `peer`'s region, all in stream order.
  virtual void read_and_free_async(int peer, size_t payload_off, void* dst, size_t n, uint64_t seq,
                                   size_t credit_off, uintptr_t stream) {
    throw std::logic_error(name() + " transport cannot read device memory");
  }
  // A local copy of n bytes between device and/or host memory (unified
  // addresses) on `stream`, after its earlier work: an all-to-all's chunk to
  // itself, or a staged message moved from a host slot into device memory.
  // With `mark`, returns a mark of the copy (0: nothing to wait for) that
  // copy_done() takes: src may be reused once the copy ran, and the host
  // never blocks on the stream's earlier work meanwhile.
  virtual uintptr_t copy_async(void* dst, const void* src, size_t n, uintptr_t stream, bool mark) {
    throw std::logic_error(name() + " transport cannot copy device memory");
  }
  // Whether the copy a mark stands for ran (`wait`: blocks until it has);
  // once true, the mark is spent.
  virtual bool copy_done(uintptr_t mark, bool wait) { return true; }
  // A device send that must wait for a slot is written later, when the
  // caller's stream may hold later work that changes its source: a copy of
  // its n bytes, made on `stream` now, in memory of the transport's own
  // (stream-ordered), that unstage_async frees on `stream` after the work
  // enqueued so far. nullptr: this transport writes later work in order
  // anyway (the send keeps its source).
  virtual void* stage_async(const void* src, size_t n, uintptr_t stream) { return nullptr; }
  virtual void unstage_async(void* staged, uintptr_t stream) {}
};

}  // namespace varcomm
