// libfabric, loaded at run time and only by the rdma transport: the extension
// links no libfabric, so `import varcomm` works where libfabric is missing,
// and a process that never opens rdma never loads it. That matters beyond
// start-up cost: libfabric links libpsm_infinipath/libinfinipath, whose
// load-time constructors install SIGTERM/SIGSEGV/SIGBUS/SIGILL/SIGABRT
// handlers that call exit() from the handler (a SIGTERM from torchrun, SLURM
// or varcomm-run then hangs or corrupts the heap of a rank inside malloc).
// Where rdma is used, KeepSignalHandlers undoes what loading did.
//
// Only libfabric's exported functions are resolved here; everything else in
// <rdma/fabric.h> is inline calls through the objects' ops tables. Do not use
// fi_allocinfo() (inline, it calls the exported fi_dupinfo): use allocinfo().
#pragma once
#include <rdma/fabric.h>
#include <signal.h>

#include <string>

namespace varcomm {
namespace fab {

struct Api {
  decltype(&::fi_getinfo) getinfo = nullptr;
  decltype(&::fi_freeinfo) freeinfo = nullptr;
  decltype(&::fi_dupinfo) dupinfo = nullptr;
  decltype(&::fi_fabric) fabric = nullptr;
  decltype(&::fi_strerror) strerror = nullptr;
  decltype(&::fi_version) version = nullptr;

  fi_info* allocinfo() const { return dupinfo(nullptr); }
};

// libfabric's functions, loading it on first use (once per process); throws
// Error(Invalid) saying why when it cannot be loaded.
const Api& api();

// Keeps this process's signal dispositions across a scope that loads foreign
// libraries (dlopen of libfabric, fi_getinfo loading its providers): a
// disposition changed inside the scope is put back on exit, so no handler of
// theirs stays installed.
class KeepSignalHandlers {
 public:
  KeepSignalHandlers();
  ~KeepSignalHandlers();
  KeepSignalHandlers(const KeepSignalHandlers&) = delete;
  KeepSignalHandlers& operator=(const KeepSignalHandlers&) = delete;

 private:
  struct sigaction saved_[NSIG];
};

}  // namespace fab
}  // namespace varcomm
