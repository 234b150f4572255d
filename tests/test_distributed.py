"""Data-parallel training of a patched UNet on two CPU processes (gloo).

DistributedDataParallel must all-reduce the gradients of the fused GroupNormAct parameters like any others:
after one backward pass both ranks hold the same gradients, equal to a single process's on the full batch.
The training example must give the same losses on two processes with batch B as on one with batch 2B.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers import UNet2DConditionModel
from torch.nn.parallel import DistributedDataParallel

from gn_patch import configs
from gn_patch.surgeon import patch_model

from .training_utils import (
    assert_grads_close,
    assert_grads_equal,
    build_unet,
    collect_grads,
    output_probe,
    parameter_grads,
    patched_copy,
    probe_loss,
    unet_inputs,
)

WORLD_SIZE = 2
BATCH = 4  # the full batch; each rank takes BATCH // WORLD_SIZE samples
TRAIN_SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_text_to_image.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train_shard(rank: int, port: int, workdir: Path) -> None:
    """One DDP rank: the tiny UNet from workdir/state.pt, patched, backward on this rank's half of the batch;
    saves the parameter gradients to workdir/grads_<rank>.pt."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two processes share a two-core CI machine
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        unet = UNet2DConditionModel(**configs.TINY_SD15_UNET)
        unet.load_state_dict(torch.load(workdir / "state.pt", weights_only=True))
        patch_model(unet.train())
        ddp = DistributedDataParallel(unet)
        batch = torch.load(workdir / "batch.pt", weights_only=True)
        shard = slice(rank * BATCH // WORLD_SIZE, (rank + 1) * BATCH // WORLD_SIZE)
        output = ddp(**{key: value[shard] for key, value in batch["inputs"].items()}).sample
        probe_loss(output, batch["probe"][shard]).backward()
        torch.save(collect_grads(unet), workdir / f"grads_{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ddp_gradients_are_synchronised_and_match_one_process(tmp_path):
    stock = build_unet(configs.TINY_SD15_UNET)
    inputs = unet_inputs(configs.TINY_SD15_UNET, BATCH, tokens=8)
    probe = output_probe(configs.TINY_SD15_UNET, BATCH)
    torch.save(stock.state_dict(), tmp_path / "state.pt")
    torch.save({"inputs": inputs, "probe": probe}, tmp_path / "batch.pt")

    mp.spawn(train_shard, args=(free_port(), tmp_path), nprocs=WORLD_SIZE)

    ranks = [torch.load(tmp_path / f"grads_{rank}.pt", weights_only=True) for rank in range(WORLD_SIZE)]
    assert_grads_equal(ranks[1], ranks[0])
    assert_grads_close(ranks[0], parameter_grads(patched_copy(stock), inputs, probe), rtol=1e-5)


def run_training(args: list[str], out: Path, processes: int) -> dict:
    """The training example on the CPU in ``processes`` processes (torchrun, which is what accelerate launch
    starts; accelerate's own CPU launcher needs MPI); returns its --log-json."""
    launcher = [sys.executable]
    if processes > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
                     str(free_port())]
    # ACCELERATE_USE_CPU: accelerate sets up multi-process CPU training (gloo) only when told to use the CPU.
    env = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    command = [*launcher, str(TRAIN_SCRIPT), *args, "--output-dir", str(out), "--log-json", str(out / "log.json")]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((out / "log.json").read_text())


def test_training_script_on_two_processes_matches_one(tmp_path):
    args = ["--tiny", "--max-train-steps", "2", "--mixed-precision", "no"]
    two = run_training([*args, "--train-batch-size", "1"], tmp_path / "two", processes=2)
    one = run_training([*args, "--train-batch-size", "2"], tmp_path / "one", processes=1)
    assert (two["config"]["num_processes"], one["config"]["num_processes"]) == (2, 1)
    assert two["config"]["global_batch_size"] == one["config"]["global_batch_size"] == 2
    assert two["patched"] and one["patched"]
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=0)
