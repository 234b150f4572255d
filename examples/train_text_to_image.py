#!/usr/bin/env python
"""Fine-tune a Stable Diffusion 1.x UNet with gn_patch's fused GroupNorm+SiLU kernels (``--no-patch``: stock).

Runs on accelerate, so the same command works on one device, under DDP or, with ``--fsdp2``, with the UNet
sharded by FSDP2 (accelerate's FSDP plugin, version 2; GPUs only)::

    python examples/train_text_to_image.py --tiny --max-train-steps 3 --mixed-precision no --output-dir /tmp/x
    accelerate launch --multi_gpu --num_processes 2 examples/train_text_to_image.py --mixed-precision bf16 ...
    accelerate launch --multi_gpu --num_processes 2 examples/train_text_to_image.py --fsdp2 ...

Without ``--model`` the UNet and VAE are SD1.5's architecture (published configs) with random weights and the
prompts are random embeddings, so it runs on a machine without any download; without ``--train-data-dir`` the
images are random too. ``--model PATH_OR_ID`` loads the real tokenizer, text encoder, VAE, UNet and scheduler.

Reproducibility, so that a ``--no-patch`` run and a patched run can be compared loss for loss: every random
draw comes from ``--seed``. Model initialisation is the same on every process; data, VAE sampling noise,
diffusion noise and timesteps are drawn for the *global* batch (per-device batch x processes) and each process
takes its slice, so the per-process offset only chooses which samples a process trains on, and one process
with batch 2B computes the same losses as two processes with batch B.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, set_seed
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm.auto import tqdm

# Run from a checkout without installing: the repository root holds the gn_patch package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gn_patch import configs, extension
from gn_patch.surgeon import PatchReport, patch_model

logger = get_logger(__name__)

PROMPT_TOKENS = 77  # CLIP's context length: the sequence length of random prompt embeddings
TIMING_WARMUP_STEPS = 3  # optimizer steps left out of samples/s (allocator growth, cuDNN/kernel selection)
LORA_TARGET_MODULES = ["to_q", "to_k", "to_v", "to_out.0"]
IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None (those options say in their help what they default to)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=_DefaultsHelpFormatter)
    data = parser.add_argument_group("model and data")
    data.add_argument("--model", help="diffusers Stable Diffusion 1.x folder or hub id (default: random SD1.5 "
                                      "architecture with random prompt embeddings)")
    data.add_argument("--tiny", action="store_true", help="tiny random UNet and VAE of SD1.5's structure (CI)")
    data.add_argument("--train-data-dir", type=Path, help="image folder; captions from its metadata.jsonl "
                                                          "({'file_name', 'text'} per line). Default: random images")
    data.add_argument("--prompt-embeds", type=Path, help="with --train-data-dir: .pt file of prompt embeddings, a "
                                                         "(N, L, D) tensor in dataset order or {file_name: (L, D)}")
    data.add_argument("--resolution", type=int, help="square image size (default: 512, 32 with --tiny)")
    data.add_argument("--precompute-latents", action="store_true",
                      help="encode every image with the VAE once before training (steps then time the UNet alone)")
    data.add_argument("--dataloader-num-workers", type=int, default=0, help="DataLoader worker processes")
    train = parser.add_argument_group("training")
    train.add_argument("--train-batch-size", type=int, default=1, help="per device")
    train.add_argument("--max-train-steps", type=int, default=100, help="optimizer steps")
    train.add_argument("--learning-rate", type=float, help="AdamW learning rate (default: 1e-5; 1e-4 with LoRA)")
    train.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm")
    train.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"], default="bf16",
                       help="accelerate's autocast dtype (no: float32)")
    train.add_argument("--gradient-accumulation-steps", type=int, default=1, help="micro-batches per optimizer step")
    train.add_argument("--gradient-checkpointing", action="store_true")
    train.add_argument("--lora-rank", type=int, help="train rank-N LoRA adapters on the attention projections "
                                                     "instead of the whole UNet")
    train.add_argument("--no-patch", action="store_true", help="stock diffusers modules, for comparison")
    train.add_argument("--fsdp2", action="store_true",
                       help="shard the UNet with FSDP2 through accelerate (one unit per down, mid and up block; "
                            "--mixed-precision sets its compute dtype); patched: patch_model(unet, "
                            "channels_last='activations'). Needs a distributed GPU launch (accelerate launch "
                            "--multi_gpu, or torchrun), also for one process")
    train.add_argument("--seed", type=int, default=0, help="weights, data and noise")
    out = parser.add_argument_group("output")
    out.add_argument("--output-dir", type=Path, default=Path("train_text_to_image_output"),
                     help="the trained UNet (or LoRA weights) and samples")
    out.add_argument("--log-json", type=Path, help="write config, per-step losses and samples/s here")
    args = parser.parse_args(argv)
    if args.tiny and args.model:
        parser.error("--tiny builds random models; it cannot be combined with --model")
    if args.fsdp2 and args.lora_rank:
        parser.error("--fsdp2 shards full fine-tuning; LoRA adapters (--lora-rank) train too few parameters to "
                     "need it, and their checkpoint is not gathered from shards here")
    if args.prompt_embeds and not args.train_data_dir:
        parser.error("--prompt-embeds belongs to the images of --train-data-dir")
    if not args.tiny and args.model is None and not torch.cuda.is_available():  # SD1.5's UNet at 512²: hours
        parser.error("no CUDA GPU here: the default model is SD1.5's full-size UNet, far too slow to train on a "
                     "CPU; --tiny runs the CPU smoke run, --model trains a model of your own")
    for name in ("train_batch_size", "max_train_steps", "gradient_accumulation_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.resolution is None:
        args.resolution = 32 if args.tiny else 512
    if args.learning_rate is None:
        args.learning_rate = 1e-4 if args.lora_rank else 1e-5
    return args


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------
# Streams of per-sample random draws (see seeded_generator).
DATA_STREAM, POSTERIOR_STREAM = 0, 1


def seeded_generator(seed: int, stream: int, index: int) -> torch.Generator:
    """A CPU generator for one sample's draws of one kind, so they never depend on who loads it or when."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, stream, index]).generate_state(1)[0]))


class SyntheticDataset(Dataset):
    """Random images in [-1, 1] with random prompt embeddings, generated per index from the seed."""

    def __init__(self, length: int, resolution: int, embed_shape: tuple[int, int], seed: int):
        self.length, self.resolution, self.embed_shape, self.seed = length, resolution, embed_shape, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        gen = seeded_generator(self.seed, DATA_STREAM, index)
        image = torch.rand(3, self.resolution, self.resolution, generator=gen) * 2 - 1
        return {"pixel_values": image, "prompt_embeds": torch.randn(self.embed_shape, generator=gen)}


def load_image(path: Path, resolution: int) -> torch.Tensor:
    """RGB image resized (shorter side) and center-cropped to resolution^2, as a (3, H, W) tensor in [-1, 1].

    No random flips or crops: a stock and a patched run must see the same pixels.
    """
    with Image.open(path) as image:
        image = image.convert("RGB")
        scale = resolution / min(image.size)
        width, height = max(resolution, round(image.width * scale)), max(resolution, round(image.height * scale))
        image = image.resize((width, height), Image.Resampling.BICUBIC)
        left, top = (width - resolution) // 2, (height - resolution) // 2
        image = image.crop((left, top, left + resolution, top + resolution))
        array = np.asarray(image, dtype=np.float32)
    return torch.from_numpy(array).permute(2, 0, 1) / 127.5 - 1


class ImageFolderDataset(Dataset):
    """Images of a folder with their captions, in diffusers' imagefolder layout.

    ``metadata.jsonl`` lists ``{"file_name": ..., "text": ...}`` per line; without it every image of the
    folder (sorted by name) is used with an empty caption. The prompt condition of each sample is, in order of
    preference: its embedding from ``prompt_embeds`` (precomputed), its caption tokenized by ``tokenizer`` (the
    text encoder runs in the training step), or a random embedding of ``embed_shape`` drawn from the seed.
    """

    def __init__(self, root: Path, resolution: int, embed_shape: tuple[int, int], seed: int,
                 tokenizer=None, prompt_embeds: Path | None = None):
        self.root, self.resolution, self.embed_shape, self.seed = root, resolution, embed_shape, seed
        metadata = root / "metadata.jsonl"
        if metadata.exists():
            rows = [json.loads(line) for line in metadata.read_text().splitlines() if line.strip()]
            self.files = [row["file_name"] for row in rows]
            self.captions = [row.get("text", "") for row in rows]
        else:
            self.files = sorted(p.name for p in root.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)
            self.captions = [""] * len(self.files)
        if not self.files:
            raise ValueError(f"no images in {root}")
        self.prompt_embeds = self._load_prompt_embeds(prompt_embeds) if prompt_embeds else None
        self.input_ids = None
        if self.prompt_embeds is None and tokenizer is not None:
            self.input_ids = tokenizer(self.captions, padding="max_length", max_length=tokenizer.model_max_length,
                                       truncation=True, return_tensors="pt").input_ids
        elif self.prompt_embeds is None:
            logger.warning("no text encoder (--model) and no --prompt-embeds: training on random prompt "
                           "embeddings instead of the captions", main_process_only=True)

    def _load_prompt_embeds(self, path: Path) -> list[torch.Tensor]:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        embeds = [loaded[name] for name in self.files] if isinstance(loaded, dict) else list(loaded)
        if len(embeds) != len(self.files):
            raise ValueError(f"{path} holds {len(embeds)} prompt embeddings for {len(self.files)} images")
        return embeds

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict:
        item = {"pixel_values": load_image(self.root / self.files[index], self.resolution)}
        if self.prompt_embeds is not None:
            item["prompt_embeds"] = self.prompt_embeds[index].float()
        elif self.input_ids is not None:
            item["input_ids"] = self.input_ids[index]
        else:
            gen = seeded_generator(self.seed, DATA_STREAM, index)
            item["prompt_embeds"] = torch.randn(self.embed_shape, generator=gen)
        return item


class TensorDictDataset(Dataset):
    """Samples from stacked tensors (precomputed latents and prompt conditions), one row per sample."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def __getitem__(self, index: int) -> dict:
        return {key: value[index] for key, value in self.tensors.items()}


class ShardedBatchSampler(Sampler[list[int]]):
    """Endless batches of dataset indices: this process's slice of each global batch.

    Epoch ``e`` is a permutation of the dataset drawn from ``seed + e``, cut into global batches of
    ``batch_size * world_size`` (an incomplete last one is dropped); process ``rank`` takes slice ``rank`` of
    each. The global batches do not depend on the number of processes.
    """

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int, seed: int):
        if num_samples < batch_size * world_size:
            raise ValueError(f"{num_samples} samples do not fill one global batch of {batch_size}x{world_size}")
        self.num_samples, self.batch_size, self.rank, self.world_size, self.seed = (
            num_samples, batch_size, rank, world_size, seed)

    def __iter__(self):
        global_batch = self.batch_size * self.world_size
        for epoch in itertools.count():
            order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))
            for start in range(0, self.num_samples - global_batch + 1, global_batch):
                mine = start + self.rank * self.batch_size
                yield order[mine:mine + self.batch_size].tolist()


# ------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------
def load_models(args, device: torch.device):
    """(unet, vae, text_encoder, tokenizer, noise_scheduler); the text encoder and tokenizer only with --model.

    Random models are built directly on ``device`` (initialising SD1.5's 860M parameters on a CPU takes
    longer than the whole benchmark) from the seed, identically on every process.
    """
    if args.model:
        from transformers import CLIPTextModel, CLIPTokenizer  # only needed for real checkpoints

        return (UNet2DConditionModel.from_pretrained(args.model, subfolder="unet"),
                AutoencoderKL.from_pretrained(args.model, subfolder="vae"),
                CLIPTextModel.from_pretrained(args.model, subfolder="text_encoder"),
                CLIPTokenizer.from_pretrained(args.model, subfolder="tokenizer"),
                DDPMScheduler.from_pretrained(args.model, subfolder="scheduler"))
    torch.manual_seed(args.seed)
    with torch.device(device):  # SD1.5's published architecture, or the same structure shrunk (--tiny)
        unet = UNet2DConditionModel(**(configs.TINY_SD15_UNET if args.tiny else configs.SD15_UNET))
        vae = AutoencoderKL(**(configs.TINY_VAE if args.tiny else configs.SD_VAE))
    # SD1.5's scheduler_config.json read as a DDPMScheduler, as diffusers' training scripts do.
    return unet, vae, None, None, DDPMScheduler.from_config(configs.SCHEDULER)


def add_lora(unet: UNet2DConditionModel, rank: int, seed: int) -> None:
    """Freeze the UNet and give its attention projections trainable LoRA adapters (float32), seeded."""
    from peft import LoraConfig  # only needed with --lora-rank

    unet.requires_grad_(False)
    torch.manual_seed(seed)
    unet.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian",
                                target_modules=LORA_TARGET_MODULES))
    for param in unet.parameters():
        if param.requires_grad:  # the adapters train in float32 even when the frozen UNet is half precision
            param.data = param.data.float()


def fsdp2_plugin() -> FullyShardedDataParallelPlugin:
    """accelerate's FSDP2 configuration for the UNet; name its units with :func:`fsdp2_units` before prepare().

    Parameters are resharded after each unit's forward (full sharding) and kept in float32 as master weights;
    the Accelerator sets the compute and gradient-reduction dtype from its ``mixed_precision``
    (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16, output_dtype=bf16)`` for bf16). A full state
    dict, gathered on process 0, is what the checkpoint is written from.
    """
    return FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True,
                                          auto_wrap_policy="transformer_based_wrap",
                                          state_dict_type="FULL_STATE_DICT")


def fsdp2_units(unet: UNet2DConditionModel) -> list[str]:
    """The class names of the UNet's down, mid and up blocks: each such block becomes one FSDP2 unit.

    accelerate's transformer-based policy wraps by class name. The blocks hold the resnets and attention that
    gn_patch patches but are not patched themselves, so a stock and a patched UNet shard into the same units
    (accelerate adds one for the final norm, conv_norm_out; the root holds conv_in, the time embedding and
    conv_out).
    """
    blocks = [*unet.down_blocks, unet.mid_block, *unet.up_blocks]
    return sorted({type(block).__name__ for block in blocks if block is not None})


def encode_latents(vae: AutoencoderKL, pixels: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """Scaled latents sampled from the VAE posterior with the given standard-normal draw, in float32."""
    posterior = vae.encode(pixels).latent_dist
    return (posterior.mean.float() + posterior.std.float() * eps) * vae.config.scaling_factor


def precompute_latents(dataset: Dataset, vae, batch_size: int, seed: int, device, dtype: torch.dtype,
                       memory_format) -> TensorDictDataset:
    """Encode every sample once (latents kept on the CPU) and keep its prompt condition beside it.

    Each sample's posterior draw comes from its own generator: the same latents for any batch size.
    """
    columns: dict[str, list[torch.Tensor]] = {}
    first = 0
    for batch in DataLoader(dataset, batch_size=batch_size):
        pixels = batch.pop("pixel_values").to(device, dtype).contiguous(memory_format=memory_format)
        shape = latent_shape(vae, pixels)[1:]
        eps = torch.stack([torch.randn(shape, generator=seeded_generator(seed, POSTERIOR_STREAM, index))
                           for index in range(first, first + len(pixels))])
        first += len(pixels)
        columns.setdefault("latents", []).append(encode_latents(vae, pixels, eps.to(device)).cpu())
        for key, value in batch.items():
            columns.setdefault(key, []).append(value)
    return TensorDictDataset({key: torch.cat(value) for key, value in columns.items()})


def latent_shape(vae: AutoencoderKL, pixels: torch.Tensor) -> tuple[int, ...]:
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    return (pixels.shape[0], vae.config.latent_channels, pixels.shape[2] // factor, pixels.shape[3] // factor)


# ------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so wall-clock time covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stock_unet_from(config, state_dict: dict[str, torch.Tensor]) -> UNet2DConditionModel:
    """A stock UNet2DConditionModel of ``config`` holding ``state_dict`` (the full weights FSDP2 gathered).

    The tensors are assigned, not copied: the model is built on the meta device and takes them as they are.
    A patched model's state dict has the stock keys (the surgeon keeps every parameter's name).
    """
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(config)
    unet.load_state_dict(state_dict, assign=True)
    return unet


def save_checkpoint(unet, output_dir: Path, lora: bool) -> Path:
    """The full UNet as a diffusers folder (stock UNet2DConditionModel.from_pretrained loads it), or the
    LoRA weights as pytorch_lora_weights.safetensors (StableDiffusionPipeline.load_lora_weights loads them)."""
    if lora:
        from diffusers import StableDiffusionPipeline
        from diffusers.utils import convert_state_dict_to_diffusers
        from peft.utils import get_peft_model_state_dict

        layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
        StableDiffusionPipeline.save_lora_weights(output_dir, unet_lora_layers=layers, safe_serialization=True)
        return output_dir / "pytorch_lora_weights.safetensors"
    unet.save_pretrained(output_dir / "unet")
    return output_dir / "unet"


def train(args: argparse.Namespace) -> dict:
    """Run the fine-tuning; returns the log (config, per-step losses, samples/s, patched) on every process."""
    accelerator = Accelerator(mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.gradient_accumulation_steps,
                              fsdp_plugin=fsdp2_plugin() if args.fsdp2 else None)
    if args.fsdp2 and accelerator.distributed_type != DistributedType.FSDP:
        # accelerate applies a plugin only in a distributed GPU (or other accelerator) run, and ignores it otherwise.
        raise SystemExit(f"--fsdp2: accelerate runs this as {accelerator.distributed_type}, not FSDP; launch it "
                         f"with `accelerate launch --multi_gpu --num_processes N` (N >= 2) or `torchrun "
                         f"--nproc_per_node N` (N >= 1) on GPUs")
    set_seed(args.seed)  # python, numpy and torch; the same on every process
    device, world, rank = accelerator.device, accelerator.num_processes, accelerator.process_index
    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)
    patched = not args.no_patch
    # NHWC activations are what the fused kernels read; stock runs keep diffusers' usual NCHW.
    memory_format = torch.channels_last if patched else torch.contiguous_format

    unet, vae, text_encoder, tokenizer, noise_scheduler = load_models(args, device)
    vae.requires_grad_(False).eval().to(device, weight_dtype)
    if text_encoder is not None:
        text_encoder.requires_grad_(False).eval().to(device, weight_dtype)
    patch_info = None
    if patched:
        # Before accelerator.prepare shards the UNet. FSDP2 refuses the channels_last conv weights of the default
        # mode: with --fsdp2 the UNet keeps its parameters' layout and its inputs are made channels_last instead.
        unet_layout = "activations" if args.fsdp2 else True
        report = (PatchReport().merge(patch_model(unet, channels_last=unet_layout), "unet")
                  .merge(patch_model(vae), "vae"))
        accelerator.print(report)
        # Build or load the CUDA kernels now, not inside the first step. Without them every GroupNormAct
        # computes with PyTorch's GroupNorm: the log says so (False), as a benchmark would otherwise mislead.
        # None: not a CUDA run, where PyTorch's GroupNorm is the design.
        kernels = extension.kernels_available() if device.type == "cuda" else None
        patch_info = dict(fused=report.counts, skipped=report.skipped,
                          channels_last_conv_weights=report.channels_last, cuda_kernels=kernels)
    # Full fine-tuning keeps float32 master weights (autocast computes in weight_dtype); LoRA freezes the
    # base weights in the compute dtype, as diffusers' LoRA script does.
    unet_dtype = weight_dtype if args.lora_rank else torch.float32
    if args.lora_rank:
        unet.to(unet_dtype)
        add_lora(unet, args.lora_rank, args.seed)
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    unet.to(device).train()

    # Data: random (one epoch spans the whole run) or an image folder; conditions are embeddings or tokens.
    embed_shape = (PROMPT_TOKENS, unet.config.cross_attention_dim)
    micro_steps = args.max_train_steps * args.gradient_accumulation_steps
    global_batch = args.train_batch_size * world
    if args.train_data_dir:
        dataset = ImageFolderDataset(args.train_data_dir, args.resolution, embed_shape, args.seed, tokenizer,
                                     args.prompt_embeds)
    else:
        dataset = SyntheticDataset(micro_steps * global_batch, args.resolution, embed_shape, args.seed)
    if args.precompute_latents:
        with torch.no_grad():
            dataset = precompute_latents(dataset, vae, args.train_batch_size, args.seed, device, weight_dtype,
                                         memory_format)
    sampler = ShardedBatchSampler(len(dataset), args.train_batch_size, rank, world, args.seed)
    batches = iter(DataLoader(dataset, batch_sampler=sampler, num_workers=args.dataloader_num_workers))

    optimizer = torch.optim.AdamW([p for p in unet.parameters() if p.requires_grad], lr=args.learning_rate,
                                  weight_decay=1e-2)
    if args.fsdp2:
        # accelerate's transformer-based wrap policy reads the class names in prepare().
        accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap = fsdp2_units(unet)
    unet, optimizer = accelerator.prepare(unet, optimizer)
    # After prepare: FSDP2 replaces each parameter by a sharded one (DTensor), and accelerator.clip_grad_norm_
    # needs the model's own (given the replaced ones, it fails mixing tensors and DTensors).
    params = [p for p in unet.parameters() if p.requires_grad]

    # Diffusion noise, timesteps and VAE sampling noise for the global batch; this process uses its slice.
    noise_gen = torch.Generator().manual_seed(args.seed)
    mine = slice(rank * args.train_batch_size, (rank + 1) * args.train_batch_size)
    num_timesteps = noise_scheduler.config.num_train_timesteps

    def training_loss(batch: dict) -> torch.Tensor:
        with torch.no_grad():
            if "latents" in batch:
                latents = batch["latents"].to(device)
            else:
                pixels = batch["pixel_values"].to(device, weight_dtype).contiguous(memory_format=memory_format)
                shape = (global_batch, *latent_shape(vae, pixels)[1:])
                latents = encode_latents(vae, pixels, torch.randn(shape, generator=noise_gen)[mine].to(device))
            if "input_ids" in batch:
                prompt_embeds = text_encoder(batch["input_ids"].to(device))[0]
            else:
                prompt_embeds = batch["prompt_embeds"].to(device)
        noise = torch.randn((global_batch, *latents.shape[1:]), generator=noise_gen)[mine].to(device)
        timesteps = torch.randint(0, num_timesteps, (global_batch,), generator=noise_gen)[mine].to(device)
        if noise_scheduler.config.prediction_type == "v_prediction":
            target = noise_scheduler.get_velocity(latents, noise, timesteps)
        else:
            target = noise
        # The UNet's inputs in its parameter dtype: autocast would cast them anyway, and where the device has
        # no autocast for the chosen precision (fp16 on a CPU) the UNet still runs.
        noisy = noise_scheduler.add_noise(latents, noise, timesteps).to(unet_dtype, memory_format=memory_format)
        prediction = unet(noisy, timesteps, prompt_embeds.to(unet_dtype)).sample
        return F.mse_loss(prediction.float(), target.float())

    log = {"config": run_config(args, accelerator, global_batch, patch_info), "losses": [], "samples_per_s": None,
           "patched": patched}
    warmup = min(TIMING_WARMUP_STEPS, args.max_train_steps - 1)  # at least one timed step
    samples_per_step = global_batch * args.gradient_accumulation_steps
    progress = tqdm(range(args.max_train_steps), desc="steps", disable=not accelerator.is_local_main_process)
    step_loss = torch.zeros((), device=device)
    start = time.perf_counter()
    for step in progress:
        for _ in range(args.gradient_accumulation_steps):
            with accelerator.accumulate(unet):
                loss = training_loss(next(batches))
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(params, args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            step_loss += loss.detach() / args.gradient_accumulation_steps
        # The logged loss of a step is its mean over all processes and accumulated micro-batches.
        log["losses"].append(accelerator.reduce(step_loss, reduction="mean").item())
        step_loss.zero_()
        if step + 1 == warmup:
            synchronize(device)
            start = time.perf_counter()
        if step + 1 > warmup:
            log["samples_per_s"] = (step + 1 - warmup) * samples_per_step / (time.perf_counter() - start)
        progress.set_postfix(loss=f"{log['losses'][-1]:.4f}",
                             samples_per_s="warm-up" if log["samples_per_s"] is None else f"{log['samples_per_s']:.2f}")
    synchronize(device)
    log["samples_per_s"] = (args.max_train_steps - warmup) * samples_per_step / (time.perf_counter() - start)

    accelerator.wait_for_everyone()
    to_save = accelerator.unwrap_model(unet)
    if args.fsdp2:
        # Every process takes part in gathering the shards; process 0 gets the full float32 weights on the CPU.
        state_dict = accelerator.get_state_dict(unet)
        to_save = stock_unet_from(to_save.config, state_dict) if accelerator.is_main_process else None
    if accelerator.is_main_process:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        saved = save_checkpoint(to_save, args.output_dir, bool(args.lora_rank))
        if args.log_json:
            args.log_json.parent.mkdir(parents=True, exist_ok=True)
            args.log_json.write_text(json.dumps(log, indent=2) + "\n")
        accelerator.print(f"{'patched' if patched else 'stock'}: {args.max_train_steps} steps, final loss "
                          f"{log['losses'][-1]:.5f}, {log['samples_per_s']:.2f} samples/s; saved {saved}")
    accelerator.end_training()
    return log


def run_config(args, accelerator: Accelerator, global_batch: int, patch_info: dict | None) -> dict:
    """What the run was: its arguments plus the facts a benchmark reader needs."""
    import diffusers

    device = accelerator.device
    return dict(
        {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        num_processes=accelerator.num_processes,
        global_batch_size=global_batch,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        torch=torch.__version__,
        diffusers=diffusers.__version__,
        gn_patch=patch_info,
    )


def main(argv: list[str] | None = None) -> dict:
    return train(parse_args(argv))


if __name__ == "__main__":
    main()
