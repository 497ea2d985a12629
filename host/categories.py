"""The pack's node categories: upstream ComfyUI's own (0.33.0 files UNETLoader and CLIPLoader under
model/loaders, its model patches under model/patch, ModelSave under model/merging), so the pack's nodes sit
beside the nodes they stand in for."""
LOADERS = "model/loaders"
MODEL_PATCHES = "model/patch"
MODEL_SAVE = "model/merging"
