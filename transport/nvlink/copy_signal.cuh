// The copy-and-flag kernel's body (kernels.cu: varcomm_copy_signal), as
// __host__ __device__ phases, so the CPU stand-in driver (fake_libcuda.cc)
// runs the same code for cuLaunchKernel: phase 1 on every thread copies,
// then (after the block's barrier) thread 0 stores the flag.
#pragma once
#include "a2a_kernels.cuh"  // the memory operations, host and device

namespace varcomm {
namespace copy_signal {

using a2a::u64;

// Head bytes up to W's alignment of dst (src shares it), W-sized words, tail bytes.
template <class W>
VC_HD inline void copy_aligned(unsigned char* dst, const unsigned char* src, u64 n, unsigned t, unsigned nt) {
  constexpr u64 A = sizeof(W);
  u64 head = (A - (reinterpret_cast<u64>(dst) & (A - 1))) & (A - 1);
  if (head > n) head = n;
  if (t < head) dst[t] = src[t];
  dst += head;
  src += head;
  n -= head;
  const u64 words = n / A;
  W* d = reinterpret_cast<W*>(dst);
  const W* s = reinterpret_cast<const W*>(src);
  for (u64 i = t; i < words; i += nt) d[i] = s[i];
  for (u64 i = words * A + t; i < n; i += nt) dst[i] = src[i];
}

// Every thread t of nt: its share of the bytes, then a system-scope fence.
VC_HD inline void phase1(unsigned char* dst, const unsigned char* src, u64 n, unsigned t, unsigned nt) {
  const u64 mis = reinterpret_cast<u64>(dst) ^ reinterpret_cast<u64>(src);
  if (!(mis & 15))
    copy_aligned<a2a::Word16>(dst, src, n, t, nt);
  else if (!(mis & 7))
    copy_aligned<u64>(dst, src, n, t, nt);
  else if (!(mis & 3))
    copy_aligned<unsigned>(dst, src, n, t, nt);
  else
    copy_aligned<unsigned char>(dst, src, n, t, nt);
  a2a::fence_system();
}

// Thread 0, after the barrier: the flag the receiver's stream waits on (release, system scope).
VC_HD inline void phase2(u64* flag, u64 seq) { a2a::store_release(flag, seq); }

#ifndef __CUDA_ARCH__
inline void host_block(unsigned char* dst, const unsigned char* src, u64 n, u64* flag, u64 seq, unsigned nt) {
  for (unsigned t = 0; t < nt; ++t) phase1(dst, src, n, t, nt);
  phase2(flag, seq);
}
#endif

}  // namespace copy_signal
}  // namespace varcomm
