"""One window of a JPEG decoded alone, with libjpeg-turbo's cropped decoding (jpeg_window.c).

A training crop covers about half of an ImageNet photo on average: the rows
above it need only their entropy decoding, the columns beside it no
transform, and nothing below it is read. TensorFlow's
``decode_and_crop_jpeg`` does this; simplejpeg (TurboJPEG's whole-image
API) cannot. The pixels are exactly those of decoding the whole image at
the same DCT scale and cutting the window out.

The C file is compiled once per machine with the system's C compiler
(``$CC``, else ``cc``) against the libjpeg-turbo Pillow's wheel carries
(its 6.2 API: headers in ``jpeg_include/``), into
``$XDG_CACHE_HOME/tpustream/`` (``~/.cache``; a temporary folder if that
cannot be written), and loaded with ctypes. Where it cannot be (no
compiler, no libjpeg-turbo 6.2 library, ``TPUSTREAM_JPEG_WINDOW=0``),
``window_decoder()`` is None, the reason is logged once, and images are
decoded whole, then cut.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCE = HERE / "jpeg_window.c"
INCLUDE = HERE / "jpeg_include"
# Off switch, for a machine where the compiled decoder misbehaves.
ENV_SWITCH = "TPUSTREAM_JPEG_WINDOW"
COMPILE_TIMEOUT_SECONDS = 120

# (data, denominator, grey, left, top, right, bottom) -> (rows, columns, channels) uint8
WindowDecoder = Callable[[bytes, int, bool, int, int, int, int], np.ndarray]


def find_libjpeg() -> str | None:
    """A libjpeg-turbo with the 6.2 ABI and cropped decoding: Pillow's own, else the system's."""
    try:
        import PIL
    except ImportError:  # pragma: no cover - Pillow is a dependency
        candidates = []
    else:
        # Linux wheels carry it in pillow.libs/, macOS ones in PIL/.dylibs/ (not tried here).
        package = Path(PIL.__file__).parent
        candidates = sorted(glob.glob(str(package.parent / "pillow.libs" / "libjpeg*.so.62*")))
        candidates += sorted(glob.glob(str(package / ".dylibs" / "libjpeg.62*.dylib")))
    for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"):
        candidates += sorted(glob.glob(f"{folder}/libjpeg.so.62*"))
    for path in candidates:
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(library, "jpeg_crop_scanline") and hasattr(library, "jpeg_skip_scanlines"):
            return path
    return None


def _cache_folders() -> list[Path]:
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    user = os.getuid() if hasattr(os, "getuid") else "user"
    return [Path(home) / "tpustream", Path(tempfile.gettempdir()) / f"tpustream-{user}"]


def build(library: str, compiler: str) -> Path:
    """The compiled decoder for this source, headers and library: made once, then found in the cache.

    Several processes may build at once: each compiles to a file of its own
    and renames it into place, so a reader sees a whole file or none.
    """
    digest = hashlib.sha256()
    for path in (SOURCE, *sorted(INCLUDE.glob("*.h"))):
        digest.update(path.read_bytes())
    digest.update(f"{library}\0{compiler}\0{sys.platform}".encode())
    name = f"jpeg_window-{digest.hexdigest()[:16]}.so"
    errors = []
    for folder in _cache_folders():
        target = folder / name
        if target.exists():
            return target
        partial = folder / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            command = [
                compiler, "-O2", "-shared", "-fPIC", f"-I{INCLUDE}", str(SOURCE), library,
                f"-Wl,-rpath,{os.path.dirname(library)}", "-o", str(partial),
            ]  # fmt: skip
            subprocess.run(
                command, check=True, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_SECONDS
            )
            os.replace(partial, target)
            log.info("built the cropped JPEG decoder %s (against %s)", target, library)
            return target
        except subprocess.CalledProcessError as exc:
            last_line = (exc.stderr.strip().splitlines() or ["no output"])[-1]
            raise OSError(f"{compiler} failed ({last_line})") from None
        except OSError as exc:  # a folder that cannot be written: the next one
            errors.append(f"{folder}: {exc}")
        finally:  # a compile that failed or timed out leaves no partial file
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
    raise OSError("; ".join(errors))


def _bind(path: Path) -> WindowDecoder:
    library = ctypes.CDLL(str(path))
    decode = library.tps_jpeg_decode_window
    decode.argtypes = [ctypes.c_void_p, ctypes.c_ulong, *[ctypes.c_int] * 6, ctypes.c_void_p, ctypes.c_char_p]
    decode.restype = ctypes.c_int
    message_size = library.tps_jpeg_message_size()

    def decode_window(
        data: bytes, denominator: int, grey: bool, left: int, top: int, right: int, bottom: int
    ) -> np.ndarray:
        """(bottom - top, right - left, 1 or 3) uint8 pixels; ValueError with libjpeg's reason if not."""
        out = np.empty((bottom - top, right - left, 1 if grey else 3), np.uint8)
        message = ctypes.create_string_buffer(message_size)
        source = np.frombuffer(data, np.uint8)  # bytes or any buffer, not copied; kept alive here
        # ctypes releases the GIL for the call.
        if decode(
            source.ctypes.data,
            source.size,
            denominator,
            grey,
            left,
            top,
            right,
            bottom,
            out.ctypes.data,
            message,
        ):
            raise ValueError(message.value.decode(errors="replace"))
        return out

    return decode_window


# The first call builds or loads: once, though replicas may be threads of one process (TPU v2/v3).
_first_call = threading.Lock()


def window_decoder() -> WindowDecoder | None:
    """The compiled window decoder of this process, built if needed; None (logged once) where it cannot be."""
    with _first_call:
        return _window_decoder()


def forget_decoder() -> None:
    """The next window_decoder() decides again (after $CC or the off switch changed)."""
    with _first_call:
        _window_decoder.cache_clear()


@functools.cache
def _window_decoder() -> WindowDecoder | None:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        log.info("cropped JPEG decoding off (%s=0): decoding whole images", ENV_SWITCH)
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    library = find_libjpeg()
    reason = None
    if compiler is None:
        reason = f"no C compiler ({os.environ.get('CC', 'cc')})"
    elif library is None:
        reason = "no libjpeg-turbo with the 6.2 API (Pillow's wheel carries one)"
    else:
        try:
            return _bind(build(library, compiler))
        except Exception as exc:  # whatever stops the build or the load leaves whole-image decoding
            reason = f"{exc.__class__.__name__}: {exc}"
    log.warning(
        "cropped JPEG decoding unavailable (%s): decoding whole images, about 10%% fewer images/s a core",
        reason,
    )
    return None
