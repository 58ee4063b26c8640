"""auto_round-format export (``qjax.convert.autoround_writer``) and load-back (``qjax.checkpoint.auto_round``).

One tiny bf16 source model, RTN-quantized by qjax with two recipes and written three ways: symmetric int4 g32 +
int2 g16 experts → ``auto_round:auto_gptq`` (auto-round's choice); asymmetric int4 g32 everywhere →
``auto_round:auto_awq`` (auto-round's choice) and, forced, ``auto_round`` (the packing auto-round picks for other
asymmetric recipes, and the one its CPU kernels can run). Scales are float16, as auto-round writes them.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from oracles.hf import make_hf_model, save_hf, tiny_text_config
from qjax.convert.autoround_writer import AutoRoundError, save_autoround
from safetensors.numpy import load_file

import qjax
from qjax.checkpoint.layout import checkpoint_tensors
from qjax.checkpoint.loading import module_weight
from qjax.quant.config import QuantizationConfig, WeightScheme
from qjax.quant.packing import pack_int32, unpack_int32, unpack_zero_point

pytestmark = pytest.mark.slow

EXPERTS = "re:.*mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$"
# auto-round leaves linears with a dim that is not a multiple of 32 unquantized (in_proj_a/b: 4 rows,
# shared_expert_gate: 1 row); the recipes do the same so both tools quantize the same set of layers.
IGNORE = ("re:.*in_proj_[ab]$", "re:.*shared_expert_gate$", "lm_head")
# (sym, expert bits, expert group, packing_format argument, packing written, auto-round's layer_config)
RECIPES = {
    "sym_w4_w2experts": (True, 2, 16, None, "auto_round:auto_gptq", {".*experts.*": {"bits": 2, "group_size": 16}}),
    "asym_w4": (False, 4, 32, None, "auto_round:auto_awq", {}),
    "asym_w4_native": (False, 4, 32, "auto_round", "auto_round", {}),
}
# a few modules for the runtime-dequantization check (it compiles per shape: slow); levels and scales of every
# module are compared exactly anyway
SAMPLED = {"model.layers.0.linear_attn.in_proj_qkv", "model.layers.3.self_attn.q_proj",
           "model.layers.0.mlp.experts.0.up_proj", "model.layers.3.mlp.experts.7.down_proj"}
IDS = np.random.default_rng(0).integers(0, 512, (2, 24)).astype(np.int32)
_AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)

# Linear modules the tiny model's export quantizes: per GDN layer in_proj_qkv, in_proj_z, out_proj (in_proj_a/b are
# skipped, too narrow for a group) and the shared expert's 3; per attention layer q/k/v/o and the shared expert's 3;
# 3 per routed expert in every layer
_TINY = tiny_text_config()
QUANTIZED_MODULES = (_TINY["layer_types"].count("linear_attention") * (3 + 3)
                     + _TINY["layer_types"].count("full_attention") * (4 + 3)
                     + _TINY["num_hidden_layers"] * _TINY["num_experts"] * 3)


def _qconfig(sym: bool, expert_bits: int, expert_group: int) -> QuantizationConfig:
    def scheme(bits: int, group: int) -> WeightScheme:
        return WeightScheme("pack-quantized", bits, "int", sym, "group", group, scale_dtype="float16")

    return QuantizationConfig(groups=(("experts", (EXPERTS,), scheme(expert_bits, expert_group)),
                                      ("rest", ("Linear",), scheme(4, 32))), ignore=IGNORE)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    """The tiny model in bf16: every value (norms, A_log, dt_bias included) is exact in bf16, so a bf16 folder and
    a float32 model hold the same numbers."""
    return save_hf(make_hf_model(tiny_text_config(), seed=0, dtype=torch.bfloat16), tmp_path_factory.mktemp("src"))


@pytest.fixture(scope="module")
def exported(source, tmp_path_factory) -> dict[str, tuple]:
    """recipe → (quantized float32 qjax model, its logits on IDS, written folder)."""
    from qjax.autoround.rtn import quantize_model

    dense = qjax.load_model(source, dtype=jnp.float32)
    models: dict[tuple, tuple] = {}  # one quantized model (and one forward compile) per recipe
    out = {}
    for name, (sym, bits, group, packing, _, layer_config) in RECIPES.items():
        if (sym, bits, group) not in models:
            qm = quantize_model(dense, _qconfig(sym, bits, group))
            models[sym, bits, group] = (qm, np.asarray(qm(IDS)))
        qm, logits = models[sym, bits, group]
        # tuning: what auto-round records for its own iters=0 RTN run (the one non-default key)
        folder = save_autoround(qm, tmp_path_factory.mktemp(name) / "ar", dtype=jnp.bfloat16, packing_format=packing,
                                layer_config=layer_config, tuning={"enable_quanted_input": False})
        out[name] = (qm, logits, folder)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# an independent decoder of the three layouts
# ---------------------------------------------------------------------------------------------------------------------
def _unpack(words: np.ndarray, bits: int, order=None) -> np.ndarray:
    """int32 [..., W] → unsigned fields [..., W·32/b], field i of a word read from slot order[i]."""
    per = 32 // bits
    slots = np.arange(per) if order is None else np.asarray(order)
    u = (words.view(np.uint32)[..., None] >> (slots * bits).astype(np.uint32)) & ((1 << bits) - 1)
    return u.reshape(*words.shape[:-1], -1).astype(np.int64)


def decode(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, bits: int, fmt: str):
    """(levels u − zp [N, K] int, scales [N, G] float16) of one auto-round layer."""
    if fmt == "auto_round:auto_awq":
        u = _unpack(qweight, bits, _AWQ_ORDER).T  # [K, N/8 words] → [N, K]
        zp = _unpack(qzeros, bits, _AWQ_ORDER)
    else:
        u = _unpack(qweight.T, bits)  # words run along K: [N, K]
        zp = _unpack(qzeros, bits) + (1 if fmt == "auto_round:auto_gptq" else 0)  # GPTQ v1 stores zp − 1
    group = u.shape[1] // scales.shape[0]
    return u - np.repeat(zp.T, group, axis=1), scales.T


def test_packers_match_autoround_bit_for_bit() -> None:
    """ct_to_autoround packs exactly what auto-round's own QuantLinear / WQLinear_GEMM pack for the same levels."""
    pytest.importorskip("auto_round")
    from auto_round.export.export_to_awq.utils import WQLinear_GEMM
    from auto_round_extension.torch import qlinear_torch, qlinear_torch_zp

    from qjax.checkpoint.auto_round import autoround_to_ct, ct_to_autoround

    rng = np.random.default_rng(1)
    cases = [("auto_round:auto_gptq", 2, True), ("auto_round:auto_gptq", 4, True), ("auto_round:auto_gptq", 8, True),
             ("auto_round", 2, False), ("auto_round", 4, False), ("auto_round", 8, True),
             ("auto_round:auto_awq", 4, False), ("auto_round:auto_awq", 4, True)]
    n, k, gs = 64, 96, 32
    for fmt, bits, sym in cases:
        half = 1 << (bits - 1)
        u = rng.integers(0, 1 << bits, (n, k))
        zp = np.full((n, k // gs), half) if sym else rng.integers(0, 1 << bits, (n, k // gs))
        s = (rng.standard_normal((n, k // gs)) * 0.01).astype(np.float16)
        # (u − zp)·s is exact in float32, so auto-round's round(W/s + zp) recovers u exactly
        w = (u - np.repeat(zp, gs, 1)) * np.repeat(s.astype(np.float32), gs, 1)
        lin = torch.nn.Linear(k, n, bias=False)
        lin.weight.data = torch.tensor(w, dtype=torch.float32)
        st, zt = torch.tensor(s.astype(np.float32)), (half if sym else torch.tensor(zp, dtype=torch.float32))
        if fmt == "auto_round:auto_awq":
            ref = WQLinear_GEMM.from_linear(lin, bits, gs, scales=st.t().contiguous(),
                                            zeros=zt if sym else zt.t().contiguous())
        else:
            mod = qlinear_torch_zp if fmt == "auto_round:auto_gptq" else qlinear_torch
            ref = mod.QuantLinear(bits, gs, k, n, False)
            ref.device = "cpu"  # pack_248_bits reads it (set by auto-round's pack_layer)
            ref.pack(lin, st, zt, None)
        packed = pack_int32((u - half).astype(np.int8), bits)
        ours = ct_to_autoround(packed, s, None if sym else (zp - half).astype(np.int8), bits=bits, packing_format=fmt)
        for field in ("qweight", "qzeros", "scales"):
            theirs = getattr(ref, field).numpy()
            assert theirs.dtype == ours[field].dtype and theirs.shape == ours[field].shape, (fmt, bits, field)
            assert np.array_equal(theirs.view(np.uint8), ours[field].view(np.uint8)), (fmt, bits, sym, field)
        back, scale, zero = autoround_to_ct(ours["qweight"], ours["qzeros"], ours["scales"], bits=bits, sym=sym,
                                            packing_format=fmt)
        assert np.array_equal(back, packed) and np.array_equal(scale, s)
        assert (zero is None) == sym and (sym or np.array_equal(zero, zp - half))


# ---------------------------------------------------------------------------------------------------------------------
# round trip
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_written_tensors_decode_to_the_model_bit_for_bit(exported, recipe: str) -> None:
    qm, _, folder = exported[recipe]
    fmt = RECIPES[recipe][4]
    qc = json.load(open(os.path.join(folder, "quantization_config.json")))
    assert qc["packing_format"] == fmt
    assert json.load(open(os.path.join(folder, "config.json")))["quantization_config"] == qc
    disk = load_file(os.path.join(folder, "model.safetensors"))
    ct = {k: get for k, _, get in checkpoint_tensors(qm, dtype=jnp.bfloat16)}
    modules = sorted(k[: -len(".qweight")] for k in disk if k.endswith(".qweight"))
    assert len(modules) == QUANTIZED_MODULES
    for name in modules:
        bits = qc["extra_config"].get(name, {}).get("bits", qc["bits"])
        levels, scales = decode(disk[f"{name}.qweight"], disk[f"{name}.qzeros"], disk[f"{name}.scales"], bits, fmt)
        n, k = levels.shape
        q = unpack_int32(ct[f"{name}.weight_packed"](), bits, k).astype(np.int64)
        zp = ct.get(f"{name}.weight_zero_point")
        if zp is not None:
            q = q - np.repeat(unpack_zero_point(zp(), bits, n).astype(np.int64), k // scales.shape[1], axis=1)
        assert np.array_equal(levels, q), name
        assert scales.dtype == np.float16 and np.array_equal(scales.view(np.uint16),
                                                             ct[f"{name}.weight_scale"]().view(np.uint16)), name
        if name in SAMPLED:  # qjax's runtime dequantization (rounded once to the scale dtype); a sample: it is slow
            dequant = (levels * np.repeat(scales.astype(np.float32), k // scales.shape[1], axis=1)).astype(np.float16)
            assert np.array_equal(dequant.astype(np.float32), module_weight(qm, name)), name
    dense = {k: v for k, v in disk.items() if k.rpartition(".")[2] not in ("qweight", "qzeros", "scales")}
    assert set(dense) == {k for k in ct if k.rpartition(".")[0] not in modules}
    for key, arr in dense.items():  # as save_pretrained writes them
        want = ct[key]()
        assert arr.dtype == want.dtype and np.array_equal(arr.view(np.uint8), want.view(np.uint8)), key


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_qjax_load_model_reads_it_back_identically(exported, recipe: str) -> None:
    _, want, folder = exported[recipe]
    back = qjax.load_model(folder, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(back(IDS)), want)


@pytest.mark.parametrize("recipe", ["sym_w4_w2experts", "asym_w4_native"])
def test_transformers_loads_it_with_autoround(exported, recipe: str) -> None:
    """transformers + auto-round (CPU torch kernels) give qjax's logits.

    auto-round's CPU kernels compute in fp16/bf16 only (it forces the model to fp16 unless loaded in bf16), so the
    model is loaded in bf16 — the dtype the dense tensors are stored in — and then cast to float32, except the
    scales: kept in float16, its kernel dequantizes ``scales · (q − zp)`` rounded once to float16, which is exactly
    qjax's (and compressed-tensors') dequantization in the scale dtype. What remains is float32 op order in two
    implementations of the same math: 1e-4, as for the dense writer (measured ≈ 1–3e-5).
    """
    pytest.importorskip("auto_round")
    from oracles.autoround import isolated

    _, want, folder = exported[recipe]
    out = os.path.join(folder, "..", f"{recipe}-transformers-logits.npy")
    n_quantized = isolated("transformers_autoround_logits_here", folder=folder, ids=IDS.tolist(), out=out)
    assert n_quantized == QUANTIZED_MODULES
    theirs = np.load(out)
    assert np.abs(theirs - want).max() <= 1e-4


# ---------------------------------------------------------------------------------------------------------------------
# against auto-round's own output
# ---------------------------------------------------------------------------------------------------------------------
def _autoround_folder(source: str, out: str, recipe: str) -> str:
    from oracles.autoround import isolated

    sym, _, _, _, _, layer_config = RECIPES[recipe]
    return isolated("autoround_export_here", source=source, out=out, sym=sym, layer_config=layer_config)


def _headers(folder: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    from qjax.checkpoint.safetensors_io import SafetensorsFile

    f = SafetensorsFile(os.path.join(folder, "model.safetensors"))
    try:
        return {k: (f.dtype(k), tuple(f.shape(k))) for k in f.keys()}
    finally:
        f.close()


@pytest.mark.parametrize("recipe", ["sym_w4_w2experts", "asym_w4"])
def test_same_structure_as_autoround(exported, source, tmp_path, recipe: str) -> None:
    """Same quantization_config (key order included), tensor names, dtypes and shapes as auto-round 0.16.1 for the
    same recipe. Packed values differ: qjax's RTN is compressed-tensors' rule, not auto-round's."""
    pytest.importorskip("auto_round")
    theirs = _autoround_folder(source, str(tmp_path / "ar"), recipe)
    ours = exported[recipe][2]
    their_qc = json.load(open(os.path.join(theirs, "quantization_config.json")))
    our_qc = json.load(open(os.path.join(ours, "quantization_config.json")))
    assert our_qc == their_qc
    assert list(our_qc) == list(their_qc)
    assert json.load(open(os.path.join(ours, "config.json")))["quantization_config"] == \
        json.load(open(os.path.join(theirs, "config.json")))["quantization_config"]
    assert _headers(ours) == _headers(theirs)
    # qjax loads auto-round's own folder: its runtime weights are the independent decoder's, rounded to float16
    back = qjax.load_model(theirs, dtype=jnp.float32)
    disk = load_file(os.path.join(theirs, "model.safetensors"))
    for name in sorted(SAMPLED):
        bits = their_qc["extra_config"].get(name, {}).get("bits", their_qc["bits"])
        levels, scales = decode(disk[f"{name}.qweight"], disk[f"{name}.qzeros"], disk[f"{name}.scales"], bits,
                                their_qc["packing_format"])
        dequant = levels * np.repeat(scales.astype(np.float32), levels.shape[1] // scales.shape[1], axis=1)
        assert np.array_equal(dequant.astype(np.float16).astype(np.float32), module_weight(back, name)), name


# ---------------------------------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------------------------------
def test_existing_target_refused_and_failed_write_leaves_nothing(exported, tmp_path, monkeypatch) -> None:
    qm = exported["sym_w4_w2experts"][0]
    target = tmp_path / "ckpt"
    save_autoround(qm, target)
    with pytest.raises(FileExistsError, match="already exists"):
        save_autoround(qm, target)

    from qjax.convert import hf_writer

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(hf_writer, "write_safetensors", boom)  # the shared shard writer
    with pytest.raises(OSError, match="disk full"):
        save_autoround(qm, tmp_path / "new")
    with pytest.raises(OSError, match="disk full"):
        save_autoround(qm, target, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary folders left behind
    monkeypatch.undo()
    assert qjax.load_model(target) is not None  # the old folder is intact


def test_refuses_what_the_format_cannot_hold(source, exported, tmp_path) -> None:
    from qjax.autoround.rtn import quantize_model

    dense = qjax.load_model(source)
    with pytest.raises(AutoRoundError, match="not quantized"):
        save_autoround(dense, tmp_path / "dense")
    # in_proj_a/b have 4 output rows: auto-round cannot pack them (it would leave them 16-bit)
    all_linear = QuantizationConfig(groups=(("all", ("Linear",), WeightScheme("pack-quantized", 4, "int", True,
                                                                               "group", 32)),),
                                    ignore=("lm_head", "re:.*shared_expert_gate$"))
    with pytest.raises(AutoRoundError, match="multiples of 32"):
        save_autoround(quantize_model(dense, all_linear), tmp_path / "odd")
    mxfp8 = QuantizationConfig(groups=(("mx", (EXPERTS,), WeightScheme("mxfp8-quantized", 8, "float", True, "group",
                                                                        32, scale_dtype="uint8")),))
    with pytest.raises(AutoRoundError, match="MXFP8"):
        save_autoround(quantize_model(dense, mxfp8), tmp_path / "mx")
    qm = exported["asym_w4"][0]
    with pytest.raises(AutoRoundError, match="symmetric layers only"):
        save_autoround(qm, tmp_path / "gptq", packing_format="auto_round:auto_gptq")
    with pytest.raises(AutoRoundError, match="matches no linear layer"):
        save_autoround(qm, tmp_path / "typo", layer_config={"mlp.expert_s": {"bits": 2}})
    with pytest.raises(AutoRoundError, match="says"):
        save_autoround(qm, tmp_path / "wrong", layer_config={".*experts.*": {"bits": 2}})
    with pytest.raises(AutoRoundError, match="unknown tuning keys"):
        save_autoround(qm, tmp_path / "tuning", tuning={"iterations": 10})
    assert sorted(os.listdir(tmp_path)) == []


def test_packing_choice_follows_autoround() -> None:
    """``AutoRoundFormat``: symmetric → GPTQ; asymmetric all 4-bit → AWQ; other asymmetric → native."""
    from qjax.convert.autoround_writer import _pick_packing

    assert _pick_packing([(4, 32, True), (2, 16, True)], None) == "auto_round:auto_gptq"
    assert _pick_packing([(4, 32, False), (4, -1, False)], None) == "auto_round:auto_awq"
    assert _pick_packing([(4, 32, False), (2, 16, False)], None) == "auto_round"
    with pytest.raises(AutoRoundError, match="4-bit"):
        _pick_packing([(4, 32, False), (2, 16, False)], "auto_round:auto_awq")
    with pytest.raises(AutoRoundError, match="symmetric and asymmetric"):
        _pick_packing([(4, 32, True), (2, 16, False)], None)


def test_int8_channel_lm_head_round_trip(source, tmp_path) -> None:
    """A quantized lm_head (outside the blocks: its whole scheme in extra_config), per-channel int8 scales
    (group_size -1) and a divisible-but-unquantized shared expert ({"bits": 16, "data_type": "float"})."""
    from flax import nnx

    from qjax.autoround.rtn import quantize_model

    def scheme(bits: int, strategy: str, group: int | None) -> WeightScheme:
        return WeightScheme("pack-quantized", bits, "int", True, strategy, group, scale_dtype="float16")

    qc = QuantizationConfig(groups=(("head", ("lm_head",), scheme(8, "channel", None)),
                                    ("rest", ("Linear",), scheme(4, "group", 32))),
                            ignore=("re:.*in_proj_[ab]$", "re:.*shared_expert_gate$", "re:.*shared_expert\\..*"))
    qm = quantize_model(qjax.load_model(source, dtype=jnp.float32), qc)
    folder = save_autoround(qm, tmp_path / "ar")
    extra = json.load(open(os.path.join(folder, "config.json")))["quantization_config"]["extra_config"]
    assert extra["lm_head"] == {"bits": 8, "group_size": -1, "sym": True, "data_type": "int"}
    assert extra["model.layers.0.mlp.shared_expert.up_proj"] == {"bits": 16, "data_type": "float"}
    assert extra["model.layers.0.linear_attn.in_proj_a"] == {"bits": 16, "data_type": "fp"}
    back = dict(nnx.to_flat_state(nnx.state(qjax.load_model(folder))))
    for path, var in nnx.to_flat_state(nnx.state(qm)):  # the same arrays, dtypes included
        a, b = np.asarray(var.get_value()), np.asarray(back[path].get_value())
        assert a.dtype == b.dtype and np.array_equal(a, b), path
