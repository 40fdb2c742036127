"""JPEGs decoded and cropped on the replica's device (data.decode=device): the replica's side.

The workers sent each batch's JPEG bytes with the crops they drew
(data.read.encoded). Here the JPEGs are decoded in one call of
``torchvision.io.decode_jpeg`` (on a GPU: nvJPEG, batched on the hardware
decoder of an A100/H100 for baseline JPEGs, one by one otherwise), then
each crop's region is resampled to its size by the same antialiasing
bilinear filter the host path applies (``F.interpolate(antialias=True)``,
in float32, rounded: the host resamples uint8 directly, so the two agree to
within one level), windowed and flipped.

On a GPU the work runs on a stream of its own, on the loader's receiving
thread, a couple of batches ahead of the step: torchvision's decode waits
for its result on the host (without the GIL), and the crops' small kernels
can overlap the step's. The batch is handed over only when its images are
complete, so the training stream needs no wait on ours; the native runtime
records every GPU tensor of a batch as used by the streams that read it
(runtime.native._CopyStream), so an image's memory is not reused while a
step reads it.

nvJPEG has no DCT-domain downscaling: each JPEG is decoded at full size. The
host path decodes at 1/2, 1/4 or 1/8 scale where the crop is shrunk at least
that much, so its pixels differ slightly from these where it did; with
``use_dct=False`` it matches these within the rounding of the resample
(tests/test_device_decode.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from tpustream.config import OnError
from tpustream.data.format.decode import first_line
from tpustream.data.read.assemble import as_tensors
from tpustream.data.read.encoded import KIND_JPEG
from tpustream.data.read.stages import MAX_LOGGED_ERRORS, SHARD_ID_SHIFT
from tpustream.errors import ConfigError, DataError

log = logging.getLogger(__name__)

_SAMPLE_MASK = (1 << SHARD_ID_SHIFT) - 1


class DeviceDecoder:
    """Batches with encoded images (data.read.encoded's fields) -> batches with "image" on `device`.

    A JPEG that cannot be decoded is bad data as in a worker: on_error=raise
    stops the run naming its shard and sample; skip logs it (bounded), leaves
    its place zeros, not real, and counts it in the batch's "filled".
    """

    def __init__(
        self, device: torch.device, size: int, channels: int, on_error: OnError, shard_urls: Sequence[str]
    ):
        from torchvision.io import ImageReadMode

        self.device = device
        self.size = size
        self.channels = channels
        # A grey JPEG decoded as RGB repeats its one plane, as the host path's crop does.
        self.mode = ImageReadMode.RGB if channels == 3 else ImageReadMode.GRAY
        self.on_error = OnError(on_error)
        self.shard_urls = list(shard_urls)
        self.logged = 0
        self._stream: torch.cuda.Stream | None = None

    def check(self) -> None:
        """ConfigError if torchvision cannot decode a JPEG on the device (built without nvJPEG, say)."""
        from torchvision.io import decode_jpeg, encode_jpeg

        probe = encode_jpeg(torch.zeros((3, 8, 8), dtype=torch.uint8))
        try:
            decode_jpeg([probe], mode=self.mode, device=self.device)
        except (RuntimeError, ValueError) as exc:
            raise ConfigError(
                f"data.decode=device: torchvision cannot decode JPEGs on {self.device} "
                f"({first_line(exc)}); use data.decode=host"
            ) from None

    def __call__(self, batch: dict) -> dict:
        batch = as_tensors(batch)
        data, sizes, crops = batch.pop("encoded"), batch.pop("encoded_size"), batch.pop("crop")
        if self.device.type != "cuda":
            batch["image"] = self._images(batch, data, sizes, crops)
            return batch
        with torch.cuda.device(self.device), torch.cuda.stream(self._side_stream()):
            images = self._images(batch, data, sizes, crops)
            done = torch.cuda.Event()
            done.record()
        done.synchronize()  # complete before the training thread sees them: no cross-stream wait
        batch["image"] = images
        return batch

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _images(
        self, batch: dict, data: torch.Tensor, sizes: torch.Tensor, crops: torch.Tensor
    ) -> torch.Tensor:
        """uint8 (B, channels, size, size) on the device."""
        count, size, channels = len(sizes), self.size, self.channels
        images = torch.empty((count, channels, size, size), dtype=torch.uint8, device=self.device)
        ends = np.cumsum(sizes.numpy()).tolist()
        starts = [0, *ends[:-1]]
        rows = crops.tolist()
        jpegs = [i for i in range(count) if rows[i][0] == KIND_JPEG]
        for i in range(count):
            if rows[i][0] != KIND_JPEG:  # a crop the worker decoded (not a JPEG nvJPEG takes)
                images[i].copy_(data[starts[i] : ends[i]].view(channels, size, size))
        decoded = self._decode([data[starts[i] : ends[i]] for i in jpegs], jpegs, batch)
        flips = []
        for i, image in zip(jpegs, decoded, strict=True):
            if image is None:
                images[i].zero_()
                continue
            self._crop_into(images[i], image, rows[i])
            if rows[i][9]:
                flips.append(i)
        if flips:  # one gather and scatter for the batch, not a flipped copy per image
            index = torch.tensor(flips, device=self.device)
            images[index] = images[index].flip(-1)
        return images

    def _crop_into(self, out: torch.Tensor, image: torch.Tensor, row: list[int]) -> None:
        """One crop plan (data.read.crops.CropPlan, as a row) of a decoded image, written into `out`."""
        _, left, top, right, bottom, resized_h, resized_w, offset_row, offset_col, _ = row
        region = image[:, top:bottom, left:right]
        if (bottom - top, right - left) != (resized_h, resized_w):
            region = F.interpolate(
                region[None].float(),
                size=(resized_h, resized_w),
                mode="bilinear",
                antialias=True,
                align_corners=False,
            )[0].round_()  # in [0, 255]: the filter's weights are non-negative and sum to one
        out.copy_(region[:, offset_row : offset_row + self.size, offset_col : offset_col + self.size])

    def _decode(
        self, encoded: list[torch.Tensor], places: list[int], batch: dict
    ) -> list[torch.Tensor | None]:
        """The JPEGs decoded in one call; if that fails, one by one, on the host where the device
        refuses one, None for each neither reads."""
        if not encoded:
            return []
        try:
            return self._on_device(encoded)
        except RuntimeError:
            pass
        images: list[torch.Tensor | None] = []
        for piece, place in zip(encoded, places, strict=True):
            try:
                images.append(self._on_device([piece])[0])
                continue
            except RuntimeError as exc:
                reason = first_line(exc)
            # What nvJPEG refuses (an unusual chroma subsampling, say) libjpeg-turbo may
            # read: decoded by the host, then cropped on the device like the rest.
            try:
                images.append(self._on_host(piece).to(self.device))
                continue
            except RuntimeError as exc:
                reason = f"{reason}; on the host: {first_line(exc)}"
            self._bad(batch, place, reason)
            images.append(None)
        return images

    def _on_device(self, encoded: list[torch.Tensor]) -> list[torch.Tensor]:
        from torchvision.io import decode_jpeg

        return list(decode_jpeg(encoded, mode=self.mode, device=self.device))

    def _on_host(self, piece: torch.Tensor) -> torch.Tensor:
        from torchvision.io import decode_jpeg

        return decode_jpeg(piece, mode=self.mode)

    def _bad(self, batch: dict, place: int, reason: str) -> None:
        sample_id = int(batch["sample_id"][place])
        url = self.shard_urls[sample_id >> SHARD_ID_SHIFT] if sample_id >= 0 else None
        where = f"{url}, its sample at index {sample_id & _SAMPLE_MASK}" if url is not None else "a fill"
        if self.on_error == OnError["raise"]:
            raise DataError(f"{where}: cannot decode its JPEG on {self.device}: {reason}")
        if batch["real"][place] > 0:  # padding and fills were counted where they are real
            batch["real"][place] = 0
            batch["filled"] = batch["filled"] + 1
            if url is not None and url not in batch["bad_shards"]:
                batch["bad_shards"] = [*batch["bad_shards"], url]
        if self.logged < MAX_LOGGED_ERRORS:
            log.warning("skipping bad data: %s: cannot decode its JPEG on %s: %s", where, self.device, reason)
        elif self.logged == MAX_LOGGED_ERRORS:
            log.warning("more JPEGs the device cannot decode; counting without logging")
        self.logged += 1
