// RDMA transport over libfabric (FI_EP_RDM, FI_RMA). See rdma.h.
//
// Data path. write_message is one fi_writemsg of header (padded to
// kHeaderBytes) + payload into the peer's slot with FI_REMOTE_CQ_DATA =
// ready_off >> 8 (32 bits: the verbs/EFA immediate). The receiver's
// progress() reads its CQ and, per remote
// completion, copies the landed header's seq into the slot's ready word. The
// ready word is written only from the completion, so providers that do not
// order writes (EFA) never expose a header before its payload.
//
// Source buffers. The header, and payloads up to ~8 KiB, are copied into a
// per-op staging slot (registered once): a memcpy of a few KiB is cheaper
// than a registration. Larger payloads are sent in place as a second iov; only
// FI_MR_LOCAL providers (verbs, efa) need them registered, per message, which
// the provider's own MR cache (with its memory monitor) makes cheap and safe
// when the user frees and reuses memory.
//
// Credits (write_u64) are held until this transport's next write_message,
// progress(), complete() or peer_error(): a receiver that answers puts its
// reply on the wire first, and where the provider scatters one write to
// several remote addresses (tcp: rma_iov_limit 4) the credits held for that
// peer ride in a small message's own write. Otherwise they are 8-byte
// fi_writes from a staging slot, tracked like messages (fi_inject_write would
// save a completion, but libfabric 1.17's tcp;ofi_rxm crashes when an
// injected write meets a closing connection). A credit nothing carried
// goes on its own within about 5 ms, from a thread of ours (a receiver that
// computes after its last receive sends no reply for seconds, and a sender
// out of slots would wait that long). The option rdma_eager_credits posts
// each credit at once.
//
// Liveness. Each pair keeps an idle TCP connection with aggressive keepalive
// (option peer_timeout, seconds, default 5). The kernel answers keepalive
// probes, so a peer busy computing for minutes is never reported dead, while
// a killed process gives EOF/RST at once and a link that went down gives
// ETIMEDOUT within the timeout. A heartbeat written from progress() would need
// every rank to call progress() regularly (tcp has manual progress), and CQ
// errors alone miss a dead peer we are only waiting on. CQ errors on writes
// to a peer are reported too.
#include "rdma.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#include "auth.h"
#include "errors.h"
#include "fabric_lib.h"
#include "protocol.h"
#include "registry.h"
#include "rdma_port.h"

namespace varcomm {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kApiVersion = FI_VERSION(1, 10);
constexpr size_t kStage = 8192;  // per-op staging slot: header + small payloads, then held credits
constexpr size_t kRideOff = kStage - 64;  // held credits riding along with a message (up to 8)
constexpr size_t kInline = kRideOff;      // header + payload up to this size is copied
constexpr size_t kMaxRide = 4;   // held credits carried by one message write
constexpr size_t kMaxOps = 256;  // writes in flight per transport
constexpr size_t kRxPosts = 64;  // receives posted for FI_RX_CQ_DATA providers
constexpr uint64_t kMrModes = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
// Tried in order when no provider is named; the first that offers FI_RMA on an RDM endpoint wins.
// (rdma_default_providers(): varcomm-doctor shows the same list.)
const char* const kDefaultProviders[] = {"verbs;ofi_rxm", "efa", "cxi", "tcp;ofi_rxm"};

[[noreturn]] void invalid(const std::string& msg) { throw Error(ErrorKind::Invalid, "rdma: " + msg); }
[[noreturn]] void fail(const std::string& what, long rc) {
  invalid(what + ": " + fab::api().strerror(int(rc < 0 ? -rc : rc)));
}
#define FI_CHECK(call)                    \
  do {                                    \
    long rc_ = long(call);                \
    if (rc_) fail(#call, rc_);            \
  } while (0)

std::string hex(const void* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; i++) {
    unsigned char c = static_cast<const unsigned char*>(p)[i];
    s += d[c >> 4];
    s += d[c & 15];
  }
  return s;
}

std::string unhex(const std::string& s) {
  std::string out;
  for (size_t i = 0; i + 1 < s.size(); i += 2) out += char(std::stoi(s.substr(i, 2), nullptr, 16));
  return out;
}

// hmem: an endpoint that also moves GPU memory (GPUDirect RDMA), which we
// always register and pass a descriptor for: so FI_MR_HMEM is fine there.
fi_info* hints_for(const std::string& prov, const std::string& iface, bool hmem = false) {
  fi_info* h = fab::api().allocinfo();
  h->ep_attr->type = FI_EP_RDM;
  // FI_MSG only so we can post receives if the provider has FI_RX_CQ_DATA.
  h->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE | FI_MSG | (hmem ? FI_HMEM : 0);
  h->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
  h->domain_attr->mr_mode = kMrModes | (hmem ? FI_MR_HMEM : 0);  // FI_MR_RAW providers are not offered
  h->domain_attr->threading = FI_THREAD_DOMAIN;  // the engine serialises calls under its mutex
  h->tx_attr->iov_limit = 2;                     // header + payload in one write
  h->fabric_attr->prov_name = strdup(prov.c_str());
  if (!iface.empty()) h->domain_attr->name = strdup(iface.c_str());
  return h;
}

// fi_getinfo for one provider; nullptr when it offers nothing usable.
fi_info* query(const std::string& prov, const std::string& iface, std::string* why, bool hmem = false) {
  fi_info* hints = hints_for(prov, iface, hmem);
  fi_info* list = nullptr;
  int rc = fab::api().getinfo(kApiVersion, nullptr, nullptr, 0, hints, &list);
  fab::api().freeinfo(hints);
  if (rc) {
    if (why)
      *why = std::string("fi_getinfo: ") + fab::api().strerror(-rc) +
             (rc == -FI_ENODATA ? " (no provider of that name here has an RDM endpoint with RMA" +
                                      std::string(iface.empty() ? "" : " on that interface") + ")"
                                : "");
    return nullptr;
  }
  // Prefer IPv4 on a real interface: a loopback or link-local fabric cannot reach other hosts.
  fi_info* best = nullptr;
  int best_score = -1;
  for (fi_info* i = list; i; i = i->next) {
    if (i->domain_attr->cq_data_size < 4) continue;
    // Layered providers (ofi_rxm 1.17) ignore the domain-name hint: filter here.
    if (!iface.empty() && iface != i->domain_attr->name && iface != i->fabric_attr->name) continue;
    int score = 0;
    if (i->addr_format != FI_SOCKADDR_IN6) score += 1;
    if (iface.empty() && strcmp(i->domain_attr->name, "lo") != 0) score += 2;
    if (score > best_score) best = i, best_score = score;
  }
  fi_info* out = best ? fab::api().dupinfo(best) : nullptr;
  fab::api().freeinfo(list);
  if (!out && why) *why = iface.empty() ? "no domain with >= 4 bytes of remote CQ data" : "no domain named " + iface;
  return out;
}

// Does `prov` take device memory (FI_HMEM) on domain `iface`? Asked with the
// hints we run on plus FI_HMEM / FI_MR_HMEM (fi_getinfo(3)); *why says what
// it answered either way.
bool hmem_offered(const std::string& prov, const std::string& iface, std::string* why) {
  fi_info* h = hints_for(prov, iface, true);
  fi_info* list = nullptr;
  int rc = fab::api().getinfo(kApiVersion, nullptr, nullptr, 0, h, &list);
  fab::api().freeinfo(h);
  if (rc) {
    *why = prov + " does not offer FI_HMEM (" + fab::api().strerror(-rc) + ")";
    return false;
  }
  bool ok = false;
  for (fi_info* i = list; i && !ok; i = i->next) ok = (i->caps & FI_HMEM) && iface == i->domain_attr->name;
  fab::api().freeinfo(list);
  *why = ok ? prov + " offers FI_HMEM on domain " + iface : prov + " lists FI_HMEM, but not on domain " + iface;
  return ok;
}

void set_keepalive(int fd, int timeout_s) {
  // A probe each second once idle 1 s. Linux gives up when nothing came back
  // for TCP_USER_TIMEOUT, checked when a probe is due, counted from the last
  // probe answered (up to a second before the link went silent); the link
  // must be back for the probe before that check to be answered. So a limit
  // of L s keeps links silent for L - 2 to L - 1 s: with L = timeout_s, a
  // 2.5 s flap survived a 4 s pair and a 3.6 s one failed it (helper-56).
  // L = timeout_s + 2: a link silent for up to timeout_s s survives, one
  // silent longer counts as down within timeout_s + 2 s.
  int one = 1, idle = 1, intvl = 1, cnt = timeout_s + 2;
  unsigned user_ms = (unsigned(timeout_s) + 2) * 1000;
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_ms, sizeof user_ms);
}

// An IP for the liveness listener when the fabric address is not one (efa, cxi).
std::string host_ip(const std::string& forced) {
  if (!forced.empty()) return forced;
  std::string ip;
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) == 0) {
    for (ifaddrs* i = ifs; i; i = i->ifa_next) {
      if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP) ||
          (i->ifa_flags & IFF_LOOPBACK))
        continue;
      char buf[INET_ADDRSTRLEN];
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof buf);
      ip = buf;
      break;
    }
    freeifaddrs(ifs);
  }
  return ip.empty() ? "127.0.0.1" : ip;
}

class RdmaTransport final : public Transport, public rdma::Port {
 public:
  RdmaTransport(int rank, int world, std::string provider, std::string iface, const Options& o);
  ~RdmaTransport() override;

  std::string name() const override { return "rdma"; }
  uint64_t stream_chunk() const override { return stream_chunk_; }
  // Eager up to where host messages stream anyway: on tcp;ofi_rxm the
  // rendezvous round trip before the write cost more than the copy out of
  // the slot saves (1 MiB ping-pong 0.59-0.67x fi_pingpong by rendezvous,
  // 1.01-1.15x eager; bench/results/issue11-2026-12-04-s9.md).
  // (Never under the shm default: a host message past eager_max into a GPU
  // out on a pair with a device route is refused, see Engine::misfit.)
  uint64_t eager_max() const override { return std::max<uint64_t>(2 * stream_chunk_, Transport::eager_max()); }
  // One fi_writemsg of header + payload; the provider's own limit.
  uint64_t landing_write_max() const override {
    return info_->ep_attr->max_msg_size > kHeaderBytes ? info_->ep_attr->max_msg_size - kHeaderBytes : 0;
  }
  std::string describe() const override { return describe_; }
  std::map<std::string, std::string> properties() const override {
    return {{"provider", info_->fabric_attr->prov_name},
            {"fabric", info_->fabric_attr->name},
            {"domain", info_->domain_attr->name}};
  }
  std::string expose(void* base, size_t size) override;
  void connect(int peer, const std::string& descriptor) override;
  void connected() override;
  uint64_t write_message(int peer, size_t ready_off, const void* hdr, size_t hdr_len, const void* payload, size_t n,
                         uint64_t seq) override;
  bool complete(int peer, uint64_t ticket) override;
  void write_u64(int peer, size_t off, uint64_t value) override;
  void send_credits_now(int peer) override {
    Lock g(*this);
    flush_credits(peer);
  }
  void progress() override;
  std::string peer_error(int peer) override;
  size_t peer_bytes(int peer) const override { return size_t(peers_.at(size_t(peer)).size); }

  // rdma::Port (rdma_port.h): the GPU message engine's use of this endpoint.
  void attach(std::function<bool(size_t)> sink) override {
    std::lock_guard<std::recursive_mutex> g(mu_);
    sink_ = std::move(sink);
    shared_ = true;
  }
  std::recursive_mutex& mutex() override { return mu_; }
  uint64_t write_data(int peer, size_t off, const void* src, size_t n, void* desc) override;
  bool done(uint64_t ticket) override { return complete(-1, ticket); }
  bool busy() override {
    Lock g(*this);
    return free_ops_.size() < ops_.size() || queued_credits_;
  }
  uint64_t write_data_to(int peer, size_t imm_off, uint64_t raddr, uint64_t key, const void* src, size_t n,
                         void* desc) override;
  void* reg_source(void* p, size_t n, int iface_cuda, void** handle) override;
  uint64_t reg_target(void* p, size_t n, int iface_cuda, uint64_t* addr, void** handle) override;
  void unreg(void* handle) override {
    Lock g(*this);
    if (handle) fi_close(&static_cast<fid_mr*>(handle)->fid);
  }
  bool hmem_cuda(std::string* why) const override {
    if (why) *why = hmem_why_ + (hmem_cuda_ && !hmem_ep_ ? ", but this endpoint was opened without it" : "");
    return hmem_cuda_ && hmem_ep_;
  }
  std::string provider() const override { return info_->fabric_attr->prov_name; }

 private:
  // Every entry point takes the endpoint's mutex once a GPU engine shares it
  // (attach); a host-only endpoint, called under the protocol engine's mutex
  // alone, pays nothing.
  struct Lock {
    std::unique_lock<std::recursive_mutex> g;
    explicit Lock(RdmaTransport& t) : g(t.mu_, std::defer_lock) {
      if (t.shared_) g.lock();
    }
  };
  void probe_hmem(const std::string& iface);
  struct Op {
    fi_context2 ctx;  // first: the provider's scratch space (FI_CONTEXT2)
    uint64_t ticket = 0;
    bool busy = false;
    int peer = -1;
    fid_mr* mr = nullptr;  // in-place payload registration (FI_MR_LOCAL only)
  };
  struct Rx {
    fi_context2 ctx;
  };
  struct Peer {
    fi_addr_t addr = FI_ADDR_UNSPEC;
    uint64_t key = 0, raddr = 0, size = 0;
    uint64_t hello_key = 0, hello_addr = 0;  // the peer's hello array (see connected())
    int sock = -1;  // liveness connection
    uint64_t live_token = 0;  // what its dialer sends with its rank (see live_token_)
    bool connected = false;
    Clock::time_point since;
    std::string error;
    // write_u64s held for the next write_message / progress(), or not yet
    // taken by the provider; in order, per peer (a stuck peer holds back no other)
    struct U64 {
      uint64_t addr, key, value;
    };
    std::deque<U64> credits;
  };

  void init(std::string provider, std::string iface, const Options& o);
  void close_all();
  void quiesce();
  fid_mr* reg(void* p, size_t n, uint64_t access, int iface_cuda = -1);  // iface_cuda >= 0: GPU memory
  void handle(const fi_cq_data_entry& e);
  void read_error();
  void finish(Op& op);
  void land(uint64_t imm);
  void flush_credits(int peer);
  void post_u64(int peer, uint64_t addr, uint64_t key, uint64_t value, bool now);
  void flush_held_credits();  // the credit thread (see the top of the file)
  void flush_all();
  uint64_t start(uint32_t idx, int peer);
  void accept_pending(int wait_ms);
  void check_sock(int peer);
  Op* op_of(void* ctx) {
    auto* o = static_cast<Op*>(ctx);
    return o >= ops_.data() && o < ops_.data() + ops_.size() ? o : nullptr;
  }
  Rx* rx_of(void* ctx) {
    auto* r = static_cast<Rx*>(ctx);
    return r >= rx_.data() && r < rx_.data() + rx_.size() ? r : nullptr;
  }

  int rank_, world_, timeout_s_ = 5;
  bool debug_ = false;
  std::string describe_;
  fi_info* info_ = nullptr;
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_av* av_ = nullptr;
  fid_ep* ep_ = nullptr;
  fid_mr* region_mr_ = nullptr;
  fid_mr* stage_mr_ = nullptr;
  fid_mr* hello_mr_ = nullptr;
  std::vector<uint64_t> hello_;  // hello_[q] != 0: rank q's rxm connection to us is up
  void* stage_desc_ = nullptr;
  uint64_t mr_mode_ = 0, next_key_ = 1, next_serial_ = 1;
  std::string epname_;
  char* base_ = nullptr;
  size_t size_ = 0;
  std::vector<char> stage_;
  std::vector<Op> ops_;
  std::vector<Rx> rx_;
  std::vector<Peer> peers_;
  std::vector<uint32_t> free_ops_;  // any free op, so one stuck write (dead peer) blocks nothing else
  size_t queued_credits_ = 0;
  bool said_hello_ = false;
  bool eager_credits_ = false;  // option rdma_eager_credits: post each credit at once
  uint64_t stream_chunk_ = 0;   // option rdma_chunk: host messages over twice this stream in such chunks
  size_t max_ride_ = 0;         // credits per message write: rma_iov_limit - 1, at most kMaxRide
  int listen_fd_ = -1;
  struct Handshake {
    int fd;
    Clock::time_point until;
    bool partial;  // some of its 16 bytes came
  };
  std::vector<Handshake> handshaking_;  // liveness connections accepted, their rank and token not yet read
  std::string live_ip_;
  int live_port_ = 0;
  // Sent with our rank when we dial a peer's liveness port, and published in
  // our descriptor (encrypted in the store under a job key): whoever else
  // connects first and claims our rank is not taken for us (it made a live
  // peer look dead, or a dead one look alive).
  uint64_t live_token_ = 0;
  std::recursive_mutex mu_;
  bool shared_ = false;
  // Credits held since (the oldest not yet posted); the thread that posts
  // them after kCreditHold, started with the first held credit.
  Clock::time_point held_since_{};
  bool credit_idle_ = false;  // the credit thread sleeps until the next held credit wakes it
  std::thread credit_thread_;
  std::condition_variable_any credit_cv_;
  bool stop_credits_ = false;
  std::function<bool(size_t)> sink_;  // remote completions inside a slot's payload (GPU message chunks)
  bool hmem_cuda_ = false;  // the provider offers FI_HMEM on our domain
  bool hmem_ep_ = false;    // and our endpoint was opened with it (rdma::wants_gpudirect)
  std::string hmem_why_;
};

RdmaTransport::RdmaTransport(int rank, int world, std::string provider, std::string iface, const Options& o)
    : rank_(rank), world_(world), peers_(size_t(world)) {
  try {
    init(std::move(provider), std::move(iface), o);
  } catch (...) {
    close_all();  // a throwing constructor runs no destructor
    throw;
  }
}

void RdmaTransport::init(std::string provider, std::string iface, const Options& o) {
  timeout_s_ = o.peer_timeout >= 2 ? int(o.peer_timeout) : 5;
  debug_ = o.debug;
  std::string reason;
  if (!provider.empty()) {
    std::string why;
    info_ = query(provider, iface, &why);
    if (!info_)
      invalid("provider '" + provider + "'" + (iface.empty() ? "" : " on '" + iface + "'") +
              " offers no RDM endpoint with RMA and remote CQ data (" + why + "); see `varcomm-doctor`");
    reason = "requested";
  } else {
    for (const char* p : kDefaultProviders) {
      if ((info_ = query(p, iface, nullptr))) {
        reason = strcmp(p, "tcp;ofi_rxm") == 0 ? "default: no verbs/efa/cxi provider found"
                                               : std::string("default: ") + p + " is the first RDMA provider found";
        break;
      }
    }
    if (!info_)
      invalid("no libfabric provider offers an RDM endpoint with RMA and remote CQ data" +
              (iface.empty() ? std::string() : " on '" + iface + "'") + "; see `varcomm-doctor`");
  }
  // GPUDirect RDMA (rdma-gpu) needs an endpoint opened for GPU memory:
  // asked for only where it may be used, so host-only jobs keep their endpoint.
  probe_hmem(info_->domain_attr->name);
  if (hmem_cuda_ && rdma::wants_gpudirect(o.rdma_hmem, info_->fabric_attr->prov_name, o.cuda_device)) {
    if (fi_info* h = query(info_->fabric_attr->prov_name, info_->domain_attr->name, nullptr, true)) {
      fab::api().freeinfo(info_);
      info_ = h;
      hmem_ep_ = true;
    }
  }
  mr_mode_ = info_->domain_attr->mr_mode;
  eager_credits_ = o.rdma_eager_credits;
  shared_ = !eager_credits_;  // held credits: the credit thread calls in too (Lock)
  stream_chunk_ = o.rdma_chunk;
  max_ride_ = info_->tx_attr->rma_iov_limit > 1 ? std::min(kMaxRide, info_->tx_attr->rma_iov_limit - 1) : 0;
  if (o.rdma_strict) {  // tests: take the verbs/efa registration path on tcp too
    mr_mode_ |= FI_MR_LOCAL;
    reason += ", VARCOMM_RDMA_STRICT=1";
  }

  FI_CHECK(fab::api().fabric(info_->fabric_attr, &fabric_, nullptr));
  FI_CHECK(fi_domain(fabric_, info_, &domain_, nullptr));
  fi_cq_attr cqa{};
  cqa.format = FI_CQ_FORMAT_DATA;
  cqa.wait_obj = FI_WAIT_NONE;  // the engine polls; no fd to signal per completion
  cqa.size = std::max<size_t>(4096, info_->rx_attr->size + info_->tx_attr->size);
  FI_CHECK(fi_cq_open(domain_, &cqa, &cq_, nullptr));
  fi_av_attr ava{};
  ava.type = FI_AV_TABLE;
  ava.count = size_t(world_);
  FI_CHECK(fi_av_open(domain_, &ava, &av_, nullptr));
  FI_CHECK(fi_endpoint(domain_, info_, &ep_, nullptr));
  FI_CHECK(fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV));
  FI_CHECK(fi_ep_bind(ep_, &av_->fid, 0));
  FI_CHECK(fi_enable(ep_));
  char name[256];
  size_t len = sizeof name;
  FI_CHECK(fi_getname(&ep_->fid, name, &len));
  epname_.assign(name, len);

  ops_.resize(std::min(kMaxOps, std::max<size_t>(16, info_->tx_attr->size)));
  for (size_t i = ops_.size(); i-- > 0;) free_ops_.push_back(uint32_t(i));
  stage_.resize(ops_.size() * kStage);
  if (mr_mode_ & FI_MR_LOCAL) {
    stage_mr_ = reg(stage_.data(), stage_.size(), FI_WRITE);
    stage_desc_ = fi_mr_desc(stage_mr_);
  }
  hello_.assign(size_t(world_), 0);
  hello_mr_ = reg(hello_.data(), hello_.size() * 8, FI_REMOTE_WRITE);
  // Providers with FI_RX_CQ_DATA deliver remote CQ data into a posted receive.
  if ((info_->mode | info_->rx_attr->mode) & FI_RX_CQ_DATA) {
    rx_.resize(kRxPosts);
    for (Rx& r : rx_) FI_CHECK(fi_recv(ep_, nullptr, 0, nullptr, FI_ADDR_UNSPEC, &r.ctx));
  }

  // Liveness listener on the fabric's own IP when it has one, so it shares the data path's link.
  sockaddr_storage ss{};
  socklen_t sl;
  if (info_->addr_format == FI_SOCKADDR_IN || info_->addr_format == FI_SOCKADDR_IN6 ||
      info_->addr_format == FI_SOCKADDR) {
    memcpy(&ss, name, std::min(len, sizeof ss));
  }
  if (ss.ss_family != AF_INET && ss.ss_family != AF_INET6) {
    ss = {};
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    a->sin_family = AF_INET;
    inet_pton(AF_INET, host_ip(o.liveness_addr).c_str(), &a->sin_addr);
  }
  if (ss.ss_family == AF_INET) {
    reinterpret_cast<sockaddr_in*>(&ss)->sin_port = 0;
    sl = sizeof(sockaddr_in);
  } else {
    reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port = 0;
    sl = sizeof(sockaddr_in6);
  }
  listen_fd_ = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listen_fd_ < 0 || bind(listen_fd_, reinterpret_cast<sockaddr*>(&ss), sl) != 0 || listen(listen_fd_, 1024) != 0)
    invalid(std::string("liveness listener: ") + strerror(errno));
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &sl);
  char ipbuf[INET6_ADDRSTRLEN];
  if (ss.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&ss)->sin_addr, ipbuf, sizeof ipbuf);
    live_port_ = ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  } else {
    inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&ss)->sin6_addr, ipbuf, sizeof ipbuf);
    live_port_ = ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  }
  live_ip_ = ipbuf;
  std::string tok = random_bytes(sizeof live_token_);
  std::memcpy(&live_token_, tok.data(), sizeof live_token_);

  std::ostringstream d;
  d << "rdma (" << info_->fabric_attr->prov_name << ", fabric " << info_->fabric_attr->name << ", domain "
    << info_->domain_attr->name << "): " << reason << "; liveness via tcp keepalive " << live_ip_ << ", "
    << timeout_s_ << " s";
  describe_ = d.str();
  if (debug_) fprintf(stderr, "[varcomm rank %d] %s\n", rank_, describe_.c_str());
}

RdmaTransport::~RdmaTransport() {
  if (credit_thread_.joinable()) {
    {
      std::lock_guard<std::recursive_mutex> g(mu_);
      stop_credits_ = true;
    }
    credit_cv_.notify_all();
    credit_thread_.join();
  }
  close_all();
}

// Long enough for a reply to carry the credit (a ping-pong's round trip is
// tens of microseconds), short against a step of compute.
constexpr auto kCreditHold = std::chrono::microseconds(200);

void RdmaTransport::flush_held_credits() {
  std::unique_lock<std::recursive_mutex> g(mu_);
  while (!stop_credits_) {
    if (!queued_credits_) {
      // While credits keep coming (a ping-pong holds one per message) it
      // looks every 5 ms, so holding one costs no wake-up (128 B ping-pong
      // on tcp;ofi_rxm, alternating builds: unchanged to +0.3 us; a look
      // every 200 us cost 2 us; bench/results/issue11-2026-12-06-s11.md);
      // after 10 ms without, it sleeps until one is held.
      if (Clock::now() - held_since_ > std::chrono::milliseconds(10)) {
        credit_idle_ = true;
        credit_cv_.wait(g);
        credit_idle_ = false;
      } else {
        credit_cv_.wait_for(g, std::chrono::milliseconds(5));
      }
      continue;
    }
    const auto due = held_since_ + kCreditHold;
    if (Clock::now() < due) {
      credit_cv_.wait_until(g, due);
      continue;
    }
    flush_all();
    held_since_ = Clock::now();  // (any left: no free op right now; again after another hold)
  }
}

void RdmaTransport::close_all() {
  if (ep_) {
    quiesce();
    fi_close(&ep_->fid);
  }
  for (Peer& p : peers_) {
    if (p.sock < 0) continue;
    send(p.sock, "B", 1, MSG_NOSIGNAL | MSG_DONTWAIT);  // an orderly close, not a crash
    close(p.sock);
    p.sock = -1;
  }
  if (listen_fd_ >= 0) close(listen_fd_);
  for (const Handshake& h : handshaking_) close(h.fd);
  handshaking_.clear();
  for (Op& op : ops_)
    if (op.mr) fi_close(&op.mr->fid), op.mr = nullptr;
  if (region_mr_) fi_close(&region_mr_->fid);
  if (stage_mr_) fi_close(&stage_mr_->fid);
  if (hello_mr_) fi_close(&hello_mr_->fid);
  if (av_) fi_close(&av_->fid);
  if (cq_) fi_close(&cq_->fid);
  if (domain_) fi_close(&domain_->fid);
  if (fabric_) fi_close(&fabric_->fid);
  if (info_) fab::api().freeinfo(info_);
  ep_ = nullptr, region_mr_ = stage_mr_ = hello_mr_ = nullptr, av_ = nullptr, cq_ = nullptr, domain_ = nullptr;
  fabric_ = nullptr, info_ = nullptr, listen_fd_ = -1;
}

// Let our writes finish before fi_close: libfabric 1.17's tcp;ofi_rxm handles
// the cancelled ones badly (SIGSEGV in rxm_handle_comp_error). Bounded: a
// write to a dead peer never finishes.
void RdmaTransport::quiesce() {
  for (auto until = Clock::now() + std::chrono::seconds(2);
       (free_ops_.size() < ops_.size() || queued_credits_) && Clock::now() < until;) {
    try {
      progress();
    } catch (...) {
      return;
    }
  }
  // What peers sent since this rank last progressed (a close() that raced
  // their writes: an abandoned all-to-all's parts) is taken now, while the
  // memory it lands in is still ours (the engine and its region outlive the
  // transports): left to fi_close(ep), ofi_rxm crashed in it at exit
  // (SIGSEGV in 4 of 4 runs of a close during an async all-to-all). Until
  // the queue has been empty for 20 ms, at most 500 ms. A mitigation: what
  // arrives later still reaches fi_close (on a loaded machine it crashed
  // there in 3 of 6 runs); the crash inside ofi_rxm is not understood.
  const auto start = Clock::now();
  for (auto quiet = start; Clock::now() - start < std::chrono::milliseconds(500) &&
                           Clock::now() - quiet < std::chrono::milliseconds(20);) {
    try {
      Lock g(*this);
      fi_cq_data_entry e[32];
      ssize_t n = fi_cq_read(cq_, e, 32);
      if (n == -FI_EAVAIL) {
        read_error();  // (a closing peer's errors do not count as traffic: they could keep it spinning)
      } else if (n > 0) {
        for (ssize_t i = 0; i < n; i++) handle(e[i]);
        quiet = Clock::now();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    } catch (...) {
      return;
    }
  }
}

fid_mr* RdmaTransport::reg(void* p, size_t n, uint64_t access, int iface_cuda) {
  fid_mr* mr = nullptr;
  // requested_key matters only without FI_MR_PROV_KEY; keys must be unique
  // per domain. A key that lets peers write (the region, the hello words) is
  // random, as wide as the provider takes: a sequential one (tcp: 1, 2, ...)
  // is guessed by anyone who can reach the endpoint. Local-only keys are
  // never seen remotely.
  bool remote = access & (FI_REMOTE_WRITE | FI_REMOTE_READ);
  for (int attempt = 0;; ++attempt) {
    uint64_t key = next_key_++;
    if (remote && !(mr_mode_ & FI_MR_PROV_KEY)) {
      std::string r = random_bytes(sizeof key);
      std::memcpy(&key, r.data(), sizeof key);
      size_t bytes = info_->domain_attr->mr_key_size;
      if (bytes && bytes < sizeof key) key &= (uint64_t(1) << (8 * bytes)) - 1;
    }
    int rc;
    if (iface_cuda < 0) {
      rc = fi_mr_reg(domain_, p, n, access, 0, key, 0, &mr, nullptr);
    } else {  // GPU memory for the NIC to read or write (fi_mr(3), FI_HMEM_CUDA: GPUDirect RDMA)
      iovec iov{p, n};
      fi_mr_attr a{};
      a.mr_iov = &iov;
      a.iov_count = 1;
      a.access = access;
      a.requested_key = key;
      a.iface = FI_HMEM_CUDA;
      a.device.cuda = iface_cuda;
      rc = fi_mr_regattr(domain_, &a, 0, &mr);
    }
    if (rc == -FI_ENOKEY && attempt < 8) continue;  // that key is taken (a random one, or the counter met it)
    if (rc) fail(iface_cuda < 0 ? "fi_mr_reg" : "fi_mr_regattr (GPU memory, FI_HMEM_CUDA)", rc);
    break;
  }
  if (mr_mode_ & FI_MR_ENDPOINT) {
    FI_CHECK(fi_mr_bind(mr, &ep_->fid, 0));
    FI_CHECK(fi_mr_enable(mr));
  }
  return mr;
}

std::string RdmaTransport::expose(void* base, size_t size) {
  base_ = static_cast<char*>(base);
  size_ = size;
  region_mr_ = reg(base, size, FI_REMOTE_WRITE);
  uint64_t addr = (mr_mode_ & FI_MR_VIRT_ADDR) ? uint64_t(uintptr_t(base)) : 0;
  std::ostringstream d;
  d << "prov=" << info_->fabric_attr->prov_name << " ep=" << hex(epname_.data(), epname_.size()) << std::hex
    << " key=" << fi_mr_key(region_mr_) << " addr=" << addr << " size=" << size << std::dec << " live=" << live_ip_
    << " port=" << live_port_ << std::hex << " hkey=" << fi_mr_key(hello_mr_)
    << " haddr=" << ((mr_mode_ & FI_MR_VIRT_ADDR) ? uint64_t(uintptr_t(hello_.data())) : 0) << std::dec
    << " rank=" << rank_ << std::hex << " ltok=" << live_token_ << std::dec;
  return d.str();
}

void RdmaTransport::connect(int peer, const std::string& descriptor) {
  if (peer < 0 || peer >= world_) invalid("connect: bad peer " + std::to_string(peer));
  std::map<std::string, std::string> kv;
  std::istringstream in(descriptor);
  for (std::string tok; in >> tok;) {
    size_t eq = tok.find('=');
    if (eq != std::string::npos) kv[tok.substr(0, eq)] = tok.substr(eq + 1);
  }
  // Every field read below (std::stoull of a missing one throws a bare
  // std::invalid_argument); ltok is new: an older varcomm sends none.
  for (const char* k : {"ep", "key", "addr", "size", "live", "port", "hkey", "haddr", "ltok"})
    if (!kv.count(k))
      invalid("rank " + std::to_string(peer) + " sent a malformed descriptor (no " + k +
              "; does every rank run the same varcomm version?): " + descriptor);
  if (kv["prov"] != info_->fabric_attr->prov_name)
    invalid("rank " + std::to_string(peer) + " uses provider '" + kv["prov"] + "', rank " + std::to_string(rank_) +
            " uses '" + info_->fabric_attr->prov_name + "'; set VARCOMM_FI_PROVIDER the same on every rank");
  Peer& p = peers_[size_t(peer)];
  std::string ep = unhex(kv["ep"]);
  if (fi_av_insert(av_, ep.data(), 1, &p.addr, 0, nullptr) != 1)
    invalid("fi_av_insert failed for rank " + std::to_string(peer));
  p.key = std::stoull(kv["key"], nullptr, 16);
  p.raddr = std::stoull(kv["addr"], nullptr, 16);
  p.size = std::stoull(kv["size"], nullptr, 16);
  p.hello_key = std::stoull(kv["hkey"], nullptr, 16);
  p.hello_addr = std::stoull(kv["haddr"], nullptr, 16);
  p.live_token = std::stoull(kv["ltok"], nullptr, 16);
  p.connected = true;
  p.since = Clock::now();
  if (peer == rank_ || rank_ > peer) return;  // the higher rank accepts (accept_pending)

  // The lower rank dials; the peer's listener exists since its expose(), so
  // the kernel completes this from its backlog even before it accepts.
  sockaddr_storage ss{};
  socklen_t sl;
  const std::string& ip = kv["live"];
  int port = std::stoi(kv["port"]);
  if (ip.find(':') != std::string::npos) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    a->sin6_family = AF_INET6;
    a->sin6_port = htons(uint16_t(port));
    inet_pton(AF_INET6, ip.c_str(), &a->sin6_addr);
    sl = sizeof *a;
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    a->sin_family = AF_INET;
    a->sin_port = htons(uint16_t(port));
    inet_pton(AF_INET, ip.c_str(), &a->sin_addr);
    sl = sizeof *a;
  }
  int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  timeval tv{10, 0};  // bounded connect
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  struct {
    int32_t rank;
    uint32_t pad;
    uint64_t token;
  } me{rank_, 0, live_token_};
  if (::connect(fd, reinterpret_cast<sockaddr*>(&ss), sl) != 0 ||
      send(fd, &me, sizeof me, MSG_NOSIGNAL) != ssize_t(sizeof me)) {
    p.error = "rank " + std::to_string(peer) + " unreachable: liveness connection to " + ip + ":" +
              std::to_string(port) + " failed: " + strerror(errno);
    close(fd);
    return;
  }
  set_keepalive(fd, timeout_s_);
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  p.sock = fd;
}

void RdmaTransport::accept_pending(int wait_ms) {
  auto deadline = Clock::now() + std::chrono::milliseconds(wait_ms);
  // The dialer sends its rank and its token right after connecting. Anyone
  // may reach this port, so no connection is waited on by itself: each
  // waits here, non-blocking, for its 16 bytes (up to kHandshakeMs), while
  // the others, and new ones, are served. (One at a time, every silent
  // stranger held the loop, and our lock, for the whole handshake limit.)
  constexpr int kHandshakeMs = 2000;
  struct Hi {
    int32_t rank;
    uint32_t pad;
    uint64_t token;
  };
  // At most this many wait at once: a flood of strangers costs the oldest
  // its place, not our file descriptors.
  constexpr size_t kMaxHandshakes = 64;
  for (;;) {
    auto now = Clock::now();
    int fd;
    while ((fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK)) >= 0) {
      if (handshaking_.size() >= kMaxHandshakes) {
        close(handshaking_.front().fd);
        handshaking_.erase(handshaking_.begin());
      }
      handshaking_.push_back({fd, now + std::chrono::milliseconds(kHandshakeMs), false});
    }
    // Out of descriptors (EMFILE): the listener stays readable, so it is
    // left out of the poll below, not spun on.
    const bool listen_ok = errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    for (size_t i = 0; i < handshaking_.size();) {
      int fd = handshaking_[i].fd;
      Hi hi{-1, 0, 0};
      ssize_t k = recv(fd, &hi, sizeof hi, MSG_PEEK | MSG_DONTWAIT);
      bool complete = k == ssize_t(sizeof hi);
      bool waiting = (k > 0 && !complete) || (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR));
      if (waiting && now < handshaking_[i].until) {
        handshaking_[i++].partial = k > 0;
        continue;
      }
      handshaking_.erase(handshaking_.begin() + ptrdiff_t(i));  // (in arrival order: the front is the oldest)
      int32_t who = hi.rank;
      if (!complete || recv(fd, &hi, sizeof hi, MSG_DONTWAIT) != ssize_t(sizeof hi) || who < 0 ||
          who >= world_ || !peers_[size_t(who)].connected || hi.token != peers_[size_t(who)].live_token ||
          peers_[size_t(who)].sock >= 0) {
        close(fd);
        continue;
      }
      set_keepalive(fd, timeout_s_);
      peers_[size_t(who)].sock = fd;
    }
    bool missing = false;
    for (int q = 0; q < rank_; q++) missing |= peers_[size_t(q)].connected && peers_[size_t(q)].sock < 0;
    if (!missing) {  // every rank that dials us has: whoever still waits is a stranger
      for (const Handshake& h : handshaking_) close(h.fd);
      handshaking_.clear();
    }
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (!missing || left <= 0) return;
    std::vector<pollfd> pf{{listen_ok ? listen_fd_ : -1, POLLIN, 0}};
    for (const Handshake& h : handshaking_)  // a partial one stays readable: looked at again on the next round
      if (!h.partial) pf.push_back({h.fd, POLLIN, 0});
    poll(pf.data(), pf.size(), int(std::min<long>(left, 100)));
  }
}

void RdmaTransport::connected() {
  Lock g(*this);
  if (said_hello_) return;  // the engine calls this once per peer on this transport
  said_hello_ = true;
  accept_pending(30000);
  // rxm (over tcp or verbs) opens connections on first use, and the target
  // must call progress to accept one: a rank waiting outside varcomm (a store
  // barrier, compute) would stall every first write to it. Open them now,
  // while every rank is here: write 1 into each peer's hello word for us, and
  // stay until every peer's hello has landed here and ours have left (so no
  // peer still needs us).
  for (int q = 0; q < world_; q++) {
    Peer& p = peers_[size_t(q)];
    if (q != rank_ && p.connected && p.error.empty())
      post_u64(q, p.hello_addr + 8 * uint64_t(rank_), p.hello_key, 1, true);
  }
  auto healthy = [this](int q) {
    return q != rank_ && peers_[size_t(q)].connected && peers_[size_t(q)].error.empty();
  };
  auto until = Clock::now() + std::chrono::seconds(60);
  for (;;) {
    progress();
    int missing = -1;
    for (int q = 0; q < world_ && missing < 0; q++)
      if (healthy(q) && !__atomic_load_n(&hello_[size_t(q)], __ATOMIC_ACQUIRE)) missing = q;
    bool sent = true;  // our hellos to healthy peers have left
    for (const Op& op : ops_) sent &= !op.busy || !healthy(op.peer);
    for (int q = 0; q < world_; q++) sent &= peers_[size_t(q)].credits.empty() || !healthy(q);
    if (missing < 0 && sent) return;
    if (missing >= 0 && !peer_error(missing).empty()) continue;
    if (Clock::now() > until) {
      if (missing < 0) return;
      peers_[size_t(missing)].error = "rank " + std::to_string(missing) + " unreachable: no rdma connection after 60 s";
      continue;
    }
    usleep(50);
  }
}

uint64_t RdmaTransport::write_message(int peer, size_t ready_off, const void* hdr, size_t hdr_len,
                                      const void* payload, size_t n, uint64_t /*seq*/) {
  Lock g(*this);
  Peer& p = peers_.at(size_t(peer));
  if (!p.connected) invalid("write to rank " + std::to_string(peer) + " before connect");
  if (!p.error.empty()) return 0;  // the engine learns why from peer_error()
  // The header is padded to kHeaderBytes so the payload lands at kPayloadOff.
  if (hdr_len > kHeaderBytes) invalid("header larger than kHeaderBytes");
  size_t total = kHeaderBytes + n;
  if ((ready_off & 255) || (ready_off >> 8) > 0xffffffffull || ready_off + kHeaderOff + total > p.size)
    invalid("write of " + std::to_string(total) + " bytes at slot offset " + std::to_string(ready_off) +
            " does not fit rank " + std::to_string(peer) + "'s region or the 32-bit immediate");
  if (free_ops_.empty()) progress();
  if (free_ops_.empty()) return 0;
  uint32_t idx = free_ops_.back();
  Op& op = ops_[idx];
  char* st = stage_.data() + idx * kStage;
  memcpy(st, hdr, hdr_len);
  memset(st + hdr_len, 0, kHeaderBytes - hdr_len);
  iovec iov[3];
  void* desc[3] = {stage_desc_, nullptr, stage_desc_};
  size_t count = 1;
  if (total <= kInline) {
    if (n) memcpy(st + kHeaderBytes, payload, n);
    iov[0] = {st, total};
  } else {
    iov[0] = {st, kHeaderBytes};
    iov[1] = {const_cast<void*>(payload), n};
    if (mr_mode_ & FI_MR_LOCAL) {
      op.mr = reg(const_cast<void*>(payload), n, FI_WRITE);
      desc[1] = fi_mr_desc(op.mr);
    }
    count = 2;
  }
  fi_rma_iov rma[1 + kMaxRide];
  rma[0] = {p.raddr + ready_off + kHeaderOff, total, p.key};
  // Credits held for this peer ride in the same write when the provider can
  // scatter to several remote addresses (tcp): one message per hop, not two.
  // Only small (copied) messages: on tcp a large write with extra remote
  // segments measured slower than the same write plus a separate credit.
  size_t ride = count == 1 ? std::min(p.credits.size(), max_ride_) : 0;
  for (size_t i = 0; i < ride; i++) {
    memcpy(st + kRideOff + 8 * i, &p.credits[i].value, 8);
    rma[1 + i] = {p.credits[i].addr, 8, p.credits[i].key};
  }
  if (ride) iov[count++] = {st + kRideOff, 8 * ride};
  fi_msg_rma msg{};
  msg.msg_iov = iov;
  msg.desc = desc;
  msg.iov_count = count;
  msg.addr = p.addr;
  msg.rma_iov = rma;
  msg.rma_iov_count = 1 + ride;
  msg.context = &op.ctx;
  msg.data = ready_off >> 8;
  ssize_t rc = fi_writemsg(ep_, &msg, FI_REMOTE_CQ_DATA | FI_COMPLETION);
  uint64_t ticket = 0;
  if (rc == 0) {
    ticket = start(idx, peer);
    p.credits.erase(p.credits.begin(), p.credits.begin() + long(ride));
    queued_credits_ -= ride;
  } else {
    if (op.mr) fi_close(&op.mr->fid), op.mr = nullptr;
    if (rc != -FI_EAGAIN)
      p.error = "rank " + std::to_string(peer) + " unreachable: fi_writemsg: " + fab::api().strerror(int(-rc));
  }
  flush_all();  // held credits go right behind the message
  return ticket;
}

uint64_t RdmaTransport::write_data(int peer, size_t off, const void* src, size_t n, void* desc) {
  Lock g(*this);
  Peer& p = peers_.at(size_t(peer));
  if (!p.connected || !p.error.empty()) return 0;
  if (off + n > p.size)
    invalid("data write of " + std::to_string(n) + " bytes at offset " + std::to_string(off) + " does not fit rank " +
            std::to_string(peer) + "'s region");
  return write_data_to(peer, off, p.raddr + off, p.key, src, n, desc);
}

uint64_t RdmaTransport::write_data_to(int peer, size_t imm_off, uint64_t raddr, uint64_t key, const void* src,
                                      size_t n, void* desc) {
  Lock g(*this);
  Peer& p = peers_.at(size_t(peer));
  if (!p.connected || !p.error.empty()) return 0;
  if ((imm_off & 255) || (imm_off >> 8) > 0xffffffffull || imm_off >= p.size)
    invalid("data write to rank " + std::to_string(peer) + " named offset " + std::to_string(imm_off) +
            ", outside its region or the 32-bit immediate");
  if (free_ops_.empty()) progress();
  if (free_ops_.empty()) return 0;
  uint32_t idx = free_ops_.back();
  ssize_t rc = fi_writedata(ep_, src, n, desc, imm_off >> 8, p.addr, raddr, key, &ops_[idx].ctx);
  if (rc == 0) return start(idx, peer);
  if (rc != -FI_EAGAIN)
    p.error = "rank " + std::to_string(peer) + " unreachable: fi_writedata: " + fab::api().strerror(int(-rc));
  return 0;
}

void* RdmaTransport::reg_source(void* p, size_t n, int iface_cuda, void** handle) {
  Lock g(*this);
  *handle = nullptr;
  // Host memory needs a registration only where the provider says so; GPU
  // memory always does (FI_MR_HMEM, or the provider could not tell it apart).
  if (iface_cuda < 0 && !(mr_mode_ & FI_MR_LOCAL)) return nullptr;
  fid_mr* mr = reg(p, n, FI_WRITE, iface_cuda);
  *handle = mr;
  return fi_mr_desc(mr);
}

uint64_t RdmaTransport::reg_target(void* p, size_t n, int iface_cuda, uint64_t* addr, void** handle) {
  Lock g(*this);
  fid_mr* mr = reg(p, n, FI_REMOTE_WRITE, iface_cuda);  // a random key, as the region's
  *handle = mr;
  *addr = (mr_mode_ & FI_MR_VIRT_ADDR) ? uint64_t(uintptr_t(p)) : 0;
  return fi_mr_key(mr);
}

void RdmaTransport::probe_hmem(const std::string& iface) {
  hmem_cuda_ = hmem_offered(info_->fabric_attr->prov_name, iface, &hmem_why_);
}

uint64_t RdmaTransport::start(uint32_t idx, int peer) {
  free_ops_.pop_back();
  Op& op = ops_[idx];
  op.ticket = next_serial_++ << 16 | idx;  // never 0; names the op and this use of it
  op.peer = peer;
  op.busy = true;
  return op.ticket;
}

bool RdmaTransport::complete(int /*peer*/, uint64_t ticket) {
  Lock g(*this);
  Op& op = ops_[(ticket & 0xffff) % ops_.size()];
  if (op.ticket != ticket || !op.busy) return true;
  progress();
  return !(op.ticket == ticket && op.busy);
}

void RdmaTransport::write_u64(int peer, size_t off, uint64_t value) {
  Lock g(*this);
  Peer& p = peers_.at(size_t(peer));
  if (!p.error.empty()) return;
  if (off + 8 > p.size) invalid("write_u64 beyond rank " + std::to_string(peer) + "'s region");
  // Held until the next write_message or progress() (see the top of the file):
  // on tcp a credit sent ahead of the reply doubled the 8-byte round trip.
  post_u64(peer, p.raddr + off, p.key, value, eager_credits_);
}

void RdmaTransport::post_u64(int peer, uint64_t addr, uint64_t key, uint64_t value, bool now) {
  const bool first = !queued_credits_;
  peers_[size_t(peer)].credits.push_back({addr, key, value});
  queued_credits_++;
  if (now) return flush_credits(peer);
  if (!first) return;
  held_since_ = Clock::now();
  if (!credit_thread_.joinable()) credit_thread_ = std::thread([this] { flush_held_credits(); });
  if (credit_idle_) credit_cv_.notify_one();
}

void RdmaTransport::flush_all() {
  if (queued_credits_)
    for (int q = 0; q < world_; q++)
      if (!peers_[size_t(q)].credits.empty()) flush_credits(q);
}

void RdmaTransport::flush_credits(int peer) {
  Peer& p = peers_[size_t(peer)];
  while (!p.credits.empty()) {
    auto [addr, key, value] = p.credits.front();
    ssize_t rc = 0;
    if (p.error.empty()) {  // else dropped: the peer is gone
      if (free_ops_.empty()) return;
      uint32_t idx = free_ops_.back();
      char* st = stage_.data() + idx * kStage;
      memcpy(st, &value, 8);
      rc = fi_write(ep_, st, 8, stage_desc_, p.addr, addr, key, &ops_[idx].ctx);
      if (rc == 0) start(idx, peer);
    }
    if (rc == -FI_EAGAIN) return;  // keep order: later credits wait behind this one
    if (rc) p.error = "rank " + std::to_string(peer) + " unreachable: credit write: " + fab::api().strerror(int(-rc));
    p.credits.pop_front();
    queued_credits_--;
  }
}

void RdmaTransport::progress() {
  Lock g(*this);
  flush_all();
  fi_cq_data_entry e[32];
  for (;;) {
    ssize_t n = fi_cq_read(cq_, e, 32);
    if (n == -FI_EAGAIN) return;
    if (n == -FI_EAVAIL) {
      read_error();
      continue;
    }
    if (n < 0) fail("fi_cq_read", n);
    for (ssize_t i = 0; i < n; i++) handle(e[i]);
    if (n < 32) return;
  }
}

void RdmaTransport::handle(const fi_cq_data_entry& e) {
  if (Op* op = op_of(e.op_context)) return finish(*op);
  if (e.flags & FI_REMOTE_CQ_DATA) land(e.data);
  if (Rx* r = rx_of(e.op_context)) fi_recv(ep_, nullptr, 0, nullptr, FI_ADDR_UNSPEC, &r->ctx);
}

void RdmaTransport::land(uint64_t imm) {
  size_t off = size_t(uint32_t(imm)) << 8;
  if (!base_ || off + kPayloadOff > size_) {
    fprintf(stderr, "varcomm rdma: rank %d ignored a completion for offset %zu outside its region\n", rank_, off);
    return;
  }
  if (sink_ && sink_(off)) return;  // a chunk of a GPU message (rdma_gpu.cpp), not a header
  // The completion says header and payload have landed; publish them.
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  uint64_t seq = __atomic_load_n(&reinterpret_cast<const MsgHeader*>(base_ + off + kHeaderOff)->seq, __ATOMIC_RELAXED);
  __atomic_store_n(reinterpret_cast<uint64_t*>(base_ + off), seq, __ATOMIC_RELEASE);
}

void RdmaTransport::finish(Op& op) {
  if (op.mr) fi_close(&op.mr->fid), op.mr = nullptr;
  op.busy = false;
  free_ops_.push_back(uint32_t(&op - ops_.data()));
}

void RdmaTransport::read_error() {
  fi_cq_err_entry err{};
  if (fi_cq_readerr(cq_, &err, 0) != 1) return;
  char buf[256];
  std::string what = fi_cq_strerror(cq_, err.prov_errno, err.err_data, buf, sizeof buf);
  if (Op* op = op_of(err.op_context)) {
    Peer& p = peers_[size_t(op->peer)];
    if (p.error.empty())
      p.error = "rank " + std::to_string(op->peer) + " unreachable: write failed: " + fab::api().strerror(err.err) + " (" +
                what + ")";
    finish(*op);  // the source is ours again; the engine fails the request via peer_error()
    return;
  }
  if (Rx* r = rx_of(err.op_context)) {
    if (err.err != FI_ECANCELED) fi_recv(ep_, nullptr, 0, nullptr, FI_ADDR_UNSPEC, &r->ctx);
    return;
  }
  if (debug_)
    fprintf(stderr, "[varcomm rank %d] rdma cq error: %s (%s)\n", rank_, fab::api().strerror(err.err), what.c_str());
}

void RdmaTransport::check_sock(int peer) {
  Peer& p = peers_[size_t(peer)];
  char c;
  ssize_t k = recv(p.sock, &c, 1, MSG_DONTWAIT);
  if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  std::string who = "rank " + std::to_string(peer);
  if (k == 1 && c == 'B')
    p.error = who + " closed its communicator";
  else if (k == 0)
    p.error = who + " unreachable: connection lost (process exited or was killed)";
  else if (k < 0 && (errno == ECONNRESET || errno == EPIPE))  // (a timeout on its side ends the link with a reset)
    p.error = who + " unreachable: connection reset (its process exited or was killed, or it found the link silent "
                    "for " + std::to_string(timeout_s_) + " s)";
  else if (k < 0 && errno == ETIMEDOUT)
    p.error = who + " unreachable: no answer for " + std::to_string(timeout_s_) + " s (link down or host gone)";
  else if (k < 0)
    p.error = who + " unreachable: " + strerror(errno);
  else
    return;  // stray byte: ignore
  close(p.sock);
  p.sock = -1;
}

std::string RdmaTransport::peer_error(int peer) {
  Lock g(*this);
  flush_all();
  if (peer < 0 || peer >= world_ || peer == rank_) return "";
  Peer& p = peers_[size_t(peer)];
  if (!p.error.empty() || !p.connected) return p.error;
  if (p.sock < 0 && peer < rank_) accept_pending(0);
  if (p.sock >= 0) {
    check_sock(peer);
  } else if (Clock::now() - p.since > std::chrono::seconds(30 + timeout_s_)) {
    p.error = "rank " + std::to_string(peer) + " unreachable: it never opened its liveness connection";
  }
  return p.error;
}

TransportRegistrar rdma_registrar({
    "rdma",
    /*device=*/false,
    /*same_host_only=*/false,
    [](const PeerInfo& self, const PeerInfo& peer, const Options&) -> std::string {
      if (!peer.has("rdma")) return "rank " + std::to_string(peer.rank) + " has no rdma endpoint (see varcomm-doctor)";
      if (!self.has("rdma")) return "this rank has no rdma endpoint (see varcomm-doctor)";
      return "";
    },
    [](const TransportContext& c) -> std::shared_ptr<Transport> {
      const Options& o = c.options;
      // Loading libfabric and its providers (here, on first use) installs
      // foreign signal handlers: see fabric_lib.h.
      fab::KeepSignalHandlers keep;
      if (!c.any_remote && o.rdma_iface.empty()) {
        // Forced on one host (tests, benchmarks): keep the traffic on
        // loopback rather than the host's own network address.
        try {
          return std::make_shared<RdmaTransport>(c.rank, c.world, o.rdma_provider, "lo", o);
        } catch (const Error&) {
          // a provider with no loopback domain (verbs, efa): its default
        }
      }
      return std::make_shared<RdmaTransport>(c.rank, c.world, o.rdma_provider, o.rdma_iface, o);
    },
});

}  // namespace

rdma::Port* rdma::port_of(Transport* t) { return dynamic_cast<RdmaTransport*>(t); }

std::vector<std::string> rdma_default_providers() {
  return std::vector<std::string>(std::begin(kDefaultProviders), std::end(kDefaultProviders));
}

std::string rdma_info(const std::string& provider, const std::string& iface) {
  fab::KeepSignalHandlers keep;
  try {
    fab::api();
  } catch (const Error& e) {
    return std::string(e.what()) + "\n";
  }
  uint32_t v = fab::api().version();
  std::ostringstream o;
  o << "libfabric " << FI_MAJOR(v) << "." << FI_MINOR(v) << " (built against " << FI_MAJOR_VERSION << "."
    << FI_MINOR_VERSION << ")\n";
  // Every RDM provider/domain, and whether it fits varcomm (RMA + remote CQ data).
  fi_info* hints = fab::api().allocinfo();
  hints->ep_attr->type = FI_EP_RDM;
  hints->mode = ~0ULL;                                        // list providers whatever they ask of us
  hints->domain_attr->mr_mode = int(kMrModes | FI_MR_RAW | FI_MR_HMEM | FI_MR_MMU_NOTIFY | FI_MR_RMA_EVENT);
  fi_info* list = nullptr;
  if (fab::api().getinfo(kApiVersion, nullptr, nullptr, 0, hints, &list) == 0) {
    std::map<std::string, std::string> seen;
    for (fi_info* i = list; i; i = i->next) {
      std::string key = std::string(i->fabric_attr->prov_name) + "  domain " + i->domain_attr->name;
      bool fits = (i->caps & FI_RMA) && i->domain_attr->cq_data_size >= 4;
      std::string& s = seen[key];
      if (s.empty() || fits) s = fits ? "rma+cq_data" : "no rma/cq_data";
    }
    fab::api().freeinfo(list);
    for (auto& kv : seen) o << "  " << kv.first << "  (" << kv.second << ")\n";
  } else {
    o << "  no RDM providers found\n";
  }
  fab::api().freeinfo(hints);
  std::string choice, hmem;
  for (const char* p : kDefaultProviders) {
    fi_info* i = query(p, iface, nullptr);
    if (!i) continue;
    choice = std::string(p) + " (domain " + i->domain_attr->name + ")";
    hmem_offered(p, i->domain_attr->name, &hmem);
    fab::api().freeinfo(i);
    break;
  }
  o << "default provider: " << (choice.empty() ? "none usable" : choice);
  if (!provider.empty()) o << "; VARCOMM_FI_PROVIDER=" << provider;
  o << "\n";
  // What init will do with the configured provider and interface: the same
  // query the transport makes (varcomm-doctor fails on "unusable").
  if (!provider.empty()) {
    std::string why;
    if (fi_info* i = query(provider, iface, &why)) {
      o << "configured: usable: VARCOMM_FI_PROVIDER=" << provider << " (domain " << i->domain_attr->name << ")\n";
      fab::api().freeinfo(i);
    } else {
      o << "configured: unusable: VARCOMM_FI_PROVIDER=" << provider
        << (iface.empty() ? "" : " with VARCOMM_FI_IFACE=" + iface) << ": " << why << "\n";
    }
  } else if (!iface.empty() && choice.empty()) {
    o << "configured: unusable: VARCOMM_FI_IFACE=" << iface << ": none of the default providers (";
    for (size_t k = 0; k < std::size(kDefaultProviders); ++k) o << (k ? ", " : "") << kDefaultProviders[k];
    o << ") has it\n";
  }
  // What rdma-gpu's GPUDirect choice (rdma_gpu.cpp) will see.
  if (!hmem.empty())
    o << "GPU memory (FI_HMEM, GPUDirect RDMA): " << hmem
      << "; rdma-gpu uses it with VARCOMM_RDMA_HMEM=1, or by auto on verbs/efa/cxi in a process using CUDA on a GPU "
         "that supports it (staging and receive slots in GPU memory); else GPU messages are staged through pinned "
         "host memory\n";
  return o.str();
}

}  // namespace varcomm
