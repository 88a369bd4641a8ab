// What the GPU message engine (rdma_gpu.cpp) uses of this rank's rdma
// endpoint. Device messages share the host route's endpoint, CQ, memory
// registrations and liveness: one wire, one failure story. The engine's thread
// and the protocol engine (under its own mutex) both call into it, so once a
// GPU engine is attached every entry point of the endpoint takes mutex().
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "transport.h"

namespace varcomm {
namespace rdma {

class Port {
 public:
  virtual ~Port() = default;
  // Called once, before traffic: from now on the endpoint is shared with
  // another thread. `sink(off)` sees every remote completion whose offset is
  // not a slot start (the host path only writes at slot starts) and returns
  // true when it took it.
  virtual void attach(std::function<bool(size_t off)> sink) = 0;
  virtual std::recursive_mutex& mutex() = 0;
  // One write of n bytes from src (desc: its registration, null where the
  // provider needs none) to `peer`'s region at `off`, with FI_REMOTE_CQ_DATA
  // off >> 8 (off is 256-aligned). 0: no send resources now, retry after
  // progress(); else a ticket for done().
  virtual uint64_t write_data(int peer, size_t off, const void* src, size_t n, void* desc) = 0;
  // The same write into memory of `peer`'s outside its region (its GPU
  // receive slots: raddr and key from its reg_target), with the immediate
  // imm_off >> 8 naming the region's slot it stands for.
  virtual uint64_t write_data_to(int peer, size_t imm_off, uint64_t raddr, uint64_t key, const void* src, size_t n,
                                 void* desc) = 0;
  virtual bool done(uint64_t ticket) = 0;
  // Writes posted and not yet completed, or credits held: someone must keep
  // calling progress() (tcp progresses only when asked).
  virtual bool busy() = 0;
  // A registration of local memory as a write source: where the provider
  // needs one (FI_MR_LOCAL) its descriptor, else null. `iface_cuda` >= 0:
  // device memory of that CUDA ordinal (fi_mr_regattr, FI_HMEM_CUDA).
  virtual void* reg_source(void* p, size_t n, int iface_cuda, void** handle) = 0;
  // Local memory peers may write (iface_cuda as above): its key, and in
  // *addr the address they write at (0 where the provider addresses by offset).
  virtual uint64_t reg_target(void* p, size_t n, int iface_cuda, uint64_t* addr, void** handle) = 0;
  virtual void unreg(void* handle) = 0;
  // The provider offers FI_HMEM with CUDA memory on this domain; `why` says
  // what it reported either way.
  virtual bool hmem_cuda(std::string* why) const = 0;
  virtual std::string provider() const = 0;
};

// The Port of an rdma host transport, null for any other transport.
Port* port_of(Transport* t);

// A provider that drives an RDMA NIC, so GPUDirect RDMA can pay off (verbs
// with nvidia-peermem or dma-buf, efa, cxi); tcp and shm copy on the host.
inline bool nic_provider(const std::string& prov) {
  return prov.find("verbs") != std::string::npos || prov.find("efa") != std::string::npos ||
         prov.find("cxi") != std::string::npos;
}

// Whether rdma_hmem (auto | on | off) asks for GPUDirect RDMA on `prov` in a
// process using CUDA device `cuda_device` (-1: none), if the provider offers it.
inline bool wants_gpudirect(const std::string& rdma_hmem, const std::string& prov, int cuda_device) {
  return cuda_device >= 0 && (rdma_hmem == "on" || (rdma_hmem == "auto" && nic_provider(prov)));
}

}  // namespace rdma
}  // namespace varcomm
