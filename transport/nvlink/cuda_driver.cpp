#include "cuda_driver.h"

#include <dlfcn.h>

#include <initializer_list>
#include <mutex>

namespace varcomm {
namespace cu {
namespace {

struct Loaded {
  Driver d;
  std::string why;  // empty when usable
};

// The first of `names` that the driver exports.
template <class F>
void resolve(void* lib, F& fn, std::initializer_list<const char*> names, std::string* missing) {
  for (const char* n : names) {
    if (void* p = dlsym(lib, n)) {
      fn = reinterpret_cast<F>(p);
      return;
    }
  }
  if (!missing->empty()) *missing += ", ";
  *missing += *names.begin();
}

Loaded load() {
  Loaded L;
  // Already in the process when torch (or any CUDA runtime) initialised CUDA.
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* e = dlerror();
    L.why = std::string("the NVIDIA driver library libcuda.so.1 cannot be loaded (") + (e ? e : "not found") +
            "): no NVIDIA driver on this machine";
    return L;
  }
  Driver& d = L.d;
  std::string missing;
#define VARCOMM_CU_RESOLVE(member, ret, params, ...) resolve(lib, d.member, {__VA_ARGS__}, &missing);
  VARCOMM_CU_FUNCTIONS(VARCOMM_CU_RESOLVE)
#undef VARCOMM_CU_RESOLVE
  if (!missing.empty()) {
    L.why = "the NVIDIA driver is too old for varcomm's nvlink transport (libcuda.so.1 lacks " + missing + ")";
    return L;
  }
  if (d.DriverGetVersion(&d.version) != CUDA_SUCCESS) d.version = 0;
  CUresult r = d.Init(0);
  if (r != CUDA_SUCCESS) {
    L.why = error_string(d, r, "cuInit") + " (the NVIDIA driver is installed but no usable GPU was found)";
    return L;
  }
  int n = 0;
  if (d.DeviceGetCount(&n) != CUDA_SUCCESS || n == 0) L.why = "the NVIDIA driver reports no GPU";
  return L;
}

}  // namespace

const Driver* driver(std::string* why) {
  static std::once_flag once;
  static Loaded* loaded = nullptr;  // never freed: transports may outlive static destructors
  std::call_once(once, [] { loaded = new Loaded(load()); });
  if (why) *why = loaded->why;
  return loaded->why.empty() ? &loaded->d : nullptr;
}

std::string error_string(const Driver& d, CUresult r, const char* what) {
  const char* name = nullptr;
  const char* desc = nullptr;
  if (d.GetErrorName) d.GetErrorName(r, &name);
  if (d.GetErrorString) d.GetErrorString(r, &desc);
  std::string s = std::string(what) + ": " + (name ? std::string(name) : "CUDA error " + std::to_string(r));
  if (desc) s += std::string(" (") + desc + ")";
  return s;
}

}  // namespace cu
}  // namespace varcomm
