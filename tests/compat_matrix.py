"""docs/compatibility.md's host x feature matrix, from a JUnit report of the integration suite.

    python -m pytest tests -q --junitxml=suite.xml     (or BIGDIT_REPORTS=dir bash .ci/run)
    python tests/compat_matrix.py suite.xml            prints the Markdown table

Each cell counts the tests behind a feature that ran on that host: "pass N", "FAIL N" when any
failed, or the skip reason when every one of them was skipped. A feature whose tests are missing
from the report is an error, so a renamed test cannot quietly empty a cell.
"""
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict

# feature -> tests (module::name prefix, optionally "[param prefix"); the host id is stripped first
FEATURES = [
    ("QuantizeModelINT8 (INT8 ConvRot, in place)",
     ["test_quantize_int8_workflow::test_quantized_run_is_close_but_not_identical",
      "test_quantize_int8_workflow::test_other_branch_keeps_original_weights"]),
    ("QuantizeModelINT8 on UNETLoader's marker-file model",
     ["test_quantize_int8_workflow::test_unetloaders_marker_layers_are_linear_like"]),
    ("Quantize while loading: int8_convrot", ["test_checkpoint_loader_workflows::test_load_h3_quantized_online_int8"]),
    ("Quantize while loading: float8_e4m3fn", ["test_checkpoint_loader_workflows::test_load_h3_quantized_other_formats[float8"]),
    ("Quantize while loading: auto", ["test_checkpoint_loader_workflows::test_load_h3_quantized_other_formats[auto"]),
    ("MXFP4 (emulated on CPU)", ["test_mxfp4_workflow::"]),
    ("Markers: INT8 ConvRot / row-wise (convert_to_quant)",
     ["test_checkpoint_loader_workflows::test_convert_to_quant_file[int8_row"]),
    ("Markers: INT8 tensor-wise", ["test_checkpoint_loader_workflows::test_convert_to_quant_file[int8_tensor"]),
    ("Markers: FP8", ["test_checkpoint_loader_workflows::test_convert_to_quant_file[fp8"]),
    ("Markers: NVFP4", ["test_checkpoint_loader_workflows::test_convert_to_quant_file[nvfp4",
                        "test_checkpoint_loader_workflows::test_header_markers_with_nvfp4_requantized"]),
    ("Markers: ConvRot W4A4, asymmetric W4A8 (comfy-kitchen's own files)",
     ["test_checkpoint_loader_workflows::test_kitchen_4bit_file"]),
    ("Text encoder: NVFP4 with AWQ scales (QuantizedCLIPLoader)",
     ["test_checkpoint_loader_workflows::test_quantized_clip_loader_nvfp4_awq_clip_l",
      "test_checkpoint_loader_workflows::test_quantized_clip_loader_as_the_h3_examples_configure_it"]),
    ("Markers: mixed file", ["test_checkpoint_loader_workflows::test_mixed_marker_file"]),
    ("Quanto qint8 (optimum-quanto, mmgp)", ["test_checkpoint_loader_workflows::test_quanto_file_from_optimum_quanto_and_mmgp"]),
    ("Bad files: clear error, server keeps serving",
     ["test_checkpoint_loader_workflows::test_bad_file_fails_clearly_and_the_server_keeps_serving"]),
    ("SaveQuantizedModel, reloaded by MixedCheckpointLoader",
     ["test_save_quantized_workflow::test_int8_file_loads_through_mixed_loader_bit_identical",
      "test_save_quantized_workflow::test_quantized_while_loading_saves_and_loads_bit_identical"]),
    ("Quantize to and save 4-bit (W4A4, W4A8)",
     ["test_save_quantized_workflow::test_quantized_while_loading_saves_and_loads_bit_identical[convrot_w4a4",
      "test_save_quantized_workflow::test_quantized_while_loading_saves_and_loads_bit_identical[asym_w4a8_int8",
      "test_save_quantized_workflow::test_quantize_model_w4a8_saves_upstreams_markers"]),
    ("Saved INT8 file through the host's own UNETLoader",
     ["test_save_quantized_workflow::test_int8_file_through_the_hosts_own_unet_loader"]),
    ("Attention backends and their fallbacks (Wan)", ["test_attention_workflows::test_every_backend_runs_the_tiny_wan"]),
    ("Another node's attention override is reported",
     ["test_attention_workflows::test_an_override_installed_after_the_node_is_reported_not_counted",
      "test_attention_workflows::test_a_wrapped_override_that_never_falls_back_is_reported"]),
    ("Sol sparse attention runs, dense schedule",
     ["test_attention_workflows::test_sol_really_runs_in_the_tiny_wan",
      "test_attention_workflows::test_dense_schedule_in_a_real_model"]),
    ("Attention inputs that make no sense are refused (sol_tau, dense_layers)",
     ["test_attention_workflows::test_bad_sol_tau_is_a_validation_error",
      "test_attention_workflows::test_dense_layers_beyond_the_model_is_refused"]),
    ("ComfyUI scaled_fp8 files (both loaders, requantize_fp8)", ["test_scaled_fp8_workflows::"]),
    ("Offload auto streams bit-exactly, none refuses",
     ["test_offload::test_auto_streams_what_does_not_fit_exactly_where_none_refuses",
      "test_checkpoint_loader_workflows::test_load_h3_quantized_offload_modes_agree"]),
    ("Dynamic VRAM (upstream's ModelPatcherDynamic)", ["test_dynamic_vram::"]),
    ("Quantized layers bigger than the host's budget (dynamic VRAM, partial load)", ["test_constrained_load::"]),
    ("Host memory: quantizing while loading holds one copy of the model", ["test_host_memory::"]),
    ("Dynamic VRAM: the pack's paged weights from the model file, or a scratch file", ["test_file_backed::"]),
    ("Quantize once: a hit samples the first load's latent; other source data, another pack's code or knob misses; "
     "two servers share a folder; damaged, foreign, replaced or failing entries rebuilt; eviction; a low disk or a "
     "folder that cannot be made falls back",
     ["test_quant_cache_workflows::test_the_second_load_is_a_hit_and_samples_the_same",
      "test_quant_cache_workflows::test_a_file_cut_short_foreign_or_of_another_key_is_rebuilt_with_the_right_weights",
      "test_quant_cache_workflows::test_a_source_with_other_data_misses_and_the_entries_of_both_stay",
      "test_quant_cache_workflows::test_servers_with_different_keys_alternate_on_one_folder_without_rewriting_each",
      "test_quant_cache_workflows::test_a_changed_quantization_routine_misses",
      "test_quant_cache_workflows::test_the_least_recently_used_files_go_past_the_limit",
      "test_quant_cache_workflows::test_a_folder_that_cannot_be_made_falls_back",
      "test_quant_cache_workflows::test_a_low_disk_fails_the_write_before_anything_is_evicted",
      "test_quant_cache_workflows::test_a_format_no_marker_stores_is_not_cached",
      "test_quant_cache_workflows::test_a_hit_replaced_while_checked_or_failing_rebuilds_with_the_right_weights"]),
    ("Dynamic VRAM: a quantize-once hit's and miss's weights paged from the cache file",
     ["test_quant_cache_workflows::test_dynamic_vram_pages_a_miss_and_a_hit_from_the_cache_file"]),
    ("ComfyUI's TorchCompileModel on LoadH3Quantized: compiled once, not at every step",
     ["test_torch_compile::test_loaded_model_under_comfys_torch_compile_compiles_once"]),
    ("Clones without dynamic VRAM (TorchCompileModel, CLIP hooks): the loaders' factory loads the model again",
     ["test_torch_compile::test_under_dynamic_vram_the_node_gets_the_model_loaded_again_without_it",
      "test_checkpoint_loader_workflows::test_quantized_clip_loader_leaves_upstreams_reload_factory"]),
    ("4-bit to fit: LoadH3Quantized fit_gib", ["test_fit_workflow::"]),
    ("LoRA after quantization", ["test_lora_workflows::test_lora_after_quantization_matches_lora_on_float_model"]),
    ("LoRA before quantization", ["test_lora_workflows::test_lora_before_quantization_keeps_patched_layers"]),
    ("Partial loading and unloading with LoRA", ["test_lora_workflows::test_partial_loading_and_unloading_with_lora"]),
    ("LoRA as a branch beside the quantized GEMM, against the host's patched weight (every format); other "
     "adapters folded", ["test_lora_branch::"]),
    ("Dynamic VRAM: a LoRA as a branch (a strength change reloads nothing), a LoHa folded into mapped files",
     ["test_lora_fold::test_lora_is_a_branch_that_a_strength_change_does_not_reload_under_dynamic_vram",
      "test_lora_fold::test_loha_is_folded_once_file_backed_and_restored_exactly_under_dynamic_vram"]),
    ("Quantized clones run quantized", ["test_quantized_clones::"]),
    ("Run-time witness (`last run:`)", ["test_run_witness::"]),
    ("MiniMax-H3 with upstream's model class and nodes", ["test_minimax_h3::"]),
    ("4-bit files equal upstream's own loading (MiniMax-H3)",
     ["test_minimax_h3::test_4bit_files_match_upstreams_native_loading"]),
    ("Keep patterns on the host's own module names", ["test_keep_decisions::"]),
    ("SetVAEKernels: MiniMax-H3's video VAE on the pack's kernels, within 40 dB of the host's decode",
     ["test_vae_kernels::test_h3_decode_on_the_packs_kernels_matches_the_hosts",
      "test_vae_kernels::test_h3_decode_with_everything_left_to_the_host_passes_through"]),
    ("SetVAEKernels: Wan's VAE passes through", ["test_vae_kernels::test_wans_vae_passes_through_unchanged"]),
    ("SetVAEKernels: tiles decoded in batches, in order, halved where the card cannot hold them",
     ["test_vae_kernels::test_h3_tiles_batched_on_the_hosts_layers_match_its_decode",
      "test_vae_kernels::test_tile_batches_keep_their_order_and_halve_where_the_card_cannot_hold_them"]),
    ("Read-ahead of a queued prompt's model files (on by default; BIGDIT_READ_AHEAD=0 off)", ["test_read_ahead_workflows::"]),
    ("Example workflows run on tiny models",
     ["test_examples_and_ui::test_wan_example_runs_on_the_tiny_model",
      "test_examples_and_ui::test_h3_template_example_runs_with_the_turbo_lora"]),
    ("Examples load in the host's own frontend", ["test_examples_and_ui::test_ui_workflow_loads_to_the_api_workflow"]),
    ("Starts without comfy-kitchen, clear message", ["test_without_kitchen::"]),
    ("V3 nodes serve the V1 nodes' inputs and outputs (/object_info)",
     ["test_object_info_snapshot::test_object_info_equals_the_snapshot"]),
]

_HOST = re.compile(r"comfy-(\d+\.\d+\.\d+)-?")


def outcomes(paths):
    """{(host, "module::name[params"): (outcome, skip message)} from JUnit XML files."""
    result = {}
    for path in paths:
        for case in ET.parse(path).iter("testcase"):
            name = case.get("name", "")
            host = _HOST.search(name)
            if not host:
                continue
            test = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{_HOST.sub('', name, count=1)}"
            if case.find("failure") is not None or case.find("error") is not None:
                result[(host.group(1), test)] = ("fail", "")
            elif (skip := case.find("skipped")) is not None:
                result[(host.group(1), test)] = ("skip", skip.get("message", ""))
            else:
                result[(host.group(1), test)] = ("pass", "")
    return result


def _matches(test, pattern):
    if "[" in pattern:
        return test.startswith(pattern)
    return test.startswith(pattern) if pattern.endswith("::") else (test == pattern or test.startswith(pattern + "["))


def _cell(results):
    counts = defaultdict(int)
    for outcome, _ in results:
        counts[outcome] += 1
    if counts["fail"]:
        return f"FAIL {counts['fail']}"
    if counts["pass"]:
        return f"pass {counts['pass']}"
    reasons = sorted({message.removeprefix("Skipped: ") for _, message in results})
    return "skipped: " + "; ".join(reasons)


def table(paths) -> str:
    found = outcomes(paths)
    hosts = sorted({host for host, _ in found}, key=lambda v: tuple(map(int, v.split("."))))
    lines = ["| Feature | " + " | ".join(f"ComfyUI {h}" for h in hosts) + " |",
             "|---|" + "---|" * len(hosts)]
    for feature, patterns in FEATURES:
        cells = []
        for host in hosts:
            results = [value for (h, test), value in found.items()
                       if h == host and any(_matches(test, p) for p in patterns)]
            if not results:
                raise SystemExit(f"no test of {feature!r} ({patterns}) ran on ComfyUI {host}")
            cells.append(_cell(results))
        lines.append(f"| {feature} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    print(table(sys.argv[1:]))
