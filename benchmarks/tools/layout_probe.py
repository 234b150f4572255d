"""Which ATen ops of a patched video call see mixed memory layouts (exploratory, for benchmarks/NOTES.md).

A TorchDispatchMode records, for one no_grad call, every ATen op with the layout of its 5-D (and 4-D) tensor
arguments and of its output (NCDHW, NDHWC, other), counted and weighted by the output's bytes: an elementwise op
whose inputs differ in layout, or a pad/cat/copy that turns NDHWC into NCDHW, breaks the channels-last flow.

    python benchmarks/tools/layout_probe.py [--models cogvideox,hunyuanvideo]
"""
import argparse
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gn_patch import patch_model
from gn_patch.bench.models import build_model, video_vae_decode_call

CALLS = {
    "cogvideox": ("cogvideox_vae", torch.bfloat16, (1, 16, 4, 60, 90)),
    "hunyuanvideo": ("hunyuanvideo_vae", torch.float16, (1, 16, 3, 40, 64)),
}


def layout(t):
    if t.dim() not in (4, 5):
        return f"{t.dim()}d"
    if t.is_contiguous():
        return "NCHW" if t.dim() == 4 else "NCDHW"
    if t.is_contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d):
        return "NHWC" if t.dim() == 4 else "NDHWC"
    return "other"


class Layouts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()
        self.bytes = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = tuple(layout(a) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor) and a.dim() >= 4)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if ins or any(o.dim() >= 4 for o in outs):
            key = (str(func.overloadpacket.__name__), ins, tuple(layout(o) for o in outs if o.dim() >= 4))
            self.seen[key] += 1
            self.bytes[key] += sum(o.numel() * o.element_size() for o in outs)
        return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(CALLS))
    args = parser.parse_args()
    for name in args.models.split(","):
        model_name, dtype, latents = CALLS[name]
        vae = build_model(model_name, "cuda", dtype)
        patch_model(vae)
        call = video_vae_decode_call(vae, latents)
        mode = Layouts()
        with torch.no_grad(), mode:
            call()
        print(f"== {name} patched: ops with 4-D/5-D tensors, by output MB")
        for key, size in mode.bytes.most_common(40):
            print(f"{size / 2**20:10.1f} MB {mode.seen[key]:5d}x  {key[0]:28s} in {key[1]} -> {key[2]}")
        del vae, call
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
