"""The quantised dtypes DeepSeek-V4.1 checkpoints ship, dequantised as vLLM 0.33 reads them,
and the inverse (for the tiny checkpoint writer and the tests).

* FP8: E4M3 weights [N, K] with one scale per block of `block` = quantization_config's
  `weight_block_size` (128 x 128): scale [ceil(N / 128), ceil(K / 128)], value = e4m3 x scale.
  Checkpoints with FP4 experts store these scales as UE8M0 exponent bytes (F8_E8M0), those
  with FP8 experts (Flash-Base) as float32 (vllm/models/deepseek_v41/quant_config.py,
  `is_scale_e8m0`). A UE8M0 byte b is 2^(b - 127), read the way vLLM upcasts it: b placed in
  a float32's exponent field (quantization/utils/fp8_utils.py, `_upcast_e8m0_to_fp32`).
* FP4 (MXFP4) experts: E2M1 codes, two per byte, the low nibble the even element, stored as
  I8 (or U8 / F4) bytes [N, K / 2], with one UE8M0 scale per 32 consecutive elements of a row:
  scale [N, K / 32] (quantization/mxfp4.py `create_weights`; the torch dequantisation in
  layers/fused_moe/flashinfer_moe_ep.py, `_dequant_mxfp4_ue8m0_gran32`).

Dequantisation computes in float32 and rounds once to the compute dtype. Scales are taken
as UE8M0 bytes whatever their torch dtype (float8_e8m0fnu where this torch has it, else
uint8), so nothing here depends on torch's float8_e8m0fnu.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0          # the largest finite E4M3 value
FP4_MAX = 6.0            # the largest E2M1 value
MXFP4_GROUP = 32         # elements sharing one FP4 scale, along a row
FP8_BLOCK = (128, 128)   # DeepSeek's weight_block_size unless its config says otherwise
# E2M1 code -> value; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# How UE8M0 bytes are stored: torch's own dtype where it has one (safetensors F8_E8M0).
E8M0 = getattr(torch, "float8_e8m0fnu", torch.uint8)
# How packed E2M1 pairs may be stored (DeepSeek's shards: int8).
FP4_STORAGE = tuple(d for d in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if d)


def exponent_bytes(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales as their raw bytes (uint8), from float8_e8m0fnu, uint8 or int8 storage."""
    if scale.dtype not in (E8M0, torch.uint8, torch.int8):
        raise ValueError(f"UE8M0 scales are one byte each, got {scale.dtype}")
    return scale.view(torch.uint8)


def e8m0_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """2^(b - 127) for each UE8M0 byte b (b = 0 reads as 0 and 255 as inf, as fp8_utils
    reads them; neither occurs in a checkpoint's scales)."""
    return (exponent_bytes(scale).to(torch.int32) << 23).view(torch.float32)


def float32_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """The UE8M0 bytes (stored as E8M0) of positive powers of two; anything else is refused."""
    scale = scale.to(torch.float32)
    bits = scale.view(torch.int32)
    if not bool(((scale > 0) & ((bits & 0x7FFFFF) == 0)).all()):
        raise ValueError("UE8M0 holds positive powers of two only")
    return (bits >> 23).to(torch.uint8).view(E8M0)


def scale_as_float32(scale: torch.Tensor) -> torch.Tensor:
    """A block scale as float32 multipliers: float32 stays, one-byte scales are UE8M0."""
    return scale.to(torch.float32) if scale.dtype == torch.float32 else e8m0_to_float32(scale)


def _expand(scale: torch.Tensor, rows: int, cols: int, shape: torch.Size) -> torch.Tensor:
    """A per-block scale [.., ceil(N / rows), ceil(K / cols)] repeated to the weight's [.., N, K]."""
    n, k = shape[-2], shape[-1]
    want = (*shape[:-2], -(-n // rows), -(-k // cols))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale shape {tuple(scale.shape)}, expected {want} for a weight "
                         f"{tuple(shape)} in {rows} x {cols} blocks")
    return scale.repeat_interleave(rows, -2).repeat_interleave(cols, -1)[..., :n, :k]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   block: tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    """E4M3 weight [.., N, K] x its per-block scale (UE8M0 bytes or float32) -> `dtype`."""
    if weight.dtype != FP8:
        raise ValueError(f"an FP8 weight is {FP8}, got {weight.dtype}")
    factor = _expand(scale_as_float32(scale), *block, weight.shape)
    return (weight.to(torch.float32) * factor).to(dtype)


def _ue8m0_ceil(ratio: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= ratio (how vLLM rounds a scale to UE8M0: deep_gemm.py)."""
    return torch.exp2(torch.ceil(torch.log2(ratio)))


def _block_amax(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """max |x| over each rows x cols block of [.., N, K] (partial edge blocks included)."""
    n, k = x.shape[-2:]
    padded = torch.nn.functional.pad(x.abs().float(), (0, -k % cols, 0, -n % rows))
    lead = padded.shape[:-2]
    blocks = padded.reshape(*lead, padded.shape[-2] // rows, rows, padded.shape[-1] // cols, cols)
    return blocks.amax(dim=(-3, -1))


def quantize_fp8(x: torch.Tensor, block: tuple[int, int] = FP8_BLOCK,
                 ue8m0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [.., N, K] -> (E4M3 weight, per-block scale): scale = max |x| / 448 per block
    (at least 1e-4 / 448), rounded up to a power of two and stored as UE8M0 bytes when
    `ue8m0`, else float32 (vLLM's per_block_cast_to_fp8)."""
    scale = _block_amax(x, *block).clamp(min=1e-4) / FP8_MAX
    if ue8m0:
        scale = _ue8m0_ceil(scale)
    weight = (x.float() / _expand(scale, *block, x.shape)).to(FP8)
    return weight, float32_to_e8m0(scale) if ue8m0 else scale


def fp4_bytes(weight: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 bytes as uint8, from int8 (DeepSeek's shards), uint8 or float4_e2m1fn_x2."""
    if weight.dtype not in FP4_STORAGE:
        raise ValueError(f"packed FP4 weights are int8, uint8 or float4_e2m1fn_x2, got {weight.dtype}")
    return weight.view(torch.uint8)


def unpack_fp4(weight: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 [.., N, K / 2] -> their float32 values [.., N, K] (low nibble first)."""
    packed = fp4_bytes(weight)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    pairs = torch.stack((packed & 0x0F, packed >> 4), dim=-1).long()
    return table[pairs].flatten(-2)


def dequantize_fp4(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   group: int = MXFP4_GROUP) -> torch.Tensor:
    """Packed E2M1 [.., N, K / 2] x UE8M0 scale [.., N, K / group] -> `dtype` [.., N, K]."""
    values = unpack_fp4(weight)
    return (values * _expand(e8m0_to_float32(scale), 1, group, values.shape)).to(dtype)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes [.., K] (0..15) -> bytes [.., K / 2], element 2i in the low nibble."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def quantize_fp4(x: torch.Tensor, group: int = MXFP4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [.., N, K] -> (packed E2M1 bytes as int8 [.., N, K / 2], UE8M0 scale [.., N, K / group]).
    Each group's scale is the smallest power of two putting its max |x| within 6; values
    round to the nearest E2M1 value (ties to the smaller magnitude)."""
    if x.shape[-1] % group:
        raise ValueError(f"FP4 rows must hold whole groups of {group}, got {x.shape[-1]}")
    scale = _ue8m0_ceil(_block_amax(x, 1, group).clamp(min=2.0 ** -126 * FP4_MAX) / FP4_MAX)
    scaled = x.float() / _expand(scale, 1, group, x.shape)
    magnitudes = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=x.device)
    nearest = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)
    codes = nearest | (scaled < 0).long() << 3
    return pack_fp4(codes).view(torch.int8), float32_to_e8m0(scale)
