#include "region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "errors.h"
#include "hostmem.h"

namespace varcomm {

// (world x slots x bound, plus the landing area: options.py)
static const char* const kLower = "lower the bound, the slots or the landing area (VARCOMM_BOUND, VARCOMM_SLOTS, "
                                  "VARCOMM_LANDING)";

Region::Region(size_t size) : size_(size) {
  fd_ = memfd_create("varcomm-region", MFD_CLOEXEC);
  if (fd_ < 0) throw Error(ErrorKind::Invalid, std::string("memfd_create failed: ") + strerror(errno));
  if (ftruncate(fd_, off_t(size)) != 0) {
    int e = errno;
    ::close(fd_);
    throw Error(ErrorKind::Invalid, "cannot size the receive region to " + std::to_string(size) +
                                        " bytes (" + strerror(e) + "); " + kLower);
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    ::close(fd_);
    throw Error(ErrorKind::Invalid, "cannot map the receive region (" + std::to_string(size) +
                                        " bytes): " + strerror(e) + "; " + kLower);
  }
  base_ = static_cast<char*>(p);
}

Region::~Region() {
  if (base_) munmap(base_, size_);
  close_fd();
}

void Region::close_fd() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

char* map_peer_region(int pid, unsigned long long start, int fd, size_t size, std::string* error) {
  *error = process_trust_error(pid, start);
  if (!error->empty()) return nullptr;
  std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  int f = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (f < 0) {
    *error = "cannot open " + path + ": " + strerror(errno);
    return nullptr;
  }
  struct stat st {};
  if (fstat(f, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() || size_t(st.st_size) < size) {
    *error = path + " is not a region of " + std::to_string(size) + " bytes owned by uid " +
             std::to_string(geteuid()) + " (it has " + std::to_string((long long)st.st_size) + " bytes, uid " +
             std::to_string(st.st_uid) + "): the descriptor's size, bound or slots lie, or it names another file";
    ::close(f);
    return nullptr;
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
  ::close(f);
  if (p == MAP_FAILED) {
    *error = "cannot map " + path + ": " + strerror(errno);
    return nullptr;
  }
  return static_cast<char*>(p);
}

void unmap_region(char* base, size_t size) {
  if (base) munmap(base, size);
}

std::string region_mismatch(const char* base, size_t size, int rank, int pid, const Layout& L) {
  auto* c = reinterpret_cast<const RegionCtl*>(base);
  auto want = [](const char* what, long long got, long long exp) {
    return std::string(what) + " " + std::to_string(got) + " where its descriptor says " + std::to_string(exp);
  };
  std::string who = "rank " + std::to_string(rank) + "'s mapped region ";
  if (size < kCtlBytes || c->magic != kMagic) return who + "is not a varcomm region (bad magic)";
  if (c->rank != rank) return who + "belongs to " + want("rank", c->rank, rank);
  if (c->pid != pid) return who + "belongs to " + want("pid", c->pid, pid);
  if (c->world != L.world) return who + "has " + want("world_size", c->world, L.world);
  if (c->nslots != L.nslots) return who + "has " + want("slots", c->nslots, L.nslots);
  if (c->bound != L.bound) return who + "has " + want("bound", (long long)c->bound, (long long)L.bound);
  if (c->landing != L.landing)
    return who + "has " + want("landing", (long long)c->landing, (long long)L.landing);
  if (size != L.region_bytes()) return who + "is " + want("bytes", (long long)size, (long long)L.region_bytes());
  return "";
}

}  // namespace varcomm
