#include "fabric_lib.h"

#include <dlfcn.h>

#include <cstring>
#include <mutex>

#include "errors.h"

#ifndef VARCOMM_LIBFABRIC_DIR
#define VARCOMM_LIBFABRIC_DIR ""
#endif

namespace varcomm {
namespace fab {
namespace {

struct Loaded {
  Api api;
  std::string why;  // empty when usable
};

template <class F>
bool resolve(void* lib, F& fn, const char* name) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
  return fn != nullptr;
}

Loaded load() {
  Loaded L;
  KeepSignalHandlers keep;
  // The soname first (LD_LIBRARY_PATH, ldconfig), then the one the build found
  // by pkg-config (a libfabric outside the loader's path, e.g. /opt/amazon/efa).
  void* lib = dlopen("libfabric.so.1", RTLD_NOW | RTLD_LOCAL);
  std::string err = lib ? "" : dlerror();
  if (!lib && *VARCOMM_LIBFABRIC_DIR) {
    lib = dlopen(VARCOMM_LIBFABRIC_DIR "/libfabric.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) err += std::string("; ") + dlerror();
  }
  if (!lib) {
    L.why = "libfabric cannot be loaded (" + err + "): install libfabric (Debian/Ubuntu: libfabric1) "
            "or choose another transport (VARCOMM_TRANSPORT=shm or fallback)";
    return L;
  }
  Api& a = L.api;
  // The default symbol versions: those a link against this libfabric would bind.
  bool ok = resolve(lib, a.getinfo, "fi_getinfo") && resolve(lib, a.freeinfo, "fi_freeinfo") &&
            resolve(lib, a.dupinfo, "fi_dupinfo") && resolve(lib, a.fabric, "fi_fabric") &&
            resolve(lib, a.strerror, "fi_strerror") && resolve(lib, a.version, "fi_version");
  if (!ok) L.why = "the libfabric found lacks fi_getinfo/fi_fabric/...: it is not libfabric 1.x";
  return L;
}

}  // namespace

const Api& api() {
  static std::once_flag once;
  static Loaded* loaded = nullptr;  // never freed: transports may outlive static destructors
  std::call_once(once, [] { loaded = new Loaded(load()); });
  if (!loaded->why.empty()) throw Error(ErrorKind::Invalid, "rdma: " + loaded->why);
  return loaded->api;
}

KeepSignalHandlers::KeepSignalHandlers() {
  for (int s = 1; s < NSIG; s++)
    if (sigaction(s, nullptr, &saved_[s]) != 0) saved_[s].sa_handler = SIG_ERR;  // not a signal we can set
}

KeepSignalHandlers::~KeepSignalHandlers() {
  for (int s = 1; s < NSIG; s++) {
    struct sigaction now;
    if (saved_[s].sa_handler == SIG_ERR || sigaction(s, nullptr, &now) != 0) continue;
    // sa_handler and sa_sigaction share storage: comparing one compares both.
    if (now.sa_handler != saved_[s].sa_handler || now.sa_flags != saved_[s].sa_flags)
      sigaction(s, &saved_[s], nullptr);
  }
}

}  // namespace fab
}  // namespace varcomm
