"""The float dtypes models compute in, one definition for quant/, attention/ and loaders/."""
import torch

FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})
