"""Views into the pack's run-time state that only tests and benchmarks read."""
from bigdit.quant import int8_convrot


def chooser():
    """The process-wide INT8 kernel chooser, with `timings`: {(device, shape): {candidate: ms}} of each measurement
    it made since this was first called (it measures only where tuning is asked, BIGDIT_INT8_TUNE=1)."""
    chosen = int8_convrot._chooser
    if "timings" not in vars(chosen):
        chosen.timings = {}
        choose, measure, keys = chosen.choose, chosen._measure, []

        def recording_choose(device, shape, *args, **kwargs):
            keys.append((str(device), shape))
            try:
                return choose(device, shape, *args, **kwargs)
            finally:
                keys.pop()

        def recording_measure(candidates):
            timings = measure(candidates)
            chosen.timings[keys[-1]] = timings
            return timings

        chosen.choose, chosen._measure = recording_choose, recording_measure
    return chosen


def snapshot(stats) -> dict:
    """An AttentionStats' counts as plain dicts, without taking them (no report has, in a unit test)."""
    return {kind: dict(counter) for kind, counter in stats.run.items()}
