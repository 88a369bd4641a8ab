// varcomm._torch_hooks: the torch adapter of the fast paths (array_hooks.h).
// Reading a tensor's description through Python attributes costs ~0.5 us a
// send and making a result tensor ~0.9 us (torch.empty's argument parsing
// and dispatch): together more than the rest of a small message's half round
// trip. Here both are a few field reads and one TensorImpl.
//
// Built against one torch, whose version it names (torch_version);
// python/varcomm/arrays.py installs it only under that torch, as its C++ ABI
// is that version's, and the Python paths serve any other. Loading it calls
// nothing of torch's. dtypes: the table in
// python/varcomm/dtypes.py, handed over by install().
#include <Python.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <vector>

#include "array_hooks.h"

using varcomm::ArrayDesc;
using varcomm::ArrayHooks;

namespace {

constexpr int kTypes = static_cast<int>(c10::ScalarType::NumOptions);
uint32_t g_word[kTypes] = {};  // scalar type -> dtype word; 0: not taken by the fast path
std::vector<std::pair<uint32_t, c10::ScalarType>> g_type;  // dtype word -> scalar type
PyObject* g_invalid = PyExc_TypeError;  // varcomm's InvalidArgument (install)

// As python/varcomm/dtypes.py's to_torch says it.
void no_torch_dtype(uint32_t dtype) {
  PyErr_Format(g_invalid, "received dtype word 0x%x has no torch equivalent in this torch version", unsigned(dtype));
}

// A plain strided CPU tensor with its own storage: not a wrapper (functorch,
// functionalization, a Python-dispatch subclass' impl), whose data the
// fast path must not touch behind its back.
bool plain_cpu(const c10::TensorImpl* t) {
  return t->device_type() == c10::DeviceType::CPU && t->layout() == c10::kStrided && t->has_storage() &&
         !t->is_python_dispatch() &&
         !t->key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::Functionalize,
                                                    c10::DispatchKey::FuncTorchBatched,
                                                    c10::DispatchKey::FuncTorchGradWrapper}));
}

c10::ScalarType* scalar_type_of(uint32_t dtype) {
  auto it = std::find_if(g_type.begin(), g_type.end(), [&](const auto& p) { return p.first == dtype; });
  return it == g_type.end() ? nullptr : &it->second;
}

int describe(PyObject* obj, bool writable, ArrayDesc* d) {
  try {
    const at::Tensor& t = THPVariable_Unpack(obj);
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    // Negative and conjugate views: their bytes are not their values (arrays.values).
    if (!plain_cpu(impl) || impl->is_neg() || impl->is_conj() || !impl->is_contiguous()) return 0;
    // A storage freed or shrunk under the tensor (FSDP's resize_(0)): the
    // Python path names it.
    const size_t need = (size_t(impl->storage_offset()) + size_t(impl->numel())) * impl->itemsize();
    if (impl->numel() && impl->storage().nbytes() < need) return 0;
    int st = static_cast<int>(impl->dtype().toScalarType());
    int64_t nd = impl->dim();
    if (st < 0 || st >= kTypes || !g_word[st] || nd > varcomm::kArrayHooksMaxDims) return 0;
    auto sizes = impl->sizes();
    for (int64_t i = 0; i < nd; ++i) d->shape[i] = sizes[i];
    d->ndim = uint32_t(nd);
    d->dtype = g_word[st];
    d->nbytes = uint64_t(impl->numel()) * impl->itemsize();
    // The write materializes a copy-on-write storage first, as t.data_ptr() does.
    d->ptr = writable ? t.mutable_data_ptr() : const_cast<void*>(t.const_data_ptr());
    // A write, as torch's in-place ops count it: a backward that saved the
    // tensor raises instead of using the message's values (an inference
    // tensor has no counter).
    if (writable && !impl->is_inference()) impl->bump_version();
    return 1;
  } catch (...) {  // anything unusual: the Python path decides, and names it
    return 0;
  }
}

PyObject* empty(uint32_t dtype, const int64_t* shape, uint32_t ndim, void** data) {
  c10::ScalarType* st = scalar_type_of(dtype);
  if (!st) {
    no_torch_dtype(dtype);
    return nullptr;
  }
  // torch's error handling: its C++ errors as Python's, and its warnings
  // (complex32 is experimental, ...) as Python warnings, as torch.empty gives.
  HANDLE_TH_ERRORS
  // empty_cpu is torch.empty(..., device="cpu")'s kernel without the
  // dispatcher: always host memory, whatever torch's default device is.
  at::Tensor t = at::detail::empty_cpu(c10::IntArrayRef(shape, ndim), *st, false, std::nullopt);
  *data = t.mutable_data_ptr();
  return THPVariable_Wrap(std::move(t));
  END_HANDLE_TH_ERRORS
}

PyObject* prefix(PyObject* out, const int64_t* shape, uint32_t ndim) {
  HANDLE_TH_ERRORS
  {
    const at::Tensor& base = THPVariable_Unpack(out);
    // A base autograd records: torch's own view op (the Python path).
    if (base.requires_grad()) return nullptr;
    c10::TensorImpl* b = base.unsafeGetTensorImpl();
    // What out.as_strided(shape, contiguous strides) makes, without its
    // dispatch: the same storage and offset, then autograd's view of the base
    // (as the ADInplaceOrView kernel records it: a later in-place op with a
    // tensor that requires grad reaches out, and the view shares out's
    // version counter). An inference tensor's views are plain.
    auto v = at::detail::make_tensor<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(b->storage()),
                                                      b->key_set(), b->dtype());
    c10::TensorImpl* vi = v.unsafeGetTensorImpl();
    vi->set_sizes_contiguous(c10::IntArrayRef(shape, ndim));
    vi->set_storage_offset(b->storage_offset());
    if (!b->is_inference()) {
      auto meta = c10::InferenceMode::is_enabled() ? torch::autograd::CreationMeta::INFERENCE_MODE
                  : at::GradMode::is_enabled()     ? torch::autograd::CreationMeta::DEFAULT
                                                   : torch::autograd::CreationMeta::NO_GRAD_MODE;
      v = torch::autograd::as_view(base, v, /*is_bw_differentiable=*/true, /*is_fw_differentiable=*/true, nullptr,
                                   nullptr, meta);
    }
    return THPVariable_Wrap(std::move(v));
  }
  END_HANDLE_TH_ERRORS
}

// A tensor over ptr that holds keep until its storage is freed (recv
// copy=False: keep is the slot's Loan, whose end frees the slot): what
// torch.frombuffer(...).reshape(...) makes, in one step.
PyObject* lend(PyObject* keep, void* ptr, uint32_t dtype, const int64_t* shape, uint32_t ndim) {
  c10::ScalarType* st = scalar_type_of(dtype);
  if (!st) {
    no_torch_dtype(dtype);
    return nullptr;
  }
  if (!keep) Py_RETURN_NONE;
  // (keep stays referenced if from_blob fails: whether its deleter already
  // dropped it is not known; a leak, never a double free.)
  HANDLE_TH_ERRORS
  {
    int64_t numel = 1;
    for (uint32_t i = 0; i < ndim; ++i) numel *= shape[i];
    if (!numel) {  // no bytes to lend: holding the slot for none would stall its sender
      void* unused;
      return empty(dtype, shape, ndim, &unused);
    }
    Py_INCREF(keep);
    at::Tensor t = at::from_blob(
        ptr, c10::IntArrayRef(shape, ndim),
        [keep](void*) {
          if (!Py_IsInitialized()) return;  // at exit: nothing to give back
          PyGILState_STATE g = PyGILState_Ensure();  // the last owner may be a thread without the GIL
          Py_DECREF(keep);
          PyGILState_Release(g);
        },
        at::TensorOptions().dtype(*st));
    return THPVariable_Wrap(std::move(t));
  }
  END_HANDLE_TH_ERRORS
}

ArrayHooks g_hooks = {varcomm::kArrayHooksAbi, 0, nullptr, describe, empty, prefix, lend};

// install(tensor_type, [(torch dtype, dtype word), ...], kind, error class)
// -> the capsule the core takes (_C.set_array_hooks). Errors of a dtype word
// without a torch dtype are of the error class.
PyObject* install(PyObject*, PyObject* args) {
  PyObject *type, *pairs, *invalid;
  unsigned kind;
  if (!PyArg_ParseTuple(args, "O!OIO", &PyType_Type, &type, &pairs, &kind, &invalid)) return nullptr;
  Py_INCREF(invalid);  // for the life of the process, as the type
  g_invalid = invalid;
  PyObject* seq = PySequence_Fast(pairs, "install: pairs must be a sequence of (torch.dtype, word)");
  if (!seq) return nullptr;
  std::fill(std::begin(g_word), std::end(g_word), 0u);
  g_type.clear();
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    PyObject* p = PySequence_Fast_GET_ITEM(seq, i);
    PyObject* dt;
    unsigned long w;
    if (!PyArg_ParseTuple(p, "Ok", &dt, &w)) {
      Py_DECREF(seq);
      return nullptr;
    }
    if (!THPDtype_Check(dt)) {
      Py_DECREF(seq);
      PyErr_SetString(PyExc_TypeError, "install: each pair is (torch.dtype, dtype word)");
      return nullptr;
    }
    auto st = reinterpret_cast<THPDtype*>(dt)->scalar_type;
    g_word[static_cast<int>(st)] = uint32_t(w);
    g_type.emplace_back(uint32_t(w), st);
  }
  Py_DECREF(seq);
  Py_INCREF(type);  // the table points at it for the life of the process
  g_hooks.type = reinterpret_cast<PyTypeObject*>(type);
  g_hooks.kind = kind;
  return PyCapsule_New(&g_hooks, varcomm::kArrayHooksCapsule, nullptr);
}

PyMethodDef methods[] = {
    {"install", install, METH_VARARGS, "install(tensor_type, [(torch.dtype, dtype word)], kind, error) -> capsule"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "varcomm._torch_hooks",
                      "torch's adapter for varcomm's fast paths (csrc/python/array_hooks.h)", -1, methods,
                      nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__torch_hooks() {
  PyObject* m = PyModule_Create(&module);
  if (m && PyModule_AddStringConstant(m, "torch_version", VARCOMM_TORCH_VERSION) != 0) Py_CLEAR(m);
  return m;
}
