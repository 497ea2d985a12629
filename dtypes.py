"""Dtypes, one definition for every core package: the float dtypes models compute in (FLOAT_DTYPES,
HALF_DTYPES), a dtype's short name, and safetensors' dtype codes <-> torch dtypes."""
import torch

FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})

# safetensors' code -> torch's name; a name this torch lacks (uint16/32/64, float8_e8m0fnu before 2.7) is left out
_SAFETENSORS_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu", "I16": "int16", "U16": "uint16", "F16": "float16", "BF16": "bfloat16",
    "I32": "int32", "U32": "uint32", "F32": "float32", "I64": "int64", "U64": "uint64", "F64": "float64",
}
SAFETENSORS_TO_TORCH = {code: getattr(torch, name) for code, name in _SAFETENSORS_NAMES.items() if hasattr(torch, name)}
TORCH_TO_SAFETENSORS = {dtype: code for code, dtype in SAFETENSORS_TO_TORCH.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16", the spelling of reports and format names."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code ("BF16" -> torch.bfloat16)."""
    return SAFETENSORS_TO_TORCH[code]
