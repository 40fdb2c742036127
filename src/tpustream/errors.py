"""Exceptions that carry a one-line message meant for the user."""


class TpustreamError(Exception):
    """An error caused by input, configuration or environment that the user can fix.

    The message names the thing at fault and, where it helps, what to do. Entry
    points print it as one line and exit non-zero instead of a traceback.
    """


class ConfigError(TpustreamError):
    """The configuration is inconsistent with itself, the data or the machine."""


class StorageError(TpustreamError):
    """A local path or gs:// URL cannot be read or written."""


class DataError(TpustreamError):
    """A shard or a sample is malformed (raised only with data.on_error=raise)."""


class ShardFormatError(DataError):
    """A shard is truncated or is not a tar file (or a corrupt gzip stream)."""


# train.py exits with this code after a preemption signal (SIGTERM) once
# output_dir/checkpoints/last.pt holds the progress: a launcher should run the same command
# again (resume=auto continues from there). 75 is EX_TEMPFAIL in sysexits.h.
PREEMPTED_EXIT_CODE = 75

# A replica's progress watchdog (tpustream.watchdog) found nothing moving for
# watchdog.seconds: it wrote every thread's stacks to output_dir/watchdog/ and
# the run exits with this code. Like 75, a launcher may run the same command
# again (it continues from last.pt), a bounded number of times: a hang that
# comes back at the same place is not cured by restarting.
HUNG_EXIT_CODE = 76
