"""A GGUF matrix as onnxruntime's ``MatMulNBits`` holds it: the file's own integers and scales.

Every block type llama.cpp writes stores a block of weights as ``scale * q + offset`` with
small integers ``q``: Q4_0 and Q8_0 have no offset, Q4_1/Q5_1 a per-block minimum, the
K-quants sub-blocks of 16 or 32 with their own scales and minimums. ``MatMulNBits``
computes ``(code - zero_point) * scale`` per block along the input dimension (bits 4 or
8, blocks a power of two from 16). So each type maps onto it with codes and scales taken
from the file unchanged:

========  =====  =====  =======================================================
type      bits   block  how
========  =====  =====  =======================================================
Q4_0      4      32     exact: code = q, default zero point 8
Q4_1      4      32     exact: code = q, offset ``m + 8d`` added by the graph
Q5_0      8      32     exact: code = q + 112 (q - 16 + 128), default zero point 128
Q5_1      8      32     exact, with offset ``m + 16d``
Q8_0      8      32     exact: code = q + 128
Q2_K      4      16     exact, with offset ``-dmin*m + 8*d*sc``
Q4_K      4      32     exact, with offset ``-dmin*m + 8*d*sc``
Q5_K      8      32     exact, with offset ``-dmin*m + 16*d*sc``
Q6_K      8      16     exact: code = q + 96, scale ``d * sc`` (an fp16 times an int8 is
                        exact in fp32)
others    8      32     requantized from llama.cpp's own dequantization (gguf-py) to
                        8 bits, symmetric per block: the closest form that runs at speed
F16/BF16  float  -      widened to fp32 (exact)
========  =====  =====  =======================================================

The offset is a per-block constant ``o``, so ``sum_k (s*q + o) x_k`` = the ``MatMulNBits``
product plus ``blocksum(x) @ O`` with ``O`` of shape (blocks, out): a small float matmul
the graph adds (:attr:`PackedMatrix.offsets`). The codes are read by running gguf-py's
dequantizer over blocks whose scale is set to 1 and minimum to 0, so the bit layouts stay
gguf-py's (llama.cpp's own Python package), not a copy of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as Q

__all__ = ["EXACT_TYPES", "PackedMatrix", "dequantize", "pack_matrix"]


@dataclass(frozen=True, slots=True)
class PackedMatrix:
    """One weight matrix of ``out_features`` x ``in_features`` ready for the graph: either
    ``MatMulNBits`` inputs (``codes``, ``scales``, and ``offsets`` where the type has a
    minimum) or, for float types, ``dense`` (in x out, as ``MatMul`` takes it)."""

    out_features: int
    in_features: int
    bits: int = 0
    block_size: int = 0
    codes: np.ndarray | None = None
    """uint8 (out, blocks, block_size * bits / 8): the layout ``MatMulNBits`` takes."""
    scales: np.ndarray | None = None
    """float32 (out * blocks,)."""
    offsets: np.ndarray | None = None
    """float32 (blocks, out): added as ``blocksum(x) @ offsets``; ``None``: none."""
    dense: np.ndarray | None = None
    exact: bool = True
    """Whether the graph computes with the file's values unchanged (else requantized)."""

    @property
    def nbytes(self) -> int:
        arrays = (self.codes, self.scales, self.offsets, self.dense)
        return sum(a.nbytes for a in arrays if a is not None)


EXACT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})


def dequantize(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 values llama.cpp reads from ``raw`` (gguf-py's dequantizer)."""
    raw = np.ascontiguousarray(raw).view(np.uint8)
    if qtype == Q.F32:
        return raw.view(np.float32).reshape(shape)
    if qtype == Q.F16:
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    if qtype in _BLOCK_TYPES:
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, GGML_QUANT_SIZES[qtype][1])
        return np.asarray(_BLOCK_TYPES[qtype].dequantize_blocks(blocks), dtype=np.float32).reshape(shape)
    return np.asarray(quants.dequantize(np.asarray(raw), qtype), dtype=np.float32).reshape(shape)


def pack_matrix(raw: np.ndarray, qtype: Q, out_features: int, in_features: int) -> PackedMatrix:
    """``raw`` (the tensor's bytes as gguf-py maps them, one row per output feature) as
    :class:`PackedMatrix`."""
    if qtype in (Q.F32, Q.F16, Q.BF16):
        weights = dequantize(raw, qtype, (out_features, in_features))
        return PackedMatrix(out_features, in_features, dense=np.ascontiguousarray(weights.T))
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    packer = _PACKERS.get(qtype)
    if packer is None:
        return _requantized(dequantize(raw, qtype, (out_features, in_features)))
    bits, block, integers, shift, scales, offsets = packer(blocks)
    n_blocks = in_features // block
    codes = (integers + shift).reshape(out_features, n_blocks, block)
    zero = 1 << (bits - 1)
    if offsets is not None:
        # scale * q + offset = (code - zero) * scale + (zero - shift) * scale + offset.
        offsets = (offsets + (zero - shift) * scales).reshape(out_features, n_blocks).T.copy()
    return PackedMatrix(
        out_features,
        in_features,
        bits=bits,
        block_size=block,
        codes=_packed(codes, bits),
        scales=np.ascontiguousarray(scales, dtype=np.float32).reshape(-1),
        offsets=offsets,
    )


def _packed(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes (0..2^bits-1) in ``MatMulNBits``'s bytes: neighbours share a byte at 4 bits,
    the lower index in the low nibble."""
    codes = codes.astype(np.uint8)
    if bits == 8:
        return np.ascontiguousarray(codes)
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4))


def _requantized(weights: np.ndarray) -> PackedMatrix:
    """8 bits, symmetric per block of 32: for types onnxruntime has no exact form of."""
    out_features, in_features = weights.shape
    block = 32 if in_features % 32 == 0 else 16
    blocks = weights.reshape(out_features, in_features // block, block)
    scales = np.abs(blocks).max(axis=-1) / 127
    safe = np.where(scales == 0, 1, scales)
    q = np.clip(np.rint(blocks / safe[..., None]), -127, 127).astype(np.int16) + 128
    return PackedMatrix(
        out_features,
        in_features,
        bits=8,
        block_size=block,
        codes=np.ascontiguousarray(q.astype(np.uint8)),
        scales=scales.astype(np.float32).reshape(-1),
        exact=False,
    )


def _with(blocks: np.ndarray, **fields: tuple[int, float]) -> np.ndarray:
    """Copies of ``blocks`` with fp16 fields (byte offset, value) overwritten."""
    changed = blocks.copy()
    for offset, value in fields.values():
        changed[:, offset : offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return changed


def _fp16(blocks: np.ndarray, offset: int) -> np.ndarray:
    return blocks[:, offset : offset + 2].copy().view(np.float16).astype(np.float32)


def _unit(blocks: np.ndarray, qtype: Q, **fields: tuple[int, float]) -> np.ndarray:
    """gguf-py's dequantization of ``blocks`` with the named fp16 fields replaced: with the
    scale 1 and the minimum 0 it yields the integers themselves (times sub-block scales).
    All blocks in one call: ``quants.dequantize`` goes row group by row group, 10x slower."""
    return np.asarray(_BLOCK_TYPES[qtype].dequantize_blocks(_with(blocks, **fields)), dtype=np.float32)


_Packed = tuple[int, int, np.ndarray, int, np.ndarray, np.ndarray | None]
"""bits, block size, the integers q (blocks, block) of ``scale * q + offset``, what to add
to them to make codes (0..2^bits-1), and the scales and offsets per block (or None: the
integers are centred on the zero point)."""


def _q4_0(blocks: np.ndarray) -> _Packed:
    q = _unit(blocks, Q.Q4_0, d=(0, 1.0)).reshape(-1, 32)
    return 4, 32, q, 8, _fp16(blocks, 0), None


def _q4_1(blocks: np.ndarray) -> _Packed:
    q = _unit(blocks, Q.Q4_1, d=(0, 1.0), m=(2, 0.0)).reshape(-1, 32)
    return 4, 32, q, 0, _fp16(blocks, 0), _fp16(blocks, 2)


def _q5_0(blocks: np.ndarray) -> _Packed:
    q = _unit(blocks, Q.Q5_0, d=(0, 1.0)).reshape(-1, 32)
    return 8, 32, q, 128, _fp16(blocks, 0), None


def _q5_1(blocks: np.ndarray) -> _Packed:
    q = _unit(blocks, Q.Q5_1, d=(0, 1.0), m=(2, 0.0)).reshape(-1, 32)
    return 8, 32, q, 112, _fp16(blocks, 0), _fp16(blocks, 2)


def _q8_0(blocks: np.ndarray) -> _Packed:
    q = _unit(blocks, Q.Q8_0, d=(0, 1.0)).reshape(-1, 32)
    return 8, 32, q, 128, _fp16(blocks, 0), None


def _k_quant(
    blocks: np.ndarray, qtype: Q, d_at: int, dmin_at: int, sub: int, scale_min: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Integers, scales and offsets of the K-quants with a minimum (Q2_K, Q4_K, Q5_K)."""
    sc, mins = (np.asarray(a, dtype=np.float32).reshape(-1) for a in scale_min)
    scaled = _unit(blocks, qtype, d=(d_at, 1.0), dmin=(dmin_at, 0.0)).reshape(-1, sub)
    q = np.divide(scaled, sc[:, None], out=np.zeros_like(scaled), where=sc[:, None] != 0)
    per_block = 256 // sub
    d = np.repeat(_fp16(blocks, d_at), per_block)
    dmin = np.repeat(_fp16(blocks, dmin_at), per_block)
    return q, d * sc, -dmin * mins


def _q2_k(blocks: np.ndarray) -> _Packed:
    scales = blocks[:, :16]
    q, s, o = _k_quant(blocks, Q.Q2_K, 80, 82, 16, (scales & 0xF, scales >> 4))
    return 4, 16, q, 0, s, o


def _q4_k(blocks: np.ndarray) -> _Packed:
    q, s, o = _k_quant(blocks, Q.Q4_K, 0, 2, 32, quants.Q4_K.get_scale_min(blocks[:, 4:16]))
    return 4, 32, q, 0, s, o


def _q5_k(blocks: np.ndarray) -> _Packed:
    q, s, o = _k_quant(blocks, Q.Q5_K, 0, 2, 32, quants.Q4_K.get_scale_min(blocks[:, 4:16]))
    return 8, 32, q, 112, s, o


def _q6_k(blocks: np.ndarray) -> _Packed:
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32).reshape(-1)
    scaled = _unit(blocks, Q.Q6_K, d=(208, 1.0)).reshape(-1, 16)
    q = np.divide(scaled, sc[:, None], out=np.zeros_like(scaled), where=sc[:, None] != 0)
    d = np.repeat(_fp16(blocks, 208), 16)
    return 8, 16, q, 128, d * sc, None


_BLOCK_TYPES: dict[Q, Any] = {
    Q.Q4_0: quants.Q4_0,
    Q.Q4_1: quants.Q4_1,
    Q.Q5_0: quants.Q5_0,
    Q.Q5_1: quants.Q5_1,
    Q.Q8_0: quants.Q8_0,
    Q.Q2_K: quants.Q2_K,
    Q.Q4_K: quants.Q4_K,
    Q.Q5_K: quants.Q5_K,
    Q.Q6_K: quants.Q6_K,
}

_PACKERS = {
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q8_0: _q8_0,
    Q.Q2_K: _q2_k,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
}
