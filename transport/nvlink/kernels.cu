// The nvlink transport's CUDA kernels: a small message's copy into the peer's
// slot and its data-ready flag in one launch, and the device-split
// all-to-all's send and receive (transport/nvlink/README.md). Their bodies
// are headers (copy_signal.cuh, a2a_kernels.cuh) that the CPU stand-in
// driver compiles as host C++.
// Compiled by setup.py with `nvcc -fatbin` (VARCOMM_CUDA_ARCHS) and embedded
// in varcomm._C as bytes; nvlink.cpp loads it with cuModuleLoadData, so
// nothing links libcudart. Device code only: no runtime API calls here.
#include <cstddef>
#include <cstdint>

#include "kernels.h"

// The body is copy_signal.cuh, shared with the CPU stand-in driver.
#include "copy_signal.cuh"

extern "C" __global__ void __launch_bounds__(VARCOMM_KERNEL_MAX_THREADS)
    varcomm_copy_signal(unsigned char* dst, const unsigned char* src, size_t n, unsigned long long* flag,
                        unsigned long long seq) {
  // Each thread's stores reach system scope (the peer GPU's memory over
  // NVLink or PCIe) before the barrier; then one release store of the flag,
  // which the receiver's stream waits on (cuStreamWaitValue64, GEQ).
  varcomm::copy_signal::phase1(dst, src, n, threadIdx.x, blockDim.x);
  __syncthreads();
  if (threadIdx.x == 0) varcomm::copy_signal::phase2(flag, seq);
}

// The device-split all-to-all (a2a_device.h): bodies in a2a_kernels.cuh,
// shared with the CPU stand-in driver. One block per peer, phases between
// barriers; the Args struct is passed by value.
#include "a2a_kernels.cuh"

extern "C" __global__ void __launch_bounds__(varcomm::a2a::kThreads) varcomm_a2a_send(varcomm::a2a::Args a) {
  __shared__ varcomm::a2a::SendShared sh;
  if (threadIdx.x == 0) varcomm::a2a::send_phase0(a, sh, blockIdx.x);
  __syncthreads();
  varcomm::a2a::send_phase1(a, sh, blockIdx.x, threadIdx.x, blockDim.x);
  __syncthreads();
  if (threadIdx.x == 0) varcomm::a2a::send_phase2(a, sh, blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(varcomm::a2a::kThreads) varcomm_a2a_recv(varcomm::a2a::Args a) {
  __shared__ varcomm::a2a::RecvShared sh;
  if (threadIdx.x == 0) varcomm::a2a::recv_phase0(a, sh, blockIdx.x);
  __syncthreads();
  varcomm::a2a::recv_phase1(a, sh, blockIdx.x, threadIdx.x, blockDim.x);
  __syncthreads();
  if (threadIdx.x == 0) varcomm::a2a::recv_phase2(a, sh, blockIdx.x);
}

// Point-to-point with a device-side row count (a2a_kernels.cuh): one block.
extern "C" __global__ void __launch_bounds__(varcomm::a2a::kThreads) varcomm_p2p_send(varcomm::a2a::Args a) {
  __shared__ varcomm::a2a::SendShared sh;
  if (threadIdx.x == 0) varcomm::a2a::p2p_send_phase0(a, sh);
  __syncthreads();
  varcomm::a2a::p2p_send_phase1(a, sh, threadIdx.x, blockDim.x);
  __syncthreads();
  if (threadIdx.x == 0) varcomm::a2a::p2p_send_phase2(a, sh);
}

extern "C" __global__ void __launch_bounds__(varcomm::a2a::kThreads) varcomm_p2p_recv(varcomm::a2a::Args a) {
  __shared__ varcomm::a2a::RecvShared sh;
  if (threadIdx.x == 0) varcomm::a2a::p2p_recv_phase0(a, sh);
  __syncthreads();
  varcomm::a2a::p2p_recv_phase1(a, sh, threadIdx.x, blockDim.x);
  __syncthreads();
  if (threadIdx.x == 0) varcomm::a2a::p2p_recv_phase2(a, sh);
}
