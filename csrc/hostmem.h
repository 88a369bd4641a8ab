// Same-host pieces shared by transports that reach a peer's region through a
// mapping (shm; nvlink's host part): the one-sided message write into mapped
// memory, and whether the peer process still exists.
#pragma once
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>

#include "protocol.h"

namespace varcomm {

// Copies n bytes into a peer's slot or landing block: memory the peer's core may have read last, which
// this core's ordinary stores must first take from it. On this project's VMs
// that costs ~10x in some minutes-long spells ("slow mode": 1 MiB in 360-400
// us instead of 33; bench/results/shm-cross-write.c), while non-temporal
// stores, which skip the ownership transfer, stay at 38-52 us. From
// kPeerCopyAdapt bytes the copy is timed, and whichever way was faster over
// its last samples is used, the other tried again every few milliseconds
// (slow mode comes and goes). Ordinary stores win outside slow mode (the
// reader also finds the data in cache). Fenced before returning: the caller's
// release store publishes it.
constexpr size_t kPeerCopyAdapt = size_t(16) << 10;
enum class PeerStores { kAuto, kOrdinary, kStreaming };  // Options::shm_stores
PeerStores peer_stores(const std::string& option);
// Each timed apart: a slot is read by the peer's core between writes (the
// spells slow every such copy), a landing block only where the peer reads
// its result before it is written again (ping-pong, not a one-way stream),
// and a fast landing copy must not hide a slow slot one.
enum class PeerCopyTarget { kSlots = 0, kLanding = 1 };
void copy_to_peer(char* dst, const void* src, size_t n, PeerStores how = PeerStores::kAuto,
                  PeerCopyTarget target = PeerCopyTarget::kSlots);
// Whether copy_to_peer (auto) streams large writes now, its copies each way
// so far, and the costs it decides by: for tests and the benchmarks' header.
struct PeerCopyStats {
  bool non_temporal;
  uint64_t ordinary, streamed;
  uint32_t ordinary_ns_per_kib, streamed_ns_per_kib;  // the medians it decides by; 0: no sample yet
};
PeerCopyStats peer_copy_stats(PeerCopyTarget target);
// copy_to_peer's choice, apart from the clock and the copy (tests drive it
// with made-up times: _C._store_chooser_trace). Costs in ns per KiB, the last
// three of each way: the median ignores a copy that was preempted (more ranks
// than cores). Threads race on it harmlessly: a lost sample only delays a
// switch.
class StoreChooser {
 public:
  static constexpr uint64_t kRetryOtherNs = 5000000;  // a stale choice costs at most this long (5 ms)
  static constexpr uint64_t kFreshNs = 20000000;      // slow() needs a copy this recent (20 ms)
  // The way for a copy starting at `now` (ns): 0 ordinary stores, 1 non-temporal.
  int pick(uint64_t now);
  // That copy took `ns` for n bytes and ended at `end`.
  void record(int way, uint64_t ns, size_t n, uint64_t end);
  // Streaming, by a copy of the last kFreshNs.
  bool slow(uint64_t now) const;
  void count_streamed() { copies_[1].fetch_add(1, std::memory_order_relaxed); }
  PeerCopyStats stats() const;

 private:
  uint32_t median(int way) const;
  std::atomic<uint32_t> cost_[2][3]{};
  std::atomic<uint32_t> next_[2]{};
  std::atomic<bool> nt_{false};
  std::atomic<uint64_t> tried_other_{0};
  std::atomic<uint64_t> copies_[2]{};
  std::atomic<uint64_t> last_ns_{0};
};
// copy_to_peer (auto) streams into slots now, by copies of the last 20 ms: ordinary
// stores are in a slow spell. Stale (no recent copies to tell) reads false, so
// a peer that stopped asking for copies soon gets one again and remeasures.
bool peer_stores_slow();

// Header, then payload, then the ready word with a release store: a reader
// that acquires `seq` sees both.
inline void write_mapped_message(char* slot, const void* hdr, size_t hdr_len, const void* payload, size_t n,
                                 uint64_t seq, PeerStores how = PeerStores::kAuto,
                                 PeerCopyTarget target = PeerCopyTarget::kSlots) {
  std::memcpy(slot + kHeaderOff, hdr, hdr_len);
  if (n) copy_to_peer(slot + kPayloadOff, payload, n, how, target);
  __atomic_store_n(reinterpret_cast<uint64_t*>(slot), seq, __ATOMIC_RELEASE);
}

inline void store_release_u64(char* at, uint64_t value) {
  __atomic_store_n(reinterpret_cast<uint64_t*>(at), value, __ATOMIC_RELEASE);
}

// Fresh host arrays from kHugeAdviseMin bytes get transparent huge pages, as
// numpy gives its own (its allocator's madvise, from 4 MiB): torch's CPU
// allocator does not, and first-touching a 44 MiB torch output costs 16-19 ms
// in 4 KiB faults against 4.4 ms in 2 MiB ones on this host (an all-to-all
// output too large for the landing area). Only the 2 MiB-aligned interior is
// advised; failure (THP off, an odd mapping) changes nothing.
constexpr size_t kHugeAdviseMin = size_t(4) << 20;
void advise_huge_pages(void* p, size_t n);

// Start time of a process (field 22 of /proc/<pid>/stat), 0 if it is gone:
// recorded at connect so a recycled pid is not mistaken for the peer.
unsigned long long process_start(int pid);
// Empty while process `pid` started at `start` is alive; else why not.
std::string process_exit_error(int peer, int pid, unsigned long long start);
// Empty when `pid` is the process that published `start` (the same
// incarnation, not a recycled pid) and runs as this process's user (real,
// effective, saved and filesystem uid): only then may we map its memory or let
// it map ours. Else why not. (root may open another user's /proc/<pid>/fd, so
// the kernel alone does not stop a root job mapping a stranger's memfd.)
std::string process_trust_error(int pid, unsigned long long start);

}  // namespace varcomm
