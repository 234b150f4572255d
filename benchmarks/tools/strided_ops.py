"""Which elementwise ops and copies of a patched UNetMotionModel call (AnimateDiff) run on strided operands
(broadcasts, mixed layouts: TensorIterator's non-vectorised kernels on the GPU), counted by op and by the module
that calls them, on the CPU with a small config of the same blocks, for benchmarks/NOTES.md (exploratory). On the
GPU each cuDNN convolution with a bias adds one more strided add (PyTorch adds the bias in a second kernel), which
the CPU's convolutions do not show:

    python benchmarks/tools/strided_ops.py [--stock]
"""
import argparse
from collections import Counter

import torch
from diffusers import UNetMotionModel
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.utils._python_dispatch import TorchDispatchMode

from gn_patch import configs, patch_model

ELEMENTWISE = {"add", "mul", "div", "sub", "gelu", "silu"}
COPIES = {"copy_", "clone", "_to_copy", "cat"}


def dense_alike(tensors) -> bool:
    """Same shape and strides, non-overlapping and dense: TensorIterator's vectorised case."""
    first = tensors[0]
    return (all(t.shape == first.shape and t.stride() == first.stride() for t in tensors)
            and is_non_overlapping_and_dense_or_false(first))


class OpLog(TorchDispatchMode):
    """Counts elementwise ops ("vectorised" or "strided") and copies by (op, kind, calling module)."""

    def __init__(self, modules: list[str]):
        super().__init__()
        self.modules = modules  # the stack of modules being called, kept by the hooks
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        op = name if name == "copy_" else name.rstrip("_")  # in-place variants with theirs
        if op in ELEMENTWISE or op in COPIES:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [out] if isinstance(out, torch.Tensor) else []
            kind = "copy" if op in COPIES else ("vectorised" if dense_alike(tensors) else "strided")
            self.counts[(op, kind, self.modules[-1] if self.modules else "")] += 1
        return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stock", action="store_true", help="the model as built, not patched")
    args = parser.parse_args()
    config = dict(configs.ANIMATEDIFF_UNET, block_out_channels=(64, 128, 128, 128), norm_num_groups=8)
    torch.manual_seed(0)
    model = UNetMotionModel(**config).eval()
    if not args.stock:
        print(patch_model(model))
    modules: list[str] = []
    for module in model.modules():  # after patching: the surgeon does not fuse norms that carry hooks
        module.register_forward_pre_hook(lambda m, _: modules.append(type(m).__name__))
        module.register_forward_hook(lambda m, _, __: modules.pop() and None)
    sample = torch.randn(2, 4, 4, 16, 16)
    context = torch.randn(2, 77, 768).repeat_interleave(4, 0)
    log = OpLog(modules)
    with torch.no_grad(), log:
        model(sample, torch.tensor(999), encoder_hidden_states=context)
    for (op, kind, module), count in sorted(log.counts.items(), key=lambda item: -item[1]):
        print(f"{count:5d}  {op:8s} {kind:10s} {module}")


if __name__ == "__main__":
    main()
