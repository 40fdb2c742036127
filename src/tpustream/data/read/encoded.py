"""JPEGs that travel undecoded to the replica's device (data.decode=device): the workers' side.

A worker reads each sample's bytes and draws its crop from the JPEG header
exactly as the host path does (crops.CroppingDecoder: the same counter-based
draws, so the same window and flip whichever path decodes), but leaves the
pixels to the device (data.read.device_decode: nvJPEG on a GPU). What the
device cannot take, the worker decodes and crops itself, as on the host path,
and sends as pixels: PNGs and other formats, CMYK/YCCK JPEGs, anything whose
header TurboJPEG refuses.

A batch then carries, instead of "image", three fields that concatenate
sample by sample (so workers' pieces and canonical streams' chunks join like
any other field): "encoded" (uint8: every sample's bytes, end to end),
"encoded_size" (int64 (B,): each sample's share of them) and "crop" (int32
(B, CROP_COLUMNS): what to make of them). Not through the shared ring of
decoded batches, whose slots have a fixed size: "encoded" (about 17 MB a
256-image batch of 66 KB JPEGs) as a shared-memory file of its own, the rest
inside the pickled message (SHARED_FIELDS).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import simplejpeg

from tpustream.config import DataConfig, Decode, TrainCrop
from tpustream.data.format.decode import ImageDecoder
from tpustream.data.read.crops import PIL_COLORSPACES, Chooser, CroppingDecoder, CropPlan, decode_crop

# A crop row: kind, then the plan (region left, top, right, bottom; resized height,
# width; window offset row, column; flip). A pixels row's plan is unused.
CROP_COLUMNS = 10
KIND_JPEG, KIND_PIXELS = 0, 1
# Sent by DataLoader as shared memory, not pickled inline: 3.8-5.6 ms of the receiving
# thread's CPU a 17 MB batch instead of 11.5-17.5 ms, measured on 2 cores with 2-8 workers
# (python -m bench.pipeline.receiving --batch-bytes 17000000 --bytes-as tensor|numpy).
SHARED_FIELDS = ("encoded",)


@dataclass(frozen=True)
class EncodedImage:
    """One sample for the device: its JPEG bytes and crop plan, or (plan None) its crop's pixels."""

    data: bytes
    plan: CropPlan | None = None

    def row(self) -> list[int]:
        """Its "crop" row (CROP_COLUMNS integers)."""
        if self.plan is None:
            return [KIND_PIXELS] + [0] * (CROP_COLUMNS - 1)
        plan = self.plan
        return [KIND_JPEG, *plan.region, *plan.resized, *plan.offset, int(plan.flip)]


def blank_image(channels: int, size: int) -> EncodedImage:
    """Zero pixels: what a batch with no sample at all holds (batching stage)."""
    return EncodedImage(bytes(channels * size * size))


def encode_crop(data: bytes, choose: Chooser, size: int, channels: int, use_dct: bool = True) -> EncodedImage:
    """The JPEG as it is with its plan, drawn from its header; anything else decoded here (decode_crop).

    `choose` is called once, as on the host path: here for a JPEG the device
    takes, else by decode_crop (which draws once however it reads the image).
    """
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:  # not a JPEG, or a header TurboJPEG refuses
        colorspace = None
    if colorspace is not None and colorspace not in PIL_COLORSPACES:
        return EncodedImage(data, choose(height, width))
    pixels = decode_crop(data, choose, size, channels, use_dct)
    return EncodedImage(np.ascontiguousarray(pixels).tobytes())


def pack_encoded(images: Sequence[EncodedImage]) -> dict[str, np.ndarray]:
    """A batch's "encoded", "encoded_size" and "crop" from its samples, in order."""
    return {
        # A bytearray: the array is writable, as torch.from_numpy wants.
        "encoded": np.frombuffer(bytearray().join(image.data for image in images), np.uint8),
        "encoded_size": np.fromiter((len(image.data) for image in images), np.int64, len(images)),
        "crop": np.array([image.row() for image in images], np.int32).reshape(len(images), CROP_COLUMNS),
    }


def stream_crops(
    decoder: ImageDecoder, data: DataConfig, train: bool, seed: int
) -> tuple[CroppingDecoder | None, EncodedImage | None]:
    """A stream's random-resized crops (None for pad_crop) and, for data.decode=device, its blank.

    The crops are the same draws either way: decoded by the worker
    (decode_crop), or left as JPEG bytes and a plan for the device (encode_crop).
    """
    if TrainCrop(data.train_crop) != TrainCrop.random_resized:
        return None, None
    if data.in_memory:
        raise ValueError("in_memory holds decoded images; random_resized crops need the encoded ones")
    on_device = Decode(data.decode) == Decode.device
    crops = CroppingDecoder(
        decoder, train, seed, data.eval_crop_ratio, data.hflip, crop=encode_crop if on_device else decode_crop
    )
    channels, size, _ = decoder.shape
    return crops, blank_image(channels, size) if on_device else None
