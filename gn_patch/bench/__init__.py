"""Benchmark gn_patch against PyTorch on the GroupNorm calls that real diffusers models make.

    python -m gn_patch.bench                    # full run: kernels, end to end (with torch.compile), CPU cost
    python -m gn_patch.bench --quick            # fewer shapes and repeats, no torch.compile
    python -m gn_patch.bench --only kernels,cpu --out benchmarks/results/h200
    python -m gn_patch.bench --only peers --peers DIR   # against the peer kernels found in DIR
    python -m gn_patch.bench --report-only      # summary.md and plots again from the JSON files in --out

Sections, each writing its JSON file row by row (a run cut short leaves what it had measured):

* ``kernels`` -> kernels.json: GroupNorm+SiLU on every distinct GroupNorm input of the SD1.5 UNet (512², batch 1
  and 2), the SDXL UNet (1024², batch 2) and the SD VAE decoder (to 512² and 1024²), collected by forward pre-hooks
  on the real modules; float16 and bfloat16, forward and forward+backward; gn_patch, PyTorch eager on NCHW and on
  channels_last input, torch.compile, and a device copy of the same bytes.
* ``e2e`` -> e2e.json: UNet calls, VAE decodes, the txt2img pipeline and a training step; stock NCHW, stock
  channels_last, patched, each eager and (some) compiled.
* ``cpu`` -> cpu_overhead.json: host cost of one call at a launch-bound shape.
* ``peers`` (only with --peers DIR) -> peers.json: gn_patch, PyTorch and the peer kernels of DIR (gnnhwc/,
  apex_gn/, sfast/: see gn_patch.bench.peers) at 20 UNet and VAE shapes, float16 and bfloat16, GPU time by CUDA
  graph and as-called time by triton's do_bench, with each output's error against float32.

Then summary.md, kernel_speedup.png and e2e.png. Everything needs a CUDA GPU except --report-only.

Modules: settings (what a run measures), results (result files, shared helpers), timing, models (the models and
their GroupNorm shapes), kernels, e2e, cpu, peers and peers_table, markdown, report, plots, cli.
"""
