// An array kind's adapter in C: lets the fast paths (bindings.cpp: Buf,
// received_view, recv_new, lend) describe and make arrays of a framework's exact
// array type without a Python call. The core knows only this table; an
// adapter module knows its framework (csrc/adapters/torch_hooks.cpp for
// torch, loaded by python/varcomm/arrays.py when it matches the installed
// torch) and hands the table over in a capsule named kArrayHooksCapsule.
// Without an adapter every array takes the Python paths, with the same results.
#pragma once
#include <Python.h>

#include <cstdint>

namespace varcomm {

constexpr uint32_t kArrayHooksAbi = 1;
constexpr const char* kArrayHooksCapsule = "varcomm.array_hooks";
constexpr int kArrayHooksMaxDims = 8;  // = kMaxDims (protocol.h); checked where both are seen

struct ArrayDesc {
  void* ptr;  // first byte
  uint64_t nbytes;
  uint32_t dtype;  // the dtype word (dtypes.h)
  uint32_t ndim;
  int64_t shape[kArrayHooksMaxDims];
};

struct ArrayHooks {
  uint32_t abi;  // kArrayHooksAbi
  uint32_t kind;  // the array kind messages name (protocol.h kArrayShift; arrays.KINDS)
  PyTypeObject* type;  // only objects of exactly this type (subclasses take the Python path)
  // 1: a C-contiguous host array whose bytes the fast path may read (writable:
  // and write), *d filled; 0: not one (no Python error set: the Python path
  // decides and names what is wrong).
  int (*describe)(PyObject* obj, bool writable, ArrayDesc* d);
  // A new C-contiguous host array of dtype word and shape, *data its bytes;
  // nullptr with a Python error set (e.g. a dtype the framework lacks).
  PyObject* (*empty)(uint32_t dtype, const int64_t* shape, uint32_t ndim, void** data);
  // A view of the first bytes of `out` (described by describe) with `shape`;
  // nullptr with no error: not made here (the Python path makes it); nullptr
  // with an error set: failed.
  PyObject* (*prefix)(PyObject* out, const int64_t* shape, uint32_t ndim);
  // An array over `ptr` (recv copy=False: a receive slot) that holds `keep`
  // until the array's memory is freed; with keep nullptr it only checks that
  // it could (Py_None). nullptr with a Python error set: refused.
  PyObject* (*lend)(PyObject* keep, void* ptr, uint32_t dtype, const int64_t* shape, uint32_t ndim);
};

}  // namespace varcomm
