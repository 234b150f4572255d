"""Data-parallel training of a patched UNet on two CPU processes (gloo), and FSDP2 (fully_shard) on one.

DistributedDataParallel must all-reduce the gradients of the fused GroupNormAct parameters like any others:
after one backward pass both ranks hold the same gradients, equal to a single process's on the full batch.
The training example must give the same losses on two processes with batch B as on one with batch 2B.
FSDP2 needs contiguous parameters: patch_model(channels_last="activations") shards and trains like stock, patching
after fully_shard leaves the DTensor weights alone, and unpatch_model under fully_shard's wrapper classes restores
the model fully_shard would have made of the stock one.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers import UNet2DConditionModel
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from gn_patch import configs
from gn_patch.surgeon import patch_model, unpatch_model

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
from .scripts import load_script
from .tiny_models import assert_same_outputs, module_types, sd15_unet_inputs, tiny_sd15_unet

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
    # PYTHONFAULTHANDLER: every process of the run prints its threads' Python stacks on SIGABRT, which a run that
    # outlasts its time gets: the run has hung twice after its training had finished (README), and the stacks say
    # where.
    env = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    command = [*launcher, str(TRAIN_SCRIPT), *args, "--output-dir", str(out), "--log-json", str(out / "log.json")]
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as run:
        try:
            _, stderr = run.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            stderr = stop_with_stacks(run)
            pytest.fail(f"the training run did not end within 300 s; its processes' stacks:\n{stderr[-12000:]}")
    assert run.returncode == 0, stderr[-4000:]
    return json.loads((out / "log.json").read_text())


def stop_with_stacks(run: subprocess.Popen) -> str:
    """Abort every process of ``run`` (each prints its Python stacks, PYTHONFAULTHANDLER), then kill what is left;
    returns the run's stderr."""
    # torchrun starts each worker in a session of its own, so a signal to torchrun's process group misses them:
    # walk the tree (psutil, which accelerate depends on).
    root = psutil.Process(run.pid)
    tree = [root, *root.children(recursive=True)]
    for sig in (signal.SIGABRT, signal.SIGKILL):
        for process in tree:
            try:
                process.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        try:
            return run.communicate(timeout=30)[1]
        except subprocess.TimeoutExpired:
            continue  # a process that survived its abort
    return run.communicate()[1]


def test_training_script_on_two_processes_matches_one(tmp_path):
    args = ["--tiny", "--max-train-steps", "2", "--mixed-precision", "no"]
    two = run_training([*args, "--train-batch-size", "1"], tmp_path / "two", processes=2)
    one = run_training([*args, "--train-batch-size", "2"], tmp_path / "one", processes=1)
    assert (two["config"]["num_processes"], one["config"]["num_processes"]) == (2, 1)
    assert two["config"]["global_batch_size"] == one["config"]["global_batch_size"] == 2
    assert two["patched"] and one["patched"]
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=0)


# ------------------------------------------------------------------------------------------------
# FSDP2 (fully_shard) in one process
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def gloo_group(tmp_path):
    """A single-process gloo group (a FileStore: no port to pick), destroyed after the test."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def shard_blocks(unet: UNet2DConditionModel) -> UNet2DConditionModel:
    """fully_shard on each down and up block, then on the root (the usual FSDP2 wrapping of a UNet)."""
    for block in (*unet.down_blocks, *unet.up_blocks):
        fully_shard(block)
    return fully_shard(unet)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """collect_grads with DTensor gradients gathered."""
    return {name: grad.full_tensor() if isinstance(grad, DTensor) else grad
            for name, grad in collect_grads(model).items()}


def sgd_losses(model: torch.nn.Module, inputs: dict, probe: torch.Tensor, steps: int = 3) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = probe_loss(model(**inputs).sample, probe)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_fsdp2_trains_a_unet_patched_with_channels_last_activations(gloo_group):
    """The mode FSDP2 needs: parameters stay contiguous, fully_shard accepts them, and training steps give the
    stock unsharded model's losses and gradients."""
    config = configs.TINY_SD15_UNET
    stock = build_unet(config)
    inputs, probe = unet_inputs(config, 2, tokens=8), output_probe(config, 2)
    sharded = copy.deepcopy(stock)
    report = patch_model(sharded, channels_last="activations")
    assert report.patched and report.channels_last == 0 and report.channels_last_inputs == ["", "conv_in"]
    shard_blocks(sharded)
    assert isinstance(sharded.conv_in.weight.data, DTensor)

    expected = sgd_losses(stock, inputs, probe)
    torch.testing.assert_close(sgd_losses(sharded, inputs, probe), expected, rtol=1e-5, atol=0)
    assert_grads_close(full_grads(sharded), collect_grads(stock), rtol=1e-4)


def test_patch_after_fully_shard_leaves_the_dtensors_alone(gloo_group):
    stock = tiny_sd15_unet()
    inputs = sd15_unet_inputs()
    sharded = shard_blocks(copy.deepcopy(stock))
    report = patch_model(sharded)
    conv_weights = [name for name, module in sharded.named_modules() if isinstance(module, torch.nn.Conv2d)]
    assert report.channels_last == 0 and len(report.layout_kept) == len(conv_weights)
    assert all("DTensor" in reason and "channels_last='activations'" in reason for _, reason in report.layout_kept)
    assert "conv weights whose layout is kept" in str(report)
    # The resnets inside the sharded blocks fuse; the root's own pair is behind its FSDP<Class>.
    assert report.counts["ResnetBlock2D.norm1+act"] == 8
    assert report.alone == [("conv_norm_out", "FSDPUNet2DConditionModel is a wrapper class (FSDP2's fully_shard, "
                                              "parametrize) the rules do not match: patch_model before wrapping to "
                                              "fuse it")]
    with torch.no_grad():
        expected = stock(**inputs).sample
        assert_same_outputs(sharded(**inputs).sample, expected)
        unpatch_model(sharded)
        assert_same_outputs(sharded(**inputs).sample, expected)


def test_unpatch_under_fully_shard_wrappers_restores_stock(gloo_group):
    """fully_shard gives each block it wraps a subclass FSDP<Class> of its class, here of the fused block:
    unpatch_model must leave FSDP<ResnetBlock2D>, exactly what fully_shard makes of the stock block."""
    stock = tiny_sd15_unet()
    inputs = sd15_unet_inputs()
    with torch.no_grad():
        expected = stock(**inputs).sample

    def shard(unet):
        for resnet in unet.down_blocks[0].resnets:
            fully_shard(resnet)
        return fully_shard(unet)

    patched = copy.deepcopy(stock)
    patch_model(patched, channels_last=False)
    shard(patched)
    assert unpatch_model(patched) == 21
    assert module_types(patched) == module_types(shard(copy.deepcopy(stock)))
    assert isinstance(patched.down_blocks[0].resnets[0], FSDPModule)
    with torch.no_grad():
        assert_same_outputs(patched(**inputs).sample, expected, tol=1e-6)
    assert unpatch_model(patched) == 0



def test_unpatch_under_fully_shard_of_a_parametrized_norm_restores_stock(gloo_group):
    """Wrappers nest: fully_shard on a parametrized fused norm gives FSDP<Parametrized<GroupNormAct>>; unpatch
    leaves FSDP<Parametrized<GroupNorm>> with its parametrization, as wrapping the stock norm does."""
    from torch.nn.utils import parametrize

    class Double(torch.nn.Module):
        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            return 2 * weight

    def wrap(unet):
        block = unet.down_blocks[0].resnets[0]
        parametrize.register_parametrization(block.norm1, "weight", Double())
        fully_shard(block.norm1)
        fully_shard(block)
        return fully_shard(unet)

    inputs = sd15_unet_inputs()
    stock = wrap(tiny_sd15_unet())
    patched = tiny_sd15_unet()
    patch_model(patched, channels_last="activations")
    wrap(patched)
    assert unpatch_model(patched) == 21

    def class_names(model):  # a parametrized module's class is made for it alone: compare the classes by name
        return {name: [cls.__name__ for cls in type(module).__mro__] for name, module in model.named_modules()}

    assert class_names(patched) == class_names(stock)
    assert class_names(patched)["down_blocks.0.resnets.0.norm1"][:4] == ["FSDPParametrizedGroupNorm", "FSDPModule",
                                                                         "ParametrizedGroupNorm", "GroupNorm"]
    with torch.no_grad():
        assert_same_outputs(patched(**inputs).sample, stock(**inputs).sample, tol=1e-6)


# The training example's --fsdp2 (accelerate's FSDP plugin, version 2)
# ------------------------------------------------------------------------------------------------
# accelerate applies an FSDP plugin only in a distributed run on GPUs (or other accelerators): on the CPU it
# runs the script as MULTI_CPU or NO and never shards, so the script refuses --fsdp2 there. The pieces it hands
# accelerate are tested with accelerate's own FSDP2 preparation (fsdp2_prepare_model, what Accelerator.prepare
# calls) on a single-process gloo group, and the whole script with accelerate's state made FSDP by the test as it
# is on GPUs; tests/test_train_example.py runs the script under FSDP2 on a GPU unchanged.
def load_train_script():
    return load_script(TRAIN_SCRIPT)


def test_train_script_fsdp2_arguments():
    script = load_train_script()
    assert script.parse_args(["--tiny", "--fsdp2"]).fsdp2 and not script.parse_args(["--tiny"]).fsdp2
    with pytest.raises(SystemExit):  # argparse's error: LoRA with FSDP2 is refused
        script.parse_args(["--tiny", "--fsdp2", "--lora-rank", "4"])
    plugin = script.fsdp2_plugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.state_dict_type.name == "FULL_STATE_DICT"
    # An unsharded CPU run would time and save something else than asked: the script refuses it.
    result = subprocess.run([sys.executable, str(TRAIN_SCRIPT), "--tiny", "--fsdp2", "--max-train-steps", "2",
                             "--mixed-precision", "no", "--output-dir", "unused"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0 and "not FSDP" in result.stderr and "--multi_gpu" in result.stderr


def test_train_script_fsdp2_plugin_shards_a_patched_unet_into_blocks(gloo_group):
    """The script's plugin through accelerate's fsdp2_prepare_model: a UNet patched with
    channels_last="activations" shards into one unit per block (the same units as stock), trains like the
    unsharded stock UNet, and its gathered full state dict makes the stock checkpoint the script saves."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    script = load_train_script()
    config = configs.TINY_SD15_UNET
    stock = build_unet(config)
    inputs, probe = unet_inputs(config, 2, tokens=8), output_probe(config, 2)

    def prepare(unet):
        plugin = script.fsdp2_plugin()
        plugin.transformer_cls_names_to_wrap = script.fsdp2_units(unet)
        # What fsdp2_prepare_model reads of the Accelerator (mixed_precision "no": float32 throughout).
        accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision="no",
                                      is_main_process=True, device=torch.device("cpu"))
        return fsdp2_prepare_model(accelerator, unet)

    sharded = copy.deepcopy(stock)
    patch_model(sharded, channels_last="activations")
    sharded = prepare(sharded)
    units = [name for name, module in sharded.named_modules() if isinstance(module, FSDPModule)]
    blocks = [f"down_blocks.{i}" for i in range(len(stock.down_blocks))] + ["mid_block"] + [
        f"up_blocks.{i}" for i in range(len(stock.up_blocks))]
    assert sorted(units) == sorted(["", *blocks, "conv_norm_out"])
    stock_units = [name for name, module in prepare(copy.deepcopy(stock)).named_modules()
                   if isinstance(module, FSDPModule)]
    assert stock_units == units
    assert all(isinstance(param.data, DTensor) for param in sharded.parameters())

    expected = sgd_losses(stock, inputs, probe)
    torch.testing.assert_close(sgd_losses(sharded, inputs, probe), expected, rtol=1e-5, atol=0)

    # accelerator.get_state_dict under FSDP2 calls get_model_state_dict with these options.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True)
    saved = script.stock_unet_from(sharded.config, get_model_state_dict(sharded, options=options))
    assert type(saved) is UNet2DConditionModel and module_types(saved) == module_types(build_unet(config))
    assert saved.state_dict().keys() == stock.state_dict().keys()
    for name, param in saved.named_parameters():
        torch.testing.assert_close(param, stock.get_parameter(name), rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():
        assert_same_outputs(saved.eval()(**inputs).sample, stock.eval()(**inputs).sample, tol=1e-5)


# accelerate's AcceleratorState on one CPU process made FSDP, as it is made on GPUs (it sets the distributed type,
# gives the plugin the mixed precision and keeps it), then the training script run as __main__.
FSDP_ON_CPU = """
import runpy, sys
import accelerate.state as state
from accelerate.utils import DistributedType

init = state.AcceleratorState.__init__

def fsdp_init(self, *args, fsdp_plugin=None, **kwargs):
    init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = fsdp_plugin

state.AcceleratorState.__init__ = fsdp_init
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_train_script_runs_under_fsdp2(tmp_path):
    """The script's whole --fsdp2 run on one CPU process: accelerate's FSDP2 prepare with the script's plugin,
    training steps, gradient clipping, the checkpoint gathered from the shards. The script refuses --fsdp2 unless
    accelerate runs FSDP, so finishing means the UNet was sharded; it gives the unsharded run's losses and a stock
    checkpoint of the same weights."""
    common = ["--tiny", "--train-batch-size", "2", "--max-train-steps", "3", "--mixed-precision", "no",
              "--learning-rate", "1e-3", "--max-grad-norm", "1e-3"]
    env = dict(os.environ, ACCELERATE_USE_CPU="1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="2")
    sharded, plain = tmp_path / "fsdp2", tmp_path / "plain"
    for command, run_env in (([sys.executable, "-c", FSDP_ON_CPU, str(TRAIN_SCRIPT), "--fsdp2"], env),
                             ([sys.executable, str(TRAIN_SCRIPT)], None)):
        out = sharded if run_env else plain
        result = subprocess.run([*command, *common, "--output-dir", str(out), "--log-json", str(out / "log.json")],
                                env=run_env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-4000:]
    log, expected = (json.loads((run / "log.json").read_text()) for run in (sharded, plain))
    assert log["config"]["fsdp2"] is True and log["patched"]
    torch.testing.assert_close(log["losses"], expected["losses"], rtol=1e-5, atol=0)

    checkpoint = UNet2DConditionModel.from_pretrained(sharded / "unet")
    assert module_types(checkpoint) == module_types(UNet2DConditionModel(**configs.TINY_SD15_UNET))
    reference = UNet2DConditionModel.from_pretrained(plain / "unet").state_dict()
    assert checkpoint.state_dict().keys() == reference.keys()
    for name, value in checkpoint.state_dict().items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=1e-5, msg=name)
