"""ComfyUI adapters. Each module lists its nodes in NODES = {name: (class, display name)}."""
from . import attention_backend, checkpoint_loaders, offload, quantize_int8, save_quantized

_MODULES = (quantize_int8, attention_backend, offload, checkpoint_loaders, save_quantized)

NODE_CLASS_MAPPINGS = {}
NODE_DISPLAY_NAME_MAPPINGS = {}
for _module in _MODULES:
    for _name, (_cls, _display) in _module.NODES.items():
        NODE_CLASS_MAPPINGS[_name] = _cls
        NODE_DISPLAY_NAME_MAPPINGS[_name] = _display
