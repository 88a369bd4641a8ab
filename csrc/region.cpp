#include "region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "errors.h"

namespace varcomm {

Region::Region(size_t size) : size_(size) {
  fd_ = memfd_create("varcomm-region", MFD_CLOEXEC);
  if (fd_ < 0) throw Error(ErrorKind::Invalid, std::string("memfd_create failed: ") + strerror(errno));
  if (ftruncate(fd_, off_t(size)) != 0) {
    int e = errno;
    ::close(fd_);
    throw Error(ErrorKind::Invalid, "cannot size the receive region to " + std::to_string(size) +
                                        " bytes (" + strerror(e) + "); lower bound or slots");
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    ::close(fd_);
    throw Error(ErrorKind::Invalid, "cannot map the receive region (" + std::to_string(size) +
                                        " bytes): " + strerror(e) + "; lower bound or slots");
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

char* map_peer_region(int pid, int fd, size_t size, std::string* error) {
  std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  int f = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (f < 0) {
    *error = "cannot open " + path + ": " + strerror(errno);
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

}  // namespace varcomm
