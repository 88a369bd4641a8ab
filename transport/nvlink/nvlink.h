// Same host, GPU memory: each receiver's bound-sized slots live in a device
// allocation exported with CUDA IPC; a sender copies into the peer's slot on
// its own CUDA stream and then writes a per-slot data-ready flag that the
// receiver's stream waits on. Headers, ready words and credits stay in the
// host regions (as with shm), so a receiver's CPU sees a message's size,
// dtype and shape as soon as the send is enqueued. See transport/nvlink/README.md.
#pragma once
#include <memory>
#include <string>

#include <cstdint>

namespace varcomm {

// Empty when this process can use the nvlink transport (the NVIDIA driver
// loads and reports a GPU), else why not. Loads the driver and calls cuInit:
// do not call it in a process that forks CUDA-using children afterwards.
std::string nvlink_unavailable_reason();

// A human-readable summary: driver version, GPUs, peer access between them,
// and what the options nvlink_flags / nvlink_kernel_max would select.
std::string nvlink_info(const std::string& flags, uint64_t kernel_max);

// The transport itself registers as "nvlink" (registry.h): device receive
// slots on options.cuda_device, exported with CUDA IPC.

}  // namespace varcomm
