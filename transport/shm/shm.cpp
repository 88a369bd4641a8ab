#include <sys/uio.h>
#include <unistd.h>

#include <chrono>
#include <cerrno>

#include <cstdio>
#include <cstring>
#include <memory>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include "errors.h"
#include "hostmem.h"
#include "protocol.h"
#include "registry.h"

namespace varcomm {
namespace {

class ShmTransport : public Transport {
 public:
  ShmTransport(Region& local, const Layout& layout, const std::string& cma, const std::string& stores)
      : local_(local), layout_(layout), cma_(cma), stores_(peer_stores(stores)), stores_name_(stores) {}
  ~ShmTransport() override {
    for (auto& kv : peers_)
      if (kv.second.base != local_.base()) unmap_region(kv.second.base, kv.second.size);
  }

  std::string name() const override { return "shm"; }
  std::string describe() const override {
    std::string d = "shm (same host, mapped host memory; ";
    if (!use_cma()) {
      std::string why = probe_.empty() ? "cma=" + cma_ : probe_;
      if (cma_ == "off" || !cma_refused_.empty())
        return d + "messages over the bound stream through the slots: no single-copy reads (" +
               (cma_refused_.empty() ? why : cma_refused_) + "))";
      return d + "messages over the bound stream through the slots (read once by CMA while the sender's copies into "
                 "slots are slow: shm_stores); a collective's chunks from 128 KiB copied once, "
                 "by their sender into an output in the landing area, else straight from the sender's memory (CMA), "
                 "which beats two memcpys out of cache (" + why + "))";
    }
    if (cma_refused_.empty())
      return d + "messages over eager_max copied once, straight from the sender's memory (CMA" +
             (probe_.empty() ? std::string(", cma=on)") : ": " + probe_ + ")") + ")";
    return d + "no single-copy reads: " + cma_refused_ + "; messages over the bound stream through the slots)";
  }
  std::map<std::string, std::string> properties() const override {
    // on: every message over eager_max; chunks: a collective's large chunks only
    const char* cma = !cma_refused_.empty() || cma_ == "off" ? "off" : use_cma() ? "on" : "chunks";
    return {{"cma", cma}, {"cma_refused", cma_refused_}, {"cma_probe", probe_}, {"stores", stores_name_}};
  }

  std::string expose(void* base, size_t size) override {
    unsigned long long start = process_start(getpid());
    return std::to_string(getpid()) + ":" + std::to_string(local_.fd()) + ":" + std::to_string(size) + ":" +
           std::to_string(start) + ":" + std::to_string(layout_.nslots) + ":" + std::to_string(layout_.bound) + ":" +
           std::to_string(uintptr_t(base)) + ":" + std::to_string(layout_.landing);
  }

  void connect(int peer, const std::string& d) override {
    Peer p;
    int fd = -1;
    size_t size = 0;
    Layout L;
    L.world = layout_.world;
    unsigned long long bound = 0, at = 0, landing = 0;
    if (sscanf(d.c_str(), "%d:%d:%zu:%llu:%d:%llu:%llu:%llu", &p.pid, &fd, &size, &p.start, &L.nslots, &bound, &at,
               &landing) != 8)
      throw Error(ErrorKind::Invalid, "bad shm descriptor from rank " + std::to_string(peer));
    L.bound = bound;
    L.landing = landing;
    p.size = size;
    p.slots_end = L.total();
    if (p.pid == getpid()) {
      p.base = local_.base();
    } else {
      std::string err;
      p.base = map_peer_region(p.pid, p.start, fd, size, &err);
      if (!p.base)
        throw Error(ErrorKind::PeerFailure,
                    "cannot map rank " + std::to_string(peer) + "'s region: " + err +
                        " (same-host ranks must run as the same user; set VARCOMM_TRANSPORT=fallback to avoid shm)",
                    peer);
    }
    std::string bad = region_mismatch(p.base, size, peer, p.pid, L);
    if (!bad.empty()) {
      if (p.base != local_.base()) unmap_region(p.base, size);
      throw Error(ErrorKind::PeerFailure, "cannot use " + bad + " (a stale descriptor, or a process that reused its pid)",
                  peer);
    }
    // Single-copy reads (process_vm_readv) need ptrace rights over the peer
    // (same user, and Yama's ptrace_scope): tried once on its region's magic,
    // where the peer says it mapped the region.
    if (p.pid != getpid()) {
      uint64_t magic = 0;
      std::string err = read_from(p.pid, at, &magic, sizeof magic);
      if (err.empty() && magic != kMagic) err = "the address it published is not its region";
      p.cma = err.empty();
      if (!p.cma && cma_refused_.empty()) cma_refused_ = "CMA to rank " + std::to_string(peer) + " refused (" + err + ")";
    }
    peers_[peer] = p;
  }

  std::string read_refused(int peer) const override {
    if (!use_cma()) return probe_.empty() ? "cma=" + cma_ : probe_;
    return chunk_read_refused(peer);
  }

  std::string chunk_read_refused(int peer) const override {
    if (cma_ == "off") return "cma=off";
    auto& p = peers_.at(peer);
    return p.cma || p.pid == getpid() ? "" : cma_refused_;
  }

  std::string read_peer(int peer, uint64_t src, void* dst, size_t n) override {
    auto& p = peers_.at(peer);
    if (p.pid == getpid()) {
      std::memcpy(dst, reinterpret_cast<const void*>(uintptr_t(src)), n);
      return "";
    }
    std::string err = read_from(p.pid, src, dst, n);
    if (err.empty()) return "";
    std::string gone = process_exit_error(peer, p.pid, p.start);
    return gone.empty() ? err : gone;
  }

  uint64_t* peer_word(int peer, size_t off) override {
    return reinterpret_cast<uint64_t*>(peers_.at(peer).base + off);
  }

  void connected() override { local_.close_fd(); }

  uint64_t landing_write_max() const override { return UINT64_MAX; }
  // A large message into an ordinary out (no landing block, no CMA) streams
  // through the slots in pieces of this size: the sender copies the next
  // into a slot while the receiver copies the last out, so the two copies
  // overlap on two cores. Whole-bound pieces (8 MiB) barely overlap and cycle
  // through cold pages: 16 MiB unidirectional 5.9 ms through a landing block
  // and a second memcpy, 2.5 ms in 1 MiB pieces, one memcpy 2.3-2.6 ms.
  uint64_t stream_chunk() const override { return 1u << 20; }

  size_t peer_bytes(int peer) const override { return peers_.at(peer).size; }

  uint64_t write_message(int peer, size_t ready_off, const void* hdr, size_t hdr_len,
                         const void* payload, size_t n, uint64_t seq) override {
    auto& p = peers_.at(peer);
    // Slots and landing blocks are timed apart (hostmem.h PeerCopyTarget).
    write_mapped_message(p.base + ready_off, hdr, hdr_len, payload, n, seq, stores_,
                         ready_off < p.slots_end ? PeerCopyTarget::kSlots : PeerCopyTarget::kLanding);
    return 1;
  }

  // (Forced streaming says so for good: the user found ordinary stores slow here.)
  bool slot_writes_slow() const override {
    return stores_ == PeerStores::kStreaming || (stores_ == PeerStores::kAuto && peer_stores_slow());
  }

  bool raw_writes() const override { return true; }
  void write_into(int peer, size_t off, const void* data, size_t n) override {
    std::memcpy(peers_.at(peer).base + off, data, n);
  }

  void write_u64(int peer, size_t off, uint64_t value) override {
    store_release_u64(peers_.at(peer).base + off, value);
  }

  std::string peer_error(int peer) override {
    auto& p = peers_.at(peer);
    return p.pid == getpid() ? "" : process_exit_error(peer, p.pid, p.start);
  }
  bool peer_exited(int peer) override { return !peer_error(peer).empty(); }  // (its only failure)

 private:
  // process_vm_readv until all n bytes are in (it may stop early); empty or why not.
  static std::string read_from(int pid, uint64_t src, void* dst, size_t n) {
    char* d = static_cast<char*>(dst);
    while (n) {
      iovec l{d, n}, r{reinterpret_cast<void*>(uintptr_t(src)), n};
      ssize_t got = process_vm_readv(pid, &l, 1, &r, 1, 0);
      if (got <= 0) {
        int e = got < 0 ? errno : EFAULT;
        std::string why = std::string("process_vm_readv: ") + strerror(e);
        if (e == EPERM)
          why += "; same-host ranks need ptrace rights over each other: the same user, and "
                 "/proc/sys/kernel/yama/ptrace_scope 0 (or CAP_SYS_PTRACE)";
        return why;
      }
      d += got;
      src += uint64_t(got);
      n -= size_t(got);
    }
    return "";
  }

  struct Peer {
    char* base = nullptr;
    size_t size = 0;
    int pid = 0;
    unsigned long long start = 0;
    bool cma = false;
    size_t slots_end = 0;  // where the peer's slot rings end (its landing area follows)
  };
  Region& local_;
  Layout layout_;
  std::string cma_refused_;  // why single-copy reads are off for some peer; empty: on for all
  std::string cma_;          // option cma: auto | on | off
  PeerStores stores_;        // option shm_stores (hostmem.h copy_to_peer)
  std::string stores_name_;
  mutable int probed_ = -1;  // use_cma under auto: -1 not yet, 0 no, 1 yes
  mutable std::string probe_;

  // Whether this rank takes single-copy reads for every message over
  // eager_max: option cma, and under auto whether one CMA copy beats the
  // eager path's two memcpys on this machine (cma=chunks: never; a
  // collective's large chunks may still be, chunk_read_refused).
  // The kernel copies page by page; where it moves far less than a
  // user-space memcpy (10 GB/s against 33 GB/s on one host here) two memcpys,
  // or chunks streamed through the slots, are faster. Measured once, on
  // 4 MiB, reading our own memory. Each receiver decides for itself (it
  // either copies a head's data or asks for the stream), so the two sides
  // need not agree.
  bool use_cma() const {
    if (cma_ != "auto") return cma_ == "on";  // (chunks: no)
    if (probed_ < 0) probe();
    return probed_ == 1;
  }

  void probe() const {
    const size_t n = 4u << 20;
    std::unique_ptr<char[]> a(new char[n]), b(new char[n]);
    std::memset(a.get(), 1, n);
    std::memset(b.get(), 2, n);
    auto best = [](auto&& f) {
      double t = 1e30;
      for (int i = 0; i < 3; ++i) {
        auto t0 = std::chrono::steady_clock::now();
        f();
        t = std::min(t, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      return t;
    };
    double mem = best([&] { std::memcpy(b.get(), a.get(), n); });
    bool ok = true;
    double cma = best([&] { ok = ok && read_from(getpid(), uint64_t(uintptr_t(a.get())), b.get(), n).empty(); });
    probed_ = ok && cma < 2 * mem ? 1 : 0;
    char buf[160];
    snprintf(buf, sizeof buf, "CMA %.1f GB/s against memcpy %.1f GB/s (two memcpys: %.1f GB/s): %s", n / cma / 1e9,
             n / mem / 1e9, n / mem / 2e9,
             probed_ ? "one CMA copy is faster than two memcpys" : "two memcpys are faster than one CMA copy here");
    probe_ = buf;
  }
  std::unordered_map<int, Peer> peers_;
};

TransportRegistrar shm_registrar({
    "shm",
    /*device=*/false,
    /*same_host_only=*/true,
    [](const PeerInfo& self, const PeerInfo& peer, const Options&) -> std::string {
      if (peer.host != self.host) return "rank " + std::to_string(peer.rank) + " is on another host";
      if (!peer.has("shm") || !self.has("shm")) return "rank " + std::to_string(peer.rank) + " has no shm endpoint";
      return "";
    },
    [](const TransportContext& c) -> std::shared_ptr<Transport> {
      return std::make_shared<ShmTransport>(c.region, c.layout, c.options.cma, c.options.shm_stores);
    },
});

}  // namespace

}  // namespace varcomm
