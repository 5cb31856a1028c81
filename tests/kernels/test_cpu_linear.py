"""oneDNN packed linear layers: same values as F.linear, picked by size, kept in step with the weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mm_serve.kernels.cpu_linear import (
    MIN_PACKED_MACS,
    PackedLinear,
    onednn_linear_available,
    pack_linear_layers,
)
from mm_serve.models.loader import load_model
from mm_serve.runtime.engine_config import EngineConfig

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN linear ops")


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 257])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_matches_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    dense = nn.Linear(256, 1536, bias=bias)
    packed = PackedLinear(dense)
    x = torch.randn(rows, 256)
    with torch.inference_mode():
        ref = F.linear(x, dense.weight, dense.bias)
        got = packed(x)
    assert got.shape == (rows, 1536)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


def test_packed_path_is_taken_from_min_rows_and_differs_only_in_rounding() -> None:
    """At and above ``min_rows`` the output is oneDNN's (not bitwise MKL's), below it is exactly F.linear's."""
    torch.manual_seed(0)
    dense = nn.Linear(256, 1536, bias=False)
    packed = PackedLinear(dense)
    assert packed.min_rows == -(-MIN_PACKED_MACS // (256 * 1536)) == 2
    with torch.inference_mode():
        one = torch.randn(1, 256)
        assert torch.equal(packed(one), F.linear(one, dense.weight))  # below: the MKL call itself
        many = torch.randn(64, 256)
        direct = torch.ops.mkldnn._linear_pointwise(many, packed.packed, None, "none", [], "")
        assert torch.equal(packed(many), direct)


def test_three_dimensional_input_keeps_its_shape() -> None:
    torch.manual_seed(1)
    dense = nn.Linear(192, 768)
    packed = PackedLinear(dense)
    x = torch.randn(4, 65, 192)
    with torch.inference_mode():
        got, ref = packed(x), F.linear(x, dense.weight, dense.bias)
    assert got.shape == (4, 65, 768)
    assert float((got - ref).abs().max()) < 1e-4


def test_in_place_weight_write_is_repacked() -> None:
    torch.manual_seed(2)
    dense = nn.Linear(256, 1536, bias=False)
    packed = PackedLinear(dense)
    x = torch.randn(32, 256)
    with torch.inference_mode():
        before = packed(x)
    with torch.no_grad():
        packed.weight[5, :] += 1.0
    with torch.inference_mode():
        after = packed(x)
    assert torch.allclose(after[:, 5] - before[:, 5], x.sum(dim=1), atol=1e-3)
    assert torch.equal(after[:, 6], before[:, 6])


def test_refuses_non_float32_layers() -> None:
    with pytest.raises(ValueError, match="float32 CPU layer"):
        PackedLinear(nn.Linear(4, 4).to(torch.bfloat16))


def test_pack_linear_layers_keeps_state_dict_and_tied_weights() -> None:
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10, bias=False), nn.Sequential(nn.Linear(8, 8)))
    model[1].weight = model[0].weight
    keys = list(model.state_dict())
    assert pack_linear_layers(model) == 2
    assert isinstance(model[1], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert list(model.state_dict()) == keys
    assert model[1].weight is model[0].weight


def test_load_model_packs_on_request(tiny_llava: Path) -> None:
    packed = load_model(tiny_llava)
    plain = load_model(tiny_llava, pack_cpu_linears=False)
    n_linear = sum(type(m) is nn.Linear for m in plain.modules())
    assert n_linear > 10  # decoder, projector and vision tower
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == n_linear
    assert not any(type(m) is nn.Linear for m in packed.modules())
    assert packed.language_model.state_dict().keys() == plain.language_model.state_dict().keys()


def test_engine_config_rejects_unknown_cpu_gemm() -> None:
    with pytest.raises(ValueError, match="cpu_gemm"):
        EngineConfig(cpu_gemm="blas")


def test_large_layer_keeps_only_the_packed_weight() -> None:
    """512 x 2048 (1 M MACs per row): every product goes to oneDNN, so no dense copy is held."""
    torch.manual_seed(3)
    dense = nn.Linear(512, 2048)
    original = dense.weight.detach().clone()
    packed = PackedLinear(dense)
    assert packed.min_rows == 1 and not packed.keep_dense
    assert [name for name, _ in packed.named_parameters()] == ["bias"]  # the weight is not held twice
    assert torch.equal(packed.weight, original)  # read back from the packed copy
    state = packed.state_dict()
    assert list(state) == ["weight", "bias"] and torch.equal(state["weight"], original)
    x = torch.randn(3, 512)
    with torch.inference_mode():
        assert float((packed(x) - F.linear(x, original, dense.bias)).abs().max()) < 1e-4
    new_weight = torch.randn(2048, 512)
    packed.load_state_dict({"weight": new_weight, "bias": state["bias"]})
    with torch.inference_mode():
        assert float((packed(x) - F.linear(x, new_weight, dense.bias)).abs().max()) < 1e-4
    with pytest.raises(RuntimeError, match="Missing key"):
        packed.load_state_dict({"bias": state["bias"]})
    with pytest.raises(RuntimeError, match="size mismatch"):
        packed.load_state_dict({"weight": torch.zeros(4, 4), "bias": state["bias"]})
    grad_mode = packed(x)  # grad enabled: F.linear on the weight read back from the packed copy
    assert float((grad_mode - F.linear(x, new_weight, dense.bias)).abs().max().detach()) < 1e-4


def test_tied_large_weight_stays_dense_and_shared() -> None:
    model = nn.Sequential(nn.Embedding(2048, 512), nn.Linear(512, 2048, bias=False))
    model[1].weight = model[0].weight
    assert pack_linear_layers(model) == 1
    assert model[1].keep_dense and model[1].weight is model[0].weight


@pytest.mark.parametrize("shape", [(64, 64), (512, 2048)], ids=["dense-kept", "packed-only"])
def test_module_operations_behave_like_nn_linear(shape: tuple[int, int]) -> None:
    import copy
    import pickle

    torch.manual_seed(4)
    dense = nn.Linear(*shape)
    reference = copy.deepcopy(dense)
    packed = PackedLinear(dense)
    x = torch.randn(300, shape[0])

    def check(layer: nn.Module, ref: nn.Module, inputs: torch.Tensor, tol: float = 1e-5) -> None:
        with torch.inference_mode():
            expected = ref(inputs)
            assert float((layer(inputs) - expected).abs().max() / expected.abs().max()) < tol

    check(copy.deepcopy(packed), reference, x)
    check(pickle.loads(pickle.dumps(packed)), reference, x)
    # a new weight: both paths (few rows: F.linear; many: oneDNN) use it
    new = torch.randn(shape[1], shape[0])
    packed.weight = nn.Parameter(new.clone())
    reference.weight = nn.Parameter(new.clone())
    check(packed, reference, x)
    check(packed, reference, x[:1])
    # .to(float64) drops the packed copy (F.linear in that dtype); back to float32 packs again
    packed.to(torch.float64)
    reference.to(torch.float64)
    assert packed.packed is None
    check(packed, reference, x.double(), 1e-12)
    packed.float()
    reference.float()
    assert packed.packed is not None
    check(packed, reference, x)


def test_same_version_replacement_is_repacked() -> None:
    """A replacement whose version counter equals the old one's is still noticed (identity check)."""
    torch.manual_seed(5)
    packed = PackedLinear(nn.Linear(64, 64, bias=False))
    new = torch.randn(64, 64)
    param = nn.Parameter(new.clone())
    with torch.no_grad():
        param.mul_(1.0)
    packed.weight = param
    x = torch.randn(256, 64)
    with torch.inference_mode():
        assert float((packed(x) - F.linear(x, new)).abs().max()) < 1e-4


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_bad_inputs_get_f_linear_errors_and_empty_layers_are_skipped() -> None:
    packed = PackedLinear(nn.Linear(512, 2048))
    with torch.inference_mode(), pytest.raises(RuntimeError, match="cannot be multiplied"):
        packed(torch.randn(8, 100))
    with pytest.raises(ValueError, match="non-empty"):
        PackedLinear(nn.Linear(0, 4))
    model = nn.Sequential(nn.Linear(0, 4), nn.Linear(4, 0))
    assert pack_linear_layers(model) == 0


def test_cpu_autocast_keeps_nn_linear_semantics() -> None:
    packed = PackedLinear(nn.Linear(512, 2048))
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert packed(torch.randn(8, 512)).dtype == torch.bfloat16
