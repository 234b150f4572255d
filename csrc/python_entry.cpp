// The Python module gn_patch_C: one function, group_norm_act_dispatch, through which GroupNormAct.forward and
// gn_patch.group_norm_act call the dispatching op (autograd.cpp) in eager mode. Called through its OpOverload, the op
// costs 2-3 us more per call on a fast host (Python arguments matched against the schema and boxed, 11 of them:
// benchmarks/NOTES.md, session 24), a large part of an inference call; here the arguments are read straight from the
// Python objects and the op is called unboxed, through the dispatcher (autograd, autocast, tracing and dispatch
// modes see the same call). Where an argument is not a plain tensor, None, int, float, str or bool (a tensor
// subclass or a __torch_function__ mode, which the OpOverload would hand to __torch_function__; an int as eps, a
// number as input_offset), it returns None and the caller calls the OpOverload.
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <array>

namespace gn_patch {
namespace {

using OptTensor = std::optional<at::Tensor>;

const auto& dispatch_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("gn_patch::group_norm_act_dispatch", "")
          .typed<at::Tensor(const at::Tensor&, int64_t, const OptTensor&, const OptTensor&, double, c10::string_view,
                            const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, bool)>();
  return op;
}

// A tensor whose call __torch_function__ would not intercept: a torch.Tensor or nn.Parameter (whose override is
// disabled), not a subclass, while no torch-function mode is active.
bool plain_tensor(PyObject* obj) { return THPVariable_CheckExact(obj) && !at::impl::torch_function_mode_enabled(); }

// None, or a plain tensor into `out`; false for anything else.
bool read_optional(PyObject* obj, OptTensor& out) {
  if (obj == Py_None) return true;
  if (!plain_tensor(obj)) return false;
  out = THPVariable_Unpack(obj);
  return true;
}

// group_norm_act_dispatch(x, num_groups, weight, bias, eps, activation, scale, shift, input_offset, input_bias,
// frames_last) -> y, or None where the OpOverload must take the call; positional, as the op's schema orders them.
PyObject* group_norm_act_dispatch(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  at::Tensor y;
  // The op's C++ warnings reach Python's warnings as PyTorch's own bindings hand them on. y is wrapped after the
  // handler's scope: a warning that a filter turns into an exception is raised as the scope closes, and would leave
  // a result wrapped inside it unreferenced.
  HANDLE_TH_ERRORS
  if (nargs != 11) {
    PyErr_Format(PyExc_TypeError, "group_norm_act_dispatch takes 11 positional arguments, got %zd", nargs);
    return nullptr;
  }
  if (!plain_tensor(args[0]) || !PyLong_CheckExact(args[1]) || !PyFloat_CheckExact(args[4]) ||
      !PyUnicode_CheckExact(args[5]) || !PyBool_Check(args[10])) {
    Py_RETURN_NONE;
  }
  constexpr std::array<int, 6> kOptional = {2, 3, 6, 7, 8, 9};  // weight, bias, scale, shift, input_offset, input_bias
  std::array<OptTensor, 6> opt;
  for (size_t i = 0; i < kOptional.size(); ++i) {
    if (!read_optional(args[kOptional[i]], opt[i])) Py_RETURN_NONE;
  }
  int overflow = 0;
  const long long num_groups = PyLong_AsLongLongAndOverflow(args[1], &overflow);
  if (overflow != 0) {  // PyTorch's message for an int argument outside int64 (F.group_norm's, the schema's)
    PyErr_SetString(PyExc_ValueError, "Overflow when unpacking long long");
    return nullptr;
  }
  Py_ssize_t length = 0;
  const char* activation = PyUnicode_AsUTF8AndSize(args[5], &length);
  if (activation == nullptr) {  // not UTF-8 encodable (a lone surrogate): the OpOverload's schema error
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  const at::Tensor& x = THPVariable_Unpack(args[0]);
  const double eps = PyFloat_AS_DOUBLE(args[4]);
  const bool frames_last = args[10] == Py_True;
  pybind11::gil_scoped_release no_gil;  // as PyTorch's own bindings call ops
  y = dispatch_op().call(x, num_groups, opt[0], opt[1], eps, c10::string_view(activation, length), opt[2], opt[3],
                         opt[4], opt[5], frames_last);
  END_HANDLE_TH_ERRORS
  return THPVariable_Wrap(std::move(y));
}

PyMethodDef methods[] = {
    {"group_norm_act_dispatch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(group_norm_act_dispatch)),
     METH_FASTCALL,
     "group_norm_act_dispatch(x, num_groups, weight, bias, eps, activation, scale, shift, input_offset, input_bias, "
     "frames_last) -> Tensor | None: gn_patch::group_norm_act_dispatch called from C++; None where the arguments "
     "need the op's OpOverload (a tensor subclass, a __torch_function__ mode, an argument of another type)."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace
}  // namespace gn_patch

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  if (PyModule_AddFunctions(m.ptr(), gn_patch::methods) != 0) throw pybind11::error_already_set();
}
