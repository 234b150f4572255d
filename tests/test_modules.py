"""CPU tests of gn_patch.GroupNormAct (gn_patch/modules.py): nn.GroupNorm compatibility, parameter sharing,
errors, torch.compile and TorchScript."""

import pytest
import torch
import torch.nn.functional as F

import gn_patch


def test_channels_not_divisible():
    with pytest.raises(ValueError) as stock:
        torch.nn.GroupNorm(4, 6)
    with pytest.raises(ValueError, match="divisible") as fused:
        gn_patch.GroupNormAct(4, 6)
    assert str(fused.value) == str(stock.value)  # nn.GroupNorm's own message


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(num_groups=2.0), TypeError, "num_groups must be an int, got float"),
    (dict(num_groups=0), ValueError, "num_groups must be positive, got 0"),
    (dict(num_groups=-4), ValueError, "num_groups must be positive, got -4"),
    (dict(eps=-1e-5), ValueError, "eps must be a finite number >= 0"),
    (dict(eps=float("nan")), ValueError, "eps must be a finite number >= 0"),
    (dict(eps="1e-5"), TypeError, "eps must be a float, got str"),
    (dict(activation="tanh"), ValueError, "unknown activation 'tanh'"),
], ids=["num_groups_float", "num_groups_0", "num_groups_negative", "eps_negative", "eps_nan", "eps_str",
        "activation"])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        gn_patch.GroupNormAct(**dict(dict(num_groups=4, num_channels=8), **kwargs))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(num_groups=2.0), TypeError, "num_groups must be an int, got float"),
    (dict(num_groups=0), ValueError, "num_groups must be positive, got 0"),
    (dict(eps=-1.0), ValueError, "eps must be a finite number >= 0"),
    (dict(eps=float("inf")), ValueError, "eps must be a finite number >= 0"),
    (dict(num_groups=3), ValueError, "num_channels must be divisible by num_groups"),
], ids=["num_groups_float", "num_groups_0", "eps_negative", "eps_inf", "num_groups_not_dividing"])
@pytest.mark.parametrize("loaded", [False, True], ids=["python_path", "extension"])
def test_bad_arguments_assigned_after_construction(kwargs, error, match, loaded, monkeypatch, request):
    """num_groups and eps assigned to a module are checked then, as the constructor checks them, whichever path
    the next call would take; the module keeps its values."""
    if loaded:
        request.getfixturevalue("ext")
    else:
        monkeypatch.setattr(gn_patch.extension, "loaded", False)
    module = gn_patch.GroupNormAct(4, 8)
    (name, value), = kwargs.items()
    with pytest.raises(error, match=match):
        setattr(module, name, value)
    assert (module.num_groups, module.eps) == (4, 1e-5)
    x = torch.randn(2, 8, 3, 3)
    torch.testing.assert_close(module(x), F.silu(F.group_norm(x, 4, module.weight, module.bias, 1e-5)))


def test_arguments_assigned_after_construction_are_stored_as_python_numbers():
    module = gn_patch.GroupNormAct(4, 8)
    module.num_groups, module.eps = torch.tensor(2), torch.tensor(1e-3)
    assert type(module.num_groups) is int and type(module.eps) is float
    assert (module.num_groups, module.eps) == (2, pytest.approx(1e-3))


def test_from_group_norm_of_another_norm():
    with pytest.raises(TypeError, match=r"group_norm must be a torch\.nn\.GroupNorm, got BatchNorm2d"):
        gn_patch.GroupNormAct.from_group_norm(torch.nn.BatchNorm2d(32))


def test_bias_false_as_torch_group_norm():
    """bias=False (keyword-only, as torch.nn.GroupNorm's): no bias parameter, the same state_dict keys and values
    as nn.GroupNorm's, and its output activated."""
    module = gn_patch.GroupNormAct(2, 4, bias=False)
    stock = torch.nn.GroupNorm(2, 4, bias=False)
    assert module.bias is None and module.state_dict().keys() == stock.state_dict().keys() == {"weight"}
    x = torch.randn(2, 4, 3, 3)
    torch.testing.assert_close(module(x), F.silu(stock(x)), rtol=0, atol=0)
    with pytest.raises(TypeError):
        gn_patch.GroupNormAct(2, 4, 1e-5, True, "silu", None, None, False)  # keyword-only, as nn.GroupNorm's


def test_activation_name_is_case_insensitive():
    assert gn_patch.GroupNormAct(2, 8, activation="SiLU").activation == "silu"
    assert gn_patch.GroupNormAct.from_group_norm(torch.nn.GroupNorm(2, 8), "GELU").activation == "gelu"


@pytest.mark.parametrize("name,expected", [("SiLU", F.silu), ("none", None), (None, None), ("swish", F.silu),
                                           ("GELU", F.gelu)])
def test_activation_assigned_after_construction(name, expected):
    """Any name the constructor takes may be assigned later: it is made canonical then, and forward applies it."""
    module = gn_patch.GroupNormAct(2, 8, activation="relu")
    module.activation = name
    x = torch.randn(2, 8, 3, 3)
    reference = F.group_norm(x, 2, module.weight, module.bias, module.eps)
    assert torch.equal(module(x), expected(reference) if expected else reference)
    with pytest.raises(ValueError, match="unknown activation 'bogus'"):
        module.activation = "bogus"


class TestModule:
    def test_state_dict_interchangeable_with_group_norm(self):
        gn = torch.nn.GroupNorm(4, 16)
        with torch.no_grad():
            gn.weight.normal_()
            gn.bias.normal_()
        fused = gn_patch.GroupNormAct(4, 16, activation="gelu")
        fused.load_state_dict(gn.state_dict(), strict=True)
        back = torch.nn.GroupNorm(4, 16)
        back.load_state_dict(fused.state_dict(), strict=True)
        assert fused.state_dict().keys() == gn.state_dict().keys()
        x = torch.randn(2, 16, 5, 5)
        torch.testing.assert_close(fused(x), F.gelu(gn(x)), rtol=0, atol=0)

    def test_from_group_norm_shares_parameters(self):
        gn = torch.nn.GroupNorm(2, 8, eps=1e-6).eval()
        fused = gn_patch.GroupNormAct.from_group_norm(gn, "relu")
        assert fused.weight is gn.weight and fused.bias is gn.bias
        assert (fused.num_groups, fused.num_channels, fused.eps, fused.training) == (2, 8, 1e-6, False)
        assert "activation=relu" in repr(fused)

    def test_no_affine(self):
        fused = gn_patch.GroupNormAct(2, 8, affine=False)
        x = torch.randn(3, 8, 4)
        torch.testing.assert_close(fused(x), F.silu(F.group_norm(x, 2)))

    @pytest.mark.parametrize("replaced", ["parametrize", "weight_norm", "functional_call", "deleted_and_assigned"])
    def test_forward_reads_the_weight_as_the_attribute_gives_it(self, replaced):
        """forward takes weight and bias from _parameters where they are there, else from the attribute: a
        parametrization, weight_norm, torch.func.functional_call and a plain tensor assigned after `del` all give
        what F.group_norm computes with module.weight and module.bias."""
        torch.manual_seed(0)
        fused = gn_patch.GroupNormAct(2, 8)
        x, doubled = torch.randn(2, 8, 3, 3), torch.randn(8)
        if replaced == "parametrize":
            class Double(torch.nn.Module):
                def forward(self, w):
                    return 2 * w

            torch.nn.utils.parametrize.register_parametrization(fused, "weight", Double())
            call = fused
        elif replaced == "weight_norm":
            call = torch.nn.utils.weight_norm(fused, dim=0)
        elif replaced == "functional_call":
            def call(x):
                return torch.func.functional_call(fused, {"weight": doubled}, (x,))
        else:
            del fused.weight
            fused.weight = doubled
            call = fused
        y = call(x)
        weight = doubled if replaced == "functional_call" else fused.weight
        torch.testing.assert_close(y, F.silu(F.group_norm(x, 2, weight, fused.bias, fused.eps)), rtol=0, atol=0)
        assert y.grad_fn is not None


def test_compile_module_fullgraph():
    module = gn_patch.GroupNormAct(4, 8)
    x = torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), module(x))


def test_torchscript_is_refused_clearly():
    with pytest.raises(RuntimeError, match="does not support TorchScript"):
        torch.jit.script(gn_patch.GroupNormAct(2, 8))
