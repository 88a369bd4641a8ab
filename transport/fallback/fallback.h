// The fallback transport: the engine's one-sided writes, emulated over a
// two-sided byte mover that lives outside the core (Python threads over a
// torch.distributed gloo group, python/varcomm/fallback.py).
//
// Every rank's region has the same Layout as for shm, and the engine picks
// slots, sequence numbers and credits exactly as for shm. A write becomes an
// op on the peer's outbound FIFO; the mover takes it (next_op), sends its
// fixed-size frame and then its payload, and reports it sent (op_sent). On
// the receiving rank the mover hands each frame to landing(), which checks
// that it names a slot of that peer's ring in our region and fits our bound,
// and gives back where the payload goes: straight into that slot. landed()
// then writes the header and release-stores seq into the slot's ready word,
// as a mapped shm write does. A peer's frames can therefore never make us
// write outside its own ring, nor over a slot we have not freed.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "protocol.h"
#include "region.h"
#include "transport.h"

namespace varcomm {

class FallbackTransport : public Transport {
 public:
  // kind u32, hdr_len u32, off u64, n u64, seq (or credit value) u64, header.
  static constexpr size_t kFrameBytes = 32 + kHeaderBytes;
  enum class Landing { Write, Handled, Bye };

  FallbackTransport(Region& local, const Layout& layout, int rank);

  std::string name() const override { return "fallback"; }
  std::string describe() const override;
  std::string expose(void* base, size_t size) override;
  void connect(int peer, const std::string& descriptor) override;
  uint64_t write_message(int peer, size_t ready_off, const void* hdr, size_t hdr_len, const void* payload, size_t n,
                         uint64_t seq) override;
  bool complete(int peer, uint64_t ticket) override;
  void write_u64(int peer, size_t off, uint64_t value) override;
  std::string peer_error(int peer) override;

  // The peers this rank's mover carries (connected through the fallback).
  std::vector<int> peers();

  // ---- the mover, sending side (one thread per peer) ----------------------
  // Waits until an op for `peer` is queued, copies its frame into `frame`
  // (kFrameBytes) and returns its ticket, with the payload the mover must send
  // after the frame in *payload / *n (n may be 0: frame only). The payload is
  // the sender's buffer, valid until op_sent. Returns 0 when `timeout`
  // passed, -1 when nothing more will go to `peer` (goodbye sent, or failed).
  int64_t next_op(int peer, char* frame, std::chrono::steady_clock::time_point deadline, const void** payload,
                  size_t* n);
  void op_sent(int peer, uint64_t ticket);
  // Sending the op failed (gloo's error, `reason`): the mover no longer reads
  // its buffer, and `peer` is failed.
  void op_failed(int peer, const std::string& reason);
  // The mover lost `peer` while receiving: fail everything with it.
  void fail(int peer, const std::string& reason);

  // ---- the mover, receiving side (one thread per peer) --------------------
  // Checks a frame received from `peer`. Write: receive n payload bytes into
  // *dst (our slot; n may be 0), then call landed(). Handled: a credit, stored.
  // Bye: the peer closed; nothing more comes from it (our goodbye is queued).
  // A frame that is not a valid write from `peer` marks it failed and throws.
  Landing landing(int peer, const char* frame, size_t len, char** dst, size_t* n);
  void landed(int peer);

  // Close: queue a goodbye behind whatever is queued to each peer, so that
  // the peers' receivers end; our senders end once it is sent.
  void shutdown();

 private:
  struct Op {
    uint32_t kind;
    size_t off;
    uint64_t value;  // seq of a write, value of a credit
    const void* payload;
    size_t n;
    uint64_t ticket;
    MsgHeader hdr;
  };
  struct Peer {
    bool connected = false;
    int nslots = 0;  // the peer's ring depth for us: the slots our credit row for it covers
    std::deque<Op> q;
    std::condition_variable cv;
    uint64_t next_ticket = 1;
    uint64_t sent = 0;          // tickets up to this one are sent, FIFO
    bool handed_write = false;  // the mover is reading a sender buffer (an op not yet sent)
    bool bye_queued = false;    // nothing more is queued after our goodbye
    bool bye_sent = false;      // ... and the mover has it: the sender ends
    bool bye_received = false;  // the peer closed (only our goodbye still goes out)
    bool failed = false;        // the connection is lost: the queue is dropped
    std::string error;  // why the peer is unusable (as the engine shows it)
    std::chrono::steady_clock::time_point failed_at{};
    // receiving
    std::vector<uint64_t> landed_seq;  // last seq landed per slot of its ring in our region
    std::vector<uint64_t> freed_seq;   // last seq we credited back per slot
    bool pending = false;              // a write between landing() and landed()
    int pending_slot = -1;
    MsgHeader pending_hdr{};
  };
  Peer& peer_at(int peer);
  void fail_locked(Peer& p, const std::string& why);
  [[noreturn]] void refuse(int peer, Peer& p, const std::string& why);
  void push(Peer& p, Op op);

  Region& local_;
  Layout layout_;
  int rank_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Peer>> peers_;
};

}  // namespace varcomm
