"""Run ComfyUI's main.py on an emulated smaller GPU (benchmarks only; production code knows nothing of it).

    cd COMFYUI && python vram_cap.py --gib 24 main.py [ComfyUI arguments...]
    cd COMFYUI && python vram_cap.py main.py [...]          # no cap: the same start-up path

Before anything of ComfyUI's model management loads, with the CUDA allocator
ComfyUI itself chooses (its cuda_malloc module runs first, as main.py runs it,
after comfy-aimdo's library where the host has dynamic VRAM):
- `torch.cuda.set_per_process_memory_fraction` limits this process's allocator to
  the card size less what the device already holds at start (the CUDA context), so
  allocating past the card raises torch.OutOfMemoryError;
- `torch.cuda.mem_get_info` reports the card as GIB total, and as free the card
  less everything the device really holds, which is what ComfyUI's and the pack's
  memory decisions read (model_management.get_total_memory / get_free_memory).
The cap is then checked: an allocation of the whole card must fail. The
environment variable BIGDIT_EMULATED_VRAM holds the card's bytes for reports.
Without CUDA (a CPU test run) the cap is not applied and a line says so.

Upstream ComfyUI's dynamic VRAM (comfy-aimdo, where the host has --vram-headroom)
maps weight pages with the CUDA driver's virtual memory calls, outside PyTorch's
allocator, and reads the real card through cuMemGetInfo/NVML: neither the fraction
nor the patched mem_get_info reaches it. So the host's own --vram-headroom (GB
that aimdo keeps free, besides its usual reserve) is raised to the real card less
the emulated one, and aimdo evicts weight pages as a 24 GiB card would make it.
That binds aimdo by its own budget, not by a failing allocation: the report's
NVML peak (device_used_peak_sampling) shows whether it held.

    cd COMFYUI && python vram_cap.py --ram-gib 32 main.py [...]   # and a host of 32 GiB of RAM

`--ram-gib` emulates a smaller host for ComfyUI's own memory decisions: upstream sizes its RAM cache, pins and
pin eviction from psutil.virtual_memory() (total, available), which inside a memory cgroup still reads the
whole machine. psutil.virtual_memory() then reports GIB as total and as available GIB less the memory this
process holds that the kernel could not reclaim (anonymous and shared pages: what a machine of that size would
have in use), never more than the machine has. Whether the kernel also enforces the size is the caller's
(tests/bench/whole_job.py runs the server in a memory cgroup where it can).
"""
import argparse
import os
import runpy
import sys
import time


def emulate_card(cap_bytes: int) -> str:
    import torch
    if not torch.cuda.is_available():
        return "no CUDA device: the emulated card is not applied"
    torch.cuda.init()
    device = torch.cuda.current_device()
    real_mem_get_info = torch.cuda.mem_get_info
    free, total = real_mem_get_info(device)
    deadline = time.monotonic() + 20
    while total - free > 2 * 2 ** 30 and time.monotonic() < deadline:  # a server just stopped may still hold memory
        time.sleep(0.5)
        free, total = real_mem_get_info(device)
    held = total - free
    if cap_bytes <= held or cap_bytes > total:
        raise SystemExit(f"vram_cap: a {cap_bytes / 2**30:.1f} GiB card does not fit this device "
                         f"({total / 2**30:.1f} GiB, {held / 2**30:.2f} GiB held at start)")
    torch.cuda.set_per_process_memory_fraction((cap_bytes - held) / total, device)

    def mem_get_info(device=None):
        free, total = real_mem_get_info(device)
        return max(0, cap_bytes - (total - free)), cap_bytes

    torch.cuda.mem_get_info = mem_get_info
    torch.cuda.memory.mem_get_info = mem_get_info
    try:
        torch.empty(cap_bytes, dtype=torch.uint8, device=device)
    except torch.cuda.OutOfMemoryError:
        pass
    else:
        raise SystemExit("vram_cap: allocating the whole emulated card succeeded; the cap is not enforced")
    torch.cuda.empty_cache()
    os.environ["BIGDIT_EMULATED_VRAM"] = str(cap_bytes)
    return (f"emulated card: {cap_bytes / 2**30:.1f} GiB of {total / 2**30:.1f} GiB "
            f"({held / 2**30:.2f} GiB held at start; allocator {torch.cuda.get_allocator_backend()}); "
            f"allocating past it fails{bind_dynamic_vram(total - cap_bytes)}")


def unreclaimable_bytes() -> int:
    """This process's anonymous and shared resident pages (pinned host memory included), from /proc."""
    held = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssShmem:")):
                held += int(line.split()[1]) * 1024
    return held


def emulate_ram(cap_bytes: int) -> str:
    import psutil
    real = psutil.virtual_memory

    def virtual_memory():
        vm = real()
        available = max(0, min(vm.available, cap_bytes - unreclaimable_bytes()))
        return vm._replace(total=cap_bytes, available=available, used=cap_bytes - available, free=available,
                           percent=round(100 * (cap_bytes - available) / cap_bytes, 1))

    psutil.virtual_memory = virtual_memory
    os.environ["BIGDIT_EMULATED_RAM"] = str(cap_bytes)
    return f"emulated host RAM: {cap_bytes / 2**30:.1f} GiB of {real().total / 2**30:.1f} GiB (psutil.virtual_memory)"


def load_dynamic_vram_library():
    """Where the host enables dynamic VRAM, load comfy-aimdo's library before torch, as upstream's main.py does
    (the cap imports torch first); main.py's own init call later applies its settings to the loaded library."""
    import comfy.cli_args
    enabled = getattr(comfy.cli_args, "enables_dynamic_vram", None)
    if enabled is not None and enabled():
        import comfy_aimdo.control
        comfy_aimdo.control.init()


def bind_dynamic_vram(beyond_card: int) -> str:
    """Raise the host's --vram-headroom (where it has one) so that dynamic VRAM keeps `beyond_card` bytes free."""
    from comfy.cli_args import args
    if not hasattr(args, "vram_headroom"):
        return ""
    args.vram_headroom = max(args.vram_headroom or 0, beyond_card / 2 ** 30)
    return f"; dynamic VRAM (if enabled) keeps {args.vram_headroom:.2f} GiB free: --vram-headroom"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=None, help="card size in GiB (default: no cap)")
    parser.add_argument("--ram-gib", type=float, default=None, help="host RAM in GiB as ComfyUI sees it (default: "
                        "the machine's)")
    parser.add_argument("script", help="ComfyUI's main.py")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args()
    script = os.path.abspath(opts.script)
    comfyui = os.path.dirname(script)
    sys.argv = [script, *opts.args]
    sys.path[0] = comfyui  # as `python main.py` would have it, not this file's folder
    os.chdir(comfyui)
    if opts.ram_gib is not None:  # before ComfyUI's model management reads the total at import
        print(f"vram_cap: {emulate_ram(int(opts.ram_gib * 2 ** 30))}", flush=True)
    if opts.gib is not None:
        # main.py's own order: parse the arguments, let cuda_malloc pick the allocator, then torch.
        import comfy.options
        comfy.options.enable_args_parsing()
        load_dynamic_vram_library()
        import cuda_malloc  # noqa: F401  (sets PYTORCH_CUDA_ALLOC_CONF unless --disable-cuda-malloc)
        print(f"vram_cap: {emulate_card(int(opts.gib * 2 ** 30))}", flush=True)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
