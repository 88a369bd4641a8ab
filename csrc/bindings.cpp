// pybind11 surface of the core. Arrays arrive as raw pointers (torch, via
// data_ptr) or through the buffer protocol (numpy); the core never sees a
// framework type.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <map>
#include <memory>

#include "collectives.h"
#include "engine.h"
#include "shm.h"
#ifdef VARCOMM_HAVE_RDMA
#include "rdma.h"
#endif
#ifdef VARCOMM_HAVE_CUDA
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
    case ErrorKind::Refused: return "VarcommError";
    default: return "InvalidArgument";
  }
}

// Buffer-protocol format -> DLPack dtype word.
uint32_t dtype_of_format(const std::string& f, ssize_t itemsize) {
  auto w = [](uint32_t code, uint32_t bits) { return (code << 16) | (bits << 8) | 1u; };
  char c = f.empty() ? 0 : f.back();
  bool complex = f.size() >= 2 && f[f.size() - 2] == 'Z';
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

// A borrowed C-contiguous buffer. Raw CPython API: the ping-pong path cannot
// afford py::buffer_info's vector copies.
struct Buf {
  Py_buffer v{};
  bool ok = false;
  uint32_t dtype = 0;
  uint64_t nbytes = 0;
  int64_t shape[kMaxDims] = {};
  uint32_t ndim = 0;
  // false when the object is not C-contiguous (the caller copies it first).
  bool get(PyObject* o, bool writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(o, &v, flags) != 0) {
      PyErr_Clear();
      return false;
    }
    ok = true;
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

// The core owns the engine and whichever transports this build has.
struct Comm {
  std::unique_ptr<Engine> engine;
  std::map<std::string, std::shared_ptr<Transport>> transports;
  std::map<std::string, std::string> descriptors;

  // Waits in slices so Ctrl-C reaches Python while a peer is silent.
  void wait(uint64_t id, std::optional<double> timeout) {
    if (engine->wait(id, Clock::time_point::min())) return;  // done already: keep the GIL
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
      if (done) return;
      if (PyErr_CheckSignals() != 0) {
        engine->cancel(id);
        throw py::error_already_set();
      }
      if (Clock::now() >= deadline) engine->raise_timeout(id, *timeout);
    }
  }
};

// Python passes stream = -1 for host memory, else the CUDA stream handle
// (torch.cuda.current_stream().cuda_stream) that orders a device buffer.
Mem mem_of(int64_t stream) {
  Mem m;
  m.device = stream >= 0;
  m.stream = m.device ? uintptr_t(stream) : 0;
  return m;
}

Clock::time_point deadline_of(std::optional<double> timeout) {
  return timeout ? Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(*timeout))
                 : Clock::time_point::max();
}

void send_blocking(Comm& c, int dst, int64_t tag, const void* ptr, uint64_t nbytes, uint32_t dtype,
                   const int64_t* shape, uint32_t ndim, std::optional<double> timeout, Mem mem = {}) {
  uint64_t id = c.engine->send_now(dst, tag, ptr, nbytes, dtype, shape, ndim, mem);
  if (id == Engine::kSentDone) return;
  if (!id) id = c.engine->isend(dst, tag, ptr, nbytes, dtype, shape, ndim, mem);
  c.wait(id, timeout);
}

// Blocking receive into a caller buffer; false when irecvs from src are
// posted (FIFO: the caller must queue behind them).
bool recv_blocking(Comm& c, int src, int64_t tag, void* out, uint64_t cap, uint32_t dtype, MsgHeader* h,
                   std::optional<double> timeout, Mem mem = {}) {
  int r = c.engine->recv_direct(src, tag, out, cap, dtype, h, Clock::time_point::min(), mem);
  if (r != 0) return r > 0;
  auto deadline = deadline_of(timeout);
  for (;;) {
    auto slice = std::min(deadline, Clock::now() + std::chrono::milliseconds(100));
    int got;
    {
      py::gil_scoped_release nogil;
      got = c.engine->recv_direct(src, tag, out, cap, dtype, h, slice, mem);
    }
    if (got != 0) return got > 0;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    if (Clock::now() >= deadline) {
      char secs[32];
      snprintf(secs, sizeof secs, "%.3g", *timeout);
      throw Error(ErrorKind::Timeout,
                  "recv from rank " + std::to_string(src) + " (tag " + std::to_string(tag) + ") timed out after " +
                      secs + " s; nothing arrived (is the peer sending with this tag?)",
                  src);
    }
  }
}

py::tuple header_tuple(int src, const MsgHeader& h) {
  py::tuple shape(h.ndim);
  for (uint32_t i = 0; i < h.ndim; ++i) shape[i] = h.shape[i];
  return py::make_tuple(src, h.tag, h.nbytes, h.dtype, shape);
}

// (src, tag, nbytes, dtype word, shape, flags): flags has FLAG_DEVICE, FLAG_DESCRIPTOR.
py::tuple info_tuple(const MsgInfo& m) {
  py::tuple shape(m.shape.size());
  for (size_t i = 0; i < m.shape.size(); ++i) shape[i] = m.shape[i];
  return py::make_tuple(m.src, m.tag, m.nbytes, m.dtype, shape, m.flags);
}

std::vector<int64_t> to_shape(const py::sequence& s) {
  std::vector<int64_t> v;
  v.reserve(py::len(s));
  for (auto x : s) v.push_back(x.cast<int64_t>());
  return v;
}

}  // namespace

// ---- collectives ------------------------------------------------------------
// The all-to-all exchange engine (csrc/collectives.h). Python builds a plan
// from its arrays, then run() finishes the collective; it calls back into
// Python only to allocate outputs whose size the headers told.
namespace {

struct AllToAllHandle {
  py::object comm;  // keeps the Comm, and so the Engine, alive
  std::unique_ptr<AllToAll> a;
};

std::string dtype_name(uint32_t w) {
  return py::module_::import("varcomm.dtypes").attr("describe")(w).cast<std::string>();
}

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
    if (PyErr_CheckSignals() != 0) {
      a.cleanup();
      throw py::error_already_set();
    }
    if (Clock::now() >= deadline) a.timeout(*timeout);
  }
}

void fill_chunk(A2AChunk& c, const py::handle& t) {
  // (ptr, nbytes, dtype word, shape)
  auto tup = py::reinterpret_borrow<py::tuple>(t);
  c.data = reinterpret_cast<const void*>(tup[0].cast<uintptr_t>());
  c.nbytes = tup[1].cast<uint64_t>();
  c.dtype = tup[2].cast<uint32_t>();
  auto shape = to_shape(tup[3]);
  if (shape.size() > size_t(kMaxDims))
    throw Error(ErrorKind::Invalid, "tensors of more than " + std::to_string(kMaxDims) + " dimensions are not supported");
  c.ndim = uint32_t(shape.size());
  std::copy(shape.begin(), shape.end(), c.shape);
}

AllToAllHandle make_a2a(py::object comm, A2APlan plan) {
  Comm& c = comm.cast<Comm&>();
  AllToAllHandle h;
  h.comm = comm;
  h.a = std::make_unique<AllToAll>(*c.engine, std::move(plan));
  return h;
}

// Finishes the collective. Row forms: returns the rows per source; alloc(total
// rows) -> pointer is called when there is no out. List form: returns None;
// alloc(src, dtype word, shape) -> pointer for each output left to allocate.
py::object a2a_run(AllToAllHandle& h, std::optional<double> timeout, py::object alloc) {
  AllToAll& a = *h.a;
  auto deadline = deadline_of(timeout);
  a2a_drive(a, [&](Clock::time_point d) { return a.wait_headers(d); }, deadline, timeout);
  if (a.op() == A2AOp::List) {
    for (int s : a.unplaced()) {
      const A2AChunk& g = a.arrived(s);
      py::tuple shape(g.ndim);
      for (uint32_t i = 0; i < g.ndim; ++i) shape[i] = g.shape[i];
      try {
        a.place(s, reinterpret_cast<void*>(alloc(s, g.dtype, shape).cast<uintptr_t>()), Mem{}, "");
      } catch (py::error_already_set&) {
        a.place(s, nullptr, Mem{}, "rank " + std::to_string(s) + " sent dtype " + dtype_name(g.dtype) + ", which rank " +
                                       std::to_string(h.comm.cast<Comm&>().engine->rank()) + " cannot represent");
      }
    }
  } else if (a.needs_out()) {
    int64_t rows = 0;
    for (int64_t v : a.recv_rows()) rows += v;
    a.place(reinterpret_cast<void*>(alloc(rows).cast<uintptr_t>()), a.total_bytes(), Mem{});
  }
  a2a_drive(a, [&](Clock::time_point d) { return a.wait_done(d); }, deadline, timeout);
  if (auto e = a.error(dtype_name)) throw *e;
  if (a.op() == A2AOp::List) return py::none();
  return py::cast(a.recv_rows());
}

void bind_collectives(py::module_& m) {
  m.attr("COLL_TAG_BASE") = kCollTagBase;
  m.attr("MAX_COLL_TAG") = kMaxCollTag;
  m.attr("FLAG_DEVICE") = kDevicePayload;
  m.attr("FLAG_DESCRIPTOR") = kDescriptor;
  py::class_<AllToAllHandle>(m, "AllToAll")
      .def("run", &a2a_run, py::arg("timeout"), py::arg("alloc") = py::none());
  // x's rows split by splits (V: op 0, out 0 = allocate; Single: op 1, with the
  // expected rows per source).
  m.def("all_to_all_rows",
        [](py::object comm, int op, int strategy, int64_t tag, uintptr_t x, uint64_t row_bytes,
           const std::vector<int64_t>& splits, uint32_t dtype, const std::vector<int64_t>& trailing, uintptr_t out,
           uint64_t cap, std::optional<std::vector<int64_t>> expect) {
          A2APlan p = rows_plan(A2AOp(op), reinterpret_cast<const void*>(x), row_bytes, splits, dtype, trailing, Mem{});
          p.strategy = A2AStrategy(strategy);
          p.user_tag = tag;
          p.out = reinterpret_cast<void*>(out);
          p.out_cap = cap;
          if (expect) p.expect_rows = *expect;
          return make_a2a(comm, std::move(p));
        },
        py::arg("comm"), py::arg("op"), py::arg("strategy"), py::arg("tag"), py::arg("x"), py::arg("row_bytes"),
        py::arg("splits"), py::arg("dtype"), py::arg("trailing"), py::arg("out"), py::arg("cap"),
        py::arg("expect") = py::none());
  // sends[d], outs[s]: (ptr, nbytes, dtype word, shape); an out of None is allocated.
  m.def("all_to_all_list",
        [](py::object comm, int strategy, const py::sequence& sends, const py::sequence& outs) {
          A2APlan p;
          p.op = A2AOp::List;
          p.strategy = A2AStrategy(strategy);
          p.send.resize(py::len(sends));
          p.outs.resize(py::len(outs));
          for (size_t i = 0; i < p.send.size(); ++i) fill_chunk(p.send[i], sends[i]);
          for (size_t i = 0; i < p.outs.size(); ++i)
            if (!outs[i].is_none()) fill_chunk(p.outs[i], outs[i]);
          return make_a2a(comm, std::move(p));
        });
}

}  // namespace
// ---- end collectives ---------------------------------------------------------

PYBIND11_MODULE(_C, m) {
  m.doc() = "varcomm core: slots, headers, credits over shm / rdma transports";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      py::object cls = py::module_::import("varcomm.errors").attr(error_class(e.kind));
      py::object exc = cls(e.what());
      exc.attr("peer") = e.peer >= 0 ? py::object(py::int_(e.peer)) : py::none();
      PyErr_SetObject(cls.ptr(), exc.ptr());
    }
  });

  py::dict build;
  py::list have;
  have.append("shm");
#ifdef VARCOMM_HAVE_RDMA
  have.append("rdma");
  build["rdma"] = true;
#else
  build["rdma"] = false;
#endif
#ifdef VARCOMM_HAVE_CUDA
  have.append("nvlink");
  build["cuda"] = true;
#else
  build["cuda"] = false;
#endif
  build["transports"] = have;
  build["max_dims"] = kMaxDims;
  m.attr("build_info") = build;
  bind_collectives(m);

  m.def("rdma_info", []() -> std::string {
#ifdef VARCOMM_HAVE_RDMA
    return rdma_info();
#else
    return "varcomm was built without libfabric (install libfabric-dev and rebuild)";
#endif
  });

  // Both load the NVIDIA driver (cuInit): not in a process that forks CUDA users later.
  m.def("nvlink_info", []() -> std::string {
#ifdef VARCOMM_HAVE_CUDA
    return nvlink_info();
#else
    return "varcomm was built without the nvlink transport";
#endif
  });
  m.def("nvlink_unavailable_reason", []() -> std::string {
#ifdef VARCOMM_HAVE_CUDA
    return nvlink_unavailable_reason();
#else
    return "varcomm was built without the nvlink transport";
#endif
  });

  py::class_<Comm>(m, "Comm")
      .def(py::init([](int rank, int world, uint64_t bound, int slots, int spin_us) {
             auto c = std::make_unique<Comm>();
             Options o;
             o.bound = bound;
             o.nslots = slots;
             o.spin_us = spin_us;
             c->engine = std::make_unique<Engine>(rank, world, o);
             return c;
           }),
           py::arg("rank"), py::arg("world"), py::arg("bound"), py::arg("slots"), py::arg("spin_us") = 50)
      .def_property_readonly("rank", [](Comm& c) { return c.engine->rank(); })
      .def_property_readonly("world", [](Comm& c) { return c.engine->world(); })
      .def_property_readonly("bound", [](Comm& c) { return c.engine->layout().bound; })
      .def_property_readonly("slots", [](Comm& c) { return c.engine->layout().nslots; })
      .def_property_readonly("region_bytes", [](Comm& c) { return c.engine->region().size(); })
      .def("expose",
           [](Comm& c, const std::string& kind, const std::string& provider, const std::string& iface, int device) {
             auto it = c.descriptors.find(kind);
             if (it != c.descriptors.end()) return it->second;
             std::shared_ptr<Transport> t;
             if (kind == "shm") {
               t = make_shm_transport(c.engine->region());
#ifdef VARCOMM_HAVE_RDMA
             } else if (kind == "rdma") {
               t = make_rdma_transport(c.engine->rank(), c.engine->world(), provider, iface);
#endif
#ifdef VARCOMM_HAVE_CUDA
             } else if (kind == "nvlink") {
               t = make_nvlink_transport(c.engine->region(), c.engine->layout(), device);
#endif
             } else {
               (void)provider;
               (void)iface;
               (void)device;
               throw Error(ErrorKind::Invalid, "transport '" + kind + "' is not built into this varcomm");
             }
             std::string d = t->expose(c.engine->region().base(), c.engine->region().size());
             c.transports[kind] = t;
             c.descriptors[kind] = d;
             return d;
           },
           py::arg("kind"), py::arg("provider") = "", py::arg("iface") = "", py::arg("device") = -1)
      .def("connect",
           [](Comm& c, int peer, const std::string& kind, const std::string& desc, int world, int slots,
              uint64_t bound) {
             auto it = c.transports.find(kind);
             if (it == c.transports.end()) throw Error(ErrorKind::Invalid, "transport '" + kind + "' not exposed");
             it->second->connect(peer, desc);
             Layout L;
             L.world = world;
             L.nslots = slots;
             L.bound = bound;
             c.engine->set_transport(peer, it->second, L);
           })
      // A device-memory transport (nvlink) to a peer already connected on the
      // host path: connect_device imports the peer's descriptor; once both
      // sides could, set_device_transport routes device messages through it.
      .def("connect_device",
           [](Comm& c, int peer, const std::string& kind, const std::string& desc) {
             auto it = c.transports.find(kind);
             if (it == c.transports.end() || !it->second->device())
               throw Error(ErrorKind::Invalid, "device transport '" + kind + "' not exposed");
             it->second->connect(peer, desc);
           })
      .def("set_device_transport",
           [](Comm& c, int peer, const std::string& kind) {
             auto it = c.transports.find(kind);
             if (it == c.transports.end() || !it->second->device())
               throw Error(ErrorKind::Invalid, "device transport '" + kind + "' not exposed");
             c.engine->set_device_transport(peer, it->second);
           })
      .def("connected", [](Comm& c) { c.engine->connected(); })
      .def("peer_error", [](Comm& c, int peer) { return c.engine->peer_error(peer); })
      .def("progress",
           [](Comm& c) {
             py::gil_scoped_release nogil;
             c.engine->progress();
           })
      .def("transport_name", [](Comm& c, int peer) { return c.engine->transport_name(peer); })
      .def("transport_describe", [](Comm& c, int peer) { return c.engine->transport_describe(peer); })
      .def("transport_describe_device",
           [](Comm& c, int peer) {
             auto it = c.transports.find("nvlink");
             return it == c.transports.end() ? std::string() : it->second->describe();
           })
      .def("isend",
           [](Comm& c, int dst, int64_t tag, uintptr_t ptr, uint64_t nbytes, uint32_t dtype, const py::sequence& shape,
              int64_t stream) {
             auto s = to_shape(shape);
             return c.engine->isend(dst, tag, reinterpret_cast<const void*>(ptr), nbytes, dtype, s.data(),
                                    uint32_t(s.size()), mem_of(stream));
           },
           py::arg("dst"), py::arg("tag"), py::arg("ptr"), py::arg("nbytes"), py::arg("dtype"), py::arg("shape"),
           py::arg("stream") = -1)
      .def("send",
           [](Comm& c, int dst, int64_t tag, uintptr_t ptr, uint64_t nbytes, uint32_t dtype, const py::sequence& shape,
              std::optional<double> timeout, int64_t stream) {
             auto s = to_shape(shape);
             send_blocking(c, dst, tag, reinterpret_cast<const void*>(ptr), nbytes, dtype, s.data(), uint32_t(s.size()),
                           timeout, mem_of(stream));
           },
           py::arg("dst"), py::arg("tag"), py::arg("ptr"), py::arg("nbytes"), py::arg("dtype"), py::arg("shape"),
           py::arg("timeout"), py::arg("stream") = -1)
      // Buffer-protocol (numpy) sends; false, with nothing sent, when the
      // object is not C-contiguous.
      .def("send_buffer",
           [](Comm& c, int dst, int64_t tag, py::handle obj, std::optional<double> timeout) {
             Buf b;
             if (!b.get(obj.ptr(), false)) return false;
             send_blocking(c, dst, tag, b.v.buf, b.nbytes, b.dtype, b.shape, b.ndim, timeout);
             return true;
           })
      // A descriptor message: the header of `nbytes` of data sent separately, no payload.
      .def("isend_descriptor",
           [](Comm& c, int dst, int64_t tag, uint64_t nbytes, uint32_t dtype, const py::sequence& shape) {
             auto s = to_shape(shape);
             return c.engine->isend_descriptor(dst, tag, nbytes, dtype, s.data(), uint32_t(s.size()));
           },
           py::arg("dst"), py::arg("tag"), py::arg("nbytes"), py::arg("dtype"), py::arg("shape"))
      .def("irecv",
           [](Comm& c, int src, int64_t tag, uintptr_t out, uint64_t cap, uint32_t dtype, int64_t stream) {
             return c.engine->irecv(src, tag, reinterpret_cast<void*>(out), cap, dtype, mem_of(stream));
           },
           py::arg("src"), py::arg("tag"), py::arg("out"), py::arg("cap"), py::arg("dtype"), py::arg("stream") = -1)
      // Receive into a buffer-protocol object: returns it unchanged when the
      // message has its shape, else the message's (src, tag, nbytes, dtype,
      // shape); None when the object is unusable here (the caller takes the
      // general path).
      .def("recv_buffer",
           [](Comm& c, int src, int64_t tag, py::handle obj, std::optional<double> timeout) -> py::object {
             Buf b;
             if (!b.get(obj.ptr(), true)) return py::none();
             MsgHeader h;
             if (!recv_blocking(c, src, tag, b.v.buf, b.nbytes, b.dtype, &h, timeout)) {
               uint64_t id = c.engine->irecv(src, tag, b.v.buf, b.nbytes, b.dtype);
               c.wait(id, timeout);
               MsgInfo m = c.engine->info(id);
               h.nbytes = m.nbytes;
               h.dtype = m.dtype;
               h.tag = m.tag;
               h.ndim = uint32_t(m.shape.size());
               std::copy(m.shape.begin(), m.shape.end(), h.shape);
             }
             if (h.nbytes == b.nbytes && h.ndim == b.ndim && std::equal(h.shape, h.shape + h.ndim, b.shape))
               return py::reinterpret_borrow<py::object>(obj);
             return header_tuple(src, h);
           })
      // Blocking receive into raw memory (torch out=): the message's header tuple.
      .def("recv_into",
           [](Comm& c, int src, int64_t tag, uintptr_t out, uint64_t cap, uint32_t dtype,
              std::optional<double> timeout, int64_t stream) -> py::object {
             MsgHeader h;
             if (!recv_blocking(c, src, tag, reinterpret_cast<void*>(out), cap, dtype, &h, timeout, mem_of(stream)))
               return py::none();
             return header_tuple(src, h);
           },
           py::arg("src"), py::arg("tag"), py::arg("out"), py::arg("cap"), py::arg("dtype"), py::arg("timeout"),
           py::arg("stream") = -1)
      .def("wait", [](Comm& c, uint64_t id, std::optional<double> timeout) { c.wait(id, timeout); },
           py::arg("id"), py::arg("timeout") = py::none())
      .def("test", [](Comm& c, uint64_t id) { return c.engine->test(id); })
      .def("info", [](Comm& c, uint64_t id) { return info_tuple(c.engine->info(id)); })
      .def("copy_out",
           [](Comm& c, uint64_t id, uintptr_t dst, int64_t stream) {
             c.engine->copy_out(id, reinterpret_cast<void*>(dst), mem_of(stream));
           },
           py::arg("id"), py::arg("dst"), py::arg("stream") = -1)
      .def("payload", [](Comm& c, uint64_t id) { return reinterpret_cast<uintptr_t>(c.engine->payload(id)); })
      .def("release", [](Comm& c, uint64_t id) { c.engine->release(id); })
      .def("cancel", [](Comm& c, uint64_t id) { c.engine->cancel(id); })
      .def("detach", [](Comm& c, uint64_t id) { c.engine->detach(id); })
      .def("close", [](Comm& c) {
        py::gil_scoped_release nogil;
        c.engine->close();
      });
}
