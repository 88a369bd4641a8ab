#include "hostmem.h"

#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <sstream>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace varcomm {
namespace {

// The state letter, and the start time through *start; empty when gone.
std::string proc_state(int pid, unsigned long long* start) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return "";
  auto close = line.rfind(')');  // the command name may contain spaces and ')'
  if (close == std::string::npos) return "";
  std::istringstream rest(line.substr(close + 2));
  std::string state, tok;
  rest >> state;
  for (int field = 4; field < 22 && rest >> tok; ++field) {
  }
  rest >> *start;
  return state;
}

uint64_t now_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return uint64_t(t.tv_sec) * 1000000000ull + uint64_t(t.tv_nsec);
}

#if defined(__x86_64__)
constexpr bool kHaveNonTemporal = true;
void copy_non_temporal(char* d, const char* s, size_t n) {
  size_t head = std::min(n, size_t(-reinterpret_cast<uintptr_t>(d) & 15));
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  size_t body = n & ~size_t(63);
  for (size_t i = 0; i < body; i += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + body, s + body, n - body);
  _mm_sfence();  // streaming stores are weakly ordered: before the caller's release store
}
#else
constexpr bool kHaveNonTemporal = false;
void copy_non_temporal(char* d, const char* s, size_t n) { std::memcpy(d, s, n); }
#endif

// Per process (the spell is the machine's, not a pair's).
StoreChooser g_copy[2];  // by PeerCopyTarget: the two kinds of memory are slowed by different patterns

}  // namespace

uint32_t StoreChooser::median(int way) const {
  uint32_t a = cost_[way][0].load(std::memory_order_relaxed), b = cost_[way][1].load(std::memory_order_relaxed),
           c = cost_[way][2].load(std::memory_order_relaxed);
  return std::max(std::min(a, b), std::min(std::max(a, b), c));
}

int StoreChooser::pick(uint64_t now) {
  int way = nt_.load(std::memory_order_relaxed) ? 1 : 0;
  // Try the other way now and then, so a spell's end (or start) is seen.
  uint64_t last = tried_other_.load(std::memory_order_relaxed);
  if (now - last > kRetryOtherNs && tried_other_.compare_exchange_strong(last, now, std::memory_order_relaxed))
    way ^= 1;
  return way;
}

void StoreChooser::record(int way, uint64_t ns, size_t n, uint64_t end) {
  uint64_t per_kib = ns * 1024 / (n ? n : 1);
  last_ns_.store(end, std::memory_order_relaxed);
  uint32_t k = next_[way].fetch_add(1, std::memory_order_relaxed) % 3;
  cost_[way][k].store(uint32_t(std::min<uint64_t>(per_kib, UINT32_MAX)), std::memory_order_relaxed);
  copies_[way].fetch_add(1, std::memory_order_relaxed);
  // Streaming only where ordinary stores are in a slow spell (~10x, so 3x is
  // far from both): its data is not in cache for the reader (1 MiB read back
  // in 61 us, not 31), and outside a spell the two ways time within 0.6-1.6x
  // of each other (both directions at once), which must not flip it.
  uint32_t o = median(0), t = median(1);
  nt_.store(o && t && uint64_t(t) * 3 < uint64_t(o), std::memory_order_relaxed);
}

bool StoreChooser::slow(uint64_t now) const {
  return nt_.load(std::memory_order_relaxed) && now - last_ns_.load(std::memory_order_relaxed) < kFreshNs;
}

PeerCopyStats StoreChooser::stats() const {
  return {nt_.load(), copies_[0].load(), copies_[1].load(), median(0), median(1)};
}

PeerStores peer_stores(const std::string& option) {
  return option == "ordinary" ? PeerStores::kOrdinary : option == "streaming" ? PeerStores::kStreaming : PeerStores::kAuto;
}

void copy_to_peer(char* dst, const void* src, size_t n, PeerStores how, PeerCopyTarget target) {
  const char* s = static_cast<const char*>(src);
  StoreChooser& g = g_copy[int(target)];
  if (n < kPeerCopyAdapt || !kHaveNonTemporal || how == PeerStores::kOrdinary) {
    std::memcpy(dst, s, n);
    return;
  }
  if (how == PeerStores::kStreaming) {
    copy_non_temporal(dst, s, n);
    g.count_streamed();
    return;
  }
  uint64_t t0 = now_ns();
  int way = g.pick(t0);
  if (way)
    copy_non_temporal(dst, s, n);
  else
    std::memcpy(dst, s, n);
  uint64_t t1 = now_ns();
  g.record(way, t1 - t0, n, t1);
}

bool peer_stores_slow() { return g_copy[int(PeerCopyTarget::kSlots)].slow(now_ns()); }

PeerCopyStats peer_copy_stats(PeerCopyTarget target) { return g_copy[int(target)].stats(); }

void advise_huge_pages(void* p, size_t n) {
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  if (n < kHugeAdviseMin) return;
  uintptr_t a = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  uintptr_t e = (reinterpret_cast<uintptr_t>(p) + n) & ~(kHuge - 1);
  if (e > a) (void)madvise(reinterpret_cast<void*>(a), e - a, MADV_HUGEPAGE);
}

unsigned long long process_start(int pid) {
  unsigned long long start = 0;
  proc_state(pid, &start);
  return start;
}

std::string process_exit_error(int peer, int pid, unsigned long long start) {
  unsigned long long now = 0;
  std::string st = proc_state(pid, &now);
  if (st.empty() || st == "Z" || st == "X" || now != start)
    return "rank " + std::to_string(peer) + " (pid " + std::to_string(pid) + ") has exited";
  return "";
}

std::string process_trust_error(int pid, unsigned long long start) {
  std::string who = "pid " + std::to_string(pid);
  unsigned long long now = 0;
  if (proc_state(pid, &now).empty()) return who + " does not exist";
  if (now != start)
    return who + " started at " + std::to_string(now) + " where the descriptor says " + std::to_string(start) +
           " (a recycled pid, or a descriptor that names another process)";
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(f, line);) {
    if (line.compare(0, 4, "Uid:") != 0) continue;
    std::istringstream in(line.substr(4));
    uid_t me = geteuid();
    long long u;
    for (int i = 0; i < 4 && in >> u; ++i)
      if (uid_t(u) != me)
        return who + " runs as uid " + std::to_string(u) + ", this rank as uid " + std::to_string(me) +
               ": refused (same-host ranks must run as the same user; a process of another user may have written "
               "this descriptor into the store)";
    return "";
  }
  return who + ": cannot read its owner from /proc/" + std::to_string(pid) + "/status";
}

}  // namespace varcomm
