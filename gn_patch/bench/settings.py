"""What a full or a --quick run of the benchmark measures, and the names its result files use."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SECTIONS = ("kernels", "e2e", "cpu", "peers")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
PASSES = ("fwd", "fwd+bwd")
# Result file of each section, in the output folder.
RESULT_FILES = {"kernels": "kernels.json", "e2e": "e2e.json", "cpu": "cpu_overhead.json", "peers": "peers.json"}


@dataclass(frozen=True)
class Settings:
    """What a full or a --quick run measures, and how long it spends on each measurement."""

    quick: bool
    kernel_sources: tuple[str, ...]   # ShapeSource names whose GroupNorm shapes get a row
    compile_dtypes: tuple[str, ...]   # dtypes whose rows get the compile_cl / compile_static_cl columns
    graph_ms: float                   # GPU time spent replaying one captured graph, split into >= 5 replays
    wall_rounds: int                  # rounds of the wall-time loop (median taken)
    e2e_compile: bool
    e2e_runs: dict[str, tuple[int, int]] = field(hash=False)  # config -> (warm-up calls, timed calls)
    cpu_calls: int                    # calls per round of the CPU-cost loop
    cpu_rounds: int


FULL = Settings(
    quick=False,
    kernel_sources=("sd15_unet_512_b1", "sd15_unet_512_b2", "sdxl_unet_1024_b2", "vae_decode_512", "vae_decode_1024"),
    compile_dtypes=("float16",), graph_ms=10.0, wall_rounds=3, e2e_compile=True,
    e2e_runs={"sd15_unet_512_b2": (3, 10), "vae_decode_512": (2, 10), "vae_decode_1024": (2, 5),
              "sd15_txt2img_512_30steps": (1, 3), "sdxl_unet_1024_b2": (2, 5), "sd15_train_512_b8": (2, 5),
              "cogvideox_vae_decode": (1, 5), "hunyuanvideo_vae_decode": (2, 5), "animatediff_unet": (2, 5),
              "scale_shift_unet": (2, 10)},
    cpu_calls=2000, cpu_rounds=7,
)
QUICK = Settings(
    quick=True,
    kernel_sources=("sd15_unet_512_b2", "vae_decode_512"),
    compile_dtypes=(), graph_ms=6.0, wall_rounds=2, e2e_compile=False,
    e2e_runs={"sd15_unet_512_b2": (2, 5), "vae_decode_512": (1, 5), "vae_decode_1024": (1, 3),
              "sd15_txt2img_512_30steps": (1, 2), "sdxl_unet_1024_b2": (1, 3), "sd15_train_512_b8": (1, 3),
              "cogvideox_vae_decode": (1, 2), "hunyuanvideo_vae_decode": (1, 3), "animatediff_unet": (1, 3),
              "scale_shift_unet": (1, 5)},
    cpu_calls=1000, cpu_rounds=3,
)
