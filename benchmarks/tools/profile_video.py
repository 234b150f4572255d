"""torch.profiler tables of the zoo's video calls (the e2e shapes), stock NCDHW then patched, for
benchmarks/NOTES.md (exploratory, not committed results): where the GPU time of a video VAE decode goes once the
GroupNorms run the kernels (convolutions, layout copies, PyTorch ops around the norms).

    python benchmarks/tools/profile_video.py profile_video.txt [--models cogvideox,hunyuanvideo,animatediff]
"""
import argparse

import torch

from gn_patch import patch_model
from gn_patch.bench.e2e import inference
from gn_patch.bench.models import animatediff_call, build_model, video_vae_decode_call

from profile_e2e import profile_calls

CALLS = {
    "cogvideox": ("cogvideox_vae", torch.bfloat16, lambda m: video_vae_decode_call(m, (1, 16, 4, 60, 90))),
    "hunyuanvideo": ("hunyuanvideo_vae", torch.float16, lambda m: video_vae_decode_call(m, (1, 16, 3, 40, 64))),
    "animatediff": ("animatediff_unet", torch.float16, lambda m: animatediff_call(m, 2, 16, 64)),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--models", default=",".join(CALLS))
    args = parser.parse_args()
    with open(args.path, "w") as out:
        for name in args.models.split(","):
            model_name, dtype, make_call = CALLS[name]
            model = build_model(model_name, "cuda", dtype)
            call = inference(make_call(model))
            profile_calls(f"{name} stock", call, 2, out)
            report = patch_model(model)
            print(report, file=out, flush=True)
            profile_calls(f"{name} patched", call, 2, out)
            del model, call
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
