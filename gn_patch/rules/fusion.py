"""Fused forwards generated from the verified diffusers code, and the rule that installs them.

A block such as CogVideoXResnetBlock3D computes ``h = self.norm1(h); h = self.nonlinearity(h)``. To fuse, the
norm becomes a GroupNormAct that applies the activation, and the block gets a subclass whose forward is the
block's own source with two edits, made on its syntax tree:

* the activation statement that follows a fused norm is dropped (``h = self.nonlinearity(h)``, or the call
  ``F.silu(self.norm1(h))`` becomes ``self.norm1(h)``); it may follow the norm through statements that only move
  the norm's output (``h = h.unflatten(...).permute(...)``: an elementwise activation commutes with them) or an
  ``if``/``else`` whose every branch ends with the norm;
* a per-sample modulation of a norm's output, ``h = self.norm2(h); h = h * (1 + scale) + shift`` (or
  ``self.norm(x) * (scale + 1.0) + shift``), becomes ``h = self.norm2(h, scale=scale, shift=shift)``, which
  GroupNormAct computes in the same order.
* statements the rule lists as ``rewrites`` are replaced by ones that compute the same values with less memory
  traffic: a copy to the standard layout that keeps the channels-last layout instead, a division by an
  ``output_scale_factor`` of 1.0 skipped (``unscaled``), ``h = h + temb; h = self.norm2(h)`` made
  ``h = self.norm2(h, input_offset=temb)`` (the kernels add the timestep embedding as they load h), conv1's bias
  made norm2's ``input_bias``.

Nothing else changes, and each edit must apply exactly as the rule declares, else the rule raises (a rule error
the tests catch). The source is the one recorded with ``verified``: on other code the rule does not apply. The
generated forward is compiled once per class, under a file name ``<gn_patch: fused Class.forward>`` whose lines
tracebacks and ``inspect.getsource`` show.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.nn.functional as F
from torch import nn

from ..ops import canonical_activation
from ..report import join_name
from .base import (ORIGINAL_CLASS, RULES, FusedActivation, FusedGroupNorm, Surgery, activation_name,
                   forward_override_problem, fuse_norm, output_seen, rule, set_class, stands_in_for,
                   unverified, verified)

# Activation functions a forward may call by name -> gn_patch's activation.
_FUNCTIONS = {F.silu: "silu", F.gelu: "gelu", F.relu: "relu", F.mish: "mish"}
# diffusers' own helpers that compute one of them (their code verified) -> gn_patch's activation.
_HELPER_FUNCTIONS: dict[Callable, str] = {}
# Methods that only move or reshape a tensor: an elementwise activation commutes with them.
_LAYOUT_METHODS = {"permute", "unflatten", "flatten", "reshape", "view", "contiguous", "transpose", "squeeze",
                   "unsqueeze"}

# For the layout rules of the spatial norms (MoVQ's SpatialNorm, CogVideoX's, KVAE's): the latent a spatial norm
# interpolates to f's size (zq) arrives NCDHW/NCHW. Its conv_y and conv_b are 1x1(x1) convolutions, whose
# channels-last weights are also contiguous, so cuDNN follows zq's layout and returns NCDHW: `norm_f * conv_y +
# conv_b` then mixes layouts, which TensorIterator runs through its slow strided kernel (on the H200, CogVideoX's
# decode spent 220 ms in those two ops, against 35 ms stock). Giving the interpolated zq (few channels: a small
# copy) f's channels-last layout keeps the convs and the elementwise ops NDHWC/NHWC. The interpolation itself
# stays on NCDHW input: PyTorch's channels-last nearest upsampling fails for outputs over 2**31 elements
# (pytorch#141831), the reason diffusers makes its inputs contiguous.
ZQ_LIKE_F_3D = ".contiguous(memory_format=torch.channels_last_3d if f.stride(1) == 1 else torch.contiguous_format)"
ZQ_LIKE_F_2D = ".contiguous(memory_format=torch.channels_last if f.stride(1) == 1 else torch.contiguous_format)"


class RuleError(RuntimeError):
    """A fusion rule does not fit the code it was declared for (a bug in gn_patch's rules, never the user's)."""


# ------------------------------------------------------------------------------------------------
# The edits, on the syntax tree of a forward
# ------------------------------------------------------------------------------------------------
def _self_call(node, names) -> str | None:
    """``N`` when ``node`` is the call ``self.N(...)`` with N in ``names``."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
        return node.func.attr
    return None


def _target(statement) -> str | None:
    """The variable a single-target assignment ``v = ...`` or ``v, ... = ...`` assigns (its first name)."""
    if not isinstance(statement, ast.Assign) or len(statement.targets) != 1:
        return None
    target = statement.targets[0]
    if isinstance(target, ast.Tuple) and target.elts:
        target = target.elts[0]
    return target.id if isinstance(target, ast.Name) else None


def _is_name(node, variable: str) -> bool:
    return isinstance(node, ast.Name) and node.id == variable


def _moves_only(expression, variable: str) -> bool:
    """``variable.permute(...).flatten(...)...``: layout methods applied to ``variable``."""
    while isinstance(expression, ast.Call) and isinstance(expression.func, ast.Attribute):
        if expression.func.attr not in _LAYOUT_METHODS:
            return False
        expression = expression.func.value
    return _is_name(expression, variable)


def _ends_with_norm(statements: list, variable: str, norms) -> set[str] | None:
    """The norms whose output ``variable`` holds, up to layout moves, after ``statements`` on every path; None
    when some path ends otherwise."""
    for statement in reversed(statements):
        if _target(statement) == variable and _moves_only(statement.value, variable):
            continue  # a move of the norm's output: look at what precedes it
        if _target(statement) == variable:
            name = _self_call(statement.value, norms)
            return {name} if name else None
        if isinstance(statement, ast.If) and statement.orelse:
            body, orelse = _ends_with_norm(statement.body, variable, norms), _ends_with_norm(
                statement.orelse, variable, norms)
            return body | orelse if body is not None and orelse is not None else None
        return None
    return None


class _Editor(ast.NodeTransformer):
    """Applies the two edits (see the module docstring) to every statement list of a function."""

    def __init__(self, activations: dict[str, str], modulated: set[str], resolve: Callable[[ast.AST], str]):
        self.activations = activations  # norm -> source of the activation its fusion absorbs
        self.modulated = modulated  # norms whose per-sample modulation is merged into the call
        self.resolve = resolve  # canonical source of an activation expression
        self.dropped: list[str] = []  # norms whose activation was dropped, once per drop
        self.merged: list[str] = []  # norms whose modulation was merged, once per merge

    # -- modulation ----------------------------------------------------------------------------
    def _modulation(self, node, operand_ok: Callable) -> tuple | None:
        """(scale, shift) when ``node`` is ``<operand> * (1 + scale) + shift`` (or ``(scale + 1)``) with
        operand_ok(<operand>)."""
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.left, ast.BinOp)
                and isinstance(node.left.op, ast.Mult) and operand_ok(node.left.left)):
            return None
        factor = node.left.right
        if not (isinstance(factor, ast.BinOp) and isinstance(factor.op, ast.Add)):
            return None
        for one, scale in ((factor.left, factor.right), (factor.right, factor.left)):
            if isinstance(one, ast.Constant) and one.value == 1:
                return scale, node.right
        return None

    def _merge(self, call: ast.Call, scale, shift) -> ast.Call:
        self.merged.append(call.func.attr)
        return ast.Call(func=call.func, args=call.args,
                        keywords=[*call.keywords, ast.keyword("scale", scale), ast.keyword("shift", shift)])

    def visit_BinOp(self, node):
        # self.norm(x) * (scale + 1.0) + shift  ->  self.norm(x, scale=scale, shift=shift)
        node = self.generic_visit(node)
        found = self._modulation(node, lambda operand: _self_call(operand, self.modulated) is not None)
        return self._merge(node.left.left, *found) if found else node

    # -- activation ----------------------------------------------------------------------------
    def _activation_of(self, node, norms) -> str | None:
        """The norm whose activation ``node`` is: ``ACT(self.norm(...))`` -> "norm" (nested form)."""
        if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords:
            name = _self_call(node.args[0], norms)
            if name is not None and self.resolve(node.func) == self._norm_activation(name):
                return name
        return None

    def _norm_activation(self, norm: str) -> str:
        return self.resolve(ast.parse(self.activations[norm], mode="eval").body)

    def visit_Call(self, node):
        node = self.generic_visit(node)
        name = self._activation_of(node, self.activations)
        if name is not None:
            self.dropped.append(name)
            return node.args[0]
        return node

    def _edit_block(self, statements: list) -> list:
        edited: list = []
        for statement in statements:
            variable = _target(statement)
            previous = edited[-1] if edited else None
            # h = self.norm(h); h = h * (1 + scale) + shift  ->  h = self.norm(h, scale=scale, shift=shift)
            if (variable is not None and previous is not None and _target(previous) == variable
                    and _self_call(previous.value, self.modulated)):
                found = self._modulation(statement.value, lambda operand, v=variable: _is_name(operand, v))
                if found:
                    previous.value = self._merge(previous.value, *found)
                    continue
            # h = <norm on every path>; h = ACT(h)  ->  the norm applies ACT
            if variable is not None and previous is not None and self._drops(statement, variable, edited):
                continue
            edited.append(statement)
        return edited

    def _drops(self, statement, variable: str, edited: list) -> bool:
        value = statement.value
        if not (isinstance(value, ast.Call) and len(value.args) == 1 and not value.keywords
                and isinstance(value.args[0], ast.Name) and value.args[0].id == variable):
            return False
        norms = _ends_with_norm(edited, variable, self.activations)
        if not norms or any(self.resolve(value.func) != self._norm_activation(n) for n in norms):
            return False
        self.dropped.extend(sorted(norms))
        return True

    def generic_visit(self, node):
        for name, value in ast.iter_fields(node):
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                setattr(node, name, self._edit_block([self.visit(item) for item in value]))
            elif isinstance(value, list):
                setattr(node, name, [self.visit(item) if isinstance(item, ast.AST) else item for item in value])
            elif isinstance(value, ast.AST):
                setattr(node, name, self.visit(value))
        return node


# ------------------------------------------------------------------------------------------------
# Fusion specs and the classes they generate
# ------------------------------------------------------------------------------------------------
@dataclass
class Fusion:
    """How the surgeon fuses the GroupNorms a module class calls in its forward.

    Attributes:
        cls: the diffusers class (exactly; subclasses may differ).
        activations: norm attribute -> the source of the activation the forward applies right after it
            (``"self.nonlinearity"``, ``"F.silu"``); the fused norm applies it instead.
        modulated: norm attributes whose per-sample modulation ``* (1 + scale) + shift`` is merged into the call.
        alone: norm attributes used on their own whose output may have any layout (identity GroupNormAct).
        output: for a wrapper (CosmosCausalGroupNorm, ...), the attribute of the norm whose output, moved or
            concatenated, the wrapper returns: an activation after the wrapper can be fused into that norm.
        modulated_if: for a class whose forward modulates only in some configurations, whether an instance does
            (names the fusion ``+scale_shift`` in the report).
        rewrites: statement source (one statement or several consecutive ones) -> replacement computing the same
            values with less memory traffic: a copy of a channels-last tensor to the standard layout
            (``x.contiguous()``, a reshape through an NCHW copy) that keeps the layout the input came in, a division
            by a factor of 1.0 skipped (``unscaled``), an add before a norm made the norm's ``input_offset``.
        helpers: functions the rewritten statements call as methods, ``self.<name>(...)``: added to the fused class.
    """

    cls: type
    activations: dict[str, str] = field(default_factory=dict)
    modulated: set[str] = field(default_factory=set)
    alone: set[str] = field(default_factory=set)
    output: str | None = None
    modulated_if: Callable[[nn.Module], bool] | None = None
    rewrites: dict[str, str] = field(default_factory=dict)
    helpers: dict[str, Callable] = field(default_factory=dict)
    fused_cls: type | None = None  # generated on first use (only when the forward is edited)

    @property
    def norms(self) -> list[str]:
        return sorted(set(self.activations) | self.modulated | self.alone | ({self.output} - {None}))

    @property
    def edits(self) -> bool:
        return bool(self.activations or self.modulated or self.rewrites)


FUSIONS: dict[type, Fusion] = {}  # original class -> spec
_BY_FUSED_NAME: dict[str, Fusion] = {}  # qualified name of the generated class -> spec, for unpickling
# Norm classes without an inner GroupNorm module (AdaGroupNorm, ...) -> their patched class, which applies
# ``self.activation`` at its output.
ACTIVATION_NORMS: dict[type, type] = {}


def _resolver(globals_: dict) -> Callable[[ast.AST], str]:
    """Canonical name of an activation expression in a forward: ``self.X`` stays itself, a function (``F.silu``,
    a module-level helper) is looked up in the forward's globals and named as gn_patch names it."""

    def resolve(node) -> str:
        source = ast.unparse(node)
        if source.startswith("self."):
            return source
        try:
            function = eval(source, dict(globals_))  # a dotted name from the verified diffusers source
        except Exception:  # noqa: BLE001 - anything else is no activation the surgeon knows
            return source
        if function in _HELPER_FUNCTIONS and unverified(function) is None:
            return _HELPER_FUNCTIONS[function]
        return _FUNCTIONS.get(function, source)

    return resolve


def _replace_statements(function: ast.FunctionDef, spec: Fusion) -> None:
    """Apply ``spec.rewrites``: each statement, or run of consecutive statements, must occur exactly once."""
    rewrites = [([ast.dump(statement) for statement in ast.parse(old).body], ast.parse(new).body)
                for old, new in spec.rewrites.items()]
    found = [0] * len(rewrites)
    for node in list(ast.walk(function)):  # the nodes of the source as read
        for _, value in ast.iter_fields(node):
            if not (isinstance(value, list) and value and isinstance(value[0], ast.stmt)):
                continue
            for k, (old, new) in enumerate(rewrites):
                i = 0
                while i + len(old) <= len(value):
                    if [ast.dump(statement) for statement in value[i:i + len(old)]] == old:
                        value[i:i + len(old)] = new
                        found[k] += 1
                        i += len(new)
                    else:
                        i += 1
    if found != [1] * len(rewrites):
        raise RuleError(f"{spec.cls.__qualname__}.forward: {len(rewrites)} statements or runs of statements to "
                        f"rewrite once each, found them {found} times")


def unscaled(statement: str, factor: str = "self.output_scale_factor") -> dict[str, str]:
    """The rewrite of ``statement`` that skips its division by ``factor`` where the factor is the Python number 1.0,
    as a ``rewrites`` entry. diffusers' resnet blocks end with ``(input_tensor + hidden_states) /
    self.output_scale_factor``, 1.0 in every Stable Diffusion UNet and VAE: a pass over the block's output (one
    read, one write) whose values equal its input's (x / 1.0 == x for every x, infinities and -0.0 included; a NaN
    stays a NaN, though PyTorch's division may change its bit pattern), and whose backward divides the gradient by
    1.0 likewise. A factor that is a tensor (set by hand: a Parameter, float64, per channel) divides as stock does,
    so its gradient, type promotion and broadcasting stay PyTorch's. ``statement`` must divide by ``factor``
    exactly once."""
    tree = ast.parse(statement).body[0]
    divisions = [node for node in ast.walk(tree) if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
                 and ast.unparse(node.right) == factor]
    if len(divisions) != 1:
        raise RuleError(f"{statement!r}: {len(divisions)} divisions by {factor}, expected one")
    division = divisions[0]
    skipped = ast.parse(f"_ if isinstance({factor}, (int, float)) and {factor} == 1.0 else _", mode="eval").body
    skipped.body, skipped.orelse = division.left, ast.BinOp(division.left, ast.Div(), division.right)
    for parent in ast.walk(tree):
        for name, value in ast.iter_fields(parent):
            if value is division:
                setattr(parent, name, skipped)
    return {statement: ast.unparse(ast.fix_missing_locations(tree))}


def _generate_forward(spec: Fusion) -> Callable:
    """The forward of ``spec.cls`` with the spec's edits (see the module docstring)."""
    original = inspect.unwrap(spec.cls.forward)
    if original.__code__.co_freevars:
        raise RuleError(f"{spec.cls.__qualname__}.forward uses a closure (super()?): it cannot be regenerated")
    tree = ast.parse(textwrap.dedent(inspect.getsource(spec.cls.forward)))
    function = tree.body[0]
    for argument in (*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs,
                     function.args.vararg, function.args.kwarg):
        if argument is not None:
            argument.annotation = None  # annotations would be evaluated when the function is defined
    function.returns = None
    _replace_statements(function, spec)
    editor = _Editor(spec.activations, spec.modulated, _resolver(original.__globals__))
    editor.generic_visit(function)
    expected = sorted(spec.activations), sorted(spec.modulated)
    if (sorted(editor.dropped), sorted(editor.merged)) != expected:
        raise RuleError(f"{spec.cls.__qualname__}.forward: expected to drop the activation after {expected[0]} and "
                        f"merge the modulation of {expected[1]} once each; did {sorted(editor.dropped)} and "
                        f"{sorted(editor.merged)}")
    source = ast.unparse(ast.fix_missing_locations(tree)) + "\n"
    filename = f"<gn_patch: fused {spec.cls.__qualname__}.forward>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict = {}
    exec(compile(source, filename, "exec"), original.__globals__, namespace)  # the verified source, edited
    forward = namespace[function.name]
    forward.__qualname__ = f"{spec.cls.__qualname__}.forward"
    return forward


def _fused_as(module) -> tuple[type, str] | None:
    """(class, activation) of a fused norm, also seen through peft's ``ModulesToSaveWrapper`` (``modules_to_save``:
    it keeps the module as ``original_module`` and trains deep copies of it); None for anything else."""
    inner = getattr(module, "original_module", module)
    return (type(inner), inner.activation) if _is_fused_norm(inner) else None


def _same_fused_norm(value, current) -> bool:
    """``value`` is a fused norm (or peft's wrapper of one) of ``current``'s class and activation."""
    fused = _fused_as(value)
    return fused is not None and fused == _fused_as(current)


def _replacement_guard(spec: Fusion) -> Callable[[nn.Module, str, object], None]:
    """``__setattr__`` of ``spec``'s fused class: the edited forward applies each norm's fused activation (and its
    modulation) in place of the calls it dropped, so a norm or activation module replaced on a patched instance
    would leave it computing the old pair (a new ``nn.GroupNorm`` unactivated, a new activation skipped after the
    norms): such an assignment raises instead. Other attributes are set as ``spec.cls`` sets them, and so is a fused
    norm replaced by one that fuses the same activation (peft wrapping it for ``modules_to_save``, or unloading to
    its trained copy): the block then computes as stock would with the new norm."""
    guarded = frozenset(spec.norms) | {source.removeprefix("self.") for source in spec.activations.values()
                                       if source.startswith("self.")}
    stock_setattr = spec.cls.__setattr__

    def __setattr__(self, name: str, value) -> None:
        current = self._modules.get(name) if name in guarded else None
        if current is not None and value is not current and not _same_fused_norm(value, current):
            raise RuntimeError(
                f"gn_patch: {spec.cls.__name__}.{name} is fused into this patched block's forward; replacing it "
                f"would leave the block computing the old norm and activation. Call gn_patch.unpatch_model on the "
                f"model first (and patch_model again after)")
        stock_setattr(self, name, value)

    return __setattr__


def fused_class(spec: Fusion) -> type:
    """The class patch_model switches ``spec.cls`` instances to, generated on first use and registered as a rule
    (a second patch_model call recognizes it). Replacing a fused norm or activation on an instance raises
    (_replacement_guard)."""
    if spec.fused_cls is None:
        name = next(n for n, other in _BY_FUSED_NAME.items() if other is spec)
        namespace = {"__module__": __name__, "__qualname__": name, "forward": _generate_forward(spec), **spec.helpers,
                     "__setattr__": _replacement_guard(spec),
                     "__doc__": f"{spec.cls.__name__} whose GroupNorms apply what follows them (gn_patch)."}
        spec.fused_cls = stands_in_for(spec.cls)(type(name, (spec.cls,), namespace))
        RULES[spec.fused_cls] = RULES[spec.cls]
    return spec.fused_cls


def __getattr__(name: str):
    """Generated classes, on demand: unpickling a patched model in a fresh process looks them up here."""
    if name in _BY_FUSED_NAME:
        return fused_class(_BY_FUSED_NAME[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------------------
# Fusing an instance
# ------------------------------------------------------------------------------------------------
def _spec_of(module: nn.Module) -> Fusion | None:
    return FUSIONS.get(type(module)) or FUSIONS.get(ORIGINAL_CLASS.get(type(module)))


def _is_fused_norm(module: nn.Module) -> bool:
    return type(module) is FusedGroupNorm or type(module) in ACTIVATION_NORMS.values()


def _leaf(module: nn.Module, name: str) -> tuple[str, nn.Module] | None:
    """(qualified name, module) of the norm that computes ``module``'s output: itself, or the norm of a wrapper.
    None when ``module`` is no norm the surgeon can fuse (a SpatialNorm, say)."""
    if type(module) is nn.GroupNorm or type(module) in ACTIVATION_NORMS or _is_fused_norm(module):
        return name, module
    spec = _spec_of(module)
    if spec is not None and spec.output is not None:
        return _leaf(getattr(module, spec.output), join_name(name, spec.output))
    return None


def _module_problem(s: Surgery, module: nn.Module, spec_cls: type, wrapper: bool) -> str | None:
    """Why ``module`` cannot get its patched class: other code, a forward wrapped on the instance, or (a norm or
    wrapper whose output changes) several uses or output hooks."""
    problem = unverified(spec_cls.forward) or forward_override_problem(module)
    if problem is None and wrapper and (s.uses[id(module)] > 1 or output_seen(module)):
        problem = f"{spec_cls.__name__} is registered in several places or has forward hooks"
    return problem


def _path_problem(s: Surgery, module: nn.Module) -> str | None:
    """Why a norm's output cannot change (fused activation or modulation) through ``module`` down to its leaf."""
    if type(module) is nn.GroupNorm:
        return s.norm_problem(module)
    if type(module) in ACTIVATION_NORMS:
        return _module_problem(s, module, type(module), wrapper=True)
    spec = _spec_of(module)
    return _module_problem(s, module, spec.cls, wrapper=True) or _path_problem(s, getattr(module, spec.output))


def _apply(s: Surgery, name: str, module: nn.Module, activation: str, kind: str) -> None:
    """Make ``module`` (a norm, or a wrapper of one) apply ``activation`` at its output."""
    if type(module) is nn.GroupNorm:
        fuse_norm(module, activation)
        s.fused(name, module, kind)
    elif type(module) in ACTIVATION_NORMS:
        set_class(module, ACTIVATION_NORMS[type(module)])
        module.activation = canonical_activation(activation)
        s.fused(name, module, kind)
    else:
        spec = _spec_of(module)
        _apply(s, join_name(name, spec.output), getattr(module, spec.output), activation, kind)
        _fuse_instance(s, name, module, spec)


def _fuse_instance(s: Surgery, name: str, module: nn.Module, spec: Fusion) -> None:
    """Give ``module`` its fused class (when the forward is edited) and fuse its remaining norms with the identity
    activation: the modulated ones take their scale/shift, the lone ones run on their own."""
    if spec.edits:
        set_class(module, fused_class(spec))
    s.decided.add(id(module))
    for attr in sorted(spec.modulated | spec.alone | ({spec.output} - {None})):
        leaf = _leaf(getattr(module, attr), join_name(name, attr))
        if leaf is not None and id(leaf[1]) not in s.decided:
            if _is_fused_norm(leaf[1]):
                s.already(*leaf, _kind(spec, module, attr))
            else:
                _apply(s, join_name(name, attr), getattr(module, attr), "identity", _kind(spec, module, attr))


def _kind(spec: Fusion, module: nn.Module, attr: str) -> str:
    """Report kind of the fusion of ``module.<attr>``: ``Class.attr``, then ``+scale_shift`` when it is modulated
    and ``+act`` when it takes the activation."""
    modulated = attr in spec.modulated and (spec.modulated_if is None or spec.modulated_if(module))
    return (f"{spec.cls.__name__}.{attr}" + ("+scale_shift" if modulated else "")
            + ("+act" if attr in spec.activations else ""))


def _activation(module: nn.Module, spec: Fusion, source: str) -> str:
    if source.startswith("self."):
        return activation_name(getattr(module, source.removeprefix("self.")))
    return _resolver(inspect.unwrap(spec.cls.forward).__globals__)(ast.parse(source, mode="eval").body)


def _named(attr: str, problem: str | None) -> str | None:
    return None if problem is None else f"{attr}: {problem}"


def _handler(spec: Fusion) -> Callable[[Surgery, str, nn.Module], None]:
    """The rule of ``spec.cls`` (and of its fused class): all of the spec or nothing, per instance."""

    def handler(s: Surgery, name: str, module: nn.Module) -> None:
        if id(module) in s.decided:
            return  # a wrapper its block has fused
        leaves = {attr: _leaf(getattr(module, attr), join_name(name, attr)) for attr in spec.norms}
        if type(module) is spec.fused_cls:
            for attr, leaf in leaves.items():
                if leaf is not None and id(leaf[1]) not in s.decided:
                    s.already(*leaf, _kind(spec, module, attr))
            s.decided.add(id(module))
            return
        if any(leaves[attr] is None for attr in (*spec.activations, *spec.modulated)):
            return  # the instance holds other norms (CogVideoX's decoder blocks take spatial norms): their rules
        problem = _module_problem(s, module, spec.cls, wrapper=spec.output is not None)
        # A problem of one norm or activation keeps the whole block as stock (its forward is edited as one): each
        # reason names the module it comes from, so that a sibling's entry does not read as its own.
        for attr in spec.norms:
            if problem is None and leaves[attr] is not None and not _is_fused_norm(leaves[attr][1]):
                problem = _named(attr, _path_problem(s, getattr(module, attr)))
        for source in spec.activations.values():
            if problem is None and source.startswith("self."):
                attr = source.removeprefix("self.")
                problem = _named(attr, s.activation_problem(getattr(module, attr)))
        if problem is not None:
            for leaf in leaves.values():
                if leaf is not None:
                    s.decline(*leaf, f"{spec.cls.__name__}: {problem}")
            return
        for attr, source in spec.activations.items():
            _apply(s, join_name(name, attr), getattr(module, attr), _activation(module, spec, source),
                   _kind(spec, module, attr))
        _fuse_instance(s, name, module, spec)

    return handler


def fusion(cls: type, digest: str, *, activations: dict[str, str] | None = None, modulated=(), alone=(),
           output: str | None = None, modulated_if: Callable[[nn.Module], bool] | None = None,
           rewrites: dict[str, str] | None = None, helpers: dict[str, Callable] | None = None) -> Fusion:
    """Declare how ``cls``'s forward, read as it is with source ``digest``, uses its GroupNorms; registers the
    rule. See :class:`Fusion` for the arguments."""
    spec = Fusion(cls, dict(activations or {}), set(modulated), set(alone), output, modulated_if, dict(rewrites or {}),
                  dict(helpers or {}))
    verified(cls.forward, digest)
    FUSIONS[cls] = spec
    name = f"_Fused{cls.__name__}"
    if name in _BY_FUSED_NAME:  # classes of the same name in two diffusers modules (LTX's ResBlock)
        name = f"{name}_{cls.__module__.rpartition('.')[2]}"
    _BY_FUSED_NAME[name] = spec
    rule(cls)(_handler(spec))
    return spec


def fused_norm_alone(s: Surgery, name: str, norm: nn.Module, kind: str) -> None:
    """Rule body for a norm of ACTIVATION_NORMS that no block fused an activation into: the identity activation."""
    if id(norm) in s.decided:
        return
    if _is_fused_norm(norm):
        s.already(name, norm, kind)
        return
    problem = _path_problem(s, norm)
    if problem is not None:
        s.decline(name, norm, problem)
    else:
        _apply(s, name, norm, "identity", kind)


def pairs(cls: type, digest: str, norm_activations: dict[str, str]) -> None:
    """Declare that ``cls``'s forward, read as it is with source ``digest``, applies the activation module
    ``self.<activation>`` right after each ``self.<norm>`` (up to moves of the output) and nowhere else: the norm
    is fused and the activation module replaced by a stand-in, without changing ``cls`` (fit for the top-level
    models, whose class users see). Registers the rule."""
    verified(cls.forward, digest)

    @rule(cls)
    def handler(s: Surgery, name: str, owner: nn.Module) -> None:
        for norm_attr, activation_attr in norm_activations.items():
            norm, activation = getattr(owner, norm_attr, None), getattr(owner, activation_attr, None)
            leaf = _leaf(norm, join_name(name, norm_attr)) if norm is not None else None
            if leaf is None or id(leaf[1]) in s.decided:
                continue  # absent or None (in some configurations), or another norm class: its own rule
            kind = f"{norm_attr}+{activation_attr}"
            if isinstance(activation, FusedActivation) and _is_fused_norm(leaf[1]):
                s.already(*leaf, kind)
                continue
            problem = unverified(cls.forward) or _path_problem(s, norm) or s.activation_problem(activation)
            if problem is not None:
                s.decline(*leaf, problem)
                continue
            _apply(s, join_name(name, norm_attr), norm, activation_name(activation), kind)
            setattr(owner, activation_attr, FusedActivation(activation))


def activation_function(function: Callable, digest: str, activation: str) -> None:
    """Declare that the diffusers helper ``function``, read as it is with source ``digest``, computes
    ``activation`` (KVAE's ``nonlinearity(x) = F.silu(x)``): a fused norm may absorb calls to it."""
    verified(function, digest)
    _HELPER_FUNCTIONS[function] = activation
