#include <unistd.h>

#include <cstdio>
#include <cstring>
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
  ShmTransport(Region& local, const Layout& layout) : local_(local), layout_(layout) {}
  ~ShmTransport() override {
    for (auto& kv : peers_)
      if (kv.second.base != local_.base()) unmap_region(kv.second.base, kv.second.size);
  }

  std::string name() const override { return "shm"; }
  std::string describe() const override { return "shm (same host, mapped host memory)"; }

  std::string expose(void* base, size_t size) override {
    unsigned long long start = process_start(getpid());
    (void)base;
    return std::to_string(getpid()) + ":" + std::to_string(local_.fd()) + ":" + std::to_string(size) + ":" +
           std::to_string(start) + ":" + std::to_string(layout_.nslots) + ":" + std::to_string(layout_.bound);
  }

  void connect(int peer, const std::string& d) override {
    Peer p;
    int fd = -1;
    size_t size = 0;
    Layout L;
    L.world = layout_.world;
    unsigned long long bound = 0;
    if (sscanf(d.c_str(), "%d:%d:%zu:%llu:%d:%llu", &p.pid, &fd, &size, &p.start, &L.nslots, &bound) != 6)
      throw Error(ErrorKind::Invalid, "bad shm descriptor from rank " + std::to_string(peer));
    L.bound = bound;
    p.size = size;
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
    peers_[peer] = p;
  }

  void connected() override { local_.close_fd(); }

  size_t peer_bytes(int peer) const override { return peers_.at(peer).size; }

  uint64_t write_message(int peer, size_t ready_off, const void* hdr, size_t hdr_len,
                         const void* payload, size_t n, uint64_t seq) override {
    write_mapped_message(peers_.at(peer).base + ready_off, hdr, hdr_len, payload, n, seq);
    return 1;
  }

  void write_u64(int peer, size_t off, uint64_t value) override {
    store_release_u64(peers_.at(peer).base + off, value);
  }

  std::string peer_error(int peer) override {
    auto& p = peers_.at(peer);
    return p.pid == getpid() ? "" : process_exit_error(peer, p.pid, p.start);
  }

 private:
  struct Peer {
    char* base = nullptr;
    size_t size = 0;
    int pid = 0;
    unsigned long long start = 0;
  };
  Region& local_;
  Layout layout_;
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
      return std::make_shared<ShmTransport>(c.region, c.layout);
    },
});

}  // namespace

}  // namespace varcomm
