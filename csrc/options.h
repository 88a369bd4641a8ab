// Every knob of the core, in one struct. The Python options module reads the
// environment and init() arguments once and the binding fills this from its
// dict (csrc/python/bindings.cpp, options_from_dict): nothing in csrc/ or
// transport/ reads the environment.
#pragma once
#include <cstdint>
#include <string>

namespace varcomm {

struct Options {
  uint64_t bound = 8ull << 20;   // payload bytes per slot: larger messages go by rendezvous
  uint64_t eager_max = 0;  // larger messages go by rendezvous where the pair copies once; 0: Transport::eager_max
  uint64_t landing = 64ull << 20;  // landing area bytes (protocol.h kPushCredit); 0: none
  uint64_t max_message = 0;      // largest message this rank sends; 0: no limit
  int slots = 8;                 // ring depth per sending peer
  int spin_us = 50;              // busy-poll before yielding; 0 when ranks outnumber cores
  std::string transport = "auto";  // auto | shm | rdma | fallback
  std::string a2a_algorithm = "auto";  // auto (one-phase) | one-phase | two-phase: the same on every rank (set-up)
  std::string rdma_provider;     // libfabric provider spec; "" = rdma_default_providers() in order
  std::string rdma_iface;        // libfabric domain; "" = the provider's first non-loopback one
  double peer_timeout = 5;       // seconds of silence before an rdma peer counts as gone
  bool rdma_strict = false;      // take the verbs/efa memory-registration path on any provider (tests)
  bool rdma_eager_credits = false;  // post each rdma credit at once instead of riding on messages
  uint64_t rdma_chunk = 1ull << 20;   // GPU messages over rdma move in chunks of this many bytes (pipelined)
  std::string rdma_hmem = "auto";     // auto | on | off: GPUDirect RDMA (FI_HMEM_CUDA) for GPU messages over rdma
  std::string cma = "auto";           // auto | on | off | chunks: shm single-copy reads (options.py)
  std::string shm_stores = "auto";    // auto | ordinary | streaming: how shm copies into a peer's slots (hostmem.h)
  std::string liveness_addr;     // IP for the rdma liveness listener when the fabric address is none
  bool debug = false;            // transports print their set-up to stderr
  std::string nvlink = "auto";   // auto | on | off
  int cuda_device = -1;          // the GPU this process uses (torch ordinal), -1 none/unknown
  std::string nvlink_flags = "device";  // device | host: where nvlink data-ready flags live
  uint64_t nvlink_kernel_max = 0;       // largest nvlink message sent by the copy-and-flag kernel; 0 off
  std::string job_key;  // the job's shared secret (VARCOMM_JOB_KEY); "" none: see routes.cpp, authentication
};

}  // namespace varcomm
