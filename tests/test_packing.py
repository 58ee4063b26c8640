"""qjax.quant.packing against compressed-tensors (the oracle): packing, RTN quantizers, MXFP8, dequantization."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from compressed_tensors.compressors.base import BaseCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import calculate_qparams
from qjax.kernels import unpack_int
from qjax.kernels.qmatmul_reference import e8m0_to_float32 as device_e8m0_to_float32

from qjax.quant import WeightScheme
from qjax.quant.packing import (
    dequantize,
    e4m3_to_float32,
    e8m0_to_float32,
    float32_to_e4m3,
    pack_int32,
    pack_zero_point,
    quantize_int,
    quantize_mxfp8,
    unpack_int32,
    unpack_zero_point,
)

BF16 = ml_dtypes.bfloat16
TORCH_TO_NP = {torch.float32: np.dtype(np.float32), torch.bfloat16: np.dtype(BF16), torch.float16: np.dtype(np.float16)}
COLS = (37, 100, 130)


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def t2n(t: torch.Tensor) -> np.ndarray:
    """torch -> numpy keeping bf16 / float8 bit patterns (torch.numpy() refuses those dtypes)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def n2t(a: np.ndarray) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if a.dtype == ml_dtypes.float8_e4m3fn:
        return torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(a)


def random_q(bits: int, shape: tuple[int, ...], seed: int) -> np.ndarray:
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1))
    q = rng(seed).integers(lo, hi, size=shape).astype(np.int8)
    q.reshape(-1)[:2] = (lo, hi - 1)  # both extremes present
    return q


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit for bit, except that any NaN equals any NaN (payloads and NaN signs are not part of the formats)."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind in "iub" or a.dtype.itemsize == 1:
        return a.tobytes() == b.tobytes()
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    both_nan = np.isnan(a32) & np.isnan(b32)
    same = (a32 == b32) & (np.signbit(a32) == np.signbit(b32))  # tells -0.0 from +0.0
    return bool(np.all(both_nan | same))


# ---------------------------------------------------------------------------------------------------------------------
# packing
# ---------------------------------------------------------------------------------------------------------------------
def test_worked_examples() -> None:
    """docs/formats.md §4's worked examples."""
    q2 = np.array([[-2, -1, 0, 1, 1, 0, -1, -2, 0, 0, 1, 1, -2, -2, -1, 0]], np.int8)
    p2 = pack_int32(q2, 2)
    assert p2.dtype == np.int32 and p2.shape == (1, 1)
    assert p2.view(np.uint32)[0, 0] == 0x90FA1BE4 and p2[0, 0] == -1862657052
    assert p2.astype("<i4").tobytes() == bytes([0xE4, 0x1B, 0xFA, 0x90])
    assert np.array_equal(unpack_int32(p2, 2, 16), q2)
    assert pack_int32(np.array([-8, -7, -1, 0, 1, 2, 6, 7], np.int8), 4).view(np.uint32)[0] == 0xFEA98710
    assert pack_int32(np.array([-128, -1, 0, 127], np.int8), 8).view(np.uint32)[0] == 0xFF807F00
    zp_word = np.array([[0xA8796787]], np.uint32).view(np.int32)
    assert unpack_zero_point(zp_word, 4, 8).ravel().tolist() == [-1, 0, -1, -2, 1, -1, 0, 2]


@pytest.mark.parametrize(("bits", "cols", "words"), [(4, 100, 13), (2, 37, 3), (8, 30, 8), (4, 128, 16), (2, 128, 8)])
def test_packed_widths(bits: int, cols: int, words: int) -> None:
    q = random_q(bits, (3, cols), seed=cols)
    packed = pack_int32(q, bits)
    assert packed.shape == (3, words)
    # Padding fields are zero (they would decode to -2^(b-1)), so only a cut row round-trips.
    assert np.array_equal(unpack_int32(packed, bits, cols), q)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("cols", COLS)
def test_pack_matches_compressed_tensors(bits: int, cols: int) -> None:
    q = random_q(bits, (11, cols), seed=bits * 1000 + cols)
    ref = pack_to_int32(torch.from_numpy(q), bits).numpy()
    packed = pack_int32(q, bits)
    assert packed.dtype == np.int32 and bits_equal(packed, ref)
    assert np.array_equal(unpack_int32(packed, bits, cols), q)
    assert np.array_equal(unpack_from_int32(torch.from_numpy(packed), bits, torch.Size(q.shape)).numpy(), q)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_3d_is_per_slice(bits: int) -> None:
    """A fused [E, N, K] tensor packs each [N, K] slice independently (compressed-tensors stacks slices)."""
    q = random_q(bits, (3, 9, 100), seed=bits)
    ref = pack_to_int32(torch.from_numpy(q), bits).numpy()
    packed = pack_int32(q, bits)
    assert bits_equal(packed, ref) and packed.shape == (3, 9, math.ceil(100 * bits / 32))
    assert np.array_equal(unpack_int32(packed, bits, 100), q)
    assert np.array_equal(unpack_from_int32(torch.from_numpy(packed), bits, torch.Size(q.shape)).numpy(), q)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("rows", [4, 37, 100, 130])
def test_zero_point_matches_compressed_tensors(bits: int, rows: int) -> None:
    zp = random_q(bits, (rows, 3), seed=rows + bits)
    ref = pack_to_int32(torch.from_numpy(zp), bits, packed_dim=0).numpy()
    packed = pack_zero_point(zp, bits)
    assert packed.shape == (math.ceil(rows * bits / 32), 3) and bits_equal(packed, ref)
    assert np.array_equal(unpack_zero_point(packed, bits, rows), zp)
    back = unpack_from_int32(torch.from_numpy(packed), bits, torch.Size(zp.shape), packed_dim=0).numpy()
    assert np.array_equal(back, zp)
    # 3-D (fused experts): per slice along the rows.
    zp3 = np.stack([zp, zp[::-1]])
    assert bits_equal(pack_zero_point(zp3, bits), pack_to_int32(torch.from_numpy(zp3), bits, packed_dim=0).numpy())
    assert np.array_equal(unpack_zero_point(pack_zero_point(zp3, bits), bits, rows), zp3)


def test_pack_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="signed 4-bit range"):
        pack_int32(np.array([8], np.int8), 4)
    with pytest.raises(TypeError):
        pack_int32(np.array([0.5]), 4)
    with pytest.raises(ValueError, match="num_bits"):
        pack_int32(np.array([0], np.int8), 9)
    with pytest.raises(ValueError, match="need 13 int32 words"):
        unpack_int32(np.zeros((2, 12), np.int32), 4, 100)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("cols", COLS)
def test_device_unpack_matches_numpy(bits: int, cols: int) -> None:
    q = random_q(bits, (2, 5, cols), seed=cols * bits)
    packed = pack_int32(q, bits)
    # the device decode the kernels' references use (qjax.kernels.unpack_int) against this host codec
    out = jax.jit(unpack_int, static_argnums=(1, 2))(jnp.asarray(packed), bits, cols)
    assert out.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out), unpack_int32(packed, bits, cols))
    np.testing.assert_array_equal(np.asarray(out), q.astype(np.int32))


# ---------------------------------------------------------------------------------------------------------------------
# float8 helpers
# ---------------------------------------------------------------------------------------------------------------------
def test_e8m0_decode() -> None:
    u = np.arange(256, dtype=np.uint8)
    got = e8m0_to_float32(u)
    # compressed-tensors' decompress_mx_scale evaluates 2 ** (u - 127) in bf16: exact for every byte, 255 -> inf.
    ref = (2.0 ** (torch.from_numpy(u).to(torch.int32) - 127).to(torch.bfloat16)).float().numpy()
    assert bits_equal(got, ref)
    assert got[0] == 2.0**-127 and got[127] == 1.0 and got[254] == 2.0**127 and np.isposinf(got[255])
    assert bits_equal(np.asarray(jax.jit(device_e8m0_to_float32)(jnp.asarray(u))), got)  # the kernels' decode
    if hasattr(ml_dtypes, "float8_e8m0fnu"):
        assert bits_equal(e8m0_to_float32(u.view(ml_dtypes.float8_e8m0fnu)), got)


def test_e4m3_helpers() -> None:
    raw = np.arange(256, dtype=np.uint8)
    got = e4m3_to_float32(raw)
    ref = torch.from_numpy(raw).view(torch.float8_e4m3fn).float().numpy()
    assert bits_equal(got, ref)
    assert np.isnan(got[0x7F]) and np.isnan(got[0xFF]) and got[0x7E] == 448.0
    assert bits_equal(e4m3_to_float32(raw.view(ml_dtypes.float8_e4m3fn)), got)
    x = np.array([1000.0, -1e9, 460.0, 0.3, np.nan, 2.0**-10], np.float32)
    enc = float32_to_e4m3(x)
    # torch's cast saturates (ml_dtypes alone would give NaN for |x| >= 464).
    assert bits_equal(enc.view(np.uint8), n2t(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy())


# ---------------------------------------------------------------------------------------------------------------------
# INT quantization vs compressed-tensors
# ---------------------------------------------------------------------------------------------------------------------
def ct_int_reference(w: torch.Tensor, bits: int, symmetric: bool, strategy: str, group_size: int | None,
                     scale_dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], QuantizationScheme]:
    """The llmcompressor flow: min/max observer -> calculate_qparams -> pack-quantized compressor."""
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group_size,
                            scale_dtype=scale_dtype)
    if strategy == "group":
        g = w.unflatten(-1, (w.shape[-1] // group_size, group_size))
        mn, mx = g.amin(-1), g.amax(-1)
    elif strategy == "channel":
        mn, mx = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    else:
        mn, mx = torch.aminmax(w)
    scale, zp = calculate_qparams(mn, mx, args)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")
    q = ct_quantize(w, scale, zp, args, dtype=torch.int8)
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    out = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
    return {"q": q, "scale": scale, "zp": zp, **out}, scheme


STRATEGIES = [("group", 20), ("group", 50), ("channel", None), ("tensor", None)]


def weights(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * 0.05 + torch.rand(shape[-2], 1, generator=g) * 0.02  # off-centre rows
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(("strategy", "group_size"), STRATEGIES)
def test_quantize_int_matches_compressed_tensors(dtype: torch.dtype, bits: int, symmetric: bool, strategy: str,
                                                 group_size: int | None) -> None:
    w = weights((37, 100), seed=bits * 7 + symmetric, dtype=dtype)
    ref, _ = ct_int_reference(w, bits, symmetric, strategy, group_size)
    q, scale, zp = quantize_int(t2n(w), bits, symmetric=symmetric, strategy=strategy, group_size=group_size)
    assert q.dtype == np.int8 and np.array_equal(q, ref["q"].numpy())
    assert scale.dtype == TORCH_TO_NP[dtype] and bits_equal(scale, t2n(ref["weight_scale"]))
    assert bits_equal(pack_int32(q, bits), ref["weight_packed"].numpy())
    if symmetric:
        assert zp is None and "weight_zero_point" not in ref
    else:
        assert zp.dtype == np.int8 and np.array_equal(zp, ref["zp"].numpy())
        stored = ref["weight_zero_point"].numpy()
        # group/channel zero points are packed along rows; tensor ones are stored as plain int8 [1].
        assert bits_equal(pack_zero_point(zp, bits) if strategy != "tensor" else zp, stored)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_int_ties(dtype: torch.dtype, symmetric: bool) -> None:
    """Coarse-grid weights put w / scale on exact .5 ties, where rounding in the weight dtype matters."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randint(-40, 41, (33, 64), generator=g) * 0.25 + torch.randint(0, 2, (33, 64), generator=g) * 0.125)
    w = w.to(dtype)
    for bits in (2, 4, 8):
        for strategy, gs in (("group", 16), ("channel", None), ("tensor", None)):
            ref, _ = ct_int_reference(w, bits, symmetric, strategy, gs)
            q, scale, zp = quantize_int(t2n(w), bits, symmetric=symmetric, strategy=strategy, group_size=gs)
            assert np.array_equal(q, ref["q"].numpy()), (bits, strategy)
            assert bits_equal(scale, t2n(ref["weight_scale"]))
            assert symmetric or np.array_equal(zp, ref["zp"].numpy())


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_int_scale_dtype(scale_dtype: torch.dtype, symmetric: bool) -> None:
    """float32 weights with QuantizationArgs.scale_dtype: scales rounded to it, quantized in float32."""
    w = weights((40, 96), seed=3, dtype=torch.float32)
    for bits in (2, 4, 8):
        for strategy, gs in (("group", 32), ("channel", None), ("tensor", None)):
            ref, _ = ct_int_reference(w, bits, symmetric, strategy, gs, scale_dtype=scale_dtype)
            q, scale, zp = quantize_int(w.numpy(), bits, symmetric=symmetric, strategy=strategy, group_size=gs,
                                        scale_dtype=TORCH_TO_NP[scale_dtype])
            assert scale.dtype == TORCH_TO_NP[scale_dtype]
            assert np.array_equal(q, ref["q"].numpy()) and bits_equal(scale.astype(np.float32), ref["scale"].numpy())
            assert symmetric or np.array_equal(zp, ref["zp"].numpy())


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_int_zero_groups(symmetric: bool) -> None:
    """All-zero groups: scale -> the dtype's eps; asymmetric zp = qmin - 0/0 = NaN, which torch casts to 0."""
    w = weights((4, 64), seed=8, dtype=torch.bfloat16)
    w[1] = 0.0
    w[2, :32] = 0.0
    ref, _ = ct_int_reference(w, 4, symmetric, "group", 32)
    q, scale, zp = quantize_int(t2n(w), 4, symmetric=symmetric, strategy="group", group_size=32)
    assert np.array_equal(q, ref["q"].numpy()) and bits_equal(scale, t2n(ref["weight_scale"]))
    assert float(scale[1, 0]) == float(ml_dtypes.finfo(BF16).eps) and not q[1].any()
    assert symmetric or (np.array_equal(zp, ref["zp"].numpy()) and zp[1, 0] == 0)


def test_quantize_int_3d_and_errors() -> None:
    w = weights((3, 8, 64), seed=4, dtype=torch.bfloat16)
    q, scale, _ = quantize_int(t2n(w), 4, strategy="group", group_size=32)
    assert q.shape == (3, 8, 64) and scale.shape == (3, 8, 2)
    for e in range(3):
        q_e, s_e, _ = quantize_int(t2n(w[e]), 4, strategy="group", group_size=32)
        assert np.array_equal(q[e], q_e) and bits_equal(scale[e], s_e)
    with pytest.raises(ValueError, match="not divisible by group_size"):
        quantize_int(np.ones((4, 100), np.float32), 4, strategy="group", group_size=32)
    with pytest.raises(ValueError, match="needs float32 weights"):
        quantize_int(np.ones((4, 64), BF16), 4, strategy="channel", scale_dtype=np.float16)
    with pytest.raises(ValueError, match="strategy"):
        quantize_int(np.ones((4, 64), np.float32), 4, strategy="block")


# ---------------------------------------------------------------------------------------------------------------------
# MXFP8 vs compressed-tensors
# ---------------------------------------------------------------------------------------------------------------------
MX_ARGS = dict(num_bits=8, type="float", strategy="group", group_size=32, scale_dtype=torch.uint8, symmetric=True)
MX_SCHEME = WeightScheme("mxfp8-quantized", 8, "float", True, "group", 32, "uint8")


def mx_weights(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 128, generator=g) * torch.logspace(-4, 3, 48)[:, None]
    w[0, :32] = 0.0  # all-zero group -> u8 0
    w[1, :32] = 0.01
    w[1, 5] = 1.75  # amax mantissa exactly 1.75: rounds up to the next power of two
    w[2, 32:64] = 1.7421875  # just below: rounds down
    w[3, :] = -0.0
    w[4, :32] = 1e-30  # tiny group
    w[5, 64:96] = 2.0**100
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_mxfp8_matches_compressed_tensors(dtype: torch.dtype) -> None:
    w = mx_weights(dtype)
    args = QuantizationArgs(**MX_ARGS)
    g = w.unflatten(-1, (4, 32))
    scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format="mxfp8-quantized")
    compressor = BaseCompressor.get_value_from_registry("mxfp8-quantized")
    ref = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
    values, u8 = quantize_mxfp8(t2n(w))
    assert values.dtype == ml_dtypes.float8_e4m3fn and u8.dtype == np.uint8 and u8.shape == (48, 4)
    assert bits_equal(u8, ref["weight_scale"].numpy())
    assert bits_equal(values, t2n(ref["weight"]))
    assert u8[0, 0] == 0 and u8[1, 0] == 127 + 1 - 8 and u8[2, 1] == 127 + 0 - 8

    # Decompression: compressed-tensors returns bf16; our float32 cast to bf16 must match bit for bit.
    dec = compressor.decompress({"weight": ref["weight"], "weight_scale": ref["weight_scale"]}, scheme)["weight"]
    mine = dequantize(MX_SCHEME, weight=values, scale=u8, shape=(48, 128))
    assert mine.dtype == np.float32 and dec.dtype == torch.bfloat16
    assert bits_equal(mine.astype(BF16), t2n(dec))
    # Raw bytes work as well as float8 arrays.
    assert bits_equal(dequantize(MX_SCHEME, weight=values.view(np.uint8), scale=u8, shape=(48, 128)), mine)


def test_quantize_mxfp8_overflow_and_errors() -> None:
    w = np.full((2, 32), 3.0e38, np.float32)  # amax rounds to 2^128: compressed-tensors' scale overflows to inf
    values, u8 = quantize_mxfp8(w)
    assert u8.max() == 254 and np.isfinite(dequantize(MX_SCHEME, weight=values, scale=u8, shape=(2, 32))).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp8(np.ones((2, 48), np.float32))
    with pytest.raises(TypeError):
        quantize_mxfp8(np.ones((2, 32), np.float16))


# ---------------------------------------------------------------------------------------------------------------------
# pack-quantized dequantization vs compressed-tensors' decompression
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(("strategy", "group_size"), [("group", 26), ("channel", None), ("tensor", None)])
def test_dequantize_matches_compressed_tensors(dtype: torch.dtype, bits: int, symmetric: bool, strategy: str,
                                               group_size: int | None) -> None:
    w = weights((37, 130), seed=bits + 11 * symmetric, dtype=dtype)
    ref, scheme = ct_int_reference(w, bits, symmetric, strategy, group_size)
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    stored = {k: v for k, v in ref.items() if k.startswith("weight_")}
    dec = compressor.decompress(stored, scheme)["weight"]
    ws = WeightScheme("pack-quantized", bits, "int", symmetric, strategy, group_size, None)
    mine = dequantize(
        ws,
        packed=stored["weight_packed"].numpy(),
        scale=t2n(stored["weight_scale"]),
        zero_point=None if symmetric else stored["weight_zero_point"].numpy(),
        shape=stored["weight_shape"].numpy(),
    )
    assert mine.dtype == np.float32 and mine.shape == (37, 130)
    assert dec.dtype == dtype and bits_equal(mine.astype(TORCH_TO_NP[dtype]), t2n(dec))
    # The float32 result is the exact product (q - zp) * scale.
    q = unpack_int32(stored["weight_packed"].numpy(), bits, 130).astype(np.float64)
    zp = 0.0 if symmetric else ref["zp"].numpy().astype(np.float64)
    s = ref["scale"].float().numpy().astype(np.float64)
    if strategy == "group":
        zp = zp if symmetric else np.repeat(zp, group_size, axis=-1)
        s = np.repeat(s, group_size, axis=-1)
    assert np.array_equal(mine.astype(np.float64), (q - zp) * s)


def test_dequantize_3d_and_shape_checks() -> None:
    w = weights((2, 16, 64), seed=9, dtype=torch.bfloat16)
    ref, scheme = ct_int_reference(w, 4, False, "group", 32)
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    stored = {k: v for k, v in ref.items() if k.startswith("weight_")}
    dec = compressor.decompress(stored, scheme)["weight"]
    ws = WeightScheme("pack-quantized", 4, "int", False, "group", 32, None)
    args = dict(packed=stored["weight_packed"].numpy(), scale=t2n(stored["weight_scale"]),
                zero_point=stored["weight_zero_point"].numpy())
    mine = dequantize(ws, **args, shape=(2, 16, 64))
    assert bits_equal(mine.astype(BF16), t2n(dec))
    with pytest.raises(ValueError, match="scale for weight"):
        dequantize(ws, **{**args, "scale": args["scale"][..., :1]}, shape=(2, 16, 64))
    with pytest.raises(ValueError, match="needs `zero_point`"):
        dequantize(ws, **{**args, "zero_point": None}, shape=(2, 16, 64))
    with pytest.raises(ValueError, match="int32 words"):
        dequantize(ws, **args, shape=(2, 16, 56))  # right scale width, wrong word count
