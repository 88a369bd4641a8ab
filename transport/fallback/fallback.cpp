#include "fallback.h"

#include <cstring>

#include "errors.h"
#include "hostmem.h"
#include "registry.h"

namespace varcomm {
namespace {

using Clock = std::chrono::steady_clock;

// 'vc' + kind: a stray message on the group cannot pass for one of ours.
constexpr uint32_t kWrite = 0x76630011, kCredit = 0x76630012, kBye = 0x76630013;

struct Frame {
  uint32_t kind;
  uint32_t hdr_len;
  uint64_t off;
  uint64_t n;
  uint64_t value;
  char hdr[kHeaderBytes];
};
static_assert(sizeof(Frame) == FallbackTransport::kFrameBytes, "frame layout");

// While the mover still reads a sender's buffer, the engine must not hand the
// buffer back (it would fail the send and the caller could free it): a peer
// failure is reported once that op ends, which a broken gloo pair does at
// once, and at the latest after this long, so a failure never hangs a caller.
constexpr auto kFailGrace = std::chrono::seconds(5);

std::string rank_str(int peer) { return "rank " + std::to_string(peer); }

}  // namespace

FallbackTransport::FallbackTransport(Region& local, const Layout& layout, int rank)
    : local_(local), layout_(layout), rank_(rank) {
  peers_.reserve(layout.world);
  for (int i = 0; i < layout.world; ++i) {
    peers_.push_back(std::make_unique<Peer>());
    peers_.back()->landed_seq.assign(layout.nslots, 0);
    peers_.back()->freed_seq.assign(layout.nslots, 0);
  }
}

std::string FallbackTransport::describe() const {
  return "fallback (torch.distributed gloo carries each write: a frame, then the payload into the receiver's slot)";
}

std::string FallbackTransport::expose(void* base, size_t size) { return std::to_string(layout_.nslots); }

void FallbackTransport::connect(int peer, const std::string& d) {
  if (peer < 0 || peer >= layout_.world || peer == rank_)
    throw Error(ErrorKind::Invalid, "the fallback carries only other ranks, not " + rank_str(peer));
  int nslots = 0;
  try {
    nslots = std::stoi(d);
  } catch (const std::exception&) {
  }
  if (nslots < 1 || nslots > 1024)
    throw Error(ErrorKind::Invalid, "bad fallback descriptor '" + d + "' from " + rank_str(peer));
  std::lock_guard<std::mutex> g(mu_);
  Peer& p = *peers_[peer];
  p.nslots = nslots;
  p.connected = true;
}

std::vector<int> FallbackTransport::peers() {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<int> v;
  for (int i = 0; i < layout_.world; ++i)
    if (peers_[size_t(i)]->connected) v.push_back(i);
  return v;
}

FallbackTransport::Peer& FallbackTransport::peer_at(int peer) {
  if (peer < 0 || peer >= layout_.world || !peers_[peer]->connected)
    throw Error(ErrorKind::Invalid, "the fallback does not carry " + rank_str(peer) + " (not connected)");
  return *peers_[peer];
}

void FallbackTransport::push(Peer& p, Op op) {
  op.ticket = p.next_ticket++;
  // Closing, closed or failed: nothing more goes out but one goodbye; the
  // engine fails what waits on it through peer_error (its ticket never
  // completes).
  if (p.failed || p.bye_queued || (p.bye_received && op.kind != kBye)) return;
  if (op.kind == kBye) p.bye_queued = true;
  p.q.push_back(op);
  p.cv.notify_one();
}

uint64_t FallbackTransport::write_message(int peer, size_t ready_off, const void* hdr, size_t hdr_len,
                                          const void* payload, size_t n, uint64_t seq) {
  if (hdr_len > kHeaderBytes) throw std::logic_error("header larger than its slot area");
  std::lock_guard<std::mutex> g(mu_);
  Peer& p = peer_at(peer);
  Op op{kWrite, ready_off, seq, payload, n, 0, {}};
  std::memcpy(&op.hdr, hdr, hdr_len);
  uint64_t ticket = p.next_ticket;
  push(p, op);
  return ticket;
}

bool FallbackTransport::complete(int peer, uint64_t ticket) {
  std::lock_guard<std::mutex> g(mu_);
  return peers_[peer]->sent >= ticket;
}

void FallbackTransport::write_u64(int peer, size_t off, uint64_t value) {
  std::lock_guard<std::mutex> g(mu_);
  Peer& p = peer_at(peer);
  // A credit for slot k of p's ring in our region (p's layout places it):
  // from now on p may write that slot again.
  size_t row0 = kCtlBytes + size_t(rank_) * align_up(size_t(p.nslots) * 8, 64);
  if (off >= row0 && (off - row0) % 8 == 0 && (off - row0) / 8 < size_t(layout_.nslots))
    p.freed_seq[(off - row0) / 8] = value & ~kStreamCredit;  // a rendezvous head's "stream it" frees it too
  push(p, Op{kCredit, off, value, nullptr, 0, 0, {}});
}

std::string FallbackTransport::peer_error(int peer) {
  std::lock_guard<std::mutex> g(mu_);
  Peer& p = *peers_[peer];
  if (p.error.empty()) return "";
  if (p.handed_write && Clock::now() - p.failed_at < kFailGrace) return "";
  return p.error;
}

int64_t FallbackTransport::next_op(int peer, char* frame, Clock::time_point deadline, const void** payload,
                                   size_t* n) {
  std::unique_lock<std::mutex> g(mu_);
  Peer& p = peer_at(peer);
  // After a failure the queue is dropped; after our goodbye nothing follows it.
  while (p.q.empty() && !p.failed && !p.bye_sent) {
    if (deadline == Clock::time_point::max())
      p.cv.wait(g);
    else if (p.cv.wait_until(g, deadline) == std::cv_status::timeout && p.q.empty() && !p.failed && !p.bye_sent)
      return 0;
  }
  if (p.failed || p.q.empty()) return -1;
  Op op = p.q.front();
  p.q.pop_front();
  Frame f{};
  f.kind = op.kind;
  f.off = op.off;
  f.n = op.n;
  f.value = op.value;
  if (op.kind == kWrite) {
    f.hdr_len = sizeof(MsgHeader);
    std::memcpy(f.hdr, &op.hdr, sizeof(MsgHeader));
    p.handed_write = op.n > 0;
  }
  if (op.kind == kBye) p.bye_sent = true;
  std::memcpy(frame, &f, sizeof f);
  *payload = op.payload;
  *n = op.n;
  return int64_t(op.ticket);
}

void FallbackTransport::op_sent(int peer, uint64_t ticket) {
  std::lock_guard<std::mutex> g(mu_);
  Peer& p = peer_at(peer);
  p.sent = ticket;
  p.handed_write = false;
  // Our goodbye is out: nothing more goes to this peer.
  if (p.bye_sent && p.error.empty()) {
    p.error = rank_str(peer) + " is no longer reachable: this communicator is closing";
    p.failed_at = Clock::now();
  }
}

void FallbackTransport::fail_locked(Peer& p, const std::string& why) {
  if (p.error.empty()) {
    p.error = why;
    p.failed_at = Clock::now();
  }
  p.failed = true;
  p.q.clear();
  p.cv.notify_all();
}

void FallbackTransport::fail(int peer, const std::string& reason) {
  std::lock_guard<std::mutex> g(mu_);
  fail_locked(peer_at(peer), "lost the connection to " + rank_str(peer) + " (" + reason + ")");
}

void FallbackTransport::op_failed(int peer, const std::string& reason) {
  std::lock_guard<std::mutex> g(mu_);
  Peer& p = peer_at(peer);
  p.handed_write = false;
  fail_locked(p, "lost the connection to " + rank_str(peer) + " (" + reason + ")");
}

void FallbackTransport::refuse(int peer, Peer& p, const std::string& why) {
  std::string msg = rank_str(peer) + " sent a fallback frame that " + why + "; nothing was written, and " +
                    rank_str(peer) + " is treated as failed (a different varcomm version, or memory corruption)";
  fail_locked(p, msg);
  throw Error(ErrorKind::PeerFailure, msg, peer);
}

FallbackTransport::Landing FallbackTransport::landing(int peer, const char* frame, size_t len, char** dst,
                                                      size_t* n) {
  std::lock_guard<std::mutex> g(mu_);
  Peer& p = peer_at(peer);
  if (len != kFrameBytes)
    refuse(peer, p, "has " + std::to_string(len) + " bytes, not " + std::to_string(kFrameBytes));
  Frame f;
  std::memcpy(&f, frame, sizeof f);
  if (f.kind == kCredit) {
    size_t row0 = layout_.credit_off(peer, 0);
    size_t words = std::min(size_t(p.nslots), layout_.credit_row() / 8);
    if (f.off < row0 || (f.off - row0) % 8 != 0 || (f.off - row0) / 8 >= words)
      refuse(peer, p, "stores a credit at offset " + std::to_string(f.off) + ", outside its credit row [" +
                          std::to_string(row0) + ", " + std::to_string(row0 + 8 * words) + ")");
    store_release_u64(local_.base() + f.off, f.value);
    return Landing::Handled;
  }
  if (f.kind == kBye) {
    if (p.error.empty()) {
      p.error = rank_str(peer) + " closed its communicator";
      p.failed_at = Clock::now();
    }
    p.bye_received = true;
    push(p, Op{kBye, 0, 0, nullptr, 0, 0, {}});  // answered once, so the peer's receiver ends too
    return Landing::Bye;
  }
  if (f.kind != kWrite) refuse(peer, p, "has an unknown kind " + std::to_string(f.kind));
  if (p.pending) throw std::logic_error("fallback landing() twice without landed()");
  size_t ring = layout_.slot_off(peer, 0), sb = layout_.slot_bytes();
  if (f.off < ring || (f.off - ring) % sb != 0 || (f.off - ring) / sb >= size_t(layout_.nslots))
    refuse(peer, p, "writes at offset " + std::to_string(f.off) + ", which is not a slot of its ring [" +
                        std::to_string(ring) + ", " + std::to_string(layout_.slot_off(peer + 1, 0)) + ")");
  int k = int((f.off - ring) / sb);
  if (f.n > layout_.bound)
    refuse(peer, p, "carries " + std::to_string(f.n) + " bytes, over this rank's bound of " +
                        std::to_string(layout_.bound));
  MsgHeader h;
  std::memcpy(&h, f.hdr, sizeof h);
  // A descriptor or rendezvous head carries no payload (its nbytes describe
  // data sent apart, as kChunk messages here); a device payload never travels
  // here (the caller stages it through host memory); the array-kind bits are
  // the sender's to set.
  if (f.hdr_len != sizeof(MsgHeader) || h.seq != f.value || payload_bytes(h) != f.n || h.ndim > uint32_t(kMaxDims) ||
      (h.flags & ~kHostHeaderFlags) != 0)
    refuse(peer, p, "has a header that does not match it (seq " + std::to_string(h.seq) + " vs " +
                        std::to_string(f.value) + ", nbytes " + std::to_string(h.nbytes) + " vs " +
                        std::to_string(f.n) + ", ndim " + std::to_string(h.ndim) + ", flags " +
                        std::to_string(h.flags) + ")");
  if (p.landed_seq[k] != p.freed_seq[k] || f.value <= p.landed_seq[k])
    refuse(peer, p, "writes slot " + std::to_string(k) + " (seq " + std::to_string(f.value) +
                        ") while it still holds message seq " + std::to_string(p.landed_seq[k]) +
                        " that this rank has not freed");
  p.pending = true;
  p.pending_slot = k;
  p.pending_hdr = h;
  *dst = local_.base() + f.off + kPayloadOff;
  *n = f.n;
  return Landing::Write;
}

void FallbackTransport::landed(int peer) {
  std::lock_guard<std::mutex> g(mu_);
  Peer& p = peer_at(peer);
  if (!p.pending) throw std::logic_error("fallback landed() without landing()");
  p.pending = false;
  char* slot = local_.base() + layout_.slot_off(peer, p.pending_slot);
  p.landed_seq[p.pending_slot] = p.pending_hdr.seq;
  // The payload is in place: header, then the ready word (release), as a
  // mapped write leaves them.
  write_mapped_message(slot, &p.pending_hdr, sizeof(MsgHeader), nullptr, 0, p.pending_hdr.seq);
}

void FallbackTransport::shutdown() {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& pp : peers_)
    if (pp->connected && !pp->bye_queued) push(*pp, Op{kBye, 0, 0, nullptr, 0, 0, {}});
}

namespace {

TransportRegistrar fallback_registrar({
    "fallback",
    /*device=*/false,
    /*same_host_only=*/false,
    // The route of last resort: the mover carries any pair, so it never refuses one.
    [](const PeerInfo&, const PeerInfo&, const Options&) -> std::string { return ""; },
    [](const TransportContext& c) -> std::shared_ptr<Transport> {
      return std::make_shared<FallbackTransport>(c.region, c.layout, c.rank);
    },
    /*last_resort=*/true,
});

}  // namespace

}  // namespace varcomm
