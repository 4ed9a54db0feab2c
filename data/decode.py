"""Bytes nobody vouched for -> a uint8 RGB CHW tensor, or `BadImageError` saying why not.

The format is told by content (magic bytes), never by name: ImageNet holds a PNG and CMYK
files named `.JPEG`. JPEG takes the fast path (torchvision's libjpeg-turbo decoder); every
other format goes through PIL, limited to the formats torchvision's `ImageFolder` accepts, so
no plugin that runs a program (EPS calls Ghostscript) ever sees a file. PNG goes through PIL
too: torchvision's `decode_png` segfaulted on a PNG with one flipped byte in its image data,
which kills a DataLoader worker on every restart.

Before any decoder allocates, the size the file *declares* is read from its header and a file
over `max_pixels` is refused: a 1.4 KB JPEG may declare 30000x30000, and its decode then
allocates gigabytes (filling what it cannot decode with grey). So is a JPEG with more scans
than any real one has, each of which the decoder would pay for over the whole image.

libjpeg reports corrupt entropy-coded data ("Corrupt JPEG data: premature end of data
segment") only as a line on stderr, and decodes the file anyway; torchvision offers no way to
see it. So the JPEG decode runs with file descriptor 2 pointed at a pipe, and such a line makes
the file bad. Whatever else lands on stderr in that window (another thread's log line) is
passed on to the real stderr.
"""

from __future__ import annotations

import io
import os
import re
import threading
import warnings
from typing import Callable, List, Optional, Tuple, TypeVar, Union

import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2 import functional as F

from common.redact import one_line

T = TypeVar("T")
Buffer = Union[bytes, bytearray]

# What torchvision's ImageFolder lists (torchvision.datasets.folder.IMG_EXTENSIONS).
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# The PIL plugins for those formats; a JPEG goes to torchvision instead.
PIL_FORMATS = ("PNG", "PPM", "BMP", "TIFF", "WEBP")
# PIL's own decompression-bomb threshold (Image.MAX_IMAGE_PIXELS): 1024 * 1024 * 1024 // 12.
DEFAULT_MAX_PIXELS = 89_478_485

# The leading bytes of each format decoded here (PIL's own tests for PNG, PPM, BMP, TIFF and
# WEBP). Bytes without one are no image: they are refused before they are cached or decoded.
_SIGNATURES = (b"\xff\xd8", b"\x89PNG\r\n\x1a\n", b"BM", b"MM\x00*", b"II*\x00", b"MM*\x00",
               b"II\x00*", b"MM\x00+", b"II+\x00", *(b"P" + bytes([c]) for c in b"0123456fy"))
NOT_AN_IMAGE = ("not an image (its first bytes are those of no JPEG, PNG, PPM, BMP, TIFF or "
                "WEBP file)")

# Real photographs, panoramas included, are within 1:10. A 1x2000000 PNG is 8 KB and under any
# pixel limit, yet resizing its short side to 36 pixels makes 36x72000000.
MAX_ASPECT_RATIO = 64

# Frame headers (SOF0..SOF15) carry the size; C4 (DHT), C8 (JPG) and CC (DAC) are not frames.
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_STANDALONE_MARKERS = frozenset([0x01, *range(0xD0, 0xD8)])  # TEM, RST0..7: no length
# A real JPEG has a few dozen segments before its frame header; a hostile one may claim
# millions of tiny ones. Past this many, stop reading and call the header corrupt.
_MAX_HEADER_SEGMENTS = 1024
# A progressive JPEG refines the whole image once per scan, and libjpeg decodes every scan it
# is given, valid or not: a 141-byte scan repeated 3000 times in a 740 KB file costs 38 s of
# CPU per decode. A real progressive JPEG has about ten scans (libjpeg's default script),
# a baseline one one per component; past this many, the file is refused before decoding.
MAX_JPEG_SCANS = 256
# libjpeg's warnings that mean "the pixels are not what the file's author encoded". Only the
# first warning of a decode is printed, so one decode writes at most one such line.
_CORRUPT_LINE = re.compile(
    rb"^(?:Corrupt JPEG data: (?!bad ICC marker).*|Premature end of JPEG file"
    rb"|Invalid SOS parameters for sequential JPEG|Inconsistent progression sequence.*)\n?",
    re.MULTILINE)


class BadImageError(ValueError):
    """These bytes are not a usable image; the message says why (one line)."""


def looks_like_an_image(data: Buffer) -> bool:
    """Whether `data` starts as a file of a format decoded here does (its magic bytes)."""
    return (bytes(data[:8]).startswith(_SIGNATURES)
            or (data[:4] == b"RIFF" and data[8:12] == b"WEBP"))


def jpeg_problem(data: Buffer) -> Optional[str]:
    """Why `data` cannot be a whole JPEG, or None. Decoders often accept a truncated file
    (filling the rest with grey), so the end-of-image marker is checked explicitly."""
    if data[:2] != b"\xff\xd8":
        return "not a JPEG (no start-of-image marker)"
    end = len(data)
    while end > 2 and data[end - 1] == 0:  # some writers pad after the marker
        end -= 1
    if data[end - 2:end] != b"\xff\xd9":
        return "truncated JPEG (no end-of-image marker)"
    return None


def jpeg_dimensions(data: Buffer) -> Tuple[int, int]:
    """(height, width) from the JPEG's frame header, reading only the segments before it."""
    pos, end = 2, len(data)
    for _ in range(_MAX_HEADER_SEGMENTS):
        if pos + 4 > end:
            break
        if data[pos] != 0xFF:
            raise BadImageError("corrupt JPEG header (no marker where one must be)")
        marker = data[pos + 1]
        if marker == 0xFF:  # a fill byte before a marker
            pos += 1
            continue
        if marker in _STANDALONE_MARKERS:
            pos += 2
            continue
        if marker in (0xDA, 0xD9):  # start of scan or end of image before any frame header
            break
        length = int.from_bytes(data[pos + 2:pos + 4], "big")
        if length < 2:
            raise BadImageError("corrupt JPEG header (a segment shorter than its length field)")
        if marker in _SOF_MARKERS:
            if pos + 9 > end:
                break
            height = int.from_bytes(data[pos + 5:pos + 7], "big")
            width = int.from_bytes(data[pos + 7:pos + 9], "big")
            if height == 0 or width == 0:  # height 0 defers it to a DNL marker: unsupported
                raise BadImageError(f"JPEG frame header declares {width}x{height} pixels")
            return height, width
        pos += 2 + length
    raise BadImageError("corrupt JPEG header (no frame header before the image data)")


def jpeg_scans(data: Buffer) -> int:
    """How many scans the JPEG holds, at most. Entropy-coded data never holds the bytes
    FF DA (an FF there is followed by 00 or a restart marker), so every start-of-scan marker
    is counted, plus any FF DA inside a metadata segment (an EXIF thumbnail's own scans):
    an upper bound, found at memory speed whatever the file's structure."""
    return data.count(b"\xff\xda")


def check_size(width: int, height: int, max_pixels: int) -> None:
    """Refuse a declared size that no decode, or no resize of the decoded image, should be
    allowed to allocate for."""
    if width * height > max_pixels:
        raise BadImageError(f"declares {width}x{height} pixels, more than "
                            f"data.max_image_pixels={max_pixels} (a decompression bomb, or "
                            f"raise data.max_image_pixels)")
    if min(width, height) == 0 or max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise BadImageError(f"declares {width}x{height} pixels, one side more than "
                            f"{MAX_ASPECT_RATIO} times the other (resizing its short side to "
                            f"the model's input would take gigabytes)")


def decode(data: Buffer, max_pixels: int = DEFAULT_MAX_PIXELS) -> torch.Tensor:
    """The image in `data` as uint8 RGB CHW; BadImageError when it is not a usable image."""
    if data[:2] == b"\xff\xd8":
        return _decode_jpeg(data, max_pixels)
    return _decode_pil(data, max_pixels)


def _decode_jpeg(data: Buffer, max_pixels: int) -> torch.Tensor:
    problem = jpeg_problem(data)
    if problem is not None:
        raise BadImageError(problem)
    height, width = jpeg_dimensions(data)
    check_size(width, height, max_pixels)
    scans = jpeg_scans(data)
    if scans > MAX_JPEG_SCANS:
        raise BadImageError(f"a JPEG of {scans} scans, more than {MAX_JPEG_SCANS} (a real one "
                            f"has about ten; each is a pass over the whole image: a CPU bomb)")
    # frombuffer wants a writable buffer; a cache hit already is a fresh one.
    buffer = data if isinstance(data, bytearray) else bytearray(data)
    try:
        image, messages = _with_stderr_captured(lambda: decode_jpeg(
            torch.frombuffer(buffer, dtype=torch.uint8), mode=ImageReadMode.RGB))
    except RuntimeError:  # the decoder's verdict on a corrupt file
        raise BadImageError("corrupt JPEG (the decoder rejected it)") from None
    corrupt = _CORRUPT_LINE.search(messages)
    if corrupt is not None:
        raise BadImageError(f"corrupt JPEG (the decoder said: "
                            f"{corrupt.group().decode(errors='replace').strip()})")
    return image


def _decode_pil(data: Buffer, max_pixels: int) -> torch.Tensor:
    # Any exception out of a decoder fed hostile bytes says the same thing: not an image we
    # can use (PIL's plugins raise OSError, SyntaxError, struct.error, ValueError, ...).
    try:
        with warnings.catch_warnings():
            # Image.open warns past Image.MAX_IMAGE_PIXELS (and raises past twice that);
            # the size is checked against our own limit below, before anything is decoded.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=PIL_FORMATS)
    except Image.DecompressionBombError as err:
        raise BadImageError(f"declares more pixels than PIL's decompression-bomb limit "
                            f"({one_line(err, limit=100)})") from None
    except Exception as err:
        raise BadImageError(f"not a JPEG, nor an image PIL reads as "
                            f"{', '.join(f.lower() for f in PIL_FORMATS)} "
                            f"({one_line(err, limit=100)})") from None
    check_size(*image.size, max_pixels)
    try:
        # ImageFile.LOAD_TRUNCATED_IMAGES stays False: a truncated file raises here.
        return F.pil_to_tensor(image.convert("RGB"))
    except Exception as err:
        raise BadImageError(f"corrupt {image.format} ({one_line(err, limit=100)})") from None


_capture_lock = threading.Lock()
_pipe: Optional[Tuple[int, int, int]] = None  # (read end, write end, owning pid)


def _own_pipe() -> Tuple[int, int]:
    """This process's capture pipe. A forked DataLoader worker inherits its parent's, and
    must not share it (each would read the other's messages), so it makes its own."""
    global _pipe
    if _pipe is None or _pipe[2] != os.getpid():
        if _pipe is not None:
            os.close(_pipe[0])
            os.close(_pipe[1])
        read, write = os.pipe()
        # Never block: a full pipe drops a decoder's message instead of hanging the decode.
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        _pipe = (read, write, os.getpid())
    return _pipe[0], _pipe[1]


def _with_stderr_captured(call: Callable[[], T]) -> Tuple[T, bytes]:
    """`call()`'s result and the decoder messages it wrote to fd 2 (other text is passed on)."""
    with _capture_lock:
        try:
            saved = os.dup(2)
        except OSError:  # no stderr at all: nothing to capture, nor to print to
            return call(), b""
        read, write = _own_pipe()
        os.dup2(write, 2)
        chunks: List[bytes] = []
        try:
            result = call()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            while True:
                try:
                    chunk = os.read(read, 65536)
                except BlockingIOError:
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            rest = _CORRUPT_LINE.sub(b"", b"".join(chunks))
            if rest:
                os.write(2, rest)
    return result, b"".join(chunks)
