#include "collectives.h"

#include <algorithm>
#include <cstring>

#include "dtypes.h"

namespace varcomm {

namespace {

using Clock = std::chrono::steady_clock;
// After the grace (AllToAll::held_grace), how often a held send not yet
// written is tried again.
constexpr auto kHeldRetry = std::chrono::milliseconds(1);

std::string rank_str(int r) { return "rank " + std::to_string(r); }

// Python's list spelling (tuples: dtypes.h tuple_str), so messages read like the caller's values.
template <class T>
std::string list_str(const std::vector<T>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

std::string op_name(const A2APlan& p) {
  if (!p.name.empty()) return p.name;
  switch (p.op) {
    case A2AOp::V: return "all_to_all_v";
    case A2AOp::Single: return "all_to_all_single";
    default: return "all_to_all";
  }
}

std::string input_name(const A2APlan& p) { return !p.input.empty() ? p.input : p.op == A2AOp::V ? "x" : "input"; }

// An output that overlaps the input (an in-place all-to-all) would be
// written while peers still read the input (a rendezvous chunk is copied out
// of its sender's memory when its receiver gets to it; a queued eager one
// when a slot frees): wrong rows with no error. Refused before the call
// takes its number, so the caller refuses it to the peers too.
void refuse_overlap(const A2APlan& p, int rank) {
  if (p.send.size() < 2) return;  // no peers: the one chunk is a local copy
  struct Range {
    uintptr_t lo, hi;
  };
  for (bool device : {false, true}) {
    std::vector<Range> outs;
    auto add = [&](const void* d, uint64_t n, const Mem& m) {
      if (d && n && m.device == device) outs.push_back({uintptr_t(d), uintptr_t(d) + n});
    };
    if (p.op == A2AOp::List)
      for (const A2AChunk& o : p.outs) add(o.data, o.nbytes, o.mem);
    else
      add(p.out, p.out_cap, p.out_mem);
    if (outs.empty()) continue;
    std::sort(outs.begin(), outs.end(), [](const Range& a, const Range& b) { return a.lo < b.lo; });
    std::vector<uintptr_t> reach(outs.size());  // the furthest end among outs[0..i]
    for (size_t i = 0; i < outs.size(); ++i) reach[i] = std::max(outs[i].hi, i ? reach[i - 1] : 0);
    for (size_t d = 0; d < p.send.size(); ++d) {
      const A2AChunk& c = p.send[d];
      if (!c.data || !c.nbytes || c.mem.device != device) continue;
      // The list form's own chunk into its own output, the same memory: a
      // local copy onto itself, which no peer reads (what other chunks overlap is refused)
      if (p.op == A2AOp::List && int(d) == rank && c.data == p.outs[d].data) continue;
      const uintptr_t lo = uintptr_t(c.data), hi = lo + c.nbytes;
      // the outputs that start before this chunk ends; one of them overlaps it if any reaches past its start
      size_t k = size_t(std::lower_bound(outs.begin(), outs.end(), hi,
                                         [](const Range& r, uintptr_t v) { return r.lo < v; }) - outs.begin());
      if (k && reach[k - 1] > lo) {
        throw Error(ErrorKind::Invalid,
                    op_name(p) + ": the output overlaps " + input_name(p) +
                        " (an in-place all-to-all, which varcomm does not do: peers read " + input_name(p) +
                        " while this rank's output is written, so rows would be overwritten before they are "
                        "sent); pass an output of its own, or a clone of " + input_name(p) + " as the input");
      }
    }
  }
}

A2AChunk chunk_of(const MsgInfo& m) {
  A2AChunk c;
  c.nbytes = m.nbytes;
  c.dtype = m.dtype;
  c.ndim = uint32_t(m.shape.size());
  std::copy(m.shape.begin(), m.shape.end(), c.shape);
  return c;
}

}  // namespace

A2APlan rows_plan(A2AOp op, const void* x, uint64_t row_bytes, const std::vector<int64_t>& splits, uint32_t dtype,
                  const std::vector<int64_t>& trailing, Mem mem, const void* x_host) {
  if (trailing.size() + 1 > size_t(kMaxDims))
    throw Error(ErrorKind::Invalid, "tensors of more than " + std::to_string(kMaxDims) + " dimensions are not supported");
  A2APlan p;
  p.op = op;
  p.dtype = dtype;
  p.trailing = trailing;
  p.row_bytes = row_bytes;
  p.send.resize(splits.size());
  const char* at = static_cast<const char*>(x);
  const char* host = static_cast<const char*>(x_host);
  for (size_t d = 0; d < splits.size(); ++d) {
    A2AChunk& c = p.send[d];
    c.data = at;
    c.nbytes = uint64_t(splits[d]) * row_bytes;
    c.dtype = dtype;
    c.ndim = uint32_t(trailing.size() + 1);
    c.shape[0] = splits[d];
    std::copy(trailing.begin(), trailing.end(), c.shape + 1);
    c.mem = mem;
    if (host) c.host = host + (at - static_cast<const char*>(x));
    at += c.nbytes;
  }
  return p;
}

int64_t AllToAll::coll_tag(int64_t user_tag, uint64_t seq) {
  return kCollTagBase * (1 + user_tag) + 2 * int64_t(seq % uint64_t(kCollTagBase / 2));
}

void AllToAll::refuse(Engine& e, int64_t user_tag) {
  if (user_tag < 0 || user_tag > kMaxCollTag) user_tag = 0;  // (the refusal's own reason, most likely)
  const int64_t tag = coll_tag(user_tag, e.next_collective());
  const int n = e.world(), r = e.rank();
  const int64_t shape[1] = {0};
  for (int k = 1; k < n; ++k) {
    int p = (r + k) % n;
    try {
      // What p sends us for this call is dropped as it comes; our descriptor
      // tells it why nothing else comes (two-phase: it then sends us no
      // payload, post_payloads).
      e.detach(e.irecv(p, tag, nullptr, 0, 0));
      e.detach(e.isend_descriptor(p, tag, 0, 0, shape, 1, kRefusedCall));
    } catch (const Error&) {  // p is gone or closed: it learns nothing more from us anyway
    }
  }
}

AllToAll::AllToAll(Engine& e, A2APlan plan) : e_(e), plan_(std::move(plan)), rank_(e.rank()), world_(e.world()) {
  const int n = world_, r = rank_;
  if (int(plan_.send.size()) != n) throw Error(ErrorKind::Invalid, "all-to-all plan: one chunk per rank expected");
  if (plan_.op == A2AOp::List && int(plan_.outs.size()) != n)
    throw Error(ErrorKind::Invalid, "all-to-all plan: one output per rank expected");
  if (plan_.op == A2AOp::Single && int(plan_.expect_rows.size()) != n)
    throw Error(ErrorKind::Invalid, "all-to-all plan: one expected row count per rank expected");
  if (plan_.user_tag < 0 || plan_.user_tag > kMaxCollTag)
    throw Error(ErrorKind::Invalid, "tag " + std::to_string(plan_.user_tag) + " out of range [0, " +
                                        std::to_string(kMaxCollTag) + "] for a collective");
  refuse_overlap(plan_, rank_);
  tag_ = coll_tag(plan_.user_tag, e_.next_collective());
  recv_.assign(n, 0);
  payload_.assign(n, 0);
  payload_into_.assign(n, 0);
  copying_.assign(n, 0);
  got_.resize(n);
  fate_.assign(n, Fate::Pending);
  why_.resize(n);
  no_payload_.assign(n, 0);
  recv_rows_.assign(n, 0);
  offset_.assign(n, 0);
  got_[r] = plan_.send[r];
  got_[r].data = nullptr;
}

void AllToAll::start() {
  const int n = world_, r = rank_;
  const bool two = plan_.strategy == A2AStrategy::TwoPhase;
  guarded([&] {
    for (int k = 1; k < n; ++k) {  // receives first, so early senders find them posted
      int s = (r - k + n) % n;
      recv_[s] = e_.irecv(s, tag_, nullptr, 0, 0, {}, true, dest_mem(s).device);
    }
    // A peer known dead fails the call here, but only once every live peer
    // has its part: they are in this call too, and would wait for it.
    std::optional<Error> dead;
    for (int k = 1; k < n; ++k) {  // staggered destinations spread the load over receivers
      int d = (r + k) % n;
      try {
        send_part(d, two);
      } catch (const Error& x) {
        if (x.kind != ErrorKind::PeerFailure) throw;
        if (!dead) dead = x;
      }
    }
    if (dead) throw *dead;
  });
}

// One peer's part of the first phase: its chunk, or a descriptor in place of it.
void AllToAll::send_part(int d, bool two) {
  const A2AChunk& c = plan_.send[d];
  if (e_.over_max_message(c.nbytes)) {
    // Refused here in either strategy, before any byte is written; d
    // learns which limit it was and expects no payload (kOverMaxMessage).
    too_large_.push_back({d, e_.max_message_error(d, c.nbytes).what()});
    sends_.push_back(e_.isend_descriptor(d, tag_, c.nbytes, c.dtype, c.shape, c.ndim, kOverMaxMessage | kind()));
    return;
  }
  if (!two) {
    try {
      Mem m;
      const void* src = source(d, &m);
      sends_.push_back(e_.isend(d, tag_, src, c.nbytes, c.dtype, c.shape, c.ndim, m, 0, true, !c.mem.device, kind()));
      return;
    } catch (const Error& x) {
      if (x.kind != ErrorKind::TooLarge) throw;
      too_large_.push_back({d, x.what()});
    }
  }
  // Two-phase: the counts first. One-phase: in place of a chunk over d's
  // bound, so d learns why nothing came.
  sends_.push_back(e_.isend_descriptor(d, tag_, c.nbytes, c.dtype, c.shape, c.ndim, kind()));
}

AllToAll::~AllToAll() { cleanup(); }

template <class F>
void AllToAll::guarded(F&& f) {
  try {
    f();
  } catch (const Error& x) {
    // A dead peer breaks the call for this rank only: what it sends the live
    // peers still goes, since they wait for it in this same call.
    cleanup(x.kind == ErrorKind::PeerFailure);
    // A dead peer surfaces from one of many sends and receives: say which
    // collective it broke (the user called that, not a recv).
    const std::string op = op_name(plan_);
    if (x.kind != ErrorKind::PeerFailure || std::string(x.what()).rfind(op, 0) == 0) throw;
    throw Error(x.kind, op + ": " + x.what(), x.peer, x.forced);
  } catch (...) {
    cleanup();
    throw;
  }
}

// Sends not started are cancelled (nothing half-written); those in flight go
// on and are reported (take_in_flight). Receives are detached, so a message
// that still arrives is dropped and its slot freed; none holds caller memory
// (every receive is posted without a buffer and copied out once matched),
// but for a copy_out that streams into the output: reported too.
void AllToAll::cleanup(bool sends_go_on) {
  auto drop = [&](uint64_t& id, bool send, bool writes = false) {
    if (!id) return;
    try {
      if (send && sends_go_on) {
        // Sent on detached, from a copy of the core's own where they would
        // read the input later (queued, or a rendezvous whose head is out):
        // the caller, told the call failed, may change its input at once.
        // One still reading it (device memory) is reported.
        if (e_.own_queued(id))
          e_.detach(id);
        else if (!e_.let_go(id) && e_.detach(id, true))
          in_flight_.push_back(id);
      } else if (send) {
        if (e_.cancel(id, true) == Engine::Cancelled::kKept) in_flight_.push_back(id);
      } else if (e_.detach(id, writes) && writes) {
        in_flight_.push_back(id);  // still streaming into the output (copy_out returned false): kept alive
      }
    } catch (const Error&) {
    }
    id = 0;
  };
  for (auto& id : recv_) drop(id, false);
  for (size_t s = 0; s < payload_.size(); ++s) drop(payload_[s], false, copying_[s]);
  for (auto& id : sends_) drop(id, true);
}

void AllToAll::check(int s) {
  const A2AChunk& h = got_[s];
  auto bad = [&] {
    fate_[s] = Fate::Mismatch;
    mismatch_ = true;
  };
  if (plan_.op == A2AOp::List) {
    const A2AChunk& o = plan_.outs[s];
    if (o.data && (o.dtype != h.dtype || o.ndim != h.ndim || !std::equal(h.shape, h.shape + h.ndim, o.shape)))
      return bad();
    fate_[s] = Fate::Ok;
    return;
  }
  const auto& t = plan_.trailing;
  if (h.dtype != plan_.dtype || h.ndim != t.size() + 1 || !std::equal(t.begin(), t.end(), h.shape + 1)) return bad();
  if (plan_.op == A2AOp::Single && h.shape[0] != plan_.expect_rows[s]) return bad();
  fate_[s] = Fate::Ok;
  recv_rows_[s] = h.shape[0];
}

// One of this call's receives, waited for in slices: between them, a peer
// of another receive that died fails the call now (its chunk will never
// come), not once this one's sender turns up (a late rank held a dead
// peer's error back for as long as it was late).
bool AllToAll::wait_for(uint64_t id, std::chrono::steady_clock::time_point deadline) {
  constexpr auto kSlice = std::chrono::milliseconds(100);
  for (;;) {
    if (e_.wait(id, std::min(deadline, Clock::now() + kSlice))) return true;
    for (auto* ids : {&recv_, &payload_})
      for (uint64_t& other : *ids) {
        if (!other || other == id) continue;
        try {
          e_.raise_if_failed(other);
        } catch (...) {
          other = 0;  // (recycled by the engine: not dropped again)
          throw;
        }
      }
    if (Clock::now() >= deadline) return false;  // (the caller's slices are short: checked after each)
  }
}

bool AllToAll::wait_headers(std::chrono::steady_clock::time_point deadline) {
  if (headers_) return true;
  const int n = world_, r = rank_;
  bool done = true;
  guarded([&] {
    for (; next_ < n; ++next_) {
      int s = (r - next_ + n) % n;
      if (!wait_for(recv_[s], deadline)) {
        done = false;
        return;
      }
      MsgInfo m = e_.info(recv_[s]);
      got_[s] = chunk_of(m);
      const bool crossed = bool(m.flags & kBackwardCall) != plan_.backward;
      const uint64_t agree = (m.flags & kAgreeMask) >> kAgreeShift;
      if (!(m.flags & kRefusedCall) && (crossed || agree != plan_.agree)) {
        // A forward met a backward (a rank ran no backward through a
        // differentiable all-to-all), or a value every rank passes alike
        // differs: taken and dropped, as any refused chunk, on both sides
        // (a chunk of no rows too, which has nothing else to check).
        fate_[s] = Fate::Rejected;
        if (crossed)
          why_[s] = rank_str(s) + " ran " + (plan_.backward ? "a forward" : "an autograd backward's") +
                    " all-to-all where " + rank_str(rank_) + " ran " + (plan_.backward ? "a backward" : "a forward") +
                    ": the ranks are out of step (every rank must run backward through the same differentiable "
                    "all-to-alls, in the same order; an all-to-all is differentiable where its input requires grad, "
                    "so that must agree across ranks)";
        else if (agree >> kAgreeKindShift != plan_.agree >> kAgreeKindShift)
          why_[s] = rank_str(s) + " ran another collective where " + rank_str(rank_) + " ran " + op_name(plan_) +
                    ": the ranks are out of step (every rank must make the same collective calls, in the same order)";
        else
          why_[s] = rank_str(s) + " passed " + plan_.agree_name + " " +
                    std::to_string(agree & ((1u << kAgreeKindShift) - 1)) + " where " + rank_str(rank_) + " passed " +
                    std::to_string(plan_.agree & ((1u << kAgreeKindShift) - 1)) + plan_.agree_why;
        mismatch_ = true;
        crossed_ = crossed_ || crossed;
        if (m.flags & kDescriptor) {
          e_.release(recv_[s]);
          recv_[s] = 0;
          // Its sender sends a payload after it only for a two-phase count
          // within our bound (post_payloads): that one is taken and dropped
          // (Rejected); else none comes, and none is waited for.
          bool payload = plan_.strategy == A2AStrategy::TwoPhase && !(m.flags & kOverMaxMessage) &&
                         m.nbytes <= e_.layout().bound;
          no_payload_[s] = !payload;
        }
        continue;
      }
      if (m.flags & kDescriptor) {
        e_.release(recv_[s]);  // no payload of its own
        recv_[s] = 0;
        if (m.flags & kRefusedCall) {
          fate_[s] = Fate::Refused;
          why_[s] = rank_str(s) + " refused its part of this call before it started (its own error says why)";
          mismatch_ = true;
          continue;
        }
        // One-phase: a descriptor stands in for a chunk its sender could not
        // send (a device chunk's host copy over our bound; host chunks go by
        // rendezvous at any size). Two-phase (the conventional count-first
        // baseline, held to the bound): every count travels so; the sender
        // skips a chunk over our bound.
        if (m.flags & kOverMaxMessage) {
          fate_[s] = Fate::OverBound;
          why_[s] = "over " + rank_str(s) + "'s max_message (varcomm.init(max_message=...) / " +
                    "VARCOMM_MAX_MESSAGE on that rank)";
        } else if (plan_.strategy == A2AStrategy::OnePhase || m.nbytes > e_.layout().bound) {
          fate_[s] = Fate::OverBound;
          why_[s] = "over " + rank_str(rank_) + "'s receive bound of " + std::to_string(e_.layout().bound) + " bytes";
        }
      }
    }
  });
  if (!done) return false;
  headers_ = true;
  uint64_t o = 0;
  for (int s = 0; s < n; ++s) {
    if (fate_[s] == Fate::Pending) check(s);
    offset_[s] = o;
    if (fate_[s] == Fate::Ok && plan_.op != A2AOp::List) o += got_[s].nbytes;
  }
  total_bytes_ = o;
  if (plan_.op != A2AOp::List && plan_.out) {
    placed_ = true;
    overflow_ = total_bytes_ > plan_.out_cap;
  }
  if (plan_.op == A2AOp::List) placed_ = true;  // what the caller leaves unplaced is dropped
  return true;
}

bool AllToAll::needs_out() const { return plan_.op != A2AOp::List && !placed_; }

void AllToAll::place(void* out, uint64_t cap, Mem mem) {
  plan_.out = out;
  plan_.out_cap = cap;
  plan_.out_mem = mem;
  overflow_ = total_bytes_ > cap;
  placed_ = true;
}

std::vector<int> AllToAll::unplaced() const {
  std::vector<int> v;
  for (int s = 0; s < world_; ++s)
    if (fate_[s] == Fate::Ok && !plan_.outs[s].data) v.push_back(s);
  return v;
}

void AllToAll::place(int s, void* out, Mem mem, const std::string& why) {
  A2AChunk& o = plan_.outs.at(s);
  if (!out && !why.empty()) {
    fate_[s] = Fate::Rejected;
    why_[s] = why;
    mismatch_ = true;
    return;
  }
  o = got_[s];
  o.data = out;
  o.mem = mem;
}

void* AllToAll::dest(int s) const {
  if (fate_[s] != Fate::Ok) return nullptr;
  // The rows land only when every chunk is right: an error writes nothing
  // (in the list form either: not the outputs of the sources that were right).
  if (mismatch_) return nullptr;
  if (plan_.op == A2AOp::List) return const_cast<void*>(plan_.outs[s].data);
  if (overflow_ || !plan_.out) return nullptr;
  return static_cast<char*>(plan_.out) + offset_[s];
}

Mem AllToAll::dest_mem(int s) const { return plan_.op == A2AOp::List ? plan_.outs[s].mem : plan_.out_mem; }

void AllToAll::local_copy() {
  const A2AChunk& c = plan_.send[rank_];
  void* d = dest(rank_);
  if (!d || !c.nbytes) return;
  const Mem dm = dest_mem(rank_);
  // On the stream, like every other chunk's copy into the output.
  if (c.mem.device || dm.device) return e_.copy_local(d, c.data, c.nbytes, c.mem.device ? c.mem : dm);
  if (d != c.data) std::memcpy(d, c.data, c.nbytes);  // (the same memory: in place, refuse_overlap)
}

// A device chunk to a receiver with no device route goes from its host copy.
const void* AllToAll::source(int d, Mem* mem) const {
  const A2AChunk& c = plan_.send[d];
  *mem = c.mem;
  if (!c.mem.device || e_.device_route(d)) return c.data;
  if (c.nbytes && !c.host)
    throw Error(ErrorKind::Invalid, op_name(plan_) + ": " + rank_str(d) + " has no device route from " +
                                        rank_str(rank_) + " and the chunk for it has no host copy to stage");
  *mem = Mem{};
  return c.host;
}

void AllToAll::post_payloads() {
  const int n = world_, r = rank_;
  for (int k = 1; k < n; ++k) {
    int s = (r - k + n) % n;
    if (fate_[s] == Fate::OverBound || fate_[s] == Fate::Refused || no_payload_[s]) continue;  // none comes
    // A refused chunk is still received (and dropped): its sender cannot know.
    // Posted without a buffer (copied out in wait_done): a receive given up
    // on never writes into the caller's output afterwards.
    payload_into_[s] = dest(s) && got_[s].nbytes;
    payload_[s] = e_.irecv(s, tag_ + 1, nullptr, 0, 0, {}, true, dest_mem(s).device);
  }
  for (int k = 1; k < n; ++k) {
    int d = (r + k) % n;
    if (fate_[d] == Fate::Refused) continue;  // d refused the whole call: it reads nothing more of it
    const A2AChunk& c = plan_.send[d];
    if (e_.over_max_message(c.nbytes)) continue;  // refused in start(): d expects nothing
    if (c.nbytes > e_.peer_bound(d)) {  // d saw the count and took it as over its bound (wait_headers)
      too_large_.push_back({d, e_.over_bound(d, c.nbytes, c.mem.device).what()});
      continue;
    }
    try {
      Mem m;
      const void* src = source(d, &m);
      sends_.push_back(
          e_.isend(d, tag_ + 1, src, c.nbytes, c.dtype, c.shape, c.ndim, m, 0, true, !c.mem.device, kind()));
    } catch (const Error& x) {
      if (x.kind != ErrorKind::TooLarge) throw;
      too_large_.push_back({d, x.what()});  // d saw the count: it expects nothing
    }
  }
}

bool AllToAll::wait_done(std::chrono::steady_clock::time_point deadline) {
  bool done = true;
  guarded([&] {
    if (!payloads_) {
      if (!placed_) throw Error(ErrorKind::Invalid, "all-to-all: the output was not placed");
      if (plan_.strategy == A2AStrategy::TwoPhase) {
        post_payloads();
      } else {
        for (int k = 1; k < world_; ++k) {  // staggered, as the sends: no source is everyone's last
          int s = (rank_ - k + world_) % world_;
          if (!recv_[s]) continue;
          // (false: it streams into d, and is waited for below)
          if (void* d = dest(s)) {
            if (!e_.copy_out(recv_[s], d, dest_mem(s))) payload_[s] = recv_[s], copying_[s] = true;
          } else {
            e_.release(recv_[s]);
          }
          recv_[s] = 0;
        }
      }
      local_copy();
      payloads_ = true;
    }
    for (int k = 1; k < world_; ++k) {
      int s = (rank_ - k + world_) % world_;
      uint64_t& id = payload_[s];
      if (!id) continue;
      if (!wait_for(id, deadline)) {
        done = false;
        return;
      }
      if (copying_[s]) {  // its copy_out streamed into the output, and is done now
        copying_[s] = false;
      } else if (payload_into_[s]) {
        MsgInfo m = e_.info(id);
        const A2AChunk& want = got_[s];
        if (m.nbytes != want.nbytes || m.dtype != want.dtype || (m.flags & kDescriptor)) {
          e_.release(id);
          id = 0;
          throw Error(ErrorKind::Mismatch,
                      op_name(plan_) + ": the payload from " + rank_str(s) + " (" +
                          std::to_string(m.nbytes) + " bytes, dtype code " + std::to_string(m.dtype) +
                          ") does not match the count it sent first (" + std::to_string(want.nbytes) +
                          " bytes, dtype code " + std::to_string(want.dtype) +
                          "); is every rank running the same strategy (a2a_algorithm) and varcomm version?",
                      s);
        }
        if (!e_.copy_out(id, dest(s), dest_mem(s))) {
          copying_[s] = true;  // streams into the output: waited for next
          --k;
          continue;
        }
      } else {
        e_.release(id);
      }
      id = 0;
    }
    // A chunk sent by rendezvous (Engine::rendezvous `held`) completes when
    // its receiver copies it, which may be only when that rank waits for its
    // own collective, perhaps after waiting for something of ours (an async
    // all-to-all, then a recv from us): past a grace time its data moves into
    // the core's memory (one copy more) and we return.
    if (sends_since_ == Clock::time_point{}) sends_since_ = Clock::now();
    const auto grace = sends_since_ + held_grace();
    for (auto& id : sends_) {
      while (id) {
        const auto now = Clock::now();
        if (now >= grace && e_.let_go(id)) {
          id = 0;
        } else if (e_.wait(id, std::min(deadline, now < grace ? grace : now + kHeldRetry))) {
          id = 0;
        } else if (Clock::now() >= deadline) {
          done = false;
          return;
        }
      }
    }
  });
  return done;
}

// How long wait_done waits for its chunks sent by rendezvous to be copied
// before it moves them: each receiver copies its sources one after another,
// so the last copy of ours may come about a whole output's copy time after
// our own copies were done (taken as ours, at a slow 1 GB/s), plus 5 ms of
// scheduling (more ranks than cores); later than that, a receiver is busy
// elsewhere, perhaps waiting for us.
std::chrono::nanoseconds AllToAll::held_grace() const {
  return std::chrono::milliseconds(5) + std::chrono::nanoseconds(total_bytes_);
}

void AllToAll::timeout(double seconds) {
  uint64_t late = 0;
  if (!headers_) late = recv_[(rank_ - next_ + world_) % world_];  // the one wait_headers waits for
  for (int s = 0; s < world_ && !late; ++s) late = payload_[s];
  const bool receiving = late != 0;
  for (size_t i = 0; i < sends_.size() && !late; ++i) late = sends_[i];
  int peer = -1;
  char secs[32];
  snprintf(secs, sizeof secs, "%.3g", seconds);
  std::string msg = op_name(plan_) + " on " + rank_str(rank_) + " timed out after " + secs + " s";
  if (late) {
    // Said in the call's terms (the point-to-point text names the internal
    // tag and gives point-to-point advice).
    e_.timeout_message(late, seconds, &peer);
    const std::string sent = receiving && peer >= 0 ? other_calls_from(peer) : "";
    msg += ": " + (!sent.empty() ? sent
                                 : rank_str(peer) + (receiving ? " has not sent its part of this call"
                                                               : " has not taken its part") +
                                       " (is every rank making the same collective calls, in the same order?)");
  }
  cleanup();  // `late` with the rest: an in-flight send is reported
  throw Error(ErrorKind::Timeout, msg, peer);
}

// Why `peer`'s part of this call is not here, from what it did send that
// waits unmatched: a collective's part under another tag (the ranks passed
// different tags), or parts of other calls (out of step). Empty: nothing.
std::string AllToAll::other_calls_from(int peer) {
  std::vector<int64_t> tags;
  try {
    tags = e_.unreceived_tags(peer);
  } catch (const Error&) {
    return "";
  }
  std::vector<int64_t> other_tags;
  size_t other_calls = 0;
  for (int64_t t : tags) {
    if (t < kCollTagBase) continue;  // point-to-point
    const int64_t user = t / kCollTagBase - 1;
    if (user != plan_.user_tag) {
      if (std::find(other_tags.begin(), other_tags.end(), user) == other_tags.end()) other_tags.push_back(user);
    } else if (t > tag_ + 1) {  // a later call's (an earlier one's: left from a call this rank gave up on)
      ++other_calls;
    }
  }
  std::sort(other_tags.begin(), other_tags.end());
  std::string msg;
  if (!other_tags.empty())
    msg += rank_str(peer) + "'s part of a collective with tag " +
           (other_tags.size() == 1 ? std::to_string(other_tags[0]) : list_str(other_tags)) + " waits here " +
           "unreceived, where " + rank_str(rank_) + " called with tag " + std::to_string(plan_.user_tag) +
           ": every rank must pass the same tag";
  if (other_calls)
    msg += (msg.empty() ? "" : "; ") + std::to_string(other_calls) + (other_calls == 1 ? " part" : " parts") +
           " of later calls from " + rank_str(peer) + (other_calls == 1 ? " waits" : " wait") +
           " here unreceived, but not this call's: the ranks are out of step (every rank must make the same "
           "collective calls, in the same order)";
  return msg;
}

std::optional<Error> AllToAll::error() const {
  const std::string op = op_name(plan_), me = rank_str(rank_);
  // Out of step is the cause to fix first: a chunk that did not fit then was
  // sized for another call.
  if (!too_large_.empty() && !crossed_) {
    auto [d, why] = too_large_[0];
    std::string msg = op + ": " + me + "'s chunk for " + rank_str(d) + " does not fit: " + why;
    if (too_large_.size() > 1) {
      std::vector<int> rest;
      for (size_t i = 1; i < too_large_.size(); ++i) rest.push_back(too_large_[i].first);
      msg += " (nor do its chunks for ranks " + list_str(rest) + ")";
    }
    return Error(ErrorKind::TooLarge, msg + "; the other ranks were told, and the communicator stays usable", d);
  }
  std::vector<std::string> problems;
  bool shape_rule = false;  // said once, after every chunk it applies to
  int first = -1;
  for (int s = 0; s < world_; ++s) {
    const A2AChunk& h = got_[s];
    std::string p;
    if (fate_[s] == Fate::Rejected || fate_[s] == Fate::Refused) {
      p = why_[s];
    } else if (fate_[s] != Fate::Mismatch) {
      continue;
    } else if (plan_.op == A2AOp::List) {
      const A2AChunk& o = plan_.outs[s];
      p = rank_str(s) + " sent " + dtype_name(h.dtype) + " of shape " + tuple_str(h.shape, h.ndim) +
          ", but output_tensor_list[" + std::to_string(s) + "] on " + me + " is " + dtype_name(o.dtype) +
          " of shape " + tuple_str(o.shape, o.ndim);
    } else {
      const auto& t = plan_.trailing;
      bool rows_only = h.dtype == plan_.dtype && h.ndim == t.size() + 1 && std::equal(t.begin(), t.end(), h.shape + 1);
      if (rows_only) {
        // A row count only: the dtype and shape rule is not what was broken.
        p = rank_str(s) + " sent " + std::to_string(h.shape[0]) + " rows, but output_split_sizes[" +
            std::to_string(s) + "] on " + me + " is " + std::to_string(plan_.expect_rows[s]) +
            " (it must equal that rank's input_split_sizes[" + std::to_string(rank_) + "])";
      } else {
        p = "the chunk from " + rank_str(s) + " is " + dtype_name(h.dtype) + " of shape " +
            tuple_str(h.shape, h.ndim) + ", but " + me + "'s " + input_name(plan_) + " is " +
            dtype_name(plan_.dtype) + " with rows of shape " + tuple_str(t.data(), t.size());
        shape_rule = true;
      }
    }
    if (first < 0) first = s;
    problems.push_back(p);
  }
  if (!problems.empty()) {
    std::string msg = op + " on " + me + ": ";
    for (size_t i = 0; i < problems.size(); ++i) msg += (i ? "; " : "") + problems[i];
    if (shape_rule) msg += "; every rank must pass the same dtype and trailing shape";
    return Error(ErrorKind::Mismatch, msg, first);
  }
  std::vector<int> over;
  for (int s = 0; s < world_; ++s)
    if (fate_[s] == Fate::OverBound) over.push_back(s);
  if (!over.empty()) {
    // Senders grouped by limit: one may be over this rank's bound, another
    // over its own max_message, and each limit is what someone must raise.
    std::vector<std::pair<std::string, std::vector<int>>> by_why;
    for (int s : over) {
      auto it = std::find_if(by_why.begin(), by_why.end(), [&](const auto& b) { return b.first == why_[s]; });
      if (it == by_why.end())
        by_why.push_back({why_[s], {s}});
      else
        it->second.push_back(s);
    }
    std::string msg = op + ": ";
    for (size_t i = 0; i < by_why.size(); ++i) {
      const auto& [why, ranks] = by_why[i];
      msg += (i ? "; " : "") + (ranks.size() == 1 ? rank_str(ranks[0]) + " could not send its chunk"
                                                   : "ranks " + list_str(ranks) + " could not send their chunks") +
             " to " + me + ": " + why;
    }
    msg += over.size() == 1 ? ", and " + rank_str(over[0]) + " raised MessageTooLarge" : ", and each raised MessageTooLarge";
    // MessageTooLarge here too (naming the sender): one except clause
    // catches an over-bound call on every rank.
    return Error(ErrorKind::TooLarge, msg + "; the communicator stays usable", over[0]);
  }
  if (overflow_) {
    int64_t total = 0;
    for (int64_t v : recv_rows_) total += v;
    return Error(ErrorKind::TooLarge,
                 op + " on " + me + ": " + std::to_string(total) + " rows (" + std::to_string(total_bytes_) +
                     " bytes) arrived but out holds only " + std::to_string(plan_.out_cap) + " bytes (recv_splits " +
                     list_str(recv_rows_) + "); the chunks were dropped");
  }
  return std::nullopt;
}

}  // namespace varcomm
