"""Triton kernels compiled side by side on a thread pool instead of one after another at their first launches.

A kernel's first launch in a process compiles it where Triton's on-disk cache lacks it (about a second each, one
after another: the first step of H3's turbo job on an H100 paid 9.6 s for its INT8 kernels) and otherwise loads it
(milliseconds). `ready(warm, device)` runs `warm` (the kernel's `warmup` with the launch's own arguments, so the
same specialization) under Triton's `AsyncCompileMode`, which hands the compile to a pool of threads (`WORKERS`;
Triton's compiler passes and ptxas run outside Python's lock), and at its first check waits up to `WAIT_S`: a
kernel its cache holds is ready by then; one still compiling is not, and the caller computes that call another way
(the INT8 linear: comfy-kitchen's kernel, the host's own) until it is. Once one was not, no first check waits again
in the process: a cache that lacks one kernel mostly lacks the others. A first step's kernels thus compile together while it runs.

One mode serves every check, so a kernel compiles once however many calls ask for it before it is ready; it is
entered in a copy of the caller's context, so no other launch of the caller compiles asynchronously. A check that
finds the compile finished puts the kernel into the JIT's cache under the launch's key (Triton does so only when
the pending kernel's result is asked for, and 3.6 keeps no pending kernel there), where the launch then finds it.
A compiled kernel's launcher is built on the pool too before it counts as ready: Triton 3.6 builds each launcher
signature with the C compiler at a kernel's first launch (an H100's two first INT8 launches after their compile
took 0.57 s), and puts it in its cache, where the launch then loads it.

Off, every launch compiling in place as Triton does: where BIGDIT_TRITON_COMPILE_AHEAD=0 (results then do not
depend on which kernels were compiled yet), where the user asked for tuning (a search times the kernels
themselves), while a CUDA graph is captured (it would keep the other kernel), while torch.compile traces, off CUDA
(Triton's interpreter compiles nothing), and where Triton has no `AsyncCompileMode` (before 3.4).
"""
from __future__ import annotations

import contextvars
import os
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from typing import Callable

import torch

from ..pack_logging import pack_logger
from ..threads import name_this_thread
from . import tuning

log = pack_logger(__name__)

ENV = "BIGDIT_TRITON_COMPILE_AHEAD"
# one CPU left to the host's own thread; compiles are small in RAM (tests/bench/triton_compile.py: 9 of H3's INT8
# kernels for sm90 grew a process by 84 MiB one after another, 31 MiB more on two threads)
WORKERS = max(1, min(8, (os.cpu_count() or 2) - 1))
WAIT_S = 0.1  # a kernel loaded from Triton's cache is ready within it (about 30 ms each on the H100 runs)

try:
    from triton import AsyncCompileMode, FutureKernel
    from triton.runtime import driver
except Exception:  # no Triton, or one without asynchronous compiles
    AsyncCompileMode = FutureKernel = driver = None

_pool: ThreadPoolExecutor | None = None
_async = None  # the AsyncCompileMode on _pool (`_mode`)
_said = False
_cold = False  # a first check's wait ran out: later first checks do not wait
_waited: weakref.WeakSet = weakref.WeakSet()  # pending kernels a call waited for already: later calls do not
_launchers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # pending kernel -> its launcher's build


def enabled(device: torch.device) -> bool:
    """Whether launches on `device` may compile ahead now (see the module's docstring)."""
    return (AsyncCompileMode is not None and device.type == "cuda"
            and os.environ.get(ENV, "1").strip() != "0" and not tuning.search_asked()
            and not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing())


def said_once(message: str) -> None:
    """`message` logged at INFO once per process: a first step's kernels all compile ahead at once."""
    global _said
    if not _said:
        _said = True
        log.info("%s (%s=0: each launch compiles in place)", message, ENV)


def _mode():
    """The one mode every check enters: it hands a kernel's compile to the pool once (keyed by Triton's compile key),
    and gives the same pending kernel back while it compiles."""
    global _pool, _async
    if _async is None:
        _pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="bigdit-triton-compile",
                                   initializer=name_this_thread, initargs=("bigdit-compile",))
        _async = AsyncCompileMode(_pool)
    return _async


def ready(warm: Callable[[], object], device: torch.device) -> bool:
    """Whether the kernel `warm` warms up is compiled for its launch; where compiling ahead is on and it is not,
    its compile is handed to the pool (once: Triton keeps the pending kernel under the launch's key) and False
    returned. A compile that failed counts as ready: the launch then raises its error, as a launch in place would."""
    if not enabled(device):
        return True

    def submit():
        _mode().__enter__()  # active in this copied context only, never left in the caller's
        return warm()

    try:
        kernel = contextvars.copy_context().run(submit)
    except Exception as exc:  # another mode active, or a warm-up Triton refuses: the launch compiles in place
        log.debug("Triton compile ahead: not taken (%s: %s)", type(exc).__name__, exc)
        return True
    if not isinstance(kernel, FutureKernel):
        return True
    built = _launcher(kernel)
    if built.done():
        kernel.result(ignore_errors=True)  # into the JIT's cache, where the launch finds it (a failure: it compiles
        return True                        # in place and raises the error)
    global _cold
    if _cold or kernel in _waited:
        return False
    _waited.add(kernel)
    try:
        built.result(timeout=WAIT_S)
    except FutureTimeout:
        _cold = True  # Triton's cache lacks this one, so likely the rest of a first run's: no more waits
        return False
    kernel.result(ignore_errors=True)
    return True


def _launcher(kernel) -> Future:
    """The build of the pending `kernel`'s launcher, handed to the pool once its compile is done (once per kernel);
    done once it ran, built or not (one not built is built by the launch)."""
    built = _launchers.get(kernel)
    if built is None:
        built, pool = Future(), _mode().executor
        _launchers[kernel] = built

        def compiled(future: Future) -> None:
            try:
                pool.submit(_build_launcher, future, built)
            except RuntimeError:  # the pool is shut down (the process exits)
                built.set_result(None)
        kernel.future.add_done_callback(compiled)
    return built


def _build_launcher(compiled: Future, built: Future) -> None:
    """Builds the launcher of the kernel `compiled` holds into Triton's cache; a failed compile or build leaves it
    to the launch (which then raises the error, as a launch in place would)."""
    try:
        if compiled.exception() is None:
            kernel = compiled.result()
            driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception as exc:
        log.debug("Triton compile ahead: launcher not built ahead (%s: %s)", type(exc).__name__, exc)
    finally:
        built.set_result(None)
