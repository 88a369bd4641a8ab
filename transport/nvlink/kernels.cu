// The nvlink transport's CUDA kernel: a small message's copy into the peer's
// slot and its data-ready flag in one launch (transport/nvlink/README.md).
// Compiled by setup.py with `nvcc -fatbin` (VARCOMM_CUDA_ARCHS) and embedded
// in varcomm._C as bytes; nvlink.cpp loads it with cuModuleLoadData, so
// nothing links libcudart. Device code only: no runtime API calls here.
#include <cstddef>
#include <cstdint>
#include <cuda/atomic>

#include "kernels.h"

namespace {

// Head bytes up to W's alignment of dst (src shares it), W-sized words, tail bytes.
template <class W>
__device__ __forceinline__ void copy_aligned(unsigned char* dst, const unsigned char* src, size_t n) {
  constexpr uintptr_t A = sizeof(W);
  size_t head = (A - (reinterpret_cast<uintptr_t>(dst) & (A - 1))) & (A - 1);
  if (head > n) head = n;
  if (threadIdx.x < head) dst[threadIdx.x] = src[threadIdx.x];
  dst += head;
  src += head;
  n -= head;
  const size_t words = n / A;
  W* d = reinterpret_cast<W*>(dst);
  const W* s = reinterpret_cast<const W*>(src);
  for (size_t i = threadIdx.x; i < words; i += blockDim.x) d[i] = s[i];
  for (size_t i = words * A + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

}  // namespace

extern "C" __global__ void __launch_bounds__(VARCOMM_KERNEL_MAX_THREADS)
    varcomm_copy_signal(unsigned char* dst, const unsigned char* src, size_t n, unsigned long long* flag,
                        unsigned long long seq) {
  const uintptr_t mis = reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src);
  if (!(mis & 15))
    copy_aligned<uint4>(dst, src, n);
  else if (!(mis & 7))
    copy_aligned<uint2>(dst, src, n);
  else if (!(mis & 3))
    copy_aligned<unsigned int>(dst, src, n);
  else
    copy_aligned<unsigned char>(dst, src, n);
  // Each thread's stores reach system scope (the peer GPU's memory over
  // NVLink or PCIe) before the barrier; then one release store of the flag,
  // which the receiver's stream waits on (cuStreamWaitValue64, GEQ).
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0)
    cuda::atomic_ref<unsigned long long, cuda::thread_scope_system>(*flag).store(seq, cuda::memory_order_release);
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
