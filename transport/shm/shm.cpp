#include "shm.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include "errors.h"
#include "protocol.h"

namespace varcomm {
namespace {

// Field 22 of /proc/<pid>/stat: start time, so a recycled pid is not mistaken
// for the peer. Empty string when the process is gone.
std::string proc_state(int pid, unsigned long long* start) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return "";
  auto close = line.rfind(')');
  if (close == std::string::npos) return "";
  std::istringstream rest(line.substr(close + 2));
  std::string state;
  rest >> state;
  std::string tok;
  for (int field = 4; field < 22 && rest >> tok; ++field) {
  }
  rest >> *start;
  return state;
}

class ShmTransport : public Transport {
 public:
  explicit ShmTransport(Region& local) : local_(local) {}
  ~ShmTransport() override {
    for (auto& kv : peers_)
      if (kv.second.base != local_.base()) unmap_region(kv.second.base, kv.second.size);
  }

  std::string name() const override { return "shm"; }
  std::string describe() const override { return "shm (same host, mapped host memory)"; }

  std::string expose(void* base, size_t size) override {
    unsigned long long start = 0;
    proc_state(getpid(), &start);
    (void)base;
    return std::to_string(getpid()) + ":" + std::to_string(local_.fd()) + ":" +
           std::to_string(size) + ":" + std::to_string(start);
  }

  void connect(int peer, const std::string& d) override {
    Peer p;
    int fd = -1;
    size_t size = 0;
    if (sscanf(d.c_str(), "%d:%d:%zu:%llu", &p.pid, &fd, &size, &p.start) != 4)
      throw Error(ErrorKind::Invalid, "bad shm descriptor from rank " + std::to_string(peer));
    p.size = size;
    if (p.pid == getpid()) {
      p.base = local_.base();
    } else {
      std::string err;
      p.base = map_peer_region(p.pid, fd, size, &err);
      if (!p.base)
        throw Error(ErrorKind::PeerFailure,
                    "cannot map rank " + std::to_string(peer) + "'s region: " + err +
                        " (same-host ranks must run as the same user; set VARCOMM_TRANSPORT=fallback to avoid shm)",
                    peer);
    }
    peers_[peer] = p;
  }

  void connected() override { local_.close_fd(); }

  uint64_t write_message(int peer, size_t ready_off, const void* hdr, size_t hdr_len,
                         const void* payload, size_t n, uint64_t seq) override {
    char* slot = peers_.at(peer).base + ready_off;
    std::memcpy(slot + kHeaderOff, hdr, hdr_len);
    if (n) std::memcpy(slot + kPayloadOff, payload, n);
    __atomic_store_n(reinterpret_cast<uint64_t*>(slot), seq, __ATOMIC_RELEASE);
    return 1;
  }

  void write_u64(int peer, size_t off, uint64_t value) override {
    __atomic_store_n(reinterpret_cast<uint64_t*>(peers_.at(peer).base + off), value, __ATOMIC_RELEASE);
  }

  std::string peer_error(int peer) override {
    auto& p = peers_.at(peer);
    if (p.pid == getpid()) return "";
    unsigned long long start = 0;
    std::string st = proc_state(p.pid, &start);
    if (st.empty() || st == "Z" || st == "X" || start != p.start)
      return "rank " + std::to_string(peer) + " (pid " + std::to_string(p.pid) + ") has exited";
    return "";
  }

 private:
  struct Peer {
    char* base = nullptr;
    size_t size = 0;
    int pid = 0;
    unsigned long long start = 0;
  };
  Region& local_;
  std::unordered_map<int, Peer> peers_;
};

}  // namespace

std::shared_ptr<Transport> make_shm_transport(Region& local) {
  return std::make_shared<ShmTransport>(local);
}

}  // namespace varcomm
