"""The pack's nodes, V3 `io.ComfyNode` classes, one module per group; each module lists its nodes in NODES. Both
hosts take V3 classes through NODE_CLASS_MAPPINGS (they tell them from V1 ones by their base class). What the
nodes do beyond declaring themselves is in host/."""
from ..host.read_ahead import install as install_read_ahead
from . import attention_backend, loader_nodes, offload, quantize_int8, save_quantized, vae_kernels

NODE_CLASS_MAPPINGS = {}
NODE_DISPLAY_NAME_MAPPINGS = {}
for _module in (quantize_int8, attention_backend, offload, loader_nodes, save_quantized, vae_kernels):
    for _cls in _module.NODES:
        _schema = _cls.GET_SCHEMA()
        NODE_CLASS_MAPPINGS[_schema.node_id] = _cls
        NODE_DISPLAY_NAME_MAPPINGS[_schema.node_id] = _schema.display_name
# the nodes whose model runs the read-ahead's sampling hooks (host/read_ahead.py's hook_sampling)
_HOOKED = (loader_nodes.MixedCheckpointLoader, loader_nodes.LoadH3Quantized, quantize_int8.QuantizeModelINT8,
           attention_backend.SetAttentionBackend)
install_read_ahead(set(NODE_CLASS_MAPPINGS), {_cls.GET_SCHEMA().node_id for _cls in _HOOKED})
