// pybind11 surface of the core. Arrays arrive as raw pointers (torch, via
// data_ptr) or through the buffer protocol (numpy); the core never sees a
// framework type. The transport headers are included only for the doctor's
// info functions: routes come from the registry (csrc/routes.cpp).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <unordered_map>
#include <vector>

#include "array_hooks.h"
#include "collectives.h"
#include "dtypes.h"
#include "engine.h"
#include "fallback.h"
#include "hostmem.h"
#include "options.h"
#include "routes.h"
#ifdef VARCOMM_HAVE_RDMA
#include "rdma.h"
#endif
#ifdef VARCOMM_HAVE_CUDA
#include "a2a_device.h"
#include "nvlink.h"
#endif

namespace py = pybind11;
using namespace varcomm;
using Clock = std::chrono::steady_clock;

namespace {

const char* error_class(ErrorKind k) {
  switch (k) {
    case ErrorKind::TooLarge: return "MessageTooLarge";
    case ErrorKind::Mismatch: return "MessageMismatch";
    case ErrorKind::Timeout: return "TimeoutError";
    case ErrorKind::PeerFailure: return "PeerFailure";
    case ErrorKind::Closed: return "ClosedError";
    default: return "InvalidArgument";
  }
}

// Past this a timeout is "none": a deadline so far away would overflow the clock.
constexpr double kForeverS = 1e9;  // ~31 years

// A timeout as Python passes it: seconds, or None. inf and anything past
// kForeverS mean no timeout; NaN is refused before anything is done.
std::optional<double> timeout_of(std::optional<double> t) {
  if (!t) return t;
  if (std::isnan(*t)) throw Error(ErrorKind::Invalid, "timeout nan: pass seconds (>= 0), or None (or inf) for no limit");
  if (*t > kForeverS) return std::nullopt;
  return t;
}

// The same rule for whatever a caller passed as a timeout (a str, a list, a
// bool, a negative number are refused, naming it), checked before a blocking
// call posts anything: an unusable timeout found only at the wait would leave
// a receive posted that takes (and drops) the next message.
std::optional<double> seconds_of(py::handle o) {
  PyObject* p = o.ptr();
  if (p == Py_None) return std::nullopt;
  if (!PyBool_Check(p) && (PyFloat_Check(p) || PyLong_Check(p) || (PyNumber_Check(p) && !PyUnicode_Check(p)))) {
    double d = PyFloat_AsDouble(p);
    if (!(d == -1.0 && PyErr_Occurred())) {
      if (d < 0)
        throw Error(ErrorKind::Invalid, "timeout " + std::string(py::repr(o)) +
                                            ": pass seconds (>= 0), or None (or inf) for no limit");
      return timeout_of(d);
    }
    PyErr_Clear();
  }
  throw Error(ErrorKind::Invalid, "timeout " + std::string(py::repr(o)) + " (" +
                                      std::string(py::str(py::type::of(o).attr("__name__"))) +
                                      "): pass seconds as a number (>= 0), or None (or inf) for no limit");
}

// Buffer-protocol format -> DLPack dtype word.
uint32_t dtype_of_format(const std::string& f, ssize_t itemsize) {
  auto w = [](uint32_t code, uint32_t bits) { return (code << 16) | (bits << 8) | 1u; };
  char c = f.empty() ? 0 : f.back();
  bool complex = f.size() >= 2 && f[f.size() - 2] == 'Z';
  // 8 bits hold the width: a wider item (np.clongdouble, 'Zg', 32 bytes) has
  // no dtype word (its width would read as 0, a header the receiver fails).
  if (itemsize <= 0 || itemsize > 16)
    throw Error(ErrorKind::Invalid, "unsupported buffer format '" + f + "' (" + std::to_string(itemsize) +
                                        "-byte items); pass a numpy array or torch tensor of a fixed-size dtype");
  uint32_t bits = uint32_t(itemsize * 8);
  if (complex) return w(5, bits);
  switch (c) {
    case '?': return w(6, 8);
    case 'b': case 'h': case 'i': case 'l': case 'q': case 'n': return w(0, bits);
    case 'B': case 'H': case 'I': case 'L': case 'Q': case 'N': return w(1, bits);
    case 'e': case 'f': case 'd': return w(2, bits);
    default:
      throw Error(ErrorKind::Invalid, "unsupported buffer format '" + f + "'; pass a numpy array or torch tensor of a fixed-size dtype");
  }
}

// '>' or '!' on a little-endian host, '<' on a big-endian one (struct-module format).
bool foreign_byte_order(const char* format) {
  char c = format ? format[0] : 0;
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  return c == '>' || c == '!';
#else
  return c == '<';
#endif
}

static_assert(kArrayHooksMaxDims == kMaxDims, "array_hooks.h describes shapes of up to kMaxDims");

// Array adapters (array_hooks.h), at most one per array kind: the types whose
// objects the fast paths describe and make through C, not Python.
const ArrayHooks* g_hooks[4] = {};

const ArrayHooks* hooks_of(PyObject* o) {
  for (const ArrayHooks* h : g_hooks)
    if (h && Py_TYPE(o) == h->type) return h;
  return nullptr;
}

// An adapter's table when `o` is its capsule (an allocator or lender in its
// place: arrays.allocators, arrays.lenders); nullptr for anything else, or
// with a Python error set for a capsule of another name.
const ArrayHooks* capsule_hooks(PyObject* o) {
  if (!PyCapsule_CheckExact(o)) return nullptr;
  return static_cast<const ArrayHooks*>(PyCapsule_GetPointer(o, kArrayHooksCapsule));
}

// A borrowed C-contiguous buffer. Raw CPython API: the ping-pong path cannot
// afford py::buffer_info's vector copies.
struct Buf {
  Py_buffer v{};
  bool ok = false;
  uint32_t dtype = 0;
  uint64_t nbytes = 0;
  int64_t shape[kMaxDims] = {};
  uint32_t ndim = 0;
  // false when the object is not C-contiguous or not in our byte order (the
  // caller converts it first), or is an adapter's array it does not take.
  bool get(PyObject* o, bool writable) {
    if (const ArrayHooks* h = hooks_of(o)) {
      ArrayDesc d;
      if (h->describe(o, writable, &d) != 1 || Engine::no_memory(d.ptr, d.nbytes)) return false;
      v.buf = d.ptr;  // ok stays false: nothing to release
      nbytes = d.nbytes;
      dtype = d.dtype;
      ndim = d.ndim;
      std::copy(d.shape, d.shape + d.ndim, shape);
      return true;
    }
    if (!PyObject_CheckBuffer(o)) return false;  // (no exception made and dropped: a torch tensor without adapter)
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(o, &v, flags) != 0) {
      PyErr_Clear();
      return false;
    }
    ok = true;
    // A foreign byte order is converted on the general path (or refused for an out).
    if (foreign_byte_order(v.format) && v.itemsize > 1) return false;
    if (v.ndim > kMaxDims)
      throw Error(ErrorKind::Invalid, "arrays of more than " + std::to_string(kMaxDims) + " dimensions are not supported");
    ndim = uint32_t(v.ndim);
    for (int i = 0; i < v.ndim; ++i) shape[i] = v.shape[i];
    nbytes = uint64_t(v.len);
    dtype = dtype_of_format(v.format ? v.format : "B", v.itemsize);
    return true;
  }
  ~Buf() {
    if (ok) PyBuffer_Release(&v);
  }
};

// The one place an option is read on the C++ side: the Python options module's
// dict, with exactly these keys, becomes the Options every part of the core gets.
Options options_from_dict(const py::dict& d) {
  static const std::set<std::string> keys = {
      "bound", "slots", "spin_us", "transport", "rdma_provider", "rdma_iface", "peer_timeout", "rdma_strict",
      "rdma_eager_credits", "liveness_addr", "debug", "nvlink", "cuda_device", "nvlink_flags", "nvlink_kernel_max",
      "eager_max", "max_message", "job_key", "rdma_chunk", "rdma_hmem", "cma", "landing",
      "shm_stores", "a2a_algorithm"};
  std::set<std::string> seen;
  for (auto kv : d) {
    std::string k = py::str(kv.first);
    if (!keys.count(k)) throw Error(ErrorKind::Invalid, "unknown core option '" + k + "'");
    seen.insert(k);
  }
  for (auto& k : keys)
    if (!seen.count(k)) throw Error(ErrorKind::Invalid, "core option '" + k + "' is missing");
  auto get = [&](const char* k, auto* out) {
    try {
      *out = d[k].cast<std::decay_t<decltype(*out)>>();
    } catch (const py::cast_error&) {
      throw Error(ErrorKind::Invalid, std::string("core option '") + k + "' has the wrong type: " +
                                          std::string(py::str(py::type::of(d[k]).attr("__name__"))));
    }
  };
  auto one_of = [](const char* k, const std::string& v, std::initializer_list<const char*> ok) {
    std::string list;
    for (const char* x : ok) {
      if (v == x) return;
      list += std::string(list.empty() ? "" : ", ") + x;
    }
    throw Error(ErrorKind::Invalid, std::string(k) + "='" + v + "': use " + list);
  };
  Options o;
  get("bound", &o.bound);
  get("slots", &o.slots);
  get("spin_us", &o.spin_us);
  get("transport", &o.transport);
  get("rdma_provider", &o.rdma_provider);
  get("rdma_iface", &o.rdma_iface);
  get("peer_timeout", &o.peer_timeout);
  get("rdma_strict", &o.rdma_strict);
  get("rdma_eager_credits", &o.rdma_eager_credits);
  get("liveness_addr", &o.liveness_addr);
  get("debug", &o.debug);
  get("nvlink", &o.nvlink);
  get("cuda_device", &o.cuda_device);
  get("nvlink_flags", &o.nvlink_flags);
  get("nvlink_kernel_max", &o.nvlink_kernel_max);
  get("eager_max", &o.eager_max);
  get("landing", &o.landing);
  get("max_message", &o.max_message);
  get("job_key", &o.job_key);
  get("rdma_chunk", &o.rdma_chunk);
  get("rdma_hmem", &o.rdma_hmem);
  one_of("rdma_hmem", o.rdma_hmem, {"auto", "on", "off"});
  get("cma", &o.cma);
  one_of("cma", o.cma, {"auto", "on", "off", "chunks"});
  get("shm_stores", &o.shm_stores);
  one_of("shm_stores", o.shm_stores, {"auto", "ordinary", "streaming"});
  get("a2a_algorithm", &o.a2a_algorithm);
  one_of("a2a_algorithm", o.a2a_algorithm, {"auto", "one-phase", "two-phase"});
  one_of("transport", o.transport, {"auto", "shm", "rdma", "fallback"});
  one_of("nvlink", o.nvlink, {"auto", "on", "off"});
  one_of("nvlink_flags", o.nvlink_flags, {"device", "host"});
  if (o.bound == 0) throw Error(ErrorKind::Invalid, "bound must be positive (bytes)");
  return o;
}

// The status of one received message: what its header said. A C struct
// sequence (like os.stat_result): named, typed fields at the cost of a tuple,
// since the prefix-view recv path builds one per message.
PyStructSequence_Field kStatusFields[] = {
    {"src", "the rank that sent it"},
    {"tag", "its tag"},
    {"nbytes", "payload bytes (a descriptor: the bytes it describes)"},
    {"dtype", "DLPack dtype word (varcomm.dtypes.describe names it)"},
    {"shape", "its shape, a tuple"},
    {"device", "the payload is in device memory"},
    {"descriptor", "a descriptor: nbytes, dtype and shape describe data sent separately"},
    // By name only (not in the tuple): unpacking code written for 7 fields keeps working.
    {"array", "the sender's array kind (varcomm.arrays.KINDS: 0 unknown, 1 numpy, 2 torch, 3 cupy)"},
    {nullptr, nullptr}};
PyStructSequence_Desc kStatusDesc = {"varcomm.Status",
                                     "A received message's header: source, tag, size, dtype, shape, and the "
                                     "device and descriptor flags.",
                                     kStatusFields, 7};
PyTypeObject* status_type = nullptr;

// repr names the dtype (csrc/dtypes.h), not its DLPack word.
PyObject* status_repr(PyObject* self) {
  try {
    auto item = [&](int i) { return py::reinterpret_borrow<py::object>(PyStructSequence_GetItem(self, i)); };
    std::string dt = dtype_name(uint32_t(PyLong_AsUnsignedLong(item(3).ptr())));
    std::string r = "varcomm.Status(src=" + std::string(py::str(item(0))) + ", tag=" + std::string(py::str(item(1))) +
                    ", nbytes=" + std::string(py::str(item(2))) + ", dtype=" + dt +
                    ", shape=" + std::string(py::repr(item(4))) + ", device=" + std::string(py::str(item(5))) +
                    ", descriptor=" + std::string(py::str(item(6))) + ")";
    return PyUnicode_FromStringAndSize(r.data(), Py_ssize_t(r.size()));
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  }
}

py::object make_status(int src, int64_t tag, uint64_t nbytes, uint32_t dtype, const int64_t* shape, size_t ndim,
                       uint64_t flags) {
  PyObject* t = PyTuple_New(Py_ssize_t(ndim));
  if (!t) throw py::error_already_set();
  for (size_t i = 0; i < ndim; ++i) PyTuple_SET_ITEM(t, Py_ssize_t(i), PyLong_FromLongLong(shape[i]));
  PyObject* o = PyStructSequence_New(status_type);
  if (!o) {
    Py_DECREF(t);
    throw py::error_already_set();
  }
  PyStructSequence_SetItem(o, 0, PyLong_FromLong(src));
  PyStructSequence_SetItem(o, 1, PyLong_FromLongLong(tag));
  PyStructSequence_SetItem(o, 2, PyLong_FromUnsignedLongLong(nbytes));
  PyStructSequence_SetItem(o, 3, PyLong_FromUnsignedLong(dtype));
  PyStructSequence_SetItem(o, 4, t);
  PyStructSequence_SetItem(o, 5, PyBool_FromLong((flags & kDevicePayload) != 0));
  PyStructSequence_SetItem(o, 6, PyBool_FromLong((flags & kDescriptor) != 0));
  PyStructSequence_SetItem(o, 7, PyLong_FromUnsignedLong(unsigned((flags & kArrayMask) >> kArrayShift)));
  return py::reinterpret_steal<py::object>(o);
}

py::object status_of(int src, const MsgHeader& h) {
  return make_status(src, h.tag, h.nbytes, h.dtype, h.shape, std::min<uint32_t>(h.ndim, kMaxDims), h.flags);
}

py::object status_of(const MsgInfo& m) {
  return make_status(m.src, m.tag, m.nbytes, m.dtype, m.shape.data(), m.shape.size(), m.flags);
}

// Bumped in every child a fork makes (pthread_atfork, registered at import):
// a Comm made before the fork is its parent's, whose peers and slots it must
// not touch. One load to ask, where getpid() is a system call.
std::atomic<unsigned> g_fork_generation{0};

// The core: the engine and the set-up that chose and connected its routes.
struct Comm {
  // Buffers of dropped requests the engine still reads or writes (a send's
  // source, a recv's out), by request id, until the engine reports it is done
  // with them. Declared first so it outlives the engine: its transports stop
  // touching memory when they are destroyed. Touched only under the GIL.
  std::unordered_map<uint64_t, py::object> kept;
  std::vector<uint64_t> recycled;  // take_recycled's scratch
  std::unique_ptr<Engine> engine;
  std::unique_ptr<Setup> setup;
  // The process that set it up. A child forked after that (os.fork, then a
  // normal exit whose finalizers destroy this) must not close it: the
  // transports' sockets and mappings are the parent's too, and closing would
  // tell every peer that the parent left. It lets them go untouched instead.
  const pid_t owner = getpid();
  const unsigned generation = g_fork_generation.load(std::memory_order_relaxed);
  // In a child forked after this Comm was made (its copy of a Work or a
  // copy=False view being dropped there): nothing of the parent's to give back.
  bool forked() const { return generation != g_fork_generation.load(std::memory_order_relaxed); }
  ~Comm() {
    if (getpid() == owner) return;
    (void)engine.release();
    (void)setup.release();
  }

  // Lets go of the buffers the engine is done with. Empty `kept` (no dropped
  // request in flight): one size check, no lock.
  void drop_kept() {
    if (kept.empty()) return;
    engine->take_recycled(recycled);
    if (recycled.empty()) return;
    // Released after the map is consistent again: a buffer's destructor may
    // run Python code that comes back here (a Work's __del__ detaching).
    std::vector<py::object> gone;
    gone.reserve(recycled.size());
    for (uint64_t id : recycled) {
      auto it = kept.find(id);
      if (it == kept.end()) continue;
      gone.push_back(std::move(it->second));
      kept.erase(it);
    }
    recycled.clear();
  }
  void detach(uint64_t id, py::object keep) {
    if (forked()) return;
    drop_kept();
    if (engine->detach(id, !keep.is_none())) kept[id] = std::move(keep);
  }
  // `kept` stays until the Comm goes: a fallback mover thread that close()
  // could not join (a hung peer) may still be sending from a kept buffer, and
  // such a thread keeps this Comm alive (fallback_mover's keep_alive).
  void close() {
    if (getpid() != owner) return;
    py::gil_scoped_release nogil;
    engine->close();
  }

  Setup& ready() {
    if (!setup->done()) throw Error(ErrorKind::Invalid, "set-up is not complete (setup_step until it returns None)");
    return *setup;
  }
  void check_peer(int peer) {
    if (peer < 0 || peer >= engine->world())
      throw Error(ErrorKind::Invalid, "peer " + std::to_string(peer) + " out of range [0, " +
                                          std::to_string(engine->world()) + ")");
  }

  // Waits in slices so Ctrl-C reaches Python while a peer is silent. `owner`
  // (may be null): what a send's source belongs to; when the wait gives up on
  // a send the transport still reads, it is kept until the engine is done.
  void wait(uint64_t id, std::optional<double> timeout, py::handle owner = {}) {
    timeout = timeout_of(timeout);
    if (engine->wait(id, Clock::time_point::min())) {  // done already: keep the GIL
      drop_kept();
      return;
    }
    auto start = Clock::now();
    auto deadline = timeout ? start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(*timeout))
                            : Clock::time_point::max();
    for (;;) {
      auto slice = std::min(deadline, Clock::now() + std::chrono::milliseconds(100));
      bool done;
      {
        py::gil_scoped_release nogil;
        done = engine->wait(id, slice);
      }
      if (done) break;
      if (PyErr_CheckSignals() != 0) {
        give_up(id, owner);
        throw py::error_already_set();
      }
      if (Clock::now() >= deadline) {
        int peer;
        std::string msg = engine->timeout_message(id, *timeout, &peer);
        switch (give_up(id, owner)) {
          case Engine::Cancelled::kCompleted:  // its receiver finished copying as we gave up
            drop_kept();
            return;
          case Engine::Cancelled::kMoved:
            msg += ". The buffer is yours again: varcomm copied the message, and the receiver still gets it if it "
                   "receives before this rank closes";
            break;
          default:
            break;
        }
        throw Error(ErrorKind::Timeout, msg, peer);
      }
    }
    drop_kept();
  }
  // Without the GIL: giving up on a rendezvous send may wait (briefly) for a
  // receiver that is copying it right now.
  Engine::Cancelled give_up(uint64_t id, py::handle owner) {
    Engine::Cancelled how;
    {
      py::gil_scoped_release nogil;
      how = engine->cancel(id, bool(owner));
    }
    if (how == Engine::Cancelled::kKept) kept[id] = py::reinterpret_borrow<py::object>(owner);
    return how;
  }
};

// Point-to-point tags stay below the collectives' reserved space, so a user
// message can never be matched by (or steal) a collective's receive.
inline void check_tag(int64_t tag) {
  if (tag >= kCollTagBase)
    throw Error(ErrorKind::Invalid, "tag " + std::to_string(tag) + " is reserved for collectives: point-to-point "
                                    "tags must be below 2**40 (" + std::to_string(kCollTagBase) + ")");
}

// A point-to-point tag as Python passes it: an int or a numpy integer (any
// __index__), never a bool, a float or a str; every route refuses the same way.
int64_t tag_of(py::handle o) {
  PyObject* p = o.ptr();
  if (PyLong_CheckExact(p)) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(p, &overflow);
    if (!overflow) {
      check_tag(v);
      return v;
    }
  } else if (!PyBool_Check(p) && !PyFloat_Check(p) && PyIndex_Check(p)) {
    auto i = py::reinterpret_steal<py::object>(PyNumber_Index(p));
    if (!i) throw py::error_already_set();
    if (PyLong_CheckExact(i.ptr())) return tag_of(i);
  }
  throw Error(ErrorKind::Invalid, "tag " + std::string(py::repr(o)) + " (" +
                                      std::string(py::str(py::type::of(o).attr("__name__"))) +
                                      "): a point-to-point tag is an int in [-2**63, 2**40)");
}


// Python passes stream = -1 for host memory, else the CUDA stream handle
// (torch.cuda.current_stream().cuda_stream) that orders a device buffer.
Mem mem_of(int64_t stream) {
  Mem m;
  m.device = stream >= 0;
  m.stream = m.device ? uintptr_t(stream) : 0;
  return m;
}

Clock::time_point deadline_of(std::optional<double> timeout) {
  timeout = timeout_of(timeout);
  return timeout ? Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(*timeout))
                 : Clock::time_point::max();
}

// owner: what ptr belongs to, kept if the send is given up on in flight.
void send_blocking(Comm& c, int dst, int64_t tag, const void* ptr, uint64_t nbytes, uint32_t dtype,
                   const int64_t* shape, uint32_t ndim, std::optional<double> timeout, Mem mem, py::handle owner,
                   uint32_t array) {
  timeout = timeout_of(timeout);  // NaN refused before anything is written
  uint64_t id = c.engine->send_now(dst, tag, ptr, nbytes, dtype, shape, ndim, mem, array);
  if (id == Engine::kSentDone) return;
  if (!id)
    id = c.engine->isend(dst, tag, ptr, nbytes, dtype, shape, ndim, mem, array, false, true, 0, /*waited=*/true);
  c.wait(id, timeout, owner);
}

// A receive into a host out that recv_direct cannot finish (its message
// lands in out or streams in, or irecvs from src are posted before it): as
// an irecv, waited for here, so a large message into a comm.empty buffer is
// one call too (the Python irecv path cost ~10 us per message). False where
// the caller's own path must take it (no out: recv_new's claim; device memory,
// whose stream the caller records). The wait has the whole timeout again,
// as the Python path had: the message has come, only its data is awaited.
bool recv_posted(Comm& c, int src, int64_t tag, void* out, uint64_t cap, uint32_t dtype, MsgHeader* h,
                 std::optional<double> timeout, Mem mem, int* claim) {
  if (claim || !out || mem.device) return false;
  uint64_t id = c.engine->irecv(src, tag, out, cap, dtype, mem, false);
  c.wait(id, timeout);
  MsgInfo m = c.engine->info(id);
  h->tag = m.tag;
  h->nbytes = m.nbytes;
  h->dtype = m.dtype;
  h->ndim = uint32_t(m.shape.size());
  std::copy(m.shape.begin(), m.shape.end(), h->shape);
  h->flags = m.flags;
  return true;
}
// Blocking receive into a caller buffer; false when the caller's own path
// must take it (see recv_posted).
bool recv_blocking(Comm& c, int src, int64_t tag, void* out, uint64_t cap, uint32_t dtype, MsgHeader* h,
                   std::optional<double> timeout, Mem mem = {}, int* claim = nullptr) {
  timeout = timeout_of(timeout);  // NaN refused before anything is consumed
  int r = c.engine->recv_direct(src, tag, out, cap, dtype, h, Clock::time_point::min(), mem, claim);
  if (r != 0) return r > 0 || recv_posted(c, src, tag, out, cap, dtype, h, timeout, mem, claim);
  auto deadline = deadline_of(timeout);
  for (;;) {
    auto slice = std::min(deadline, Clock::now() + std::chrono::milliseconds(100));
    int got;
    {
      py::gil_scoped_release nogil;
      got = c.engine->recv_direct(src, tag, out, cap, dtype, h, slice, mem, claim);
    }
    if (got != 0) return got > 0 || recv_posted(c, src, tag, out, cap, dtype, h, timeout, mem, claim);
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    if (Clock::now() >= deadline) {
      if (c.engine->out_unsettled(out, mem)) throw Error(ErrorKind::Timeout, Engine::unsettled_text(), src);
      char secs[32];
      snprintf(secs, sizeof secs, "%.3g", *timeout);
      throw Error(ErrorKind::Timeout,
                  "recv from rank " + std::to_string(src) + " (tag " + std::to_string(tag) + ") timed out after " +
                      secs + " s" + c.engine->nothing_arrived(src),
                  src);
    }
  }
}

std::vector<int64_t> to_shape(const py::sequence& s) {
  std::vector<int64_t> v;
  v.reserve(py::len(s));
  for (auto x : s) v.push_back(x.cast<int64_t>());
  return v;
}

// Blocking receive of a new array (recv without out): claims the message,
// alloc(dtype word, shape) makes its array, the payload is copied there and
// the slot freed; one call and no request. allocs: a tuple of allocators
// indexed by the sender's array kind (its item 0 for a kind past its end), so
// one table serves a fixed kind and array="auto". An allocator returns the
// array (a writable C-contiguous buffer: numpy), or (array, data pointer) for
// one without the buffer protocol (torch), or (array, pointer, then): then
// turns the host array into the kind asked for (cupy: a copy on the GPU); an
// allocator may also be an adapter's capsule (array_hooks.h: its empty()).
// None, with the message left in place, when irecvs from src are posted
// (FIFO) or the message is a device payload or a descriptor (the caller's
// irecv path handles those). An alloc that raises leaves the message for the
// next recv.
py::object recv_new(Comm& c, int src, int64_t tag, std::optional<double> timeout, PyObject* allocs) {
  MsgHeader h;
  int slot = -1;
  if (!recv_blocking(c, src, tag, nullptr, 0, 0, &h, timeout, {}, &slot)) return py::none();
  if (h.flags & (kDevicePayload | kDescriptor)) {
    c.engine->unclaim(src, h.seq);
    return py::none();
  }
  py::object arr, then;
  void* ptr = nullptr;
  size_t kind = size_t((h.flags & kArrayMask) >> kArrayShift);
  Py_ssize_t n = PyTuple_GET_SIZE(allocs);
  try {  // anything that refuses the message leaves it for the next recv
    py::handle alloc = PyTuple_GET_ITEM(allocs, Py_ssize_t(kind) < n ? Py_ssize_t(kind) : 0);
    if (PyCapsule_CheckExact(alloc.ptr())) {  // an adapter's (set_array_hooks): no Python call
      const ArrayHooks* hk = capsule_hooks(alloc.ptr());
      arr = py::reinterpret_steal<py::object>(hk ? hk->empty(h.dtype, h.shape, h.ndim, &ptr) : nullptr);
      if (!arr) throw py::error_already_set();
    } else {
      py::tuple shape(h.ndim);
      for (uint32_t i = 0; i < h.ndim; ++i) shape[i] = py::int_(h.shape[i]);
      py::object made = alloc(h.dtype, shape);
      if (PyTuple_Check(made.ptr())) {
        arr = made[py::int_(0)];
        ptr = reinterpret_cast<void*>(made[py::int_(1)].cast<uintptr_t>());
        if (PyTuple_GET_SIZE(made.ptr()) > 2) then = made[py::int_(2)];
      } else {
        arr = made;
        Py_buffer v;
        if (PyObject_GetBuffer(arr.ptr(), &v, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) throw py::error_already_set();
        ptr = v.buf;
        bool short_ = uint64_t(v.len) < h.nbytes;
        PyBuffer_Release(&v);
        if (short_) throw Error(ErrorKind::Invalid, "recv allocator made an array smaller than the message");
      }
    }
    if (Engine::no_memory(ptr, h.nbytes))  // (torch.empty under a mode such as FakeTensorMode)
      throw Error(ErrorKind::Invalid, "the recv allocator made an array without memory for the message (data "
                                      "pointer " + std::to_string(reinterpret_cast<uintptr_t>(ptr)) + " for " +
                                      std::to_string(h.nbytes) + " bytes: a torch mode such as FakeTensorMode "
                                      "is active?): receive outside the mode, or into out=; the message is kept");
  } catch (...) {
    c.engine->unclaim(src, h.seq);
    throw;
  }
  advise_huge_pages(ptr, h.nbytes);  // a fresh array, not touched yet (hostmem.h)
  c.engine->consume_claimed(src, slot, h, ptr);
  return then ? then(arr) : arr;
}

// ---- the hot path ------------------------------------------------------------
// Blocking send and receive as plain CPython METH_FASTCALL methods of one
// object per communicator (Comm.fast()): one call per operation, no pybind11
// argument dispatch (about a third of a small message's CPU time). Each takes
// what it can and answers "not here" (False / None) for anything else, and
// the facade then takes the general path, which gives every error its words.

// A varcomm Error as the Python exception of its kind (the exception
// translator below does the same for pybind11 calls).
void set_error(const Error& e) {
  // A Ctrl-C that came while the call waited wins, as in any blocking Python
  // call: the error the wait ended with is often only its echo (the peer that
  // the same Ctrl-C stopped first said goodbye), and raised over a pending
  // KeyboardInterrupt it made the interpreter's exit print an object dump.
  if (PyErr_CheckSignals() != 0) return;
  py::object cls = py::module_::import("varcomm.errors").attr(error_class(e.kind));
  // Texts may quote bytes from elsewhere (a peer's note, an OS message):
  // never a UnicodeDecodeError in place of the error.
  const char* w = e.what();
  py::object text = py::reinterpret_steal<py::object>(PyUnicode_DecodeUTF8(w, Py_ssize_t(strlen(w)), "replace"));
  if (!text) throw py::error_already_set();
  py::object exc = cls(text);
  exc.attr("peer") = e.peer >= 0 ? py::object(py::int_(e.peer)) : py::none();
  PyErr_SetObject(cls.ptr(), exc.ptr());
}

template <class F>
PyObject* guarded(F&& f) {
  try {
    return f();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const Error& e) {
    try {
      set_error(e);
    } catch (py::error_already_set& e2) {
      e2.restore();
    }
  } catch (const py::cast_error& e) {
    PyErr_SetString(PyExc_TypeError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

// A rank argument the fast path takes: an exact int in [0, world).
bool rank_arg(PyObject* o, int world, int* r) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  long v = PyLong_AsLongAndOverflow(o, &overflow);
  if (overflow || v < 0 || v >= world) return false;
  *r = int(v);
  return true;
}

// A timeout argument the fast path takes: None, a float or an int (seconds).
bool timeout_arg(PyObject* o, std::optional<double>* t) {
  if (o == Py_None) {
    *t = std::nullopt;
    return true;
  }
  if (PyFloat_CheckExact(o)) {
    *t = PyFloat_AS_DOUBLE(o);
    return *t >= 0;  // a negative one: the general path refuses it (seconds_of)
  }
  if (PyLong_CheckExact(o)) {
    double d = PyLong_AsDouble(o);
    if (d == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    *t = d;
    return d >= 0;
  }
  return false;
}

// What a receive into `out` returns: out itself when the message has its
// shape; out[:n] when both are 1-d (one slice, no Status); else the Status
// (the facade builds the prefix view).
PyObject* received_view(PyObject* out, int src, const MsgHeader& h, const int64_t* out_shape, uint32_t out_ndim) {
  if (h.ndim == out_ndim && std::equal(h.shape, h.shape + h.ndim, out_shape)) {
    Py_INCREF(out);
    return out;
  }
  if (h.flags & kDescriptor) return status_of(src, h).release().ptr();
  if (const ArrayHooks* hk = hooks_of(out)) {
    if (PyObject* v = hk->prefix(out, h.shape, h.ndim)) return v;
    if (PyErr_Occurred()) return nullptr;
    return status_of(src, h).release().ptr();  // the Python path makes the view
  }
  if (h.ndim == 1 && out_ndim == 1) {
    PyObject* stop = PyLong_FromLongLong(h.shape[0]);
    if (!stop) return nullptr;
    PyObject* sl = PySlice_New(nullptr, stop, nullptr);
    Py_DECREF(stop);
    if (!sl) return nullptr;
    PyObject* v = PyObject_GetItem(out, sl);
    Py_DECREF(sl);
    return v;
  }
  return status_of(src, h).release().ptr();
}

// A message read in place (recv copy=False): a buffer over its payload in our
// receive slot. The slot goes back to the sender when the Loan is freed, i.e.
// when the last array made from it (numpy/torch frombuffer) is gone. It holds
// the Comm, so the region stays mapped while any view lives.
struct LoanObj {
  PyObject_HEAD
  PyObject* owner;  // the Python Comm
  Comm* c;
  char* ptr;
  Py_ssize_t nbytes;
  uint64_t seq;
  int peer;
  int slot;
  bool live;  // the claim is this Loan's to end
};

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
PyTypeObject loan_type = {PyVarObject_HEAD_INIT(nullptr, 0)};  // the rest is set in ready_fast_types
#pragma GCC diagnostic pop

void loan_dealloc(PyObject* self) {
  auto* l = reinterpret_cast<LoanObj*>(self);
  if (l->live && !l->c->forked()) {  // (a forked child's copy: the slot is its parent's to give back)
    try {
      l->c->engine->release_claimed(l->peer, l->slot, l->seq);
    } catch (...) {
      // nothing to give back to (closed, failed peer): the slot is gone with it
    }
  }
  Py_XDECREF(l->owner);
  Py_TYPE(self)->tp_free(self);
}

int loan_getbuffer(PyObject* self, Py_buffer* view, int flags) {
  auto* l = reinterpret_cast<LoanObj*>(self);
  return PyBuffer_FillInfo(view, self, l->ptr, l->nbytes, 0, flags);
}

PyBufferProcs loan_buffer = {loan_getbuffer, nullptr};

PyObject* new_loan(PyObject* owner, Comm& c, int peer, int slot, const MsgHeader& h) {
  auto* l = PyObject_New(LoanObj, &loan_type);
  if (!l) return nullptr;
  Py_INCREF(owner);
  l->owner = owner;
  l->c = &c;
  l->ptr = const_cast<char*>(c.engine->slot_payload(peer, slot));
  l->nbytes = Py_ssize_t(h.nbytes);
  l->seq = h.seq;
  l->peer = peer;
  l->slot = slot;
  l->live = true;
  return reinterpret_cast<PyObject*>(l);
}

// A lender by the sender's array kind: `make` itself, or for a tuple of
// lenders (arrays.lenders) its item for that kind (item 0 past its end).
PyObject* lender_for(PyObject* make, unsigned kind) {
  if (!PyTuple_Check(make)) return make;
  Py_ssize_t n = PyTuple_GET_SIZE(make);
  return PyTuple_GET_ITEM(make, Py_ssize_t(kind) < n ? Py_ssize_t(kind) : 0);
}

// make(loan, dtype word, shape, sender's array kind) turns a Loan into the
// array recv returns (make: a lender, a tuple of them, or an adapter's
// capsule: see lender_for); if it raises, the message stays for the next recv.
PyObject* lend(PyObject* owner, Comm& c, int src, int slot, const MsgHeader& h, PyObject* make) {
  PyObject* loan = new_loan(owner, c, src, slot, h);
  if (!loan) {
    c.engine->unclaim(src, h.seq);
    return nullptr;
  }
  unsigned kind = unsigned((h.flags & kArrayMask) >> kArrayShift);
  make = lender_for(make, kind);
  PyObject* made = nullptr;
  if (PyCapsule_CheckExact(make)) {  // an adapter's (array_hooks.h): no Python call
    if (const ArrayHooks* hk = capsule_hooks(make))
      made = hk->lend(loan, reinterpret_cast<LoanObj*>(loan)->ptr, h.dtype, h.shape, h.ndim);
  } else {
    py::tuple shape(h.ndim);
    for (uint32_t i = 0; i < h.ndim; ++i) shape[i] = py::int_(h.shape[i]);
    PyObject* args[4] = {loan, PyLong_FromUnsignedLong(h.dtype), shape.ptr(), PyLong_FromUnsignedLong(kind)};
    made = (args[1] && args[3]) ? PyObject_Vectorcall(make, args, 4, nullptr) : nullptr;
    Py_XDECREF(args[1]);
    Py_XDECREF(args[3]);
  }
  if (!made) {
    // Whatever make kept of the Loan no longer frees the slot: the message is
    // back (a landed one has left the ring and is dropped, as a message taken
    // early is: its block is freed).
    reinterpret_cast<LoanObj*>(loan)->live = false;
    if (slot <= Engine::kLandedSlot)
      c.engine->release_claimed(src, slot, h.seq);
    else
      c.engine->unclaim(src, h.seq);
  }
  Py_DECREF(loan);
  return made;
}

struct FastObj {
  PyObject_HEAD
  PyObject* owner;  // the Python Comm (keeps c alive)
  Comm* c;
  int world;
};

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
PyTypeObject fast_type = {PyVarObject_HEAD_INIT(nullptr, 0)};  // the rest is set in ready_fast_types
#pragma GCC diagnostic pop

void fast_dealloc(PyObject* self) {
  Py_XDECREF(reinterpret_cast<FastObj*>(self)->owner);
  Py_TYPE(self)->tp_free(self);
}

#define VARCOMM_NARGS(n)                                                                   \
  if (nargs != (n)) {                                                                      \
    PyErr_Format(PyExc_TypeError, "expected %d arguments, got %zd", (n), Py_ssize_t(nargs)); \
    return nullptr;                                                                        \
  }

// send(obj, dst, tag, timeout, array) -> bool: a buffer-protocol (numpy)
// array; False, nothing sent, when not taken here.
PyObject* fast_send(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  VARCOMM_NARGS(5)
  return guarded([&]() -> PyObject* {
    auto* f = reinterpret_cast<FastObj*>(self);
    int dst;
    std::optional<double> t;
    if (!rank_arg(a[1], f->world, &dst) || !timeout_arg(a[3], &t)) Py_RETURN_FALSE;
    int64_t tag = tag_of(a[2]);
    Buf b;
    if (!b.get(a[0], false)) Py_RETURN_FALSE;
    send_blocking(*f->c, dst, tag, b.v.buf, b.nbytes, b.dtype, b.shape, b.ndim, t, {}, a[0],
                  uint32_t(PyLong_AsUnsignedLong(a[4])));
    Py_RETURN_TRUE;
  });
}

// send_ptr(keep, dst, tag, ptr, dtype, shape, timeout, array) -> bool: a
// contiguous host array the caller described (torch); its bytes are
// prod(shape) x the dtype's item size.
PyObject* fast_send_ptr(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  VARCOMM_NARGS(8)
  return guarded([&]() -> PyObject* {
    auto* f = reinterpret_cast<FastObj*>(self);
    int dst;
    std::optional<double> t;
    if (!rank_arg(a[1], f->world, &dst) || !timeout_arg(a[6], &t) || !PyTuple_Check(a[5])) Py_RETURN_FALSE;
    Py_ssize_t nd = PyTuple_GET_SIZE(a[5]);
    if (nd > kMaxDims) Py_RETURN_FALSE;
    int64_t tag = tag_of(a[2]);
    uint32_t dtype = uint32_t(PyLong_AsUnsignedLong(a[4]));
    int64_t shape[kMaxDims];
    uint64_t n = (((dtype >> 8) & 0xFF) * std::max(dtype & 0xFF, 1u) + 7) / 8;
    for (Py_ssize_t i = 0; i < nd; ++i) {
      shape[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(a[5], i));
      n *= uint64_t(shape[i]);
    }
    void* ptr = PyLong_AsVoidPtr(a[3]);
    uint32_t array = uint32_t(PyLong_AsUnsignedLong(a[7]));
    if (PyErr_Occurred()) return nullptr;
    if (Engine::no_memory(ptr, n)) Py_RETURN_FALSE;  // (a zero tensor: the general path materializes it)
    send_blocking(*f->c, dst, tag, ptr, n, dtype, shape, uint32_t(nd), t, {}, a[0], array);
    Py_RETURN_TRUE;
  });
}

// isend(obj, dst, tag, array) -> request id: a buffer-protocol (numpy)
// array, posted in one call; 0, nothing posted, when not taken here (the
// caller keeps obj alive until the Work is done, as for any isend).
PyObject* fast_isend(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  VARCOMM_NARGS(4)
  return guarded([&]() -> PyObject* {
    auto* f = reinterpret_cast<FastObj*>(self);
    int dst;
    if (!rank_arg(a[1], f->world, &dst)) return PyLong_FromLong(0);
    int64_t tag = tag_of(a[2]);
    Buf b;
    if (!b.get(a[0], false)) return PyLong_FromLong(0);
    uint32_t array = uint32_t(PyLong_AsUnsignedLong(a[3]));
    if (PyErr_Occurred()) return nullptr;
    return PyLong_FromUnsignedLongLong(
        f->c->engine->isend(dst, tag, b.v.buf, b.nbytes, b.dtype, b.shape, b.ndim, Mem{}, array));
  });
}

// recv(src, tag, out, timeout): into a buffer-protocol (numpy) out; out, a
// view of its front (1-d), the message's Status, or None: not taken here.
PyObject* fast_recv(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  VARCOMM_NARGS(4)
  return guarded([&]() -> PyObject* {
    auto* f = reinterpret_cast<FastObj*>(self);
    int src;
    std::optional<double> t;
    if (!rank_arg(a[0], f->world, &src) || !timeout_arg(a[3], &t)) Py_RETURN_NONE;
    int64_t tag = tag_of(a[1]);
    Buf b;
    if (!b.get(a[2], true)) Py_RETURN_NONE;
    MsgHeader h;
    if (!recv_blocking(*f->c, src, tag, b.v.buf, b.nbytes, b.dtype, &h, t)) Py_RETURN_NONE;
    return received_view(a[2], src, h, b.shape, b.ndim);
  });
}

// recv_ptr(src, tag, out, ptr, cap, dtype, shape, timeout): into host memory
// the caller described (a torch out; shape: its shape); as recv.
PyObject* fast_recv_ptr(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  VARCOMM_NARGS(8)
  return guarded([&]() -> PyObject* {
    auto* f = reinterpret_cast<FastObj*>(self);
    int src;
    std::optional<double> t;
    if (!rank_arg(a[0], f->world, &src) || !timeout_arg(a[7], &t) || !PyTuple_Check(a[6])) Py_RETURN_NONE;
    Py_ssize_t nd = PyTuple_GET_SIZE(a[6]);
    if (nd > kMaxDims) Py_RETURN_NONE;
    int64_t tag = tag_of(a[1]);
    int64_t shape[kMaxDims];
    for (Py_ssize_t i = 0; i < nd; ++i) shape[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(a[6], i));
    void* ptr = PyLong_AsVoidPtr(a[3]);
    uint64_t cap = PyLong_AsUnsignedLongLong(a[4]);
    uint32_t dtype = uint32_t(PyLong_AsUnsignedLong(a[5]));
    if (PyErr_Occurred()) return nullptr;
    if (Engine::no_memory(ptr, cap)) Py_RETURN_NONE;  // (a zero tensor: the general path names it)
    MsgHeader h;
    if (!recv_blocking(*f->c, src, tag, ptr, cap, dtype, &h, t)) Py_RETURN_NONE;
    return received_view(a[2], src, h, shape, uint32_t(nd));
  });
}

// recv_new(src, tag, timeout, allocs): a new array (see Comm.recv_new).
PyObject* fast_recv_new(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  VARCOMM_NARGS(4)
  return guarded([&]() -> PyObject* {
    auto* f = reinterpret_cast<FastObj*>(self);
    int src;
    std::optional<double> t;
    if (!rank_arg(a[0], f->world, &src) || !timeout_arg(a[2], &t) || !PyTuple_Check(a[3])) Py_RETURN_NONE;
    int64_t tag = tag_of(a[1]);
    return recv_new(*f->c, src, tag, t, a[3]).release().ptr();
  });
}

// recv_loan(src, tag, timeout, make): copy=False; make(loan, dtype word,
// shape, sender's kind) -> the array; None: not taken here (take irecv).
PyObject* fast_recv_loan(PyObject* self, PyObject* const* a, Py_ssize_t nargs) {
  VARCOMM_NARGS(4)
  return guarded([&]() -> PyObject* {
    auto* f = reinterpret_cast<FastObj*>(self);
    int src;
    std::optional<double> t;
    if (!rank_arg(a[0], f->world, &src) || !timeout_arg(a[2], &t)) Py_RETURN_NONE;
    int64_t tag = tag_of(a[1]);
    MsgHeader h;
    int slot = -1;
    if (!recv_blocking(*f->c, src, tag, nullptr, 0, 0, &h, t, {}, &slot)) Py_RETURN_NONE;
    if (h.flags & (kDevicePayload | kDescriptor | kRendezvous)) {  // the general path (a rendezvous: a copy)
      f->c->engine->unclaim(src, h.seq);
      Py_RETURN_NONE;
    }
    return lend(f->owner, *f->c, src, slot, h, a[3]);
  });
}

PyMethodDef fast_methods[] = {
    {"send", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_send)), METH_FASTCALL, nullptr},
    {"send_ptr", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_send_ptr)), METH_FASTCALL, nullptr},
    {"isend", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_isend)), METH_FASTCALL, nullptr},
    {"recv", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_recv)), METH_FASTCALL, nullptr},
    {"recv_ptr", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_recv_ptr)), METH_FASTCALL, nullptr},
    {"recv_new", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_recv_new)), METH_FASTCALL, nullptr},
    {"recv_loan", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_recv_loan)), METH_FASTCALL, nullptr},
    {nullptr, nullptr, 0, nullptr}};

void ready_fast_types(py::module_& m) {
  loan_type.tp_name = "varcomm._C.Loan";
  loan_type.tp_basicsize = sizeof(LoanObj);
  loan_type.tp_flags = Py_TPFLAGS_DEFAULT;
  loan_type.tp_doc = "A received message's bytes in its receive slot (copy=False); the slot returns when it is freed.";
  loan_type.tp_dealloc = loan_dealloc;
  loan_type.tp_as_buffer = &loan_buffer;
  fast_type.tp_name = "varcomm._C.Fast";
  fast_type.tp_basicsize = sizeof(FastObj);
  fast_type.tp_flags = Py_TPFLAGS_DEFAULT;
  fast_type.tp_doc = "A communicator's blocking send/recv, one call each (Comm.fast()).";
  fast_type.tp_dealloc = fast_dealloc;
  fast_type.tp_methods = fast_methods;
  if (PyType_Ready(&loan_type) < 0 || PyType_Ready(&fast_type) < 0) throw py::error_already_set();
  m.attr("Loan") = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(&loan_type));
  m.attr("Fast") = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(&fast_type));
}

py::object make_fast(py::handle owner) {
  auto* f = PyObject_New(FastObj, &fast_type);
  if (!f) throw py::error_already_set();
  f->owner = owner.inc_ref().ptr();
  f->c = &owner.cast<Comm&>();
  f->world = f->c->engine->world();
  return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(f));
}

}  // namespace

// ---- collectives ------------------------------------------------------------
// The all-to-all exchange engine (csrc/collectives.h). Python builds a plan
// from its arrays, then run() finishes the collective; it calls back into
// Python only to allocate outputs whose size the headers told.
namespace {

struct AllToAllHandle {
  py::object comm;  // keeps the Comm, and so the Engine, alive
  py::object keep;  // what the plan's pointers belong to (inputs, outputs)
  std::unique_ptr<AllToAll> a;
  Mem mem;  // where outputs allocated from the headers live (alloc's memory)

  AllToAllHandle() = default;
  AllToAllHandle(AllToAllHandle&&) = default;
  // A collective given up on (timeout, error, interrupt, dropped) may leave
  // sends the transport still reads: their inputs stay in the Comm's keep map
  // until the engine is done with them, as for a dropped p2p Work.
  void keep_in_flight() {
    if (!a) return;
    auto ids = a->take_in_flight();
    if (ids.empty()) return;
    Comm& c = comm.cast<Comm&>();
    for (uint64_t id : ids) c.kept[id] = keep;
  }
  ~AllToAllHandle() {
    if (!a) return;
    if (comm.cast<Comm&>().forked()) {  // a forked child's copy: its slots and requests are the parent's
      (void)a.release();
      return;
    }
    {
      py::gil_scoped_release nogil;  // (as a2a_drive's cleanup: the fallback's writes need Python threads)
      a->cleanup();
    }
    keep_in_flight();
  }
};

// step(deadline) without the GIL, in slices, until it returns true.
template <class F>
void a2a_drive(AllToAll& a, F&& step, Clock::time_point deadline, std::optional<double> timeout) {
  for (;;) {
    auto slice = std::min(deadline, Clock::now() + std::chrono::milliseconds(100));
    bool done;
    {
      py::gil_scoped_release nogil;
      done = step(slice);
    }
    if (done) return;
    // cleanup and timeout (which cleans up, then throws) without the GIL too:
    // cancelling a rendezvous part waits for its writes, which on the
    // fallback transport complete on its Python mover threads (it hung).
    if (PyErr_CheckSignals() != 0) {
      {
        py::gil_scoped_release nogil;
        a.cleanup();
      }
      throw py::error_already_set();
    }
    if (Clock::now() >= deadline) {
      py::gil_scoped_release nogil;
      a.timeout(*timeout);
    }
  }
}

void fill_chunk(A2AChunk& c, const py::handle& t) {
  // (ptr, nbytes, dtype word, shape[, stream[, host copy's ptr]]): stream -1 or
  // absent for host memory (mem_of), host copy 0 or absent for none.
  auto tup = py::reinterpret_borrow<py::tuple>(t);
  if (tup.size() > 4) c.mem = mem_of(tup[4].cast<int64_t>());
  if (tup.size() > 5) c.host = reinterpret_cast<const void*>(tup[5].cast<uintptr_t>());
  c.data = reinterpret_cast<const void*>(tup[0].cast<uintptr_t>());
  c.nbytes = tup[1].cast<uint64_t>();
  c.dtype = tup[2].cast<uint32_t>();
  auto shape = to_shape(tup[3]);
  if (shape.size() > size_t(kMaxDims))
    throw Error(ErrorKind::Invalid, "tensors of more than " + std::to_string(kMaxDims) + " dimensions are not supported");
  c.ndim = uint32_t(shape.size());
  std::copy(shape.begin(), shape.end(), c.shape);
}

AllToAllHandle make_a2a(py::object comm, A2APlan plan, py::object keep, Mem mem) {
  Comm& c = comm.cast<Comm&>();
  AllToAllHandle h;
  h.comm = comm;
  h.keep = std::move(keep);
  h.mem = mem;
  h.a = std::make_unique<AllToAll>(*c.engine, std::move(plan));
  {
    // (without the GIL, as a2a_drive's cleanup: a start that throws midway cleans up, which waits for
    // the fallback's writes, done on its Python threads)
    py::gil_scoped_release nogil;
    h.a->start();  // a throw leaves its in-flight sends to h's destructor
  }
  return h;
}

py::object a2a_finish(AllToAllHandle& h, std::optional<double> timeout, py::object alloc);

// Finishes the collective. Row forms: returns the rows per source; alloc(total
// rows) -> pointer is called when there is no out. List form: returns None;
// alloc(src, dtype word, shape) -> pointer for each output left to allocate.
py::object a2a_run(AllToAllHandle& h, std::optional<double> timeout, py::object alloc) {
  try {
    return a2a_finish(h, timeout, alloc);
  } catch (...) {
    h.keep_in_flight();
    throw;
  }
}

// Places the output once every header is in: alloc(total rows) -> pointer
// for a row form without out; alloc(src, dtype word, shape) for each output
// of the list form left to allocate. Nothing when already placed.
void a2a_place(AllToAllHandle& h, py::object& alloc) {
  AllToAll& a = *h.a;
  if (a.op() == A2AOp::List) {
    for (int s : a.unplaced()) {
      const A2AChunk& g = a.arrived(s);
      py::tuple shape(g.ndim);
      for (uint32_t i = 0; i < g.ndim; ++i) shape[i] = g.shape[i];
      try {
        a.place(s, reinterpret_cast<void*>(alloc(s, g.dtype, shape).cast<uintptr_t>()), h.mem, "");
      } catch (py::error_already_set& e) {
        if (!e.matches(PyExc_ValueError)) throw;  // (InvalidArgument: no such dtype here) anything else is raised
        a.place(s, nullptr, h.mem, "rank " + std::to_string(s) + " sent dtype " + dtype_name(g.dtype) + ", which rank " +
                                       std::to_string(h.comm.cast<Comm&>().engine->rank()) + " cannot represent");
      }
    }
  } else if (a.needs_out()) {
    int64_t rows = 0;
    for (int64_t v : a.recv_rows()) rows += v;
    a.place(reinterpret_cast<void*>(alloc(rows).cast<uintptr_t>()), a.total_bytes(), h.mem);
  }
}

py::object a2a_finish(AllToAllHandle& h, std::optional<double> timeout, py::object alloc) {
  AllToAll& a = *h.a;
  auto deadline = deadline_of(timeout);
  a2a_drive(a, [&](Clock::time_point d) { return a.wait_headers(d); }, deadline, timeout);
  a2a_place(h, alloc);
  a2a_drive(a, [&](Clock::time_point d) { return a.wait_done(d); }, deadline, timeout);
  if (auto e = a.error()) throw *e;
  if (a.op() == A2AOp::List) return py::none();
  return py::cast(a.recv_rows());
}

// An async call's is_completed(): one pass that never waits for a peer; true
// once run() returns at once (it then finishes the call).
bool a2a_poll(AllToAllHandle& h, py::object alloc) {
  AllToAll& a = *h.a;
  try {
    bool got;
    {
      py::gil_scoped_release nogil;
      got = a.wait_headers(Clock::time_point::min());
    }
    if (!got) return false;
    a2a_place(h, alloc);
    py::gil_scoped_release nogil;
    return a.wait_done(Clock::time_point::min());
  } catch (...) {
    h.keep_in_flight();
    throw;
  }
}

void bind_collectives(py::module_& m) {
  m.attr("COLL_TAG_BASE") = kCollTagBase;
  m.attr("MAX_COLL_TAG") = kMaxCollTag;
  py::class_<AllToAllHandle>(m, "AllToAll")
      .def("run", &a2a_run, py::arg("timeout"), py::arg("alloc") = py::none())
      .def("poll", &a2a_poll, py::arg("alloc") = py::none());
  // x's rows split by splits (V: op 0, out 0 = allocate; Single: op 1, with the
  // expected rows per source). keep: the objects x (and out) belong to; a send
  // still in flight when the collective is given up on keeps them alive.
  // stream: -1 when x and out are host memory, else the CUDA stream both are
  // ordered on (x and out in device memory); x_host: a host copy of a device
  // x for receivers with no device route (0: none).
  m.def("all_to_all_rows",
        [](py::object comm, int op, int strategy, int64_t tag, uintptr_t x, uint64_t row_bytes,
           const std::vector<int64_t>& splits, uint32_t dtype, const std::vector<int64_t>& trailing, uintptr_t out,
           uint64_t cap, std::optional<std::vector<int64_t>> expect, py::object keep, int64_t stream,
           uintptr_t x_host, std::string name, std::string input, bool backward, uint32_t agree,
           std::string agree_name, std::string agree_why) {
          Mem mem = mem_of(stream);
          A2APlan p = rows_plan(A2AOp(op), reinterpret_cast<const void*>(x), row_bytes, splits, dtype, trailing, mem,
                                reinterpret_cast<const void*>(x_host));
          p.strategy = A2AStrategy(strategy);
          p.user_tag = tag;
          p.name = std::move(name);
          p.input = std::move(input);
          p.backward = backward;
          p.agree = agree & uint32_t(kAgreeMask >> kAgreeShift);
          p.agree_name = std::move(agree_name);
          p.agree_why = std::move(agree_why);
          p.out = reinterpret_cast<void*>(out);
          p.out_cap = cap;
          p.out_mem = mem;
          if (expect) p.expect_rows = *expect;
          return make_a2a(comm, std::move(p), std::move(keep), mem);
        },
        py::arg("comm"), py::arg("op"), py::arg("strategy"), py::arg("tag"), py::arg("x"), py::arg("row_bytes"),
        py::arg("splits"), py::arg("dtype"), py::arg("trailing"), py::arg("out"), py::arg("cap"),
        py::arg("expect") = py::none(), py::arg("keep") = py::none(), py::arg("stream") = -1,
        py::arg("x_host") = 0, py::arg("name") = "", py::arg("input") = "", py::arg("backward") = false,
        py::arg("agree") = 0, py::arg("agree_name") = "", py::arg("agree_why") = "");
  // A collective this rank refuses before it starts (AllToAll::refuse).
  m.def(
      "all_to_all_refuse",
      [](Comm& c, int64_t tag) {
        py::gil_scoped_release nogil;
        AllToAll::refuse(*c.engine, tag);
      },
      py::arg("comm"), py::arg("tag"));
  // sends[d], outs[s]: (ptr, nbytes, dtype word, shape[, stream[, host copy]]) (fill_chunk); an
  // out of None is allocated, in host memory for stream -1, else in device memory ordered on stream.
  m.def("all_to_all_list",
        [](py::object comm, int strategy, const py::sequence& sends, const py::sequence& outs, py::object keep,
           int64_t stream) {
          A2APlan p;
          p.op = A2AOp::List;
          p.strategy = A2AStrategy(strategy);
          p.send.resize(py::len(sends));
          p.outs.resize(py::len(outs));
          for (size_t i = 0; i < p.send.size(); ++i) fill_chunk(p.send[i], sends[i]);
          // An output to allocate will be in the call's memory (data null until
          // placed): the engine needs to know a device one up front (hold_device).
          for (size_t i = 0; i < p.outs.size(); ++i) {
            if (!outs[i].is_none())
              fill_chunk(p.outs[i], outs[i]);
            else
              p.outs[i].mem = mem_of(stream);
          }
          return make_a2a(comm, std::move(p), std::move(keep), mem_of(stream));
        },
        py::arg("comm"), py::arg("strategy"), py::arg("sends"), py::arg("outs"), py::arg("keep") = py::none(),
        py::arg("stream") = -1);
}

}  // namespace
// ---- end collectives ---------------------------------------------------------

// ---- fallback mover ------------------------------------------------------------
// The Python threads that move the fallback transport's frames over gloo
// (python/varcomm/fallback.py; protocol in transport/fallback/fallback.h).
namespace {

void bind_fallback_mover(py::module_& m) {
  using FT = FallbackTransport;
  // A C-contiguous buffer's bytes, without py::buffer_info's allocations
  // (one call per frame).
  struct Bytes {
    Py_buffer v{};
    Bytes(py::handle o, bool writable) {
      if (PyObject_GetBuffer(o.ptr(), &v, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) != 0)
        throw py::error_already_set();
    }
    ~Bytes() { PyBuffer_Release(&v); }
  };
  auto view = [](void* p, size_t n, bool readonly) { return py::memoryview::from_memory(p, ssize_t(n), readonly); };
  py::class_<FT, std::shared_ptr<FT>>(m, "FallbackMover")
      .def_property_readonly_static("frame_bytes", [](py::object) { return FT::kFrameBytes; })
      .def_property_readonly("peers", &FT::peers)
      // -> None when nothing more goes to peer; (0, None) at timeout; else
      // (ticket, payload view or None) with the op's frame written into `frame`.
      .def("next_op",
           [view](FT& t, int peer, py::handle frame, std::optional<double> timeout) -> py::object {
             Bytes f(frame, true);
             if (size_t(f.v.len) != FT::kFrameBytes) throw Error(ErrorKind::Invalid, "frame buffer of wrong size");
             const void* payload = nullptr;
             size_t n = 0;
             int64_t ticket;
             {
               py::gil_scoped_release nogil;
               ticket = t.next_op(peer, static_cast<char*>(f.v.buf), deadline_of(timeout), &payload, &n);
             }
             if (ticket < 0) return py::none();
             // Read-only for us; writable so torch.frombuffer takes it without a warning (gloo only reads).
             py::object pv = py::none();
             if (n) pv = view(const_cast<void*>(payload), n, false);
             return py::make_tuple(ticket, pv);
           },
           py::arg("peer"), py::arg("frame"), py::arg("timeout") = py::none())
      .def("op_sent", &FT::op_sent)
      .def("op_failed", &FT::op_failed)
      .def("fail", &FT::fail)
      // -> a writable view of our slot to receive the payload into (then
      // landed()), True for a frame already handled (a credit), False when
      // the peer said goodbye. Raises PeerFailure for a frame it refuses.
      .def("landing",
           [view](FT& t, int peer, py::handle frame) -> py::object {
             Bytes f(frame, false);
             char* dst = nullptr;
             size_t n = 0;
             switch (t.landing(peer, static_cast<const char*>(f.v.buf), size_t(f.v.len), &dst, &n)) {
               case FT::Landing::Write: return view(dst, n, false);
               case FT::Landing::Handled: return py::bool_(true);
               default: return py::bool_(false);
             }
           })
      .def("landed", &FT::landed)
      .def("shutdown", &FT::shutdown);
  // The mover writes into the region: it keeps the Comm (which owns it) alive.
  m.def(
      "fallback_mover",
      [](Comm& c) {
        auto t = std::dynamic_pointer_cast<FT>(c.ready().opened("fallback"));
        if (!t) throw Error(ErrorKind::Invalid, "this communicator has no fallback endpoint");
        return t;
      },
      py::keep_alive<0, 1>());
}

}  // namespace
// ---- end fallback mover --------------------------------------------------------


// ---- device-split all-to-all (transport/nvlink/a2a_device.h) -------------------
namespace {

struct DeviceA2AHandle {
  py::object comm;  // keeps the Comm (and its engine) alive
#ifdef VARCOMM_HAVE_CUDA
  std::unique_ptr<DeviceA2A> a;
  // keep(): objects alive until their stream passed the mark taken then
  std::map<uint64_t, py::object> kept;
  void drop_passed() {  // (with the GIL: it may free the objects)
    for (uint64_t m : a->take_passed()) kept.erase(m);
  }
#endif
};

void bind_device_a2a(py::module_& m) {
  m.def("device_a2a_unavailable_reason", []() -> std::string {
#ifdef VARCOMM_HAVE_CUDA
    return device_a2a_unavailable_reason();
#else
    return "varcomm was built without the nvlink transport";
#endif
  });
#ifdef VARCOMM_HAVE_CUDA
  m.attr("A2A_BAD_IDS_MARKER") = kA2ABadIdsMarker;
#endif
  py::class_<DeviceA2AHandle>(m, "DeviceAllToAll")
      // Collective: every rank constructs it with the same cap (bytes per source slot).
      .def(py::init([](py::object comm, int device, uint64_t cap, std::optional<double> timeout, bool p2p) {
             auto h = std::make_unique<DeviceA2AHandle>();
             h->comm = comm;
#ifdef VARCOMM_HAVE_CUDA
             Comm& c = comm.cast<Comm&>();
             timeout = timeout_of(timeout);
             py::gil_scoped_release nogil;
             h->a = std::make_unique<DeviceA2A>(*c.engine, device, cap, timeout, p2p);
#else
             (void)device, (void)cap, (void)timeout, (void)p2p;
             throw Error(ErrorKind::Invalid, "varcomm was built without the nvlink transport");
#endif
             return h;
           }),
           py::arg("comm"), py::arg("device"), py::arg("cap"), py::arg("timeout"), py::arg("p2p") = false)
#ifdef VARCOMM_HAVE_CUDA
      .def_property_readonly("cap", [](DeviceA2AHandle& h) { return h.a->cap(); })
      .def("describe", [](DeviceA2AHandle& h) { return h.a->describe(); })
      .def("launch",
           [](DeviceA2AHandle& h, unsigned ne, unsigned in_layout, unsigned out_layout, uint32_t dtype,
              uint64_t row_bytes, uintptr_t x, uint64_t x_rows, uintptr_t splits, unsigned splits_bytes, uintptr_t out,
              uint64_t out_rows, uintptr_t out_splits_offsets, uintptr_t stream, std::optional<double> timeout,
              bool backward, uintptr_t dispatch, bool dispatch_set) {
             DeviceA2ACall c;
             c.backward = backward;
             c.dispatch = dispatch;
             c.dispatch_set = dispatch_set;
             c.ne = ne;
             c.in_layout = in_layout;
             c.out_layout = out_layout;
             c.dtype = dtype;
             c.row_bytes = row_bytes;
             c.x = x;
             c.x_rows = x_rows;
             c.splits = splits;
             c.splits_bytes = splits_bytes;
             c.out = out;
             c.out_rows = out_rows;
             c.out_splits_offsets = out_splits_offsets;
             c.stream = stream;
             c.timeout = timeout_of(timeout);
             h.a->launch(c);
           },
           py::arg("ne"), py::arg("in_layout"), py::arg("out_layout"), py::arg("dtype"), py::arg("row_bytes"),
           py::arg("x"), py::arg("x_rows"), py::arg("splits"), py::arg("splits_bytes"), py::arg("out"),
           py::arg("out_rows"), py::arg("out_splits_offsets"), py::arg("stream"), py::arg("timeout"),
           py::arg("backward") = false, py::arg("dispatch") = 0, py::arg("dispatch_set") = false)
      // This rank's part of the next call refused on the host: launched with no
      // data, so every rank's call numbers stay in step (receivers: MessageMismatch).
      .def("refuse",
           [](DeviceA2AHandle& h, uintptr_t stream, std::optional<double> timeout) {
             DeviceA2ACall c;
             c.refused = true;
             c.stream = stream;
             c.timeout = timeout_of(timeout);
             h.a->launch(c);
           },
           py::arg("stream"), py::arg("timeout"))
      // Point-to-point on a handle set up for it: x/out, the row count (rows: one int; recv: int64 out).
      .def("launch_p2p",
           [](DeviceA2AHandle& h, bool send, int peer, uint32_t dtype, uint64_t row_bytes, uintptr_t data,
              uint64_t rows_cap, uintptr_t rows, unsigned rows_bytes, uintptr_t stream, std::optional<double> timeout) {
             DeviceA2ACall c;
             c.dtype = dtype;
             c.row_bytes = row_bytes;
             (send ? c.x : c.out) = data;
             (send ? c.x_rows : c.out_rows) = rows_cap;
             (send ? c.splits : c.out_splits_offsets) = rows;
             c.splits_bytes = send ? rows_bytes : 8;
             c.stream = stream;
             c.timeout = timeout_of(timeout);
             h.a->launch_p2p(send, peer, c);
           },
           py::arg("send"), py::arg("peer"), py::arg("dtype"), py::arg("row_bytes"), py::arg("data"),
           py::arg("rows_cap"), py::arg("rows"), py::arg("rows_bytes"), py::arg("stream"), py::arg("timeout"))
      .def("check", [](DeviceA2AHandle& h) { h.a->check(); })
      .def_property_readonly("launches", [](DeviceA2AHandle& h) { return h.a->launches(); })
      .def("alloc", [](DeviceA2AHandle& h, uint64_t n) { return h.a->alloc(n); }, py::arg("nbytes"))
      .def("free", [](DeviceA2AHandle& h, uintptr_t p, uintptr_t stream) { h.a->free(p, stream); }, py::arg("ptr"),
           py::arg("stream"))
      // obj stays alive until `stream` ran what is enqueued on it now: arrays a
      // call uses on a stream their allocator does not order (dropped by the
      // caller, their memory could be reused before the kernels read it).
      .def(
          "keep",
          [](DeviceA2AHandle& h, py::object obj, uintptr_t stream) {
            h.drop_passed();
            h.kept.emplace(h.a->mark(stream), std::move(obj));
          },
          py::arg("obj"), py::arg("stream"))
      .def_property_readonly("kept", [](DeviceA2AHandle& h) { return h.kept.size(); })
      .def("synchronize",
           [](DeviceA2AHandle& h, std::optional<uintptr_t> stream, std::optional<double> timeout) {
             timeout = timeout_of(timeout);
             try {
               py::gil_scoped_release nogil;
               h.a->synchronize(stream, timeout);
             } catch (...) {
               h.drop_passed();
               throw;
             }
             h.drop_passed();
           },
           py::arg("stream"), py::arg("timeout"))
      .def("close", [](DeviceA2AHandle& h) {
        {
          py::gil_scoped_release nogil;
          h.a->close();
        }
        h.drop_passed();
        h.kept.clear();  // closed: nothing of its runs any more
      })
#endif
      ;
}

}  // namespace
// ---- end device-split all-to-all -----------------------------------------------

PYBIND11_MODULE(_C, m) {
  m.doc() = "varcomm core: slots, headers, credits over shm / rdma transports";
  pthread_atfork(nullptr, nullptr, [] { g_fork_generation.fetch_add(1, std::memory_order_relaxed); });

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      set_error(e);
    }
  });

  py::dict build;
  py::list have;
  have.append("shm");
  have.append("fallback");
#ifdef VARCOMM_HAVE_RDMA
  have.append("rdma");
  build["rdma"] = true;
#else
  build["rdma"] = false;
#endif
#ifdef VARCOMM_HAVE_CUDA
  have.append("nvlink");
  build["cuda"] = true;
  build["device_a2a"] = device_a2a_built();  // the device-split all-to-all's kernels are in this build
#else
  build["cuda"] = false;
  build["device_a2a"] = false;
#endif
#if defined(VARCOMM_HAVE_RDMA) && defined(VARCOMM_HAVE_CUDA)
  have.append("rdma-gpu");
#endif
  build["transports"] = have;
  build["max_dims"] = kMaxDims;
  m.attr("build_info") = build;
  m.def("dtype_name", &dtype_name, py::arg("word"));
  // A point-to-point tag as every send and receive checks it (batch_isend_irecv validates first).
  m.attr("OUT_EXACT") = kOutExact;
  m.def("check_tag", &tag_of, py::arg("tag"));
  m.def(
      "advise_huge_pages", [](uintptr_t ptr, uint64_t nbytes) { advise_huge_pages(reinterpret_cast<void*>(ptr), nbytes); },
      py::arg("ptr"), py::arg("nbytes"), "a fresh host array from 4 MiB gets transparent huge pages, as numpy's own do");
  m.def(
      "peer_copy_stats",
      [](bool landing) {
        PeerCopyStats s = peer_copy_stats(landing ? PeerCopyTarget::kLanding : PeerCopyTarget::kSlots);
        return py::make_tuple(s.non_temporal, s.ordinary, s.streamed, s.ordinary_ns_per_kib, s.streamed_ns_per_kib);
      },
      "(streaming now, large copies with ordinary stores, with non-temporal ones, and the median ns per KiB of each "
      "way's last three) in this process, into peers' slots or (landing) their landing areas "
      "(csrc/hostmem.h copy_to_peer)",
      py::arg("landing") = false);
  m.def(
      "_store_chooser_trace",
      [](const std::vector<std::tuple<uint64_t, uint32_t, uint32_t>>& events) {
        // A fresh chooser fed 1 MiB copies at made-up times (us) that cost what each event says per KiB for
        // the way it picks (both 0: no copy, only ask); per event (way or -1, streaming, slow).
        StoreChooser c;
        std::vector<std::tuple<int, bool, bool>> out;
        for (auto& [us, ordinary, streamed] : events) {
          uint64_t now = us * 1000;
          int way = -1;
          if (ordinary || streamed) {
            way = c.pick(now);
            c.record(way, uint64_t(way ? streamed : ordinary) * 1024, size_t(1) << 20, now);
          }
          out.emplace_back(way, c.stats().non_temporal, c.slow(now));
        }
        return out;
      },
      py::arg("events"), "tests: csrc/hostmem.h StoreChooser's choices for made-up copy times");
  m.def("check_timeout", &seconds_of, py::arg("timeout"),
        "seconds, or None for no limit; InvalidArgument for anything else (one rule for every call)");
  // A timeout as every wait checks it: None for none (inf, huge), NaN refused.
  bind_collectives(m);
  bind_fallback_mover(m);
  bind_device_a2a(m);
  ready_fast_types(m);
  // An array adapter's table (array_hooks.h), from its module's install().
  m.def(
      "set_array_hooks",
      [](py::capsule cap) {
        const ArrayHooks* h = capsule_hooks(cap.ptr());
        if (!h) throw py::error_already_set();
        if (h->abi != kArrayHooksAbi || h->kind == 0 || h->kind >= std::size(g_hooks) || !h->type)
          throw Error(ErrorKind::Invalid, "set_array_hooks: an adapter built for another varcomm (ABI " +
                                              std::to_string(h->abi) + ", kind " + std::to_string(h->kind) +
                                              "): rebuild varcomm (make build)");
        cap.inc_ref();  // the table lives as long as the process
        g_hooks[h->kind] = h;
      },
      py::arg("capsule"));
  m.def(
      "clear_array_hooks",
      [](uint32_t kind) {
        if (kind < std::size(g_hooks)) g_hooks[kind] = nullptr;
      },
      py::arg("kind"));

  // The doctor's views; with an options dict they describe what those options would select.
  m.def("rdma_info", [](std::optional<py::dict> opts) -> std::string {
#ifdef VARCOMM_HAVE_RDMA
    Options o = opts ? options_from_dict(*opts) : Options();
    return rdma_info(o.rdma_provider, o.rdma_iface);
#else
    (void)opts;
    return "varcomm was built without libfabric (install libfabric-dev and rebuild)";
#endif
  }, py::arg("options") = py::none());
#ifdef VARCOMM_HAVE_RDMA
  m.attr("rdma_providers") = py::cast(rdma_default_providers());
#else
  m.attr("rdma_providers") = py::list();
#endif

  // Both load the NVIDIA driver (cuInit): not in a process that forks CUDA users later.
  m.def("nvlink_info", [](std::optional<py::dict> opts) -> std::string {
#ifdef VARCOMM_HAVE_CUDA
    Options o = opts ? options_from_dict(*opts) : Options();
    return nvlink_info(o.nvlink_flags, o.nvlink_kernel_max);
#else
    (void)opts;
    return "varcomm was built without the nvlink transport";
#endif
  }, py::arg("options") = py::none());
  m.def("nvlink_unavailable_reason", []() -> std::string {
#ifdef VARCOMM_HAVE_CUDA
    return nvlink_unavailable_reason();
#else
    return "varcomm was built without the nvlink transport";
#endif
  });

  status_type = PyStructSequence_NewType(&kStatusDesc);
  if (!status_type) throw py::error_already_set();
  status_type->tp_repr = status_repr;
  PyType_Modified(status_type);
  m.attr("Status") = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(status_type));

  py::class_<Comm>(m, "Comm")
      .def(py::init([](int rank, int world, const py::dict& options) {
             auto c = std::make_unique<Comm>();
             c->engine = std::make_unique<Engine>(rank, world, options_from_dict(options));
             c->setup = std::make_unique<Setup>(*c->engine);
             return c;
           }),
           py::arg("rank"), py::arg("world"), py::arg("options"))
      .def_property_readonly("rank", [](Comm& c) { return c.engine->rank(); })
      .def_property_readonly("world", [](Comm& c) { return c.engine->world(); })
      .def_property_readonly("bound", [](Comm& c) { return c.engine->layout().bound; })
      .def_property_readonly("slots", [](Comm& c) { return c.engine->layout().nslots; })
      .def_property_readonly("region_bytes", [](Comm& c) { return c.engine->region().size(); })
      // Set-up rounds: each rank publishes the blob it is given, and hands back
      // every rank's blob of that round, until the core answers None.
      .def("setup_begin", [](Comm& c) { return py::bytes(c.setup->begin()); })
      .def("setup_step",
           [](Comm& c, const std::vector<std::string>& blobs) -> py::object {
             std::optional<std::string> next;
             {
               py::gil_scoped_release nogil;
               next = c.setup->step(blobs);
             }
             return next ? py::object(py::bytes(*next)) : py::object(py::none());
           })
      .def("store_mac",
           [](Comm& c, int rank, const std::string& name) {
             c.check_peer(rank);
             return c.ready().store_mac(rank, name);
           })
      .def_property_readonly("routes", [](Comm& c) { return c.ready().routes(); })
      .def_property_readonly("device_routes",
                             [](Comm& c) {
                               py::list l;
                               for (auto& r : c.ready().device_routes())
                                 l.append(r.empty() ? py::object(py::none()) : py::object(py::str(r)));
                               return l;
                             })
      .def("transport_for",
           [](Comm& c, int peer) {
             c.check_peer(peer);
             return c.ready().routes()[size_t(peer)];
           })
      .def("device_transport_for",
           [](Comm& c, int peer) -> py::object {
             c.check_peer(peer);
             auto& r = c.ready().device_routes()[size_t(peer)];
             return r.empty() ? py::object(py::none()) : py::object(py::str(r));
           })
      .def("describe_transport",
           [](Comm& c, int peer) {
             c.check_peer(peer);
             return c.ready().describe(peer);
           })
      .def("route_info",
           [](Comm& c, int peer) {
             c.check_peer(peer);
             return c.ready().route_info(peer);
           })
      // Some pair in the job uses the fallback: every rank starts its mover (fallback_mover).
      .def_property_readonly("needs_fallback_group", [](Comm& c) { return c.ready().any_fallback(); })
      .def_property_readonly("close_waits_for_peers", [](Comm& c) { return c.ready().close_waits_for_peers(); })
      .def_property_readonly("device_ordinal", [](Comm& c) { return c.ready().device_ordinal(); })
      .def_property_readonly("forged_headers", [](Comm& c) { return c.engine->forged_headers(); })
      .def_property_readonly("pulled_bytes", [](Comm& c) { return c.engine->pulled_bytes(); })
      .def_property_readonly("pushed_bytes", [](Comm& c) { return c.engine->pushed_bytes(); })
      .def("landed_output_min", [](Comm& c, bool torch) { return c.engine->landed_output_min(torch); }, py::arg("torch"))
      .def("peer_error", [](Comm& c, int peer) { return c.engine->peer_error(peer); })
      .def("progress",
           [](Comm& c) {
             {
               py::gil_scoped_release nogil;
               c.engine->progress();
             }
             c.drop_kept();
           })
      .def("isend",
           [](Comm& c, int dst, py::handle tag_obj, uintptr_t ptr, uint64_t nbytes, uint32_t dtype, const py::sequence& shape,
              int64_t stream, uint32_t array) {
             int64_t tag = tag_of(tag_obj);
             auto s = to_shape(shape);
             return c.engine->isend(dst, tag, reinterpret_cast<const void*>(ptr), nbytes, dtype, s.data(),
                                    uint32_t(s.size()), mem_of(stream), array);
           },
           py::arg("dst"), py::arg("tag"), py::arg("ptr"), py::arg("nbytes"), py::arg("dtype"), py::arg("shape"),
           py::arg("stream") = -1, py::arg("array") = 0)
      .def("send",
           [](Comm& c, int dst, py::handle tag_obj, uintptr_t ptr, uint64_t nbytes, uint32_t dtype, const py::sequence& shape,
              std::optional<double> timeout, int64_t stream, py::handle keep, uint32_t array) {
             int64_t tag = tag_of(tag_obj);
             auto s = to_shape(shape);
             // keep: what ptr points into; a send that times out or is
             // interrupted while the transport still reads it keeps it alive.
             send_blocking(c, dst, tag, reinterpret_cast<const void*>(ptr), nbytes, dtype, s.data(), uint32_t(s.size()),
                           timeout, mem_of(stream), keep, array);
           },
           py::arg("dst"), py::arg("tag"), py::arg("ptr"), py::arg("nbytes"), py::arg("dtype"), py::arg("shape"),
           py::arg("timeout"), py::arg("stream") = -1, py::arg("keep") = py::none(), py::arg("array") = 0)
      // A descriptor message: the header of `nbytes` of data sent separately, no payload.
      .def("isend_descriptor",
           [](Comm& c, int dst, py::handle tag_obj, uint64_t nbytes, uint32_t dtype, const py::sequence& shape) {
             int64_t tag = tag_of(tag_obj);
             auto s = to_shape(shape);
             return c.engine->isend_descriptor(dst, tag, nbytes, dtype, s.data(), uint32_t(s.size()));
           },
           py::arg("dst"), py::arg("tag"), py::arg("nbytes"), py::arg("dtype"), py::arg("shape"))
      .def("irecv",
           [](Comm& c, int src, py::handle tag_obj, uintptr_t out, uint64_t cap, uint32_t dtype, int64_t stream) {
             int64_t tag = tag_of(tag_obj);
             return c.engine->irecv(src, tag, reinterpret_cast<void*>(out), cap, dtype, mem_of(stream));
           },
           py::arg("src"), py::arg("tag"), py::arg("out"), py::arg("cap"), py::arg("dtype"), py::arg("stream") = -1)
      // Blocking receive into raw memory the general path described (a CUDA
      // out, ordered on `stream`): the message's Status; None: take irecv.
      .def("recv_into",
           [](Comm& c, int src, py::handle tag_obj, uintptr_t out, uint64_t cap, uint32_t dtype,
              std::optional<double> timeout, int64_t stream) -> py::object {
             int64_t tag = tag_of(tag_obj);
             MsgHeader h;
             if (!recv_blocking(c, src, tag, reinterpret_cast<void*>(out), cap, dtype, &h, timeout, mem_of(stream)))
               return py::none();
             return status_of(src, h);
           },
           py::arg("src"), py::arg("tag"), py::arg("out"), py::arg("cap"), py::arg("dtype"), py::arg("timeout"),
           py::arg("stream") = -1)
      .def("wait", [](Comm& c, uint64_t id, std::optional<double> timeout) { c.wait(id, timeout); },
           py::arg("id"), py::arg("timeout") = py::none())
      .def("test", [](Comm& c, uint64_t id) { return c.engine->test(id); })
      .def("info", [](Comm& c, uint64_t id) { return status_of(c.engine->info(id)); })
      .def("copy_out",
           // False: a rendezvous message whose data streams in; wait(id) for it.
           [](Comm& c, uint64_t id, uintptr_t dst, int64_t stream) {
             return c.engine->copy_out(id, reinterpret_cast<void*>(dst), mem_of(stream));
           },
           py::arg("id"), py::arg("dst"), py::arg("stream") = -1)
      // A matched recv without out, read in place (copy=False): make(Loan,
      // dtype word, shape, sender's kind) -> the array; the request is done.
      // landed_only: only a message that landed in a landing block (whose
      // block then becomes the array: the one copy was its sender's); None otherwise.
      .def("loan",
           [](py::object self, uint64_t id, py::handle make, bool landed_only) -> py::object {
             Comm& c = self.cast<Comm&>();
             MsgHeader h;
             int src;
             int slot;
             const bool landed = c.engine->landed(id);
             if (landed_only && !landed) return py::none();
             if (landed) {
               // A landed message cannot go back once taken (its head's slot
               // is free again), so make's refusals (a kind that cannot hold
               // the dtype) are asked first, with no Loan: refused, it is kept.
               MsgInfo m = c.engine->info(id);
               unsigned kind = unsigned((m.flags & kArrayMask) >> kArrayShift);
               py::handle lender = lender_for(make.ptr(), kind);
               try {
                 if (PyCapsule_CheckExact(lender.ptr())) {
                   const ArrayHooks* hk = capsule_hooks(lender.ptr());
                   if (!py::reinterpret_steal<py::object>(
                           hk ? hk->lend(nullptr, nullptr, m.dtype, m.shape.data(), uint32_t(m.shape.size()))
                              : nullptr))
                     throw py::error_already_set();
                 } else {
                   py::tuple shape(m.shape.size());
                   for (size_t i = 0; i < m.shape.size(); ++i) shape[i] = py::int_(m.shape[i]);
                   lender(py::none(), m.dtype, shape, kind);
                 }
               } catch (...) {
                 c.engine->cancel(id);  // back for the next recv (Engine::Peer::returned)
                 throw;
               }
             }
             try {
               slot = c.engine->take_claim(id, &h, &src);
             } catch (const Error&) {
               c.engine->cancel(id);  // refused (a device message): it stays for the next recv
               throw;
             }
             if (slot == -1) return py::none();  // a rendezvous: nothing in the slot to lend, copy it out
             PyObject* r = lend(self.ptr(), c, src, slot, h, make.ptr());
             if (!r) throw py::error_already_set();
             return py::reinterpret_steal<py::object>(r);
           },
           py::arg("id"), py::arg("make"), py::arg("landed_only") = false)
      // A Loan over a new landing block of nbytes (Comm.empty), or None when
      // the landing area has no room (or lent blocks would pass lend_cap bytes).
      .def("landing_buffer",
           [](py::object self, uint64_t nbytes, uint64_t lend_cap) -> py::object {
             Comm& c = self.cast<Comm&>();
             int slot = c.engine->landing_buffer(nbytes, lend_cap);
             if (!slot) return py::none();
             MsgHeader h{};
             h.nbytes = nbytes;
             PyObject* l = new_loan(self.ptr(), c, c.engine->rank(), slot, h);
             if (!l) {
               c.engine->release_claimed(c.engine->rank(), slot, 0);
               throw py::error_already_set();
             }
             return py::reinterpret_steal<py::object>(l);
           },
           py::arg("nbytes"), py::arg("lend_cap") = 0)
      .def("landing_stats", [](Comm& c) { return c.engine->landing_stats(); })
      .def_property_readonly("collectives", [](Comm& c) { return c.engine->collectives(); })
      // The blocking send/recv, one CPython call each.
      .def("fast", [](py::object self) { return make_fast(self); })
      .def("release", [](Comm& c, uint64_t id) { c.engine->release(id); })
      // keep: what the request's buffer belongs to, held if a send is in flight.
      .def("cancel", [](Comm& c, uint64_t id, py::handle keep) { c.give_up(id, keep.is_none() ? py::handle() : keep); },
           py::arg("id"), py::arg("keep") = py::none())
      // The largest message a send to `peer` may carry (host memory: max_message, else no limit; device: its bound).
      .def("send_limit", [](Comm& c, int peer, bool device) { return c.engine->send_limit(peer, device); })
      .def("peer_bound", [](Comm& c, int peer) {
             c.check_peer(peer);
             return c.engine->peer_bound(peer);
           })
      // close(): tell every peer this rank sends nothing more (Engine::goodbye).
      .def("goodbye",
           [](Comm& c, bool failing) {
             py::gil_scoped_release nogil;
             c.engine->goodbye(failing);
           },
           py::arg("failing") = false)
      // close(): the peers that queued sends still wait for (none: flushed).
      .def("unflushed",
           [](Comm& c) {
             py::gil_scoped_release nogil;
             return c.engine->unflushed();
           })
      // keep: what the dropped request's memory belongs to; held until the
      // engine is done with it (or closes).
      .def("detach", [](Comm& c, uint64_t id, py::object keep) { c.detach(id, std::move(keep)); },
           py::arg("id"), py::arg("keep") = py::none())
      .def("close", [](Comm& c) { c.close(); });
}
