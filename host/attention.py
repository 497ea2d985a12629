"""ComfyUI's attention hook, spoken by duck typing (this module imports no ComfyUI, so it is unit-tested alone).

ComfyUI (0.3.75 and later) runs every `optimized_attention*` call through
transformer_options["optimized_attention_override"] when it is set, as
`override(func, q, k, v, heads, mask=None, attn_precision=None,
skip_reshape=False, skip_output_reshape=False, transformer_options=..., ...)`
where `func` is the attention function ComfyUI would have used. Layouts:
q/k/v are (B, S, heads*D) unless skip_reshape, then (B, heads, S, D); the
output is (B, S, heads*D) unless skip_output_reshape, then (B, heads, S, D).
Masks are 2-D (Sq, Sk), 3-D (B, Sq, Sk) or 4-D, boolean or additive, with
SDPA's meaning, as ComfyUI's attention_pytorch reads them. The router gets the
keys of transformer_options it uses as a `CallOptions` (`call_options`).
"""
from __future__ import annotations

from ..attention.options import CallOptions, PackedLayout

KEY = "optimized_attention_override"
MARKER = "_bigdit_attention_override"


class AttentionOverride:
    """Our override. Composition with one that was already installed:

    - an earlier SetAttentionBackend (recognised by the `MARKER` attribute,
      so also across two imports of this pack) is replaced, never stacked:
      the new settings win, and whatever the earlier one wrapped is kept;
    - any other override (another pack's, or ComfyUI's sparse node) stays in
      charge and is wrapped: it is called as before, but the `func` it gets,
      the attention it falls back to, is this router. An override that never
      calls its `func` therefore still decides every call; the statistics
      then show no calls here.
    """

    def __init__(self, router, previous=None):
        setattr(self, MARKER, True)
        self.router = router
        self.previous = previous

    def __call__(self, func, *args, **kwargs):
        if self.previous is not None:
            return self.previous(self.attention, *args, **kwargs)
        return self.attention(*args, **kwargs)

    def attention(self, q, k, v, heads, mask=None, attn_precision=None,
                  skip_reshape=False, skip_output_reshape=False, **kwargs):
        """A ComfyUI attention function (attention_pytorch's signature)."""
        if skip_reshape:
            layout, (b, _, _, d) = "BHSD", q.shape
        else:
            b, _, inner = q.shape
            d = inner // heads
            layout = "BSHD"
            # k/v may carry fewer heads than q (grouped-query attention): each keeps its own count
            q, k, v = (t.view(b, t.shape[1], -1, d) for t in (q, k, v))
        if mask is not None:
            if mask.ndim == 2:  # (Sq, Sk): add the batch dimension
                mask = mask.unsqueeze(0)
            if mask.ndim == 3:  # (B, Sq, Sk): add the heads dimension
                mask = mask.unsqueeze(1)
        out = self.router(q, k, v, layout=layout, mask=mask, scale=kwargs.get("scale"),
                          options=call_options(kwargs.get("transformer_options")))
        if skip_output_reshape:
            return out if layout == "BHSD" else out.transpose(1, 2)
        if layout == "BHSD":
            out = out.transpose(1, 2)
        return out.reshape(b, -1, heads * d)

    def __deepcopy__(self, memo):
        # ModelPatcher.clone deep-copies model_options; every clone must share
        # this object so that its statistics are the model's
        return self

    def __repr__(self):
        return f"<bigdit attention override: {self.router.describe()}>"


def call_options(transformer_options: dict | None) -> CallOptions:
    """What the router reads of a call's transformer_options: the sampler's current sigmas and schedule, the
    block a model reports (Flux, HunyuanVideo, Qwen-Image, recent MiniMax-H3) and the packed layout that
    upstream's MiniMax-H3 publishes (an object with `seq_len` and (start, stop, kind) `segments`)."""
    options = transformer_options or {}
    layout = options.get("minimax_h3_layout")
    length, segments = getattr(layout, "seq_len", None), getattr(layout, "segments", None)
    packed = (None if length is None or segments is None
              else PackedLayout(int(length), tuple((int(a), int(b), str(kind)) for a, b, kind in segments)))
    block = options.get("block_index")
    return CallOptions(sigmas=options.get("sigmas"), sample_sigmas=options.get("sample_sigmas"),
                       block_index=None if block is None else int(block), packed=packed)


def is_ours(override) -> bool:
    return bool(getattr(override, MARKER, False))


def _name(override) -> str:
    """A short name for another node's override: its function's or class's qualified name."""
    return getattr(override, "__qualname__", None) or type(override).__qualname__


def not_reached(current, ours: AttentionOverride) -> str:
    """Why a sampling that ran the model sent no attention call to `ours`, for the `last run:` line.
    `current` is the override the sampled model carried."""
    if current is not ours:
        if current is None:
            why = "another node removed this attention override"
        else:
            why = f"another node replaced this attention override ({_name(current)})"
    elif ours.previous is not None:
        why = f"the override it wraps ({_name(ours.previous)}) never called it"
    else:
        why = "no attention call reached this override (attention patched another way)"
    return f"{why}; its kernels did not run"


def install(transformer_options: dict, router) -> tuple[AttentionOverride, str]:
    """Put `router` on transformer_options' attention hook, composing with
    what is there (see AttentionOverride). Returns the override and one of
    "installed", "replaced" (an earlier one of ours), "wrapped" (another)."""
    current = transformer_options.get(KEY)
    if current is None:
        previous, how = None, "installed"
    elif is_ours(current):
        previous, how = current.previous, "replaced"
    else:
        previous, how = current, "wrapped"
    override = AttentionOverride(router, previous)
    transformer_options[KEY] = override
    return override, how
