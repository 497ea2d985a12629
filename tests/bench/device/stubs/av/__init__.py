"""Stand-in for PyAV on the benchmark's GPU machine, whose image lacks it.

ComfyUI imports `av` at start-up (comfy_api's video types); the benchmark never
reads or writes video. Every name is a class that raises ImportError when called.
"""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args, **kwargs):
        raise ImportError(f"PyAV is not installed: av.{name} is the benchmark's stand-in")

    return type(name, (), {"__new__": unavailable})
