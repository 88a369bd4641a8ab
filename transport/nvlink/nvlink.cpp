// The nvlink transport: the shm protocol with slot payloads in GPU memory.
//
//   receiver's host region (memfd, mapped by peers, as with shm)
//     ctl | credit rows | per sender, per slot: [ready word | data flag*] [header] [payload unused]
//   receiver's device allocation (CUDA IPC, opened by peers), same offsets, from rings_off:
//     per sender, per slot: [  | data flag ] [ ] [payload]
//   (* the data flag lives in device memory by default, in the host region's
//      slot control block with the option nvlink_flags=host)
//
// Send, on the caller's stream: copy payload -> peer's device slot; write seq to
// the slot's data flag (a stream memory operation, fenced after the copy);
// then, on the CPU, header + release store of the ready word in the peer's
// host region. Receive, on the caller's stream: wait flag >= seq; copy slot ->
// dst; write seq to the sender's credit word (host memory, registered with
// the driver and written by the GPU). No CPU waits on GPU work.
//
// Small messages (n <= option nvlink_kernel_max, off by default) may instead
// go as one kernel launch that copies and then writes the flag (kernels.cu,
// embedded in the build as a fatbin and loaded with cuModuleLoadData).
#include "nvlink.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cuda_driver.h"
#include "errors.h"
#include "hostmem.h"
#include "kernels.h"
#include "registry.h"

namespace varcomm {
namespace {

using namespace cu;  // driver types and constants (cuda_driver.h)

// The data-ready flag of a slot: the second cache line of its control block
// (the first holds the host ready word).
constexpr size_t kFlagOff = 64;
static_assert(kFlagOff + 8 <= kSlotCtlBytes, "flag must fit the slot control block");

enum class FlagMem { Device, Host };

std::string to_hex(const void* p, size_t n) {
  static const char* digits = "0123456789abcdef";
  const auto* b = static_cast<const unsigned char*>(p);
  std::string s(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    s[2 * i] = digits[b[i] >> 4];
    s[2 * i + 1] = digits[b[i] & 15];
  }
  return s;
}

bool from_hex(const std::string& s, void* out, size_t n) {
  if (s.size() != 2 * n) return false;
  auto* b = static_cast<unsigned char*>(out);
  auto nib = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < n; ++i) {
    int hi = nib(s[2 * i]), lo = nib(s[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    b[i] = static_cast<unsigned char>(hi << 4 | lo);
  }
  return true;
}

std::string device_label(const cu::Driver& d, CUdevice dev) {
  char name[128] = {0}, bus[32] = {0};
  if (d.DeviceGetName(name, sizeof name, dev) != CUDA_SUCCESS) std::strcpy(name, "?");
  if (d.DeviceGetPCIBusId(bus, sizeof bus, dev) != CUDA_SUCCESS) std::strcpy(bus, "?");
  return std::string(name) + " at " + bus;
}

FlagMem flag_mode(const std::string& v) {
  if (v.empty() || v == "device") return FlagMem::Device;
  if (v == "host") return FlagMem::Host;
  throw Error(ErrorKind::Invalid, "VARCOMM_NVLINK_FLAGS=" + v + ": use 'device' or 'host'");
}

// The fatbin's image for a GPU of compute capability major.minor: "sm_90"
// (machine code), "compute_90" (PTX, compiled by the driver at load), or ""
// (none fits). Images are listed as in varcomm_fatbin_archs: "sm_80 sm_90 compute_90".
std::string kernel_image_for(const std::string& images, int major, int minor) {
  const int cc = major * 10 + minor;
  std::string sass, ptx;
  int ptx_cc = -1;
  std::istringstream in(images);
  for (std::string img; in >> img;) {
    const bool is_sm = img.rfind("sm_", 0) == 0, is_ptx = img.rfind("compute_", 0) == 0;
    if (!is_sm && !is_ptx) continue;
    const std::string num = img.substr(is_sm ? 3 : 8);
    const int a = std::atoi(num.c_str());
    const bool exact = !num.empty() && num.back() == 'a';  // sm_90a: that GPU only
    if (is_sm && (exact ? a == cc : a / 10 == major && a <= cc)) sass = img;
    if (is_ptx && !exact && a <= cc && a > ptx_cc) ptx = img, ptx_cc = a;
  }
  return !sass.empty() ? sass : ptx;
}

std::string built_kernel_images() {
#ifdef VARCOMM_HAVE_FATBIN
  return varcomm_fatbin_archs;
#else
  return "";
#endif
}

// What the last transport created in this process found when it loaded the
// kernel, for nvlink_info().
std::mutex g_kernel_mu;
std::string g_kernel_note;  // guarded by g_kernel_mu

void note_kernel(const std::string& s) {
  std::lock_guard<std::mutex> g(g_kernel_mu);
  g_kernel_note = s;
}

class NvlinkTransport : public Transport {
 public:
  // Options: nvlink_flags (where data flags live), nvlink_kernel_max (the
  // largest message sent with the copy-and-flag kernel instead of
  // cuMemcpyAsync + cuStreamWriteValue64; 0 keeps the copy engine for every size).
  NvlinkTransport(const cu::Driver& d, Region& local, const Layout& L, int device, const Options& o)
      : d_(d), local_(local), layout_(L), mode_(flag_mode(o.nvlink_flags)), kernel_max_(o.nvlink_kernel_max),
        stores_(peer_stores(o.shm_stores)) {
    if (local.size() != L.region_bytes()) throw Error(ErrorKind::Invalid, "nvlink: region size does not match its layout");
    rings_off_ = L.rings_off();
    dev_bytes_ = L.total() - rings_off_;
    int count = 0;
    d_.DeviceGetCount(&count);
    if (device < 0 || device >= count)
      throw Error(ErrorKind::Invalid, "nvlink: CUDA device " + std::to_string(device) + " does not exist (" +
                                          std::to_string(count) + " visible)");
    check(d_.DeviceGet(&dev_, device), "cuDeviceGet");
    ordinal_ = device;
    check(d_.DevicePrimaryCtxRetain(&ctx_, dev_), "cuDevicePrimaryCtxRetain");
    retained_ = true;
    try {
      CtxScope scope(d_, ctx_);
      int v = 1;
      if (d_.DeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev_) == CUDA_SUCCESS && !v)
        throw Error(ErrorKind::Invalid, "nvlink: " + device_label(d_, dev_) +
                                            " does not support 64-bit stream memory operations (cuStreamWaitValue64)");
      v = 0;
      if (d_.DeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, dev_) == CUDA_SUCCESS && !v)
        throw Error(ErrorKind::Invalid, "nvlink: " + device_label(d_, dev_) + " has no unified addressing");
      check(d_.StreamCreate(&priv_, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
      check(d_.StreamCreate(&unstick_, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
      reap_at_ = std::max<size_t>(64, 4 * size_t(L.world) * size_t(L.nslots));
      if (kernel_max_) load_kernel();
      CUresult r = d_.MemAlloc(&alloc_, dev_bytes_);
      if (r != CUDA_SUCCESS)
        throw Error(ErrorKind::Invalid,
                    "nvlink: cannot allocate " + std::to_string(dev_bytes_) + " bytes of GPU memory for the receive "
                    "slots (world_size x slots x bound) on " + device_label(d_, dev_) + ": " +
                    cu::error_string(d_, r, "cuMemAlloc") + "; lower bound or slots");
      // Data flags start at 0 (sequence numbers start at 1). Done before the
      // descriptor leaves this process, so no peer can race it.
      check(d_.MemsetD8Async(alloc_, 0, dev_bytes_, priv_), "cuMemsetD8Async");
      check(d_.StreamSynchronize(priv_), "cuStreamSynchronize");
      dev_base_ = alloc_ - rings_off_;  // same offsets as the host region; never dereferenced below rings_off
      check(d_.IpcGetMemHandle(&ipc_, alloc_), "cuIpcGetMemHandle");
      // The whole region, pinned: copies between its slots and device memory
      // are then asynchronous (from pageable memory the driver first waits
      // for the stream, on the calling thread: under the engine's lock).
      CUdeviceptr whole = host_devptr(local_.base(), local_.size());
      if (mode_ == FlagMem::Host) own_flags_dev_ = whole;
    } catch (...) {
      release();
      throw;
    }
  }

  ~NvlinkTransport() override { release(); }

  std::string name() const override { return "nvlink"; }
  std::string describe() const override {
    std::string why;
    {
      std::lock_guard<std::mutex> g(kernel_mu_);
      why = kernel_why_;
    }
    return "nvlink (same host, CUDA IPC: receive slots in GPU memory of " + device_label(d_, dev_) +
           ", stream-ordered copies, data flags in " + (mode_ == FlagMem::Device ? "device" : "host") + " memory" +
           (kernel_on() ? ", messages up to " + std::to_string(kernel_max_) + " bytes as one copy-and-flag kernel"
                        : kernel_max_ ? ", copy-and-flag kernel unavailable: " + why : std::string()) +
           ")";
  }
  bool device() const override { return true; }

  std::string expose(void* base, size_t size) override {
    unsigned long long start = process_start(getpid());
    char bus[32] = {0};
    if (d_.DeviceGetPCIBusId(bus, sizeof bus, dev_) != CUDA_SUCCESS || !bus[0]) std::strcpy(bus, "?");
    std::ostringstream o;
    o << "nvlink2 " << getpid() << ' ' << local_.fd() << ' ' << size << ' ' << start << ' ' << rings_off_ << ' '
      << dev_bytes_ << ' ' << (mode_ == FlagMem::Device ? "device" : "host") << ' ' << bus << ' '
      << to_hex(&ipc_, sizeof ipc_) << ' ' << layout_.nslots << ' ' << layout_.bound << ' ' << layout_.landing;
    return o.str();
  }

  void connect(int peer, const std::string& desc) override {
    std::istringstream in(desc);
    std::string magic, mode, bus, handle;
    Peer p;
    int fd = -1;
    size_t dev_bytes = 0;
    Layout L;
    L.world = layout_.world;
    in >> magic >> p.pid >> fd >> p.host_size >> p.start >> p.rings_off >> dev_bytes >> mode >> bus >> handle >>
        L.nslots >> L.bound >> L.landing;
    CUipcMemHandle h;
    if (!in || magic != "nvlink2" || !from_hex(handle, &h, sizeof h))
      throw Error(ErrorKind::Invalid, "bad nvlink descriptor from rank " + std::to_string(peer));
    if (mode != (mode_ == FlagMem::Device ? "device" : "host"))
      throw Error(ErrorKind::Invalid, "rank " + std::to_string(peer) + " keeps nvlink data flags in " + mode +
                                          " memory, this rank does not: set VARCOMM_NVLINK_FLAGS alike on every rank");
    if (peers_.count(peer)) throw Error(ErrorKind::Invalid, "nvlink: rank " + std::to_string(peer) + " connected twice");
    CtxScope scope(d_, ctx_);
    try {
      if (p.pid == getpid()) {
        p.host = local_.base();
        p.dev = dev_base_;
      } else {
        std::string err;
        p.host = map_peer_region(p.pid, p.start, fd, p.host_size, &err);
        if (!p.host)
          throw Error(ErrorKind::PeerFailure, "nvlink: cannot map rank " + std::to_string(peer) + "'s region: " + err,
                      peer);
        p.mapped = true;
        std::string bad = region_mismatch(p.host, p.host_size, peer, p.pid, L);
        if (!bad.empty())
          throw Error(ErrorKind::PeerFailure, "nvlink: cannot use " + bad + " (a stale descriptor, or a reused pid)",
                      peer);
        CUresult r = d_.IpcOpenMemHandle(&p.opened, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
        if (r != CUDA_SUCCESS)
          throw Error(ErrorKind::Invalid,
                      "nvlink: cannot open rank " + std::to_string(peer) + "'s GPU memory (GPU at " + bus +
                          ") from " + device_label(d_, dev_) + ": " + cu::error_string(d_, r, "cuIpcOpenMemHandle") +
                          " (the two GPUs need peer access over NVLink or PCIe)");
        p.dev = p.opened - p.rings_off;
      }
      // The GPU writes the peer's credit words (and, with host flags, its data flags).
      p.host_dev = host_devptr(p.host, mode_ == FlagMem::Host ? p.host_size : p.rings_off);
    } catch (...) {
      if (p.opened) d_.IpcCloseMemHandle(p.opened);
      if (p.mapped) unmap_region(p.host, p.host_size);
      throw;
    }
    peers_[peer] = p;
  }

  // Host payloads (unused by the engine, which sends host memory over shm).
  uint64_t write_message(int peer, size_t ready_off, const void* hdr, size_t hdr_len, const void* payload, size_t n,
                         uint64_t seq) override {
    write_mapped_message(peers_.at(peer).host + ready_off, hdr, hdr_len, payload, n, seq, stores_);
    return 1;
  }

  void write_u64(int peer, size_t off, uint64_t value) override {
    store_release_u64(peers_.at(peer).host + off, value);
  }

  size_t peer_bytes(int peer) const override { return size_t(peers_.at(peer).host_size); }

  std::string peer_error(int peer) override {
    auto& p = peers_.at(peer);
    return p.pid == getpid() ? "" : process_exit_error(peer, p.pid, p.start);
  }

  uint64_t write_message_async(int peer, size_t ready_off, const void* hdr, size_t hdr_len, const void* payload,
                               size_t n, uint64_t seq, uintptr_t stream) override {
    Peer& p = peers_.at(peer);
    CtxScope scope(d_, ctx_);
    CUstream s = reinterpret_cast<CUstream>(stream);
    check_stream(s, "send");
    if (!(n && n <= kernel_max_ && launch_copy_signal(p.dev + ready_off + kPayloadOff,
                                                      reinterpret_cast<CUdeviceptr>(payload), n,
                                                      flag_of(p, ready_off), seq, s))) {
      if (n) check(d_.MemcpyAsync(p.dev + ready_off + kPayloadOff, reinterpret_cast<CUdeviceptr>(payload), n, s),
                   "cuMemcpyAsync (send: payload into the peer's GPU slot)");
      // Default flags: the write is fenced after the copy (system scope).
      check(d_.StreamWriteValue64(s, flag_of(p, ready_off), seq, CU_STREAM_WRITE_VALUE_DEFAULT),
            "cuStreamWriteValue64 (send: data flag)");
    }
    track(s, peer, ready_off, seq, Pending::kSend);
    // The header travels on the host path at once: the receiver can match,
    // allocate and enqueue its wait before the data has landed.
    char* slot = p.host + ready_off;
    std::memcpy(slot + kHeaderOff, hdr, hdr_len);
    __atomic_store_n(reinterpret_cast<uint64_t*>(slot), seq, __ATOMIC_RELEASE);
    return 1;  // stream-ordered: the caller's stream protects the source
  }

  void read_and_free_async(int peer, size_t payload_off, void* dst, size_t n, uint64_t seq, size_t credit_off,
                           uintptr_t stream) override {
    Peer& p = peers_.at(peer);
    CtxScope scope(d_, ctx_);
    const size_t ready_off = payload_off - kPayloadOff;
    const auto* h = reinterpret_cast<const MsgHeader*>(local_.base() + ready_off + kHeaderOff);
    CUstream s = reinterpret_cast<CUstream>(stream);
    if (!(h->flags & kDevicePayload)) {
      // A host-memory message received into device memory: the payload sits
      // in our host slot (registered: the copy does not wait for the stream
      // on this thread); the slot is freed from the stream once it ran.
      if (!n) return write_u64(peer, credit_off, seq);
      check_stream(s, "recv");
      check(d_.MemcpyAsync(reinterpret_cast<CUdeviceptr>(dst), reinterpret_cast<CUdeviceptr>(local_.base() + payload_off),
                           n, s),
            "cuMemcpyAsync (recv: host slot to GPU)");
      check(d_.StreamWriteValue64(s, p.host_dev + credit_off, seq, CU_STREAM_WRITE_VALUE_DEFAULT),
            "cuStreamWriteValue64 (recv: credit)");
      track(s, peer, ready_off, seq, Pending::kRecv);
      return;
    }
    // Nothing to copy (an empty message, or one dropped unread): free the
    // slot once the sender's flag write has landed, off the caller's stream.
    // A device message into host memory (slow path): our own stream, then wait for it.
    const bool host_dst = n && is_host(dst);
    if (!n || host_dst)
      s = priv_;
    else
      check_stream(s, "recv");
    check(d_.StreamWaitValue64(s, own_flag(ready_off), seq, CU_STREAM_WAIT_VALUE_GEQ),
          "cuStreamWaitValue64 (recv: data flag)");
    if (n) check(d_.MemcpyAsync(reinterpret_cast<CUdeviceptr>(dst), dev_base_ + payload_off, n, s),
                 "cuMemcpyAsync (recv: GPU slot to out)");
    // Fenced after the copy: the sender reuses the slot only once we read it.
    check(d_.StreamWriteValue64(s, p.host_dev + credit_off, seq, CU_STREAM_WRITE_VALUE_DEFAULT),
          "cuStreamWriteValue64 (recv: credit)");
    track(s, peer, ready_off, seq, Pending::kRecvWaits);
    if (host_dst) check(d_.StreamSynchronize(s), "cuStreamSynchronize (recv into host memory)");
  }

  void refuse_stream(uintptr_t stream, const char* op) override {
    CtxScope scope(d_, ctx_);
    check_stream(reinterpret_cast<CUstream>(stream), op);
  }
  uintptr_t copy_async(void* dst, const void* src, size_t n, uintptr_t stream, bool mark) override {
    return reinterpret_cast<uintptr_t>(cu::copy_async(d_, ctx_, ordinal_, "nvlink", dst, src, n, stream, mark));
  }
  bool copy_done(uintptr_t mark, bool wait) override {
    return cu::copied(d_, ctx_, reinterpret_cast<cu::CUevent>(mark), wait);
  }
  void* stage_async(const void* src, size_t n, uintptr_t stream) override {
    return cu::stage_async(d_, ctx_, "nvlink", src, n, stream);
  }
  void unstage_async(void* staged, uintptr_t stream) override { cu::unstage_async(d_, ctx_, staged, stream); }

 private:
  struct Peer {
    char* host = nullptr;       // the peer's host region, mapped here
    size_t host_size = 0;
    bool mapped = false;        // false for ourselves (our own region)
    size_t rings_off = 0;       // the peer's layout
    CUdeviceptr dev = 0;        // the peer's device slots, at host-region offsets
    CUdeviceptr opened = 0;     // cuIpcOpenMemHandle's result (0 for ourselves)
    CUdeviceptr host_dev = 0;   // device address of `host` (registered)
    int pid = 0;
    unsigned long long start = 0;
  };

  void check(CUresult r, const char* what) const {
    if (r != CUDA_SUCCESS) throw Error(ErrorKind::Invalid, "nvlink: " + cu::error_string(d_, r, what));
  }

  void check_stream(CUstream s, const char* op) const { cu::check_stream(d_, ctx_, ordinal_, s, op, "nvlink"); }

  bool is_host(const void* p) const {
    unsigned int type = 0;
    CUresult r = d_.PointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, reinterpret_cast<CUdeviceptr>(p));
    return r != CUDA_SUCCESS || type == CU_MEMORYTYPE_HOST;  // unregistered pageable memory is an error
  }

  bool kernel_on() const { return copy_signal_.load(std::memory_order_acquire) != nullptr; }

  // Loads the embedded fatbin into our context (the caller made it current).
  // On any failure the copy engine carries every size; the reason goes to
  // describe() and nvlink_info().
  void load_kernel() {
    const std::string where = "cuda:" + std::to_string(ordinal_);
#ifdef VARCOMM_HAVE_FATBIN
    int major = 0, minor = 0;
    d_.DeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev_);
    d_.DeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev_);
    const std::string image = kernel_image_for(varcomm_fatbin_archs, major, minor);
    CUresult r = d_.ModuleLoadData(&module_, varcomm_fatbin);
    CUfunction fn = nullptr;
    if (r == CUDA_SUCCESS) {
      r = d_.ModuleGetFunction(&fn, module_, VARCOMM_KERNEL_COPY_SIGNAL);
      if (r != CUDA_SUCCESS) {
        kernel_why_ = cu::error_string(d_, r, "cuModuleGetFunction(" VARCOMM_KERNEL_COPY_SIGNAL ")");
        d_.ModuleUnload(module_);
        module_ = nullptr;
      }
    } else {
      module_ = nullptr;
      const std::string driver = std::to_string(d_.version / 1000) + "." + std::to_string(d_.version % 1000 / 10);
      kernel_why_ = cu::error_string(d_, r, "cuModuleLoadData") + " (the build has " + varcomm_fatbin_archs +
                    "; this GPU is compute capability " + std::to_string(major) + "." + std::to_string(minor) +
                    (image.empty() ? ": none fits, rebuild with VARCOMM_CUDA_ARCHS including it"
                                   : ", driver " + driver + ": older than the nvcc that built varcomm?") +
                    ")";
    }
    if (fn) {
      copy_signal_.store(fn, std::memory_order_release);
      note_kernel(where + ": copy-and-flag kernel loaded (" + (image.empty() ? "?" : image) +
                  "), used for messages of 1.." + std::to_string(kernel_max_) + " bytes");
      return;
    }
#else
    kernel_why_ = "varcomm was built without nvcc (no CUDA kernels in this build)";
#endif
    note_kernel(where + ": copy-and-flag kernel not used: " + kernel_why_);
  }

  // The copy and the data flag as one launch on `s`; false (nothing enqueued)
  // when the kernel is not loaded or the launch is refused.
  bool launch_copy_signal(CUdeviceptr dst, CUdeviceptr src, size_t n, CUdeviceptr flag, uint64_t seq, CUstream s) {
    CUfunction fn = copy_signal_.load(std::memory_order_acquire);
    if (!fn) return false;
    unsigned long long sq = seq;
    void* args[] = {&dst, &src, &n, &flag, &sq};
    // One block, a 16-byte word per thread per step, whole warps.
    size_t threads = (n + 15) / 16;
    if (threads > VARCOMM_KERNEL_MAX_THREADS) threads = VARCOMM_KERNEL_MAX_THREADS;
    threads = (threads + 31) / 32 * 32;
    CUresult r = d_.LaunchKernel(fn, 1, 1, 1, static_cast<unsigned>(threads), 1, 1, 0, s, args, nullptr);
    if (r == CUDA_SUCCESS) return true;
    // Not enqueued: this and later messages take the copy engine.
    std::lock_guard<std::mutex> g(kernel_mu_);
    if (copy_signal_.exchange(nullptr)) {
      kernel_why_ = cu::error_string(d_, r, "cuLaunchKernel") + " (turned off after the first failed launch)";
      note_kernel("cuda:" + std::to_string(ordinal_) + ": copy-and-flag kernel not used: " + kernel_why_);
    }
    return false;
  }

  CUdeviceptr flag_of(const Peer& p, size_t ready_off) const {
    return (mode_ == FlagMem::Device ? p.dev : p.host_dev) + ready_off + kFlagOff;
  }
  CUdeviceptr own_flag(size_t ready_off) const {
    return (mode_ == FlagMem::Device ? dev_base_ : own_flags_dev_) + ready_off + kFlagOff;
  }

  // Register [base, base+len) for GPU access once per mapping (ourselves as a
  // peer shares our own region's registration).
  CUdeviceptr host_devptr(char* base, size_t len) {
    auto it = regs_.find(base);
    if (it != regs_.end()) {
      if (it->second.len < len) throw Error(ErrorKind::Invalid, "nvlink: host region registered with a smaller size");
      return it->second.dev;
    }
    std::string why;
    CUdeviceptr dp = cu::host_register(d_, base, len, &why);  // shared with rdma-gpu, which maps the same region
    if (!dp) throw Error(ErrorKind::Invalid, "nvlink: " + why);
    regs_[base] = {len, dp};
    return dp;
  }

  // Work this transport put on a stream (a caller's, or priv_) for one
  // message: an event after it, the peer, the slot, and what it is.
  struct Pending {
    enum Kind { kSend, kRecv, kRecvWaits };  // kRecvWaits: waits for the peer's data flag
    CUevent ev;
    int peer;
    size_t ready_off;
    uint64_t seq;
    Kind kind;
    bool let_go = false;  // its flag was written for it (let_go_locked)
    bool waits() const { return kind == kRecvWaits && !let_go; }
  };

  // Called after a message's operations are enqueued on s. Without the event
  // close could not tell when they ran; if it cannot be recorded (a broken
  // context, whose work never runs) the message goes untracked.
  void track(CUstream s, int peer, size_t ready_off, uint64_t seq, Pending::Kind kind) {
    std::lock_guard<std::mutex> g(pend_mu_);
    if (pending_.size() >= reap_at_) {
      // This thread may be capturing another stream (the caller's graph):
      // a query there, unless RELAXED, would invalidate that capture.
      CaptureModeScope relaxed(d_, CU_STREAM_CAPTURE_MODE_RELAXED);
      reap_locked();
    }
    CUevent ev = nullptr;
    if (!spare_events_.empty()) {
      ev = spare_events_.back();
      spare_events_.pop_back();
    } else if (d_.EventCreate(&ev, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) {
      return;
    }
    if (d_.EventRecord(ev, s) != CUDA_SUCCESS) {
      spare_events_.push_back(ev);
      return;
    }
    pending_.push_back({ev, peer, ready_off, seq, kind});
    if (kind == Pending::kRecvWaits) {
      if (!watcher_.joinable())
        watcher_ = std::thread([this] { watch(); });
      else if (watch_idle_)
        watch_cv_.notify_all();
    }
  }

  // Drops what ran (or never will: a sticky error). pend_mu_ held.
  void reap_locked() {
    auto done = [this](const Pending& x) {
      if (!cu::event_done(d_.EventQuery(x.ev))) return false;
      spare_events_.push_back(x.ev);
      return true;
    };
    pending_.erase(std::remove_if(pending_.begin(), pending_.end(), done), pending_.end());
  }

  // A peer that exited before its stream wrote a data flag never will (a dead
  // process's stream work is dropped), and a stream waiting for that flag
  // would wait forever: torch.cuda.synchronize, or any later work on it,
  // would hang. Its flag is written from here instead; the receive then
  // copies whatever the slot held, and varcomm's next call on this rank
  // raises PeerFailure for that peer. pend_mu_ held.
  void let_go_locked() {
    std::map<int, bool> exited;
    for (Pending& x : pending_) {
      if (!x.waits()) continue;
      auto it = exited.find(x.peer);
      if (it == exited.end()) it = exited.emplace(x.peer, !peer_error(x.peer).empty()).first;
      if (!it->second) continue;
      // Its own sequence number: waits compare cyclically ((int64)(flag - seq)
      // >= 0). Host flags are stored by this thread: a write from another
      // stream of this process may queue behind the very wait it should end
      // (one hardware queue, CUDA_DEVICE_MAX_CONNECTIONS=1); device flags
      // have no other way.
      if (mode_ == FlagMem::Host) {
        store_release_u64(local_.base() + x.ready_off + kFlagOff, x.seq);
        x.let_go = true;
      } else {
        x.let_go = d_.StreamWriteValue64(unstick_, own_flag(x.ready_off), x.seq, CU_STREAM_WRITE_VALUE_DEFAULT) ==
                   CUDA_SUCCESS;
      }
    }
  }

  // While a stream waits for a peer's flag, notices (every 100 ms) that the
  // peer exited, without anyone calling varcomm: the caller may wait on the
  // stream alone.
  void watch() {
    CtxScope scope(d_, ctx_);
    std::unique_lock<std::mutex> g(pend_mu_);
    while (!watch_stop_) {
      const bool waiting = std::any_of(pending_.begin(), pending_.end(),
                                       [](const Pending& x) { return x.waits(); });
      if (waiting) {
        watch_cv_.wait_for(g, std::chrono::milliseconds(100));
      } else {
        watch_idle_ = true;
        watch_cv_.wait(g);
        watch_idle_ = false;
      }
      if (watch_stop_) break;
      reap_locked();
      let_go_locked();
    }
  }

  // Only sends: their data is what a peer still waits for once this
  // process exits; a receive's work touches memory that release() keeps
  // until it ran.
  void settle(std::chrono::steady_clock::time_point deadline) override {
    CtxScope scope(d_, ctx_);
    if (!ran(deadline, true)) settle_gave_up_ = true;
  }

  // True once the work tracked above (only sends: sends_only), and what
  // priv_ and unstick_ hold, ran; false at `deadline` (a stream held by
  // other work).
  bool ran(std::chrono::steady_clock::time_point deadline, bool sends_only = false) {
    for (int i = 0;; ++i) {
      {
        std::lock_guard<std::mutex> g(pend_mu_);
        reap_locked();
        if (i % 64 == 0) let_go_locked();
        const bool left = sends_only ? std::any_of(pending_.begin(), pending_.end(),
                                                   [](const Pending& x) { return x.kind == Pending::kSend; })
                                     : !pending_.empty();
        if (!left && d_.StreamQuery(priv_) != CUDA_ERROR_NOT_READY &&
            d_.StreamQuery(unstick_) != CUDA_ERROR_NOT_READY)
          return true;
      }
      if (std::chrono::steady_clock::now() > deadline) return false;
      usleep(100);
    }
  }

  // Before the slots, mappings and registrations go: that work touches them
  // (a copy into a peer's GPU slot, a credit written into its region, a wait
  // on our own flags). After 10 s the caller leaks rather than frees memory
  // still in use.
  bool drain() {
    if (watcher_.joinable()) {
      {
        std::lock_guard<std::mutex> g(pend_mu_);
        watch_stop_ = true;
      }
      watch_cv_.notify_all();
      watcher_.join();
    }
    // A stream that held close's settle for its 10 s is held still: leak at
    // once rather than wait again (here, from a destructor).
    return ran(std::chrono::steady_clock::now() + (settle_gave_up_ ? std::chrono::seconds(0) : std::chrono::seconds(10)));
  }

  void release() {
    if (!retained_) return;
    {
      CtxScope scope(d_, ctx_);
      if (priv_ && unstick_ && !drain()) {
        // Leak the slots, mappings, streams and events: a late copy, flag or
        // credit write then lands in memory that still exists.
        copy_signal_.store(nullptr);
        retained_ = false;  // and keep the context retained
        return;
      }
      for (CUevent ev : spare_events_) d_.EventDestroy(ev);
      spare_events_.clear();
      for (auto& kv : peers_)
        if (kv.second.opened) d_.IpcCloseMemHandle(kv.second.opened);
      for (auto& kv : regs_) cu::host_unregister(d_, kv.first);
      regs_.clear();
      for (auto& kv : peers_)
        if (kv.second.mapped) unmap_region(kv.second.host, kv.second.host_size);
      peers_.clear();
      if (alloc_) d_.MemFree(alloc_);
      alloc_ = 0;
      copy_signal_.store(nullptr);
      if (module_) d_.ModuleUnload(module_);
      module_ = nullptr;
      if (priv_) d_.StreamDestroy(priv_);
      priv_ = nullptr;
      if (unstick_) d_.StreamDestroy(unstick_);
      unstick_ = nullptr;
    }
    d_.DevicePrimaryCtxRelease(dev_);
    retained_ = false;
  }

  struct Reg {
    size_t len;
    CUdeviceptr dev;
  };

  const cu::Driver& d_;
  Region& local_;
  Layout layout_;
  FlagMem mode_;
  int ordinal_ = 0;
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
  bool retained_ = false;
  CUstream priv_ = nullptr;  // device -> host receives
  CUstream unstick_ = nullptr;  // writes the data flags of peers that exited (let_go_locked)
  std::mutex pend_mu_;          // the members below
  std::vector<Pending> pending_;
  std::vector<CUevent> spare_events_;
  size_t reap_at_ = 64;  // an enqueue reaps from this many: more than credits let run at once
  std::thread watcher_;
  std::condition_variable watch_cv_;
  bool watch_stop_ = false, watch_idle_ = false;
  bool settle_gave_up_ = false;
  size_t rings_off_ = 0, dev_bytes_ = 0;
  CUdeviceptr alloc_ = 0, dev_base_ = 0, own_flags_dev_ = 0;
  CUipcMemHandle ipc_{};
  size_t kernel_max_ = 0;  // option nvlink_kernel_max; 0: copy engine for every size
  PeerStores stores_;       // option shm_stores, for the host payloads (hostmem.h copy_to_peer)
  CUmodule module_ = nullptr;
  std::atomic<CUfunction> copy_signal_{nullptr};  // null: kernel not loaded, or turned off
  mutable std::mutex kernel_mu_;
  std::string kernel_why_;  // why the kernel is off while kernel_max_ is set (kernel_mu_ after construction)
  std::unordered_map<int, Peer> peers_;
  std::map<char*, Reg> regs_;
};

}  // namespace

std::string nvlink_unavailable_reason() {
  std::string why;
  cu::driver(&why);
  return why;
}

std::string nvlink_info(const std::string& flags, uint64_t kernel_max) {
  std::string why;
  const cu::Driver* d = cu::driver(&why);
  if (!d) return "nvlink: unavailable: " + why;
  std::ostringstream o;
  o << "nvlink: CUDA driver " << d->version / 1000 << "." << (d->version % 1000) / 10;
  int n = 0;
  d->DeviceGetCount(&n);
  o << ", " << n << " GPU" << (n == 1 ? "" : "s");
  for (int i = 0; i < n; ++i) {
    CUdevice dev;
    if (d->DeviceGet(&dev, i) != CUDA_SUCCESS) continue;
    int memops = -1;
    d->DeviceGetAttribute(&memops, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev);
    o << "\n  cuda:" << i << " " << device_label(*d, dev)
      << (memops == 0 ? " (no 64-bit stream memory operations: nvlink unusable)" : "");
    std::string peers;
    for (int j = 0; j < n; ++j) {
      CUdevice other;
      int can = 0;
      if (j == i || d->DeviceGet(&other, j) != CUDA_SUCCESS) continue;
      d->DeviceCanAccessPeer(&can, dev, other);
      peers += (peers.empty() ? "" : ", ") + std::string("cuda:") + std::to_string(j) + (can ? " yes" : " no");
    }
    if (!peers.empty()) o << "; peer access: " << peers;
  }
  o << "\n  data flags in " << (flags.empty() ? "device" : flags) << " memory (VARCOMM_NVLINK_FLAGS)";
  const std::string images = built_kernel_images();
  if (images.empty()) {
    o << "\n  copy-and-flag kernel: not in this build (no nvcc at build time): copy engine for every size";
  } else {
    o << "\n  copy-and-flag kernel: built for " << images << " (";
    for (int i = 0; i < n; ++i) {
      CUdevice dev;
      int major = 0, minor = 0;
      if (d->DeviceGet(&dev, i) != CUDA_SUCCESS) continue;
      d->DeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
      d->DeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
      std::string img = kernel_image_for(images, major, minor);
      o << (i ? ", " : "") << "cuda:" << i << " cc " << major << "." << minor << ": "
        << (img.empty() ? "no image" : img.rfind("sm_", 0) == 0 ? img : img + " JIT");
    }
    o << ")";
    if (kernel_max)
      o << "; used for messages up to " << kernel_max << " bytes (VARCOMM_NVLINK_KERNEL_MAX)";
    else
      o << "; off (VARCOMM_NVLINK_KERNEL_MAX=0): copy engine for every size";
  }
  {
    std::lock_guard<std::mutex> g(g_kernel_mu);
    if (!g_kernel_note.empty()) o << "\n  " << g_kernel_note;
  }
  return o.str();
}

namespace {

TransportRegistrar nvlink_registrar({
    "nvlink",
    /*device=*/true,
    /*same_host_only=*/true,
    [](const PeerInfo& self, const PeerInfo& peer, const Options&) -> std::string {
      if (peer.host != self.host) return "rank " + std::to_string(peer.rank) + " is on another host";
      if (!peer.has("nvlink")) return "rank " + std::to_string(peer.rank) + " exposed no GPU memory";
      if (!self.has("nvlink")) return "this rank exposed no GPU memory";
      return "";
    },
    // Allocates layout.total() - layout.rings_off() bytes on options.cuda_device.
    [](const TransportContext& c) -> std::shared_ptr<Transport> {
      std::string why;
      const cu::Driver* d = cu::driver(&why);
      if (!d) throw Error(ErrorKind::Invalid, "nvlink transport unavailable: " + why);
      return std::make_shared<NvlinkTransport>(*d, c.region, c.layout, c.options.cuda_device, c.options);
    },
});

}  // namespace

}  // namespace varcomm
