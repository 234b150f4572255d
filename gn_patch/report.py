"""``PatchReport``: what :func:`gn_patch.patch_model` and :func:`gn_patch.patch_pipeline` did, module by module."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cuda_graphs import CUDAGraphs

__all__ = ["PatchReport", "join_name"]


def join_name(prefix: str, name: str) -> str:
    """Qualified module name ``prefix.name``; either part may be empty (the root module)."""
    return f"{prefix}.{name}" if prefix and name else prefix or name


@dataclass
class PatchReport:
    """What :func:`patch_model` (or ``patch_pipeline``) did.

    Module names are qualified from the patched model (``down_blocks.0.resnets.1.norm2``); reports merged with a
    prefix (one per pipeline component) start with the component's name (``unet.down_blocks...``).

    Attributes:
        patched: (module name, kind) of every GroupNorm this call fused with what follows, e.g.
            ``("mid_block.resnets.0.norm1", "ResnetBlock2D.norm1+act")``, or made a GroupNormAct where it knows
            that the GroupNorm's output feeds ops that take any layout (``"attention.group_norm"``).
        alone: (module name, reason) of every GroupNorm this call made a GroupNormAct on its own, with the layout
            PyTorch returns, because it cannot fuse it exactly; the reason says why not (e.g. ``"the surgeon does
            not know what follows this GroupNorm in MyBlock"``). These run gn_patch's kernels too.
        already_patched: (module name, kind) of the GroupNorms an earlier call had fused or made GroupNormActs; one
            that an earlier call ran alone and that still cannot be fused has kind ``"GroupNorm alone: <reason>"``.
        skipped: (module name, reason) of every GroupNorm-like module left as it is (from patch_pipeline, also of
            each transformers component holding a GroupNorm, which it leaves alone).
        channels_last: number of conv weights this call converted to channels_last (4-D) or channels_last_3d (5-D).
        layout_kept: (weight name, reason) of every conv weight this call would have converted but left as it is:
            DTensors (sharded by FSDP2's fully_shard) and other tensor subclasses, offloaded weights, lazy convs not
            yet called, and conv subclasses defined outside torch and diffusers with a forward of their own.
        channels_last_inputs: names of the modules whose tensor arguments this call's ``channels_last="activations"``
            makes channels-last, in a forward pre-hook (the root is ``""``).
        cuda_graphs: from patch_pipeline, the pipeline's live :class:`~gn_patch.cuda_graphs.CUDAGraphs` (captured
            signatures, replays, eager fallbacks, graph memory, updated as graphs are captured); None without.
    """

    patched: list[tuple[str, str]] = field(default_factory=list)
    alone: list[tuple[str, str]] = field(default_factory=list)
    already_patched: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    channels_last: int = 0
    layout_kept: list[tuple[str, str]] = field(default_factory=list)
    channels_last_inputs: list[str] = field(default_factory=list)
    cuda_graphs: CUDAGraphs | None = None

    @property
    def counts(self) -> dict[str, int]:
        """Number of GroupNorms patched by this call, per kind."""
        return dict(Counter(kind for _, kind in self.patched))

    def merge(self, other: PatchReport, prefix: str = "") -> PatchReport:
        """A new report holding this one's entries and ``other``'s, the latter's names prefixed by ``prefix.``."""
        def named(entries):
            return [(join_name(prefix, name), what) for name, what in entries]

        return PatchReport(
            patched=self.patched + named(other.patched),
            alone=self.alone + named(other.alone),
            already_patched=self.already_patched + named(other.already_patched),
            skipped=self.skipped + named(other.skipped),
            channels_last=self.channels_last + other.channels_last,
            layout_kept=self.layout_kept + named(other.layout_kept),
            channels_last_inputs=self.channels_last_inputs + [join_name(prefix, n) for n in other.channels_last_inputs],
        )

    def __str__(self) -> str:
        lines = [f"gn_patch: patched {len(self.patched)} GroupNorm(s), {len(self.alone)} run alone, "
                 f"{len(self.already_patched)} already patched, {len(self.skipped)} left as they are; "
                 f"{self.channels_last} conv weight(s) made channels-last"
                 + (f", inputs made channels-last at {', '.join(n or '<root>' for n in self.channels_last_inputs)}"
                    if self.channels_last_inputs else "")]
        for title, entries in (("patched", self.patched), ("run alone, not fused", self.alone),
                               ("already patched", self.already_patched)):
            if entries:
                lines.append(f"  {title}:")
                counts = Counter(kind for _, kind in entries)
                lines += [f"    {count:5d}  {kind}" for kind, count in sorted(counts.items())]
        if self.layout_kept:
            lines.append("  conv weights whose layout is kept:")
            reasons = Counter(reason for _, reason in self.layout_kept)
            lines += [f"    {count:5d}  {reason}" for reason, count in sorted(reasons.items())]
        if self.skipped:
            lines.append("  left as they are:")
            lines += [f"    {name or '<root>'}: {reason}" for name, reason in self.skipped]
        if self.cuda_graphs is not None:
            lines.append(str(self.cuda_graphs))
        return "\n".join(lines)
