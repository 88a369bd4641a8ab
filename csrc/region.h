// The memory a rank exposes to its peers. Backed by an anonymous memfd so that
// same-host peers can map it through /proc/<pid>/fd/<fd> and nothing is ever
// named in /dev/shm: a crash cannot leave a segment behind.
#pragma once
#include <cstddef>
#include <string>

#include "protocol.h"

namespace varcomm {

class Region {
 public:
  explicit Region(size_t size);
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  char* base() const { return base_; }
  size_t size() const { return size_; }
  int fd() const { return fd_; }
  // Peers have mapped us; the fd is no longer needed to share the memory.
  void close_fd();

 private:
  char* base_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;
};

// Map a peer's region given its pid, start time (hostmem.h process_start) and
// fd: only when that process runs as our user (process_trust_error) and its
// memfd is ours and holds at least `size` bytes (else touching the mapping
// past the file's end would crash us); nullptr with *error why not.
char* map_peer_region(int pid, unsigned long long start, int fd, size_t size, std::string* error);
void unmap_region(char* base, size_t size);

// Empty when the region mapped at `base` (`size` bytes) is the one `rank`
// described: its control block names that rank, pid and layout. Else what
// differs (a recycled pid or fd would otherwise let us write into a stranger).
std::string region_mismatch(const char* base, size_t size, int rank, int pid, const Layout& layout);

}  // namespace varcomm
