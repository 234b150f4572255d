#!/usr/bin/env python
"""Train stock and patched back to back and write both losses and samples/s to one JSON file.

Runs examples/train_text_to_image.py twice in fresh subprocesses (``--no-patch`` first, then patched) with the
same seed, so both see the same weights, data, noise and timesteps, then writes::

    {"config", "stock_samples_per_s", "patched_samples_per_s", "speedup", "max_loss_diff_first_10_steps",
     "stock_losses", "patched_losses", "commit"}

("speedup" is null on the CPU, where both runs take PyTorch's path.)

The defaults are the acceptance run of issue 4: 50 steps of full fine-tuning of the SD1.5-architecture UNet at
512x512, batch 8, bf16, on one GPU::

    python examples/compare_training.py --output benchmarks/results/h200/training.json
    python examples/compare_training.py --tiny --max-train-steps 3 --mixed-precision no   # CPU smoke run

Arguments it does not know go to both training runs (``--gradient-checkpointing``, ``--lora-rank 4``,
``--tiny``, ``--fsdp2``, ...). ``--num-processes N`` (N > 1) runs each under ``accelerate launch --multi_gpu``
(``--fsdp2`` with one process: under ``torchrun``, as FSDP needs a distributed launch);
``--one-gpu-json`` names the result of the same configuration on one GPU, whose samples/s the output then
records next to its own, with the scaling (N-GPU samples/s over one-GPU samples/s)::

    python examples/compare_training.py --output one.json
    python examples/compare_training.py --num-processes 2 --one-gpu-json one.json --output two.json
    python examples/compare_training.py --num-processes 2 --fsdp2 --output training_fsdp2.json   # UNet sharded
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

# Run from a checkout without installing, as train_text_to_image.py does: the repository root holds gn_patch.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gn_patch.bench.results import commit_id

REPO = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = REPO / "examples" / "train_text_to_image.py"
COMPARED_STEPS = 10
# Config entries that differ between the two runs by design.
PER_RUN_KEYS = {"no_patch", "output_dir", "log_json", "gn_patch"}
# Options the training script gained after results were committed: a config without one ran with its default.
ADDED_OPTION_DEFAULTS = {"fsdp2": False}


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Other flags (e.g. --tiny, --gradient-checkpointing, --lora-rank, "
                                            "--fsdp2) go to both runs of examples/train_text_to_image.py; its --help "
                                            "lists them.")
    parser.add_argument("--output", type=Path, default=Path("training.json"), help="result JSON (default: %(default)s)")
    parser.add_argument("--work-dir", type=Path,
                        help="checkpoints and per-run logs go to WORK_DIR/stock and WORK_DIR/patched (default: a new "
                             "folder in the system's temporary directory, printed; kept after the run)")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--one-gpu-json", type=Path,
                        help="this script's output for the same configuration on one GPU, to compute the scaling")
    parser.add_argument("--commit", help="commit to record (default: $GN_PATCH_COMMIT, else `git rev-parse HEAD` of "
                                         "the repository)")
    parser.add_argument("--resolution", type=int, help="image size (default: 512; the training script's with --tiny)")
    parser.add_argument("--train-batch-size", type=int, help="per device (default: 8; 1 with --tiny)")
    parser.add_argument("--max-train-steps", type=int, default=50)
    parser.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"], default="bf16")
    return parser.parse_known_args(argv)


def new_work_dir() -> Path:
    """A new folder in the system's temporary directory: one per call, so that two users, or two calls at once,
    never write their checkpoints over each other's."""
    return Path(tempfile.mkdtemp(prefix="gn_patch_compare_training_"))


def launcher(num_processes: int, fsdp2: bool) -> list[str]:
    if num_processes == 1 and fsdp2:  # accelerate applies FSDP only to a distributed launch
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    if num_processes == 1:
        return [sys.executable]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(num_processes)]


def train(args: argparse.Namespace, extra: list[str], patched: bool) -> dict:
    """One training run in a subprocess; returns its --log-json content."""
    run_dir = args.work_dir / ("patched" if patched else "stock")
    log_path = run_dir / "log.json"
    log_path.unlink(missing_ok=True)  # a failed run must not leave an old log to be read
    tiny = "--tiny" in extra
    resolution = args.resolution or (None if tiny else 512)
    batch = args.train_batch_size or (None if tiny else 8)
    command = [
        *launcher(args.num_processes, "--fsdp2" in extra), str(TRAIN_SCRIPT),
        *(["--resolution", str(resolution)] if resolution else []),
        *(["--train-batch-size", str(batch)] if batch else []),
        "--max-train-steps", str(args.max_train_steps), "--mixed-precision", args.mixed_precision,
        "--output-dir", str(run_dir), "--log-json", str(log_path), *extra,
    ]
    if not patched:
        command.append("--no-patch")
    print("+", " ".join(command), flush=True)
    result = subprocess.run(command, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"the {'patched' if patched else 'stock'} run failed (exit status {result.returncode})")
    return json.loads(log_path.read_text())


def summarize(stock: dict, patched: dict, commit: str) -> dict:
    """The result record of a stock and a patched run of the same configuration."""
    shared = {key: value for key, value in stock["config"].items() if key not in PER_RUN_KEYS}
    differing = [key for key, value in shared.items() if patched["config"].get(key) != value]
    if differing:
        raise SystemExit(f"the runs differ in more than the patch: {differing}")
    gn_patch = patched["config"]["gn_patch"]
    if gn_patch["cuda_kernels"] is False:
        raise SystemExit("the patched run had no gn_patch CUDA kernels (it fell back to PyTorch's GroupNorm), "
                         "so it would compare stock with stock: check `python -m gn_patch.build`")
    first = list(zip(stock["losses"], patched["losses"]))[:COMPARED_STEPS]
    return {
        "config": dict(shared, gn_patch=gn_patch),
        "stock_samples_per_s": stock["samples_per_s"],
        "patched_samples_per_s": patched["samples_per_s"],
        # On the CPU both runs take PyTorch's path: their ratio measures the host, not the patch (null).
        "speedup": None if shared.get("device") == "cpu" else patched["samples_per_s"] / stock["samples_per_s"],
        f"max_loss_diff_first_{COMPARED_STEPS}_steps": max(abs(a - b) for a, b in first),
        "stock_losses": stock["losses"],
        "patched_losses": patched["losses"],
        "commit": commit,
    }


def add_scaling(result: dict, one_gpu: dict) -> None:
    """Adds the one-GPU samples/s of the same configuration and the scaling of stock and patched."""
    ignored = {"num_processes", "global_batch_size", "gn_patch"}
    mine = {k: v for k, v in {**ADDED_OPTION_DEFAULTS, **result["config"]}.items() if k not in ignored}
    theirs = {k: v for k, v in {**ADDED_OPTION_DEFAULTS, **one_gpu["config"]}.items() if k not in ignored}
    differing = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    if differing:
        raise SystemExit(f"--one-gpu-json is another configuration: {differing} differ")
    result["one_gpu"] = {key: one_gpu[key] for key in ("stock_samples_per_s", "patched_samples_per_s", "commit")}
    for variant in ("stock", "patched"):
        result[f"{variant}_scaling"] = result[f"{variant}_samples_per_s"] / one_gpu[f"{variant}_samples_per_s"]


def main(argv: list[str] | None = None) -> dict:
    args, extra = parse_args(argv)
    if "--fsdp2" in extra and not torch.cuda.is_available():  # before torchrun, whose traceback would bury it
        raise SystemExit("--fsdp2 needs CUDA GPUs: accelerate shards only under a distributed GPU launch")
    if "--tiny" not in extra and not torch.cuda.is_available():  # SD1.5 at 512², batch 8: hours on a CPU
        raise SystemExit("no CUDA GPU here: the full-size comparison needs one; --tiny runs the CPU smoke run "
                         "(--tiny --max-train-steps 3 --mixed-precision no)")
    one_gpu = json.loads(args.one_gpu_json.read_text()) if args.one_gpu_json else None
    if args.work_dir is None:
        args.work_dir = new_work_dir()
        print(f"checkpoints and per-run logs: {args.work_dir}", flush=True)
    stock, patched = train(args, extra, patched=False), train(args, extra, patched=True)
    result = summarize(stock, patched, args.commit or commit_id(REPO))
    if one_gpu is not None:
        add_scaling(result, one_gpu)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    ratio = " (on the CPU both runs take PyTorch's path: no speedup to report)" if result["speedup"] is None else \
        f" ({result['speedup']:.3f}x)"
    print(f"stock {result['stock_samples_per_s']:.2f} samples/s, patched {result['patched_samples_per_s']:.2f} "
          f"samples/s{ratio}; max |loss difference| over the first {min(COMPARED_STEPS, len(stock['losses']))} steps "
          f"{result[f'max_loss_diff_first_{COMPARED_STEPS}_steps']:.3g}; written to {args.output}")
    return result


if __name__ == "__main__":
    main()
