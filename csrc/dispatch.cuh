// Host-side dispatch from the runtime (dtype, vector width, activation) of an op's arguments to the compile-time
// template arguments of its kernels, shared by forward.cu and backward.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "group_norm_act.h"

namespace gn_patch {

// Calls Launch<T, V, A>::run(args, stream) for args.dtype (T), args.geo.vec (V: 16 bytes of T, or 1) and
// args.act (A). Every combination is instantiated, so every kernel exists for every input the op accepts.
template <template <typename, int, Act> class Launch, typename T, int V, typename Args>
void dispatch_activation(const Args& args, cudaStream_t stream) {
  switch (args.act) {
    case Act::kIdentity: return Launch<T, V, Act::kIdentity>::run(args, stream);
    case Act::kSilu: return Launch<T, V, Act::kSilu>::run(args, stream);
    case Act::kGelu: return Launch<T, V, Act::kGelu>::run(args, stream);
    case Act::kGeluTanh: return Launch<T, V, Act::kGeluTanh>::run(args, stream);
    case Act::kRelu: return Launch<T, V, Act::kRelu>::run(args, stream);
  }
}

template <template <typename, int, Act> class Launch, typename T, typename Args>
void dispatch_vector(const Args& args, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  if (args.geo.vec == kVec) return dispatch_activation<Launch, T, kVec>(args, stream);
  return dispatch_activation<Launch, T, 1>(args, stream);
}

template <template <typename, int, Act> class Launch, typename Args>
void dispatch(const Args& args, cudaStream_t stream) {
  if (args.geo.blocks() == 0) return;
  switch (args.dtype) {
    case ScalarKind::kFloat: return dispatch_vector<Launch, float>(args, stream);
    case ScalarKind::kHalf: return dispatch_vector<Launch, __half>(args, stream);
    case ScalarKind::kBFloat16: return dispatch_vector<Launch, __nv_bfloat16>(args, stream);
  }
}

}  // namespace gn_patch
