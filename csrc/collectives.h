// The all-to-all exchange engine: one implementation of every all-to-all
// (all_to_all_v, all_to_all_single, all_to_all, moe), over the Engine's
// request API, so it runs over any route the Engine has.
//
// Per collective, every ordered pair of distinct ranks exchanges exactly one
// message (one-phase: each chunk's count, dtype and shape travel in its own
// header) or one descriptor then one payload (two-phase: the conventional
// count-first baseline), on tags of the reserved collective space. A host
// chunk over its receiver's bound goes by rendezvous, like a point-to-point
// message (the bound sizes the eager slots, it is no cap); a device chunk
// over it (GPU slots hold one chunk), or any over it in two-phase, is
// replaced by a descriptor of it (no payload), so the receiver raises
// MessageTooLarge instead of hanging; because every pair still exchanged its
// messages, the communicator stays usable. Errors are raised only once every
// pair's messages were consumed. A rank's chunk to itself is a local copy (on
// the chunk's stream for device memory).
//
// Device memory: every chunk and output carries its Mem (device, stream). A
// device chunk goes GPU to GPU where the pair has a device route (its header
// still travels through host memory at once, so receivers place their output
// without waiting on the GPU), else from its host copy (A2AChunk::host); a
// staged message lands in a device output through Engine::consume.
#pragma once
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine.h"

namespace varcomm {

// Largest user tag a collective accepts (it selects a sub-space of the reserved tags).
constexpr int64_t kMaxCollTag = (int64_t(1) << 20) - 1;

enum class A2AStrategy : int { OnePhase = 0, TwoPhase = 1 };
// Which call this is: it decides how results are laid out and errors worded.
enum class A2AOp : int { V = 0, Single = 1, List = 2 };

// A chunk: what this rank sends to one peer, or what one source sent here.
struct A2AChunk {
  const void* data = nullptr;
  uint64_t nbytes = 0;
  uint32_t dtype = 0;
  uint32_t ndim = 0;
  int64_t shape[kMaxDims] = {};
  Mem mem;
  // A send chunk in device memory: a host copy of it, sent instead to a
  // receiver with no device route (null: none was made; then every receiver
  // of a non-empty chunk must have one).
  const void* host = nullptr;
};

// Where what arrives lands.
//   V, Single: every source's rows back to back in source order, in one buffer
//     (`out`; null: the caller places it once every count is known). Every
//     chunk must have `dtype` and rows of `trailing`; Single also checks each
//     source's rows against `expect_rows`.
//   List: source s into outs[s] (data null: placed after its header arrives),
//     whose dtype and shape a chunk must match exactly when given.
struct A2APlan {
  A2AOp op = A2AOp::V;
  // What the caller called and its input, as errors name them (empty: the
  // op's own name, and x / input): moe.combine's peers are told "moe.combine",
  // not the all_to_all_v underneath.
  std::string name, input;
  // An autograd backward's all-to-all: its chunks say so (kBackwardCall), and
  // one that meets a forward's is refused on both sides.
  bool backward = false;
  // A value every rank passes alike (in every chunk's header: kAgreeShift,
  // its kind in the top 4 bits), 0 for none: a chunk with another, of no rows
  // too, fails the call on both sides naming `agree_name` and both values,
  // then `agree_why`; one of another kind, as out of step (moe.dispatch:
  // num_experts; moe.combine and the backwards: which dispatch they undo).
  uint32_t agree = 0;
  std::string agree_name, agree_why;
  A2AStrategy strategy = A2AStrategy::OnePhase;
  int64_t user_tag = 0;
  std::vector<A2AChunk> send;  // [world]
  // V, Single
  uint32_t dtype = 0;
  std::vector<int64_t> trailing;
  uint64_t row_bytes = 0;
  std::vector<int64_t> expect_rows;  // Single: [world]
  void* out = nullptr;
  uint64_t out_cap = 0;
  Mem out_mem;
  // List
  std::vector<A2AChunk> outs;  // [world]; data is the destination, nbytes its capacity
};

// A plan of the row form (V, Single): x's rows split by `splits`; x_host: a
// host copy of a device x (or null), for receivers with no device route.
A2APlan rows_plan(A2AOp op, const void* x, uint64_t row_bytes, const std::vector<int64_t>& splits, uint32_t dtype,
                  const std::vector<int64_t>& trailing, Mem mem, const void* x_host = nullptr);

class AllToAll {
 public:
  // Checks the plan; start() posts it.
  AllToAll(Engine& e, A2APlan plan);
  // A rank that refuses a collective before it starts (an argument error of
  // its own, or of the plan) takes its number all the same and tells every
  // peer (kRefusedCall), so they fail that call at once, naming it, instead
  // of pairing their next call with ours; what they send for it is dropped.
  static void refuse(Engine& e, int64_t user_tag);
  static int64_t coll_tag(int64_t user_tag, uint64_t seq);
  // Posts every receive and send (the first phase); nothing blocks.
  void start();
  ~AllToAll();
  AllToAll(const AllToAll&) = delete;
  AllToAll& operator=(const AllToAll&) = delete;

  // Until every source's header (or descriptor) is here; false at the deadline.
  bool wait_headers(std::chrono::steady_clock::time_point deadline);
  // After wait_headers, V with no out: rows per source to place (0 where refused).
  const std::vector<int64_t>& recv_rows() const { return recv_rows_; }
  bool needs_out() const;
  // V: the concatenated output, once its size (total rows) is known.
  void place(void* out, uint64_t cap, Mem mem);
  // List: sources whose destination is to be allocated from their header.
  std::vector<int> unplaced() const;
  const A2AChunk& arrived(int src) const { return got_[src]; }
  // List: source s lands in out; null with `why`: refuse it (why names the problem).
  void place(int src, void* out, Mem mem, const std::string& why);
  // Copies (one-phase) or moves the payloads (two-phase); false at the deadline.
  bool wait_done(std::chrono::steady_clock::time_point deadline);
  // The collective's error, if any.
  std::optional<Error> error() const;
  // The deadline passed: cancel what has not started, detach the rest, throw
  // TimeoutError naming a peer that did not answer.
  [[noreturn]] void timeout(double seconds);
  // Give up (an error or an interrupt): cancel the sends not started, detach
  // the rest; with sends_go_on (a peer died), every send goes on detached.
  void cleanup(bool sends_go_on = false);
  // Sends that cleanup() left in flight: the transport still reads their
  // source (the caller's input) until each id comes back from
  // Engine::take_recycled(), so the caller must keep the input alive until then.
  std::vector<uint64_t> take_in_flight() { return std::move(in_flight_); }
  uint64_t total_bytes() const { return total_bytes_; }
  A2AOp op() const { return plan_.op; }

 private:
  // Refused: its sender refused the call before it started (kRefusedCall).
  enum class Fate : uint8_t { Pending, Ok, OverBound, Mismatch, Rejected, Refused };
  void check(int src);
  bool wait_for(uint64_t id, std::chrono::steady_clock::time_point deadline);
  void send_part(int d, bool two);
  std::string other_calls_from(int peer);
  void post_payloads();
  void local_copy();
  std::chrono::nanoseconds held_grace() const;
  const void* source(int dst, Mem* mem) const;
  void* dest(int src) const;
  Mem dest_mem(int src) const;
  // Header flags of this call's kind.
  uint64_t kind() const { return (plan_.backward ? kBackwardCall : 0) | uint64_t(plan_.agree) << kAgreeShift; }
  template <class F>
  void guarded(F&& f);

  Engine& e_;
  A2APlan plan_;
  int rank_, world_;
  int64_t tag_;  // one-phase message / two-phase descriptor; tag_ + 1: two-phase payload
  std::vector<uint64_t> recv_;     // per source: pending recv id (0: none)
  std::vector<uint64_t> sends_;    // pending send ids (0: done)
  std::vector<uint64_t> in_flight_;  // sends cleanup() left reading the input, receives writing the output
  std::vector<uint64_t> payload_;  // two-phase: per source, the payload recv
  std::vector<char> payload_into_;  // ... copied into place once matched (else dropped)
  std::vector<char> copying_;       // per source: payload_ is a copy_out streaming into the output
  std::chrono::steady_clock::time_point sends_since_{};  // when wait_done first waited for the sends (held_grace)
  std::vector<A2AChunk> got_;      // per source: the header that arrived (self: own chunk)
  std::vector<Fate> fate_;
  std::vector<std::string> why_;   // Rejected: why the caller could not place it
  std::vector<char> no_payload_;   // two-phase: a rejected count whose sender sends no payload after it
  std::vector<int64_t> recv_rows_;
  std::vector<uint64_t> offset_;   // V/Single: byte offset of each source in out
  std::vector<std::pair<int, std::string>> too_large_;  // our chunk to dst over dst's bound
  uint64_t total_bytes_ = 0;
  bool overflow_ = false, mismatch_ = false;
  bool crossed_ = false;  // a chunk of the other kind (backward/forward) came: out of step, said first
  bool headers_ = false, placed_ = false, payloads_ = false;
  int next_ = 1;  // wait_headers' position (staggered index k)
};

}  // namespace varcomm
