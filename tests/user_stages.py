"""webdataset stages that tests add through data.stages (importable by spawned DataLoader workers)."""

from __future__ import annotations

from collections.abc import Iterator


def invert(samples: Iterator[dict]) -> Iterator[dict]:
    """Negative images: 255 - pixel."""
    for sample in samples:
        sample["image"] = 255 - sample["image"]
        yield sample


def drop_label_three(samples: Iterator[dict]) -> Iterator[dict]:
    """Leave out every sample of class 3 (their places are filled, like bad data)."""
    for sample in samples:
        if sample["label"] != 3:
            yield sample


def shrink(samples: Iterator[dict]) -> Iterator[dict]:
    """A stage that breaks the static image shape."""
    for sample in samples:
        sample["image"] = sample["image"][:, :4, :4]
        yield sample


def label_42(samples: Iterator[dict]) -> Iterator[dict]:
    """A stage that sets a label past the 10 classes."""
    for sample in samples:
        sample["label"] = 42
        yield sample


def twice(samples: Iterator[dict]) -> Iterator[dict]:
    """A stage that yields every sample twice (more samples than the plan has places for)."""
    for sample in samples:
        yield sample
        yield dict(sample)


def fresh_dicts(samples: Iterator[dict]) -> Iterator[dict]:
    """A stage that builds new dicts without the '__' keys (padding would pass for data)."""
    for sample in samples:
        yield {"image": sample["image"], "label": sample["label"]}


def slow(samples: Iterator[dict]) -> Iterator[dict]:
    """A deliberately slow stage (30 ms a sample): a run that starves for input.

    A sleep, so the input's share grows when a loaded machine slows the steps beside it: at 10 ms
    a sample a CI run under pytest-xdist measured a 23% share (49-60% alone). SLOW_STAGE_SECONDS
    sets another delay: the same stage (a resume must keep the stages) at another speed.
    """
    import os
    import time

    delay = float(os.environ.get("SLOW_STAGE_SECONDS", "0.03"))
    for sample in samples:
        time.sleep(delay)
        yield sample


# block_once's marker: a file whose creation picks the one reader that blocks.
BLOCK_MARKER = "TPUSTREAM_TEST_BLOCK_MARKER"
# Samples block_once lets through before it blocks.
BLOCK_AFTER = "TPUSTREAM_TEST_BLOCK_AFTER"


def block_once(samples: Iterator[dict]) -> Iterator[dict]:
    """Blocks forever after $TPUSTREAM_TEST_BLOCK_AFTER samples of a stream, in the first to get there.

    The first to create the file $TPUSTREAM_TEST_BLOCK_MARKER blocks (one
    replica of a simulated pod, one DataLoader worker); the others, and every
    later run (the rerun that resumes), pass every sample on.
    """
    import os
    import threading

    after = int(os.environ.get(BLOCK_AFTER, "0"))
    for count, sample in enumerate(samples):
        if count == after:
            try:
                os.close(os.open(os.environ[BLOCK_MARKER], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                threading.Event().wait()  # forever: a stage stuck in a read that never returns
        yield sample


def block_forever(samples: Iterator[dict]) -> Iterator[dict]:
    """Blocks forever at the first sample, in every reader (a stage stuck in a read that never returns)."""
    import threading

    for _ in samples:
        threading.Event().wait()
    yield from ()
