// GPU tensors to peers on the rdma route ("rdma-gpu"): stream-ordered, the
// host never waits on GPU work, large messages pipelined in chunks.
//
// It shares the rdma host transport's endpoint (rdma_port.h): same slots in
// the receiver's host region, same credits, same liveness. What it adds is a
// progress thread and three rows of host-mapped flag words (registered with
// the CUDA driver, so streams write and wait on them):
//
//   sender, caller's stream:  for each chunk c of the payload
//       cuMemcpyAsync(pinned staging of (peer, slot) + c*C  <-  payload + c*C)
//       cuStreamWriteValue64(sent[peer][slot], ++count)            (fenced after the copy)
//   sender, host, at once:    the header (shape, dtype, size) as a header-only
//       write: the receiver matches and enqueues its waits before any data lands
//   sender, progress thread:  sees sent[] reach a chunk's count, posts that
//       chunk's fi_writedata into the receiver's slot with immediate
//       (slot offset + kPayloadOff + c*C) >> 8: inside a slot, so never taken for a header
//   receiver, progress thread (or whoever polls the CQ): a chunk's completion
//       bumps landed[sender][slot]
//   receiver, caller's stream: per chunk, cuStreamWaitValue64(landed >= its count),
//       cuMemcpyAsync(out + c*C <- slot + c*C); then cuStreamWriteValue64(creq[slot], seq)
//   receiver, progress thread: sees creq[] reach seq, posts the credit (the
//       stream cannot post an rdma write; the thread is its hands)
//
// Counts are per slot and only grow: a slot carries one message at a time
// (credits), so the k-th message's chunks are counts [base, base + chunks).
// Chunk c of a message is waited for as count base + c + 1 where the provider
// completes one sender's writes in order (rxm over tcp or verbs RC), as
// base + chunks otherwise (efa, cxi: no receive-side overlap there).
//
// Ordering of the NIC against the GPU (fi_mr(3), "memory registration" and
// FI_HMEM): the staging copy is fenced before the flag the thread reads, so
// the NIC never reads staging memory the copy has not finished; the receive
// copy is ordered after the completion that bumped `landed`.
//
// A failed peer (liveness, write errors: the host transport's peer_error) has
// its slots' landed counts pushed past every wait, so no stream stays stuck on
// data that will never come; what such a receive copied is undefined, and the
// peer's failure is reported by the next operation with it (PeerFailure).
//
// GPUDirect RDMA (FI_HMEM_CUDA; chosen per the provider's capabilities and
// the option rdma_hmem, see choose_gpudirect): the same protocol with both
// staging areas in GPU memory, registered with the NIC (fi_mr_regattr):
//   sender:   the staging copy is device to device, and the NIC reads the
//             chunk straight out of GPU memory
//   receiver: its GPU receive slots (world x slots x bound of GPU memory, key
//             and address in its descriptor) take the chunks; the immediate
//             still names the host slot, so landed[] counts as before, and
//             the receiving stream copies device to device into `out`
// Host memory and PCIe copies are out of the data path. The D2D copies stay:
// they cost little next to the wire, and they are what lets the caller's
// stream go on at once (the source may change right after the send; the
// slot is free for the next message as soon as it is copied out).
// Each side decides alone: a sender writes into GPU slots where the receiver
// advertises them, else into its host slots; it reads from GPU staging where
// it chose GPUDirect itself. Visibility (CUDA's GPUDirect RDMA rules): where
// the GPU does not order a NIC's writes before later work
// (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING below OWNER), each
// landed chunk is flushed (cuFlushGPUDirectRDMAWrites) before landed[] lets a
// stream read it; a GPU that can do neither keeps host receive slots. The NIC
// reads staging only after the stream's flag says the copy ran.
// On the CPU stand-in driver "GPU memory" is host memory, and is registered
// as such: everything above runs but the FI_HMEM_CUDA registration itself.
#ifdef VARCOMM_HAVE_CUDA
#include <sched.h>
#include <sys/mman.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <sstream>
#include <thread>
#include <vector>

#include "cuda_driver.h"
#include "errors.h"
#include "protocol.h"
#include "rdma_port.h"
#include "region.h"
#include "registry.h"

namespace varcomm {
namespace {

using namespace cu;
using Clock = std::chrono::steady_clock;

constexpr int kMaxPeerSlots = 1024;                       // Options::slots' limit: rows of sent[] per peer
constexpr uint64_t kRelease = uint64_t(1) << 40;          // a failed peer's landed counts jump this far
constexpr auto kPeerCheck = std::chrono::milliseconds(200);  // as the engine's
// GPU memory GPUDirect takes by itself (rdma_hmem auto): receive slots are
// world x slots x bound, staging slots x bound per peer sent to, which grows
// with the job; past this, what does not fit is staged through host memory.
constexpr size_t kAutoGpuBytes = size_t(1) << 30;

inline uint64_t load(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void store(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
inline bool reached(uint64_t have, uint64_t want) { return int64_t(have - want) >= 0; }  // GEQ, as the stream waits
inline size_t chunks(uint64_t n, size_t c) { return size_t((n + c - 1) / c); }

std::string field(const std::string& desc, const std::string& key) {
  std::istringstream in(desc);
  for (std::string tok; in >> tok;)
    if (tok.compare(0, key.size() + 1, key + "=") == 0) return tok.substr(key.size() + 1);
  return "";
}

class RdmaGpuTransport final : public Transport {
 public:
  RdmaGpuTransport(const Driver& d, std::shared_ptr<Transport> host, Region& local, const Layout& L, int device,
                   const Options& o)
      : d_(d), host_(std::move(host)), port_(rdma::port_of(host_.get())), local_(local), L_(L),
        chunk_(size_t(align_up(o.rdma_chunk ? o.rdma_chunk : (1u << 20), 4096))), world_(L.world) {
    if (!port_) throw Error(ErrorKind::Invalid, "rdma-gpu: the rdma route is not a libfabric endpoint");
    int count = 0;
    d_.DeviceGetCount(&count);
    if (device < 0 || device >= count)
      throw Error(ErrorKind::Invalid, "rdma-gpu: CUDA device " + std::to_string(device) + " does not exist (" +
                                          std::to_string(count) + " visible)");
    check(d_.DeviceGet(&dev_, device), "cuDeviceGet");
    ordinal_ = device;
    check(d_.DevicePrimaryCtxRetain(&ctx_, dev_), "cuDevicePrimaryCtxRetain");
    retained_ = true;
    ordered_ = port_->provider().find("ofi_rxm") != std::string::npos;
    try {
      int v = 1;  // (the flags and credits are cuStreamWaitValue64 / cuStreamWriteValue64)
      if (d_.DeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev_) == CUDA_SUCCESS && !v)
        throw Error(ErrorKind::Invalid, "rdma-gpu: CUDA device " + std::to_string(device) +
                                            " does not support 64-bit stream memory operations (cuStreamWaitValue64)");
      choose_gpudirect(o.rdma_hmem);  // (may refuse: inside, so the context is released)
      // The NIC registers the stand-in's "GPU memory" as the host memory it is.
      iface_ = d_.stand_in ? -1 : ordinal_;
      CtxScope scope(d_, ctx_);
      std::string why;
      if (gdr_) open_device_slots();
      // Pinned, so the receive copies out of our slots are asynchronous (a
      // copy from pageable memory would wait for the stream on the host).
      region_dev_ = host_register(d_, local_.base(), local_.size(), &why);
      if (!region_dev_) throw Error(ErrorKind::Invalid, "rdma-gpu: the receive region: " + why);
      const size_t rows = size_t(world_) * size_t(L_.nslots);
      nflags_ = 2 * rows + size_t(world_) * kMaxPeerSlots;
      flags_bytes_ = align_up(nflags_ * 8, 4096);
      void* m = mmap(nullptr, flags_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (m == MAP_FAILED) throw Error(ErrorKind::Invalid, "rdma-gpu: cannot allocate its flag words");
      flags_ = static_cast<uint64_t*>(m);
      flags_dev_ = host_register(d_, flags_, flags_bytes_, &why);
      if (!flags_dev_) throw Error(ErrorKind::Invalid, "rdma-gpu: flag words: " + why);
      rbase_.assign(rows, 0);
      remotes_.resize(size_t(world_));
    } catch (...) {
      release();
      throw;
    }
    // From here the endpoint is shared with our thread: it takes the
    // endpoint's mutex on every call.
    port_->attach([this](size_t off) { return sink(off); });
  }

  ~RdmaGpuTransport() override {
    {
      std::unique_lock<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    std::unique_lock<std::mutex> g(mu_);
    // Chunks still arriving (a sender's last ones) are swallowed, not taken for headers.
    port_->attach([L = L_](size_t off) { return chunk_slot(L, off) >= 0; });
    // Streams may still wait on a receive's data (its sender closed first):
    // let them go rather than hang a process that closed.
    const bool pending = !sends_.empty() || !credits_.empty();
    if (pending) {
      std::lock_guard<std::recursive_mutex> pg(port_->mutex());
      for (size_t j = 0; j < rbase_.size(); ++j) store(landed(j), rbase_[j] + kRelease);
    }
    // The NIC may still read staging memory: let our writes finish (bounded,
    // a dead peer's never do).
    for (auto until = Clock::now() + std::chrono::seconds(2); port_->busy() && Clock::now() < until;) {
      try {
        host_->progress();
      } catch (...) {
        break;
      }
    }
    if (pending || port_->busy()) return;  // leak rather than free memory a stream or the NIC may still touch
    release();
  }

  std::string name() const override { return "rdma-gpu"; }
  std::string describe() const override {
    std::ostringstream o;
    o << "rdma-gpu (GPU tensors over rdma, cuda:" << ordinal_ << ": ";
    if (!gdr_) {
      o << "staged through pinned host memory in " << chunk_
        << "-byte chunks (device-to-host copy, wire and host-to-device copy overlap";
    } else {
      o << "GPUDirect RDMA, " << gdr_note_ << "; sends read GPU staging"
        << (gdr_forced_ ? "" : " (pinned host memory once GPUDirect holds " + std::to_string(kAutoGpuBytes) +
                                   " bytes of GPU memory, or where GPU memory cannot be allocated or registered)")
        << ", "
        << (rx_dev_ ? "receives land in " + std::to_string(rx_bytes_) + " bytes of GPU receive slots"
                    : "receives land in host slots (" + rx_note_ + ")")
        << ", in " << chunk_ << "-byte chunks (a peer without GPUDirect receives in its host slots and sends from "
        << "pinned memory";
    }
    o << (ordered_ ? "" : "; the receiver waits for the whole message: the provider may complete writes out of order")
      << "), ordered on the caller's stream, one progress thread";
    if (!gdr_) o << "; GPUDirect RDMA: " << gdr_note_;
    o << ")";
    return o.str();
  }
  std::map<std::string, std::string> properties() const override {
    return {{"chunk", std::to_string(chunk_)},
            {"gpudirect", gdr_ ? "selected" : "off"},
            {"gpu_receive_slots", std::to_string(rx_bytes_)},
            {"gdr_flush", flush_ ? "1" : "0"}};
  }
  bool device() const override { return true; }
  // The self chunk of an all-to-all, or a staged host message into device
  // memory, on a rank whose GPU transport is this one: no endpoint involved.
  uintptr_t copy_async(void* dst, const void* src, size_t n, uintptr_t stream, bool mark) override {
    return reinterpret_cast<uintptr_t>(cu::copy_async(d_, ctx_, ordinal_, "rdma-gpu", dst, src, n, stream, mark));
  }
  bool copy_done(uintptr_t mark, bool wait) override {
    return cu::copied(d_, ctx_, reinterpret_cast<cu::CUevent>(mark), wait);
  }
  void* stage_async(const void* src, size_t n, uintptr_t stream) override {
    return cu::stage_async(d_, ctx_, "rdma-gpu", src, n, stream);
  }
  void unstage_async(void* staged, uintptr_t stream) override { cu::unstage_async(d_, ctx_, staged, stream); }

  std::string expose(void* /*base*/, size_t /*size*/) override {
    std::ostringstream o;
    o << "rdmagpu2 chunk=" << chunk_ << " rings=" << L_.rings_off() << " slot=" << L_.slot_bytes()
      << " nslots=" << L_.nslots << " bound=" << L_.bound;
    if (rx_dev_)  // our GPU receive slots: senders with GPUDirect write their chunks there
      o << " dkey=" << rx_key_ << " daddr=" << rx_addr_ << " dstride=" << rx_stride_ << " dbytes=" << rx_bytes_;
    return o.str();
  }

  void connect(int peer, const std::string& desc) override {
    Remote r;
    try {
      if (desc.rfind("rdmagpu2 ", 0) != 0) throw std::invalid_argument("magic");
      r.chunk = std::stoull(field(desc, "chunk"));
      r.rings_off = std::stoull(field(desc, "rings"));
      r.slot_bytes = std::stoull(field(desc, "slot"));
      r.nslots = std::stoi(field(desc, "nslots"));
      r.bound = std::stoull(field(desc, "bound"));
      if (!field(desc, "dkey").empty()) {
        r.dev_rx = true;
        r.dkey = std::stoull(field(desc, "dkey"));
        r.daddr = std::stoull(field(desc, "daddr"));
        r.dstride = std::stoull(field(desc, "dstride"));
        r.dbytes = std::stoull(field(desc, "dbytes"));
      }
    } catch (const std::exception&) {
      throw Error(ErrorKind::Invalid, "bad rdma-gpu descriptor from rank " + std::to_string(peer) + ": " + desc);
    }
    if (r.chunk == 0 || r.chunk % 256 || r.nslots < 1 || r.nslots > kMaxPeerSlots || r.slot_bytes < kPayloadOff ||
        (r.dev_rx && (r.dstride == 0 || r.dstride < r.bound ||
                      r.dbytes / r.dstride < size_t(world_) * size_t(r.nslots))))
      throw Error(ErrorKind::Invalid, "bad rdma-gpu descriptor from rank " + std::to_string(peer) + ": " + desc);
    r.sbase.assign(size_t(r.nslots), 0);
    r.connected = true;
    std::lock_guard<std::mutex> g(mu_);
    remotes_.at(size_t(peer)) = std::move(r);
  }

  // Host memory, through the host route (the engine sends host tensors there).
  uint64_t write_message(int peer, size_t ready_off, const void* hdr, size_t hdr_len, const void* payload, size_t n,
                         uint64_t seq) override {
    return host_->write_message(peer, ready_off, hdr, hdr_len, payload, n, seq);
  }
  void write_u64(int peer, size_t off, uint64_t value) override { host_->write_u64(peer, off, value); }
  std::string peer_error(int peer) override { return host_->peer_error(peer); }

  bool flushed(int peer) override {
    std::lock_guard<std::mutex> g(mu_);
    for (const SendJob& j : sends_)
      if (j.peer == peer) return false;
    return true;
  }

  uint64_t write_message_async(int peer, size_t ready_off, const void* hdr, size_t hdr_len, const void* payload,
                               size_t n, uint64_t seq, uintptr_t stream) override {
    std::lock_guard<std::mutex> g(mu_);
    Remote& r = remotes_.at(size_t(peer));
    if (!r.connected) throw Error(ErrorKind::Invalid, "rdma-gpu: send to rank " + std::to_string(peer) + " before connect");
    if (r.dead) return 0;  // the engine learns why from peer_error()
    if (hdr_len > kHeaderBytes || ready_off < r.rings_off || (ready_off - r.rings_off) % r.slot_bytes ||
        n > r.bound)
      throw Error(ErrorKind::Invalid, "rdma-gpu: a write that does not fit rank " + std::to_string(peer) + "'s slots");
    // Our ring in the peer's region: its slots (ours) k = 0 .. nslots-1.
    const int k = int((ready_off - r.rings_off) / r.slot_bytes % size_t(r.nslots));
    const size_t slot = (ready_off - r.rings_off) / r.slot_bytes;  // (us, k) in its ring order: its GPU slot too
    if (slot >= size_t(world_) * size_t(r.nslots))
      throw Error(ErrorKind::Invalid, "rdma-gpu: a write past rank " + std::to_string(peer) + "'s slots");
    const size_t nch = chunks(n, r.chunk);
    if (nch) {
      CtxScope scope(d_, ctx_);  // the caller's thread may have no context, or another GPU's
      stage_for(peer, r);
      CUstream s = reinterpret_cast<CUstream>(stream);
      check_stream(s, "send");
      char* st = r.stage + size_t(k) * r.stride;
      const CUdeviceptr flag = devptr(sent(peer, k));
      for (size_t c = 0; c < nch; ++c) {
        size_t at = c * r.chunk, len = std::min<size_t>(r.chunk, n - at);
        check(d_.MemcpyAsync(reinterpret_cast<CUdeviceptr>(st + at), reinterpret_cast<CUdeviceptr>(payload) + at,
                             len, s),
              "cuMemcpyAsync (send: GPU payload into pinned staging)");
        check(d_.StreamWriteValue64(s, flag, r.sbase[size_t(k)] + c + 1, CU_STREAM_WRITE_VALUE_DEFAULT),
              "cuStreamWriteValue64 (send: chunk staged)");
      }
    }
    SendJob j;
    j.peer = peer;
    j.k = k;
    j.slot = slot;
    j.off = ready_off + kPayloadOff;
    j.n = n;
    j.nch = nch;
    j.sbase = r.sbase[size_t(k)];
    r.sbase[size_t(k)] += nch;
    // The header goes at once (the receiver enqueues its waits before any
    // data lands); with no send resources free now, the thread sends it.
    if (!host_->write_message(peer, ready_off, hdr, hdr_len, nullptr, 0, seq)) {
      j.header.assign(static_cast<const char*>(hdr), static_cast<const char*>(hdr) + hdr_len);
      j.ready_off = ready_off;
      j.seq = seq;
    }
    if (j.nch || !j.header.empty()) {
      sends_.push_back(std::move(j));
      wake();
    }
    return 1;  // stream-ordered: the staging copy on the caller's stream protects the source
  }

  void read_and_free_async(int peer, size_t payload_off, void* dst, size_t n, uint64_t seq, size_t credit_off,
                           uintptr_t stream) override {
    std::unique_lock<std::mutex> g(mu_);
    const size_t ready_off = payload_off - kPayloadOff;
    const size_t j = (ready_off - L_.rings_off()) / L_.slot_bytes();
    const auto* h = reinterpret_cast<const MsgHeader*>(local_.base() + ready_off + kHeaderOff);
    const char* src = local_.base() + payload_off;
    CUstream s = reinterpret_cast<CUstream>(stream);
    // A device message's chunks are in our GPU receive slot, where we have them.
    if ((h->flags & kDevicePayload) && rx_dev_) src = reinterpret_cast<const char*>(rx_dev_ + j * rx_stride_);
    if (!(h->flags & kDevicePayload)) {
      // A host message received into device memory: its payload came with its header.
      if (!n) return host_->write_u64(peer, credit_off, seq);
      CtxScope scope(d_, ctx_);
      check_stream(s, "recv");
      check(d_.MemcpyAsync(reinterpret_cast<CUdeviceptr>(dst), reinterpret_cast<CUdeviceptr>(src), n, s),
            "cuMemcpyAsync (recv: host slot to GPU)");
      return credit_from_stream(peer, j, credit_off, seq, s);
    }
    Remote& r = remotes_.at(size_t(peer));
    if (r.dead)
      throw Error(ErrorKind::PeerFailure, "recv from rank " + std::to_string(peer) + " failed: peer failure: " +
                                              host_->peer_error(peer), peer);
    const size_t nch = chunks(h->nbytes, chunk_);
    // (Into device memory: the stream is refused before this message's chunks
    // are counted, so a refused message stays for the next receive.)
    if (n && dst && !is_host(dst)) {
      CtxScope scope(d_, ctx_);
      check_stream(s, "recv");
    }
    const uint64_t base = rbase_[j], all = base + nch;
    rbase_[j] = all;
    if (!n || !dst) {  // dropped unread, or empty: the credit once every chunk has landed
      credits_.push_back({peer, j, credit_off, seq, false, all});
      return wake();
    }
    if (is_host(dst)) {
      // Into host memory (no stream to order it on): wait here, as a host
      // receive does, while our thread lands the chunks.
      waiting_++;
      wake();
      auto checked = Clock::now();
      while (!reached(load(landed(j)), all) && !r.dead) {
        g.unlock();
        sched_yield();
        g.lock();
        if (Clock::now() - checked > kPeerCheck) {
          checked = Clock::now();
          if (!host_->peer_error(peer).empty()) fail_remote(peer);
        }
      }
      waiting_--;
      if (r.dead)
        throw Error(ErrorKind::PeerFailure, "recv from rank " + std::to_string(peer) + " failed: peer failure: " +
                                                host_->peer_error(peer), peer);
      if (rx_dev_) {  // out of GPU memory: a copy on our own stream, waited for
        CtxScope scope(d_, ctx_);
        if (!own_stream_) check(d_.StreamCreate(&own_stream_, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
        cu::copied(d_, ctx_, cu::copy_async(d_, ctx_, ordinal_, "rdma-gpu", dst, src, n,
                                            reinterpret_cast<uintptr_t>(own_stream_), true),
                   true);
      } else {
        std::memcpy(dst, src, n);
      }
      return host_->write_u64(peer, credit_off, seq);
    }
    CtxScope scope(d_, ctx_);  // (its stream checked above)
    const CUdeviceptr flag = devptr(landed(j));
    for (size_t c = 0; c < nch; ++c) {
      size_t at = c * chunk_;
      if (at >= n) break;
      size_t len = std::min<size_t>(chunk_, n - at);
      if (ordered_ || c == 0)
        check(d_.StreamWaitValue64(s, flag, ordered_ ? base + c + 1 : all, CU_STREAM_WAIT_VALUE_GEQ),
              "cuStreamWaitValue64 (recv: chunk landed)");
      check(d_.MemcpyAsync(reinterpret_cast<CUdeviceptr>(dst) + at, reinterpret_cast<CUdeviceptr>(src + at), len, s),
            "cuMemcpyAsync (recv: slot to GPU)");
    }
    credit_from_stream(peer, j, credit_off, seq, s);
  }

  void refuse_stream(uintptr_t stream, const char* op) override {
    CtxScope scope(d_, ctx_);
    check_stream(reinterpret_cast<CUstream>(stream), op);
  }
 private:
  struct Remote {
    bool connected = false, dead = false;
    size_t chunk = 0, rings_off = 0, slot_bytes = 0, stride = 0;
    int nslots = 0;
    uint64_t bound = 0;
    bool dev_rx = false;          // it takes our chunks in its GPU receive slots (GPUDirect)
    uint64_t dkey = 0, daddr = 0, dstride = 0, dbytes = 0;
    std::vector<uint64_t> sbase;  // per slot of theirs: chunks staged so far (sent[] counts)
    char* stage = nullptr;        // staging, one bound-sized area per slot of theirs: pinned, or GPU memory
    bool stage_dev = false;       // (GPUDirect)
    size_t stage_bytes = 0;
    void* stage_desc = nullptr;   // its libfabric registration (FI_MR_LOCAL providers)
    void* stage_mr = nullptr;
  };
  struct SendJob {
    int peer = -1, k = 0;
    size_t slot = 0;  // the receiver's slot index (sender x nslots + k), for its GPU receive slots
    size_t off = 0, n = 0, nch = 0, next = 0;
    uint64_t sbase = 0;
    std::vector<char> header;  // not yet written (no send resources at enqueue)
    size_t ready_off = 0;
    uint64_t seq = 0;
  };
  struct CreditJob {
    int peer;
    size_t j;
    size_t credit_off;
    uint64_t seq;
    bool from_stream;  // true: when creq[j] reaches seq; false: when landed[j] reaches `landed`
    uint64_t landed;
  };

  void check(CUresult r, const char* what) const {
    if (r != CUDA_SUCCESS) throw Error(ErrorKind::Invalid, "rdma-gpu: " + cu::error_string(d_, r, what));
  }
  void check_stream(CUstream s, const char* op) const { cu::check_stream(d_, ctx_, ordinal_, s, op, "rdma-gpu"); }
  bool is_host(const void* p) const {
    unsigned int type = 0;
    CUresult r = d_.PointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, reinterpret_cast<CUdeviceptr>(p));
    return r != CUDA_SUCCESS || type == CU_MEMORYTYPE_HOST;
  }

  // The GPUDirect choice (reported by describe(); see the top of the file).
  void choose_gpudirect(const std::string& opt) {
    std::string why;
    const std::string prov = port_->provider();
    // The stand-in's "GPU memory" is host memory, which any provider takes.
    const bool offered = d_.stand_in || port_->hmem_cuda(&why);
    if (d_.stand_in) why = "CPU stand-in driver: its GPU memory is host memory, which " + prov + " registers as such";
    int gdr_ok = 1;  // (a driver before CUDA 11.3 does not know the attribute: the registration will tell)
    const bool gpu_can = d_.DeviceGetAttribute(&gdr_ok, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED, dev_) !=
                             CUDA_SUCCESS || gdr_ok;
    if (!gpu_can && opt != "off") {
      if (opt == "on")
        throw Error(ErrorKind::Invalid, "VARCOMM_RDMA_HMEM=1 (GPUDirect RDMA) but cuda:" + std::to_string(ordinal_) +
                                            " does not support GPUDirect RDMA (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_"
                                            "SUPPORTED is 0); unset it to stage GPU messages through host memory", -1, /*forced=*/true);
      gdr_note_ = "not used: cuda:" + std::to_string(ordinal_) + " does not support it";
      return;
    }
    if (opt == "off") {
      gdr_note_ = "off (VARCOMM_RDMA_HMEM=0)";
    } else if (opt == "on") {
      if (!offered)
        throw Error(ErrorKind::Invalid, "VARCOMM_RDMA_HMEM=1 (GPUDirect RDMA) but provider " + prov + ": " + why +
                                            "; unset it to stage GPU messages through host memory", -1, /*forced=*/true);
      gdr_ = true;
      gdr_forced_ = true;
      gdr_note_ = "selected by VARCOMM_RDMA_HMEM=1 (" + why + ")";
    } else if (!rdma::nic_provider(prov)) {
      gdr_note_ = "not used: provider " + prov + " is no RDMA NIC (GPUDirect needs verbs with nvidia-peermem or "
                  "dma-buf, efa or cxi)";
    } else if (!offered) {
      gdr_note_ = "not used: " + why;
    } else {
      gdr_ = true;
      gdr_note_ = "selected (" + why + ")";
    }
  }

  // GPUDirect's receive slots: one bound-sized area in GPU memory per slot of
  // every sender's ring, registered for peers to write. Kept only where this
  // GPU shows a NIC's writes to the stream that waits for them (ordered, or
  // flushed from the host; see the top of the file). Chosen by rdma_hmem=on,
  // a failure is an error; by auto, the note says why receives stay staged.
  void open_device_slots() {
    int order = 0, flush_opts = 0;
    d_.DeviceGetAttribute(&order, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING, dev_);
    d_.DeviceGetAttribute(&flush_opts, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS, dev_);
    const bool flush = order < CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER;
    if (flush && (!(flush_opts & CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST) || !d_.FlushGPUDirectRDMAWrites)) {
      rx_note_ = "this GPU neither orders a NIC's writes nor can flush them from the host";
      return;
    }
    rx_stride_ = align_up(L_.bound ? L_.bound : 1, 4096);
    const size_t bytes = rx_stride_ * size_t(world_) * size_t(L_.nslots);
    if (!gdr_forced_ && bytes > kAutoGpuBytes) {
      rx_note_ = "world x slots x bound = " + std::to_string(bytes) + " bytes of GPU memory, over the " +
                 std::to_string(kAutoGpuBytes) + " GPUDirect takes by itself: lower bound or slots, or set "
                 "VARCOMM_RDMA_HMEM=1";
      return;
    }
    std::string why;
    CUdeviceptr p = gpu_alloc(bytes, &why, [&](void* m) {
      rx_key_ = port_->reg_target(m, bytes, iface_, &rx_addr_, &rx_mr_);  // peers write here
    });
    if (!p) {
      why = "GPUDirect receive slots: " + why + " (" + std::to_string(bytes) +
            " bytes of GPU memory: world x slots x bound)";
      if (gdr_forced_)
        throw Error(ErrorKind::Invalid, "rdma-gpu: " + why + "; lower bound or slots, or set VARCOMM_RDMA_HMEM=0 "
                                        "to stage GPU messages through host memory", -1, /*forced=*/true);
      rx_note_ = why;
      return;
    }
    rx_dev_ = p;
    rx_bytes_ = bytes;
    flush_ = flush;
  }

  // GPU memory, registered with the NIC by `reg` (which throws on failure);
  // 0 with *why when either fails, nothing kept. The caller has our context current.
  template <class Reg>
  CUdeviceptr gpu_alloc(size_t bytes, std::string* why, Reg&& reg) {
    CUdeviceptr p = 0;
    CUresult r = d_.MemAlloc(&p, bytes);
    if (r != CUDA_SUCCESS) {
      *why = cu::error_string(d_, r, "cuMemAlloc");
      return 0;
    }
    try {
      reg(reinterpret_cast<void*>(p));
    } catch (const Error& e) {
      d_.MemFree(p);
      *why = e.what();
      return 0;
    }
    gpu_bytes_ += bytes;
    return p;
  }

  // Staging for sends to `peer`, on its first GPU message: one bound-sized
  // area per slot of its ring, so the protocol's credits also say when an
  // area is free again. GPU memory under GPUDirect (within kAutoGpuBytes when
  // chosen by auto, which stages through pinned memory past it or where the
  // allocation fails), else pinned host memory. The caller has our context current.
  void stage_for(int peer, Remote& r) {
    if (r.stage) return;
    r.stride = align_up(r.bound ? r.bound : 1, 4096);
    r.stage_bytes = r.stride * size_t(r.nslots);
    if (gdr_ && (gdr_forced_ || gpu_bytes_ + r.stage_bytes <= kAutoGpuBytes)) {
      std::string why;
      if (CUdeviceptr p = gpu_alloc(r.stage_bytes, &why, [&](void* m) {  // the NIC reads it
            r.stage_desc = port_->reg_source(m, r.stage_bytes, iface_, &r.stage_mr);
          })) {
        r.stage = reinterpret_cast<char*>(p);
        r.stage_dev = true;
        return;
      }
      if (gdr_forced_)
        throw Error(ErrorKind::Invalid, "rdma-gpu: GPUDirect staging for rank " + std::to_string(peer) + ": " + why +
                                            " (" + std::to_string(r.stage_bytes) + " bytes: slots x its bound); "
                                            "lower bound or slots, or set VARCOMM_RDMA_HMEM=0");
    }
    void* m = mmap(nullptr, r.stage_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
      throw Error(ErrorKind::Invalid, "rdma-gpu: cannot allocate " + std::to_string(r.stage_bytes) +
                                          " bytes of staging memory for rank " + std::to_string(peer) +
                                          " (slots x its bound); lower bound or slots");
    std::string why;
    if (!host_register(d_, m, r.stage_bytes, &why)) {
      munmap(m, r.stage_bytes);
      throw Error(ErrorKind::Invalid, "rdma-gpu: staging memory for rank " + std::to_string(peer) + ": " + why);
    }
    r.stage = static_cast<char*>(m);
    r.stage_desc = port_->reg_source(r.stage, r.stage_bytes, -1, &r.stage_mr);
  }

  uint64_t* landed(size_t j) { return flags_ + j; }
  uint64_t* creq(size_t j) { return flags_ + rbase_.size() + j; }
  uint64_t* sent(int peer, int k) { return flags_ + 2 * rbase_.size() + size_t(peer) * kMaxPeerSlots + size_t(k); }
  CUdeviceptr devptr(const uint64_t* p) const {
    return flags_dev_ + CUdeviceptr(reinterpret_cast<const char*>(p) - reinterpret_cast<const char*>(flags_));
  }

  void credit_from_stream(int peer, size_t j, size_t credit_off, uint64_t seq, CUstream s) {
    check(d_.StreamWriteValue64(s, devptr(creq(j)), seq, CU_STREAM_WRITE_VALUE_DEFAULT),
          "cuStreamWriteValue64 (recv: slot consumed)");
    credits_.push_back({peer, j, credit_off, seq, true, 0});
    wake();
  }

  // The slot (sender x nslots + k) of a chunk completion at `off` in a region
  // laid out as L, or -1 for anything else (a header lands at a slot start).
  static long chunk_slot(const Layout& L, size_t off) {
    const size_t rings = L.rings_off();
    if (off < rings) return -1;
    const size_t j = (off - rings) / L.slot_bytes();
    if (j >= size_t(L.world) * size_t(L.nslots) || (off - rings) % L.slot_bytes() < kPayloadOff) return -1;
    return long(j);
  }

  // A remote completion at `off` in our region (under the endpoint's mutex, not mu_).
  bool sink(size_t off) {
    long j = chunk_slot(L_, off);
    if (j < 0) return false;
    if (flush_) {  // the chunk's bytes in our GPU slot must be visible before a stream may read them
      CtxScope scope(d_, ctx_);
      CUresult r = d_.FlushGPUDirectRDMAWrites(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                                               CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER);
      if (r != CUDA_SUCCESS)
        fprintf(stderr, "varcomm rdma-gpu: %s\n", cu::error_string(d_, r, "cuFlushGPUDirectRDMAWrites").c_str());
    }
    store(landed(size_t(j)), load(landed(size_t(j))) + 1);
    return true;
  }

  // Caller holds mu_.
  void wake() {
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
    cv_.notify_all();
  }
  bool active() { return !sends_.empty() || !credits_.empty() || waiting_ || port_->busy(); }

  void run() {
    std::unique_lock<std::mutex> g(mu_);
    int idle = 0;
    while (!stop_) {
      bool moved = false;
      try {
        moved = step(g);
      } catch (const std::exception& e) {
        fprintf(stderr, "varcomm rdma-gpu: progress thread: %s\n", e.what());
      }
      if (!active()) {
        cv_.wait_for(g, std::chrono::milliseconds(100));
        idle = 0;
        continue;
      }
      // Let the protocol engine at the endpoint between passes (the mutex is
      // not fair: relocking at once would starve a caller enqueueing); then
      // look again, at once after progress, else after a yield (a chunk is
      // often only microseconds away), then sleeping.
      g.unlock();
      if (moved) {
        idle = 0;
        sched_yield();
      } else if (++idle < 16) {
        sched_yield();
      } else {
        timespec ts{0, 20000};
        nanosleep(&ts, nullptr);
      }
      g.lock();
    }
  }

  // One pass (under mu_, released around the endpoint's progress); true when something moved.
  bool step(std::unique_lock<std::mutex>& g) {
    bool moved = false;
    g.unlock();
    host_->progress();
    g.lock();
    const bool look = Clock::now() - last_check_ > kPeerCheck;
    if (look) {
      last_check_ = Clock::now();
      std::vector<bool> seen(size_t(world_), false);
      for (const SendJob& j : sends_) seen[size_t(j.peer)] = true;
      for (const CreditJob& c : credits_) seen[size_t(c.peer)] = true;
      for (int p = 0; p < world_; ++p)
        if (seen[size_t(p)] && !host_->peer_error(p).empty()) fail_remote(p);
    }
    for (auto it = sends_.begin(); it != sends_.end();) {
      SendJob& j = *it;
      Remote& r = remotes_[size_t(j.peer)];
      if (r.dead) {
        it = sends_.erase(it);
        continue;
      }
      if (!j.header.empty() &&
          host_->write_message(j.peer, j.ready_off, j.header.data(), j.header.size(), nullptr, 0, j.seq)) {
        j.header.clear();
        moved = true;
      }
      while (j.next < j.nch && reached(load(sent(j.peer, j.k)), j.sbase + j.next + 1)) {
        size_t at = j.next * r.chunk, len = std::min<size_t>(r.chunk, j.n - at);
        const char* src = r.stage + size_t(j.k) * r.stride + at;
        if (!(r.dev_rx ? port_->write_data_to(j.peer, j.off + at, r.daddr + j.slot * r.dstride + at, r.dkey, src, len,
                                              r.stage_desc)
                       : port_->write_data(j.peer, j.off + at, src, len, r.stage_desc)))
          break;
        j.next++;
        moved = true;
      }
      if (j.next == j.nch && j.header.empty()) {
        it = sends_.erase(it);
        continue;
      }
      ++it;
    }
    for (auto it = credits_.begin(); it != credits_.end();) {
      const CreditJob& c = *it;
      if (remotes_[size_t(c.peer)].dead) {
        it = credits_.erase(it);
        continue;
      }
      if (c.from_stream ? reached(load(creq(c.j)), c.seq) : reached(load(landed(c.j)), c.landed)) {
        host_->write_u64(c.peer, c.credit_off, c.seq);
        it = credits_.erase(it);
        moved = true;
        continue;
      }
      ++it;
    }
    if (moved) {  // credits and chunks go out now, not on the next pass
      g.unlock();
      host_->progress();
      g.lock();
    }
    return moved;
  }

  // `peer` is gone: nothing more goes to it, and no stream waits for its data.
  void fail_remote(int peer) {
    Remote& r = remotes_[size_t(peer)];
    if (r.dead) return;
    r.dead = true;
    // Under the endpoint's mutex too: a late completion's sink must not
    // overwrite the jump with its own increment.
    std::lock_guard<std::recursive_mutex> pg(port_->mutex());
    for (int k = 0; k < L_.nslots; ++k) {
      size_t j = size_t(peer) * size_t(L_.nslots) + size_t(k);
      store(landed(j), rbase_[j] + kRelease);
    }
  }

  void release() {
    release_gpu_memory();
    if (retained_) {  // unregistering host memory needs our context current, as registering it did
      CtxScope scope(d_, ctx_);
      if (flags_) {
        if (flags_dev_) host_unregister(d_, flags_);
        munmap(flags_, flags_bytes_);
        flags_ = nullptr;
      }
      if (region_dev_) host_unregister(d_, local_.base());
      region_dev_ = 0;
    }
    if (retained_) d_.DevicePrimaryCtxRelease(dev_);
    retained_ = false;
  }

  void release_gpu_memory() {
    if (!retained_) return;
    CtxScope scope(d_, ctx_);
    for (Remote& r : remotes_) {
      if (!r.stage) continue;
      port_->unreg(r.stage_mr);
      if (r.stage_dev) {
        d_.MemFree(reinterpret_cast<CUdeviceptr>(r.stage));
      } else {
        host_unregister(d_, r.stage);
        munmap(r.stage, r.stage_bytes);
      }
      r.stage = nullptr;
    }
    if (rx_dev_) {
      port_->unreg(rx_mr_);
      d_.MemFree(rx_dev_);
      rx_dev_ = 0;
    }
    if (own_stream_) d_.StreamDestroy(own_stream_);
    own_stream_ = nullptr;
  }

  const Driver& d_;
  std::shared_ptr<Transport> host_;
  rdma::Port* port_;
  Region& local_;
  Layout L_;
  size_t chunk_;  // ours: senders to us chunk by it, so our waits line up with their writes
  int world_;
  int ordinal_ = 0;
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
  bool retained_ = false;
  bool ordered_ = false;  // the provider completes one sender's writes in order
  bool gdr_ = false;  // GPUDirect chosen: our staging is GPU memory, and (rx_dev_) so are our receive slots
  bool gdr_forced_ = false;  // by rdma_hmem=on: then with no kAutoGpuBytes limit
  size_t gpu_bytes_ = 0;     // GPU memory taken for receive slots and staging
  std::string gdr_note_;
  int iface_ = -1;    // what GPU memory is registered as: the CUDA ordinal, or -1 (host) on the stand-in
  CUdeviceptr rx_dev_ = 0;  // GPU receive slots (open_device_slots), 0 when none
  size_t rx_stride_ = 0, rx_bytes_ = 0;
  uint64_t rx_key_ = 0, rx_addr_ = 0;
  void* rx_mr_ = nullptr;
  std::string rx_note_;  // why there are none although gdr_
  bool flush_ = false;   // flush each landed chunk (the GPU does not order a NIC's writes)
  CUstream own_stream_ = nullptr;  // device-to-host copies out of GPU slots into host memory
  CUdeviceptr region_dev_ = 0;
  uint64_t* flags_ = nullptr;  // landed[world x nslots] | creq[world x nslots] | sent[world x kMaxPeerSlots]
  size_t nflags_ = 0, flags_bytes_ = 0;
  CUdeviceptr flags_dev_ = 0;
  // Everything below: under mu_. Lock order: mu_, then the endpoint's mutex
  // (taken inside each host_/port_ call); the sink runs under the endpoint's
  // mutex alone and touches only the flag words. So the endpoint's progress
  // (on tcp, reading whole chunks off the socket) never holds up an enqueue.
  std::mutex mu_;
  std::vector<uint64_t> rbase_;  // per slot of ours: chunks its messages carried so far
  std::vector<Remote> remotes_;
  std::deque<SendJob> sends_;
  std::vector<CreditJob> credits_;
  int waiting_ = 0;
  bool stop_ = false;
  Clock::time_point last_check_{};
  std::condition_variable cv_;
  std::thread thread_;
};

TransportRegistrar rdma_gpu_registrar({
    "rdma-gpu",
    /*device=*/true,
    /*same_host_only=*/false,
    [](const PeerInfo& self, const PeerInfo& peer, const Options&) -> std::string {
      if (!peer.has("rdma-gpu")) return "rank " + std::to_string(peer.rank) + " exposed no GPU memory for rdma";
      if (!self.has("rdma-gpu")) return "this rank exposed no GPU memory for rdma";
      return "";
    },
    [](const TransportContext& c) -> std::shared_ptr<Transport> {
      std::string why;
      const Driver* d = driver(&why);
      if (!d) throw Error(ErrorKind::Invalid, "rdma-gpu unavailable: " + why);
      if (!c.opened || !c.opened->count("rdma")) throw Error(ErrorKind::Invalid, "rdma-gpu: no rdma endpoint");
      return std::make_shared<RdmaGpuTransport>(*d, c.opened->at("rdma"), c.region, c.layout, c.options.cuda_device,
                                                c.options);
    },
    /*last_resort=*/false,
    /*rides_on=*/"rdma",
});

}  // namespace
}  // namespace varcomm
#endif  // VARCOMM_HAVE_CUDA
