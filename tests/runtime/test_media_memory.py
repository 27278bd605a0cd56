"""What decoding one image or audio clip costs the model's og process, measured where it is
decoded (``_images.png_for_og``, ``_audio.og_wav``): the twenty-eighth probe of issue 45
found a photo's EXIF turn and audio below 16 kHz each took a request past +512 MiB."""

from __future__ import annotations

import io
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import soundfile
from ortserve_runtime._audio import og_wav
from PIL import Image

_PEAK = """
import resource, sys
from ortserve_runtime._images import png_for_og
data = open(sys.argv[1], "rb").read()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
png_for_og(data, max_pixels=25_000_000, param="x")
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def _peak_mib(path: Path) -> int:
    """The rise of a fresh process's peak resident memory while it decodes ``path``."""
    return int(
        subprocess.run([sys.executable, "-c", _PEAK, str(path)], capture_output=True, text=True, check=True).stdout
    )


def test_a_turned_photo_costs_no_more_to_decode_than_an_upright_one(tmp_path: Path) -> None:
    """25 megapixels of RGBA with EXIF orientation 6: turned before its conversion to RGB,
    its copies took +479 MiB against the upright one's +388 (which two such images in a
    request then took past +512 MiB in the og process)."""
    picture = Image.new("RGBA", (5000, 5000), (10, 200, 30, 128))
    exif = Image.Exif()
    exif[0x0112] = 6
    picture.save(tmp_path / "turned.webp", "WEBP", lossless=True, exif=exif.tobytes())
    picture.save(tmp_path / "upright.webp", "WEBP", lossless=True)
    assert _peak_mib(tmp_path / "turned.webp") <= _peak_mib(tmp_path / "upright.webp") + 30


def test_audio_below_16_khz_is_brought_up_a_block_at_a_time() -> None:
    """Twenty minutes of 4 kHz (a 15 KB FLAC of silence, within the request's 19.2 M samples
    counted at 16 kHz): brought up to 16 kHz whole, its index arrays took 750 MiB of numpy's
    memory (+750-790 MiB in the og process)."""
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(4000 * 1200, np.int16), 4000, format="FLAC")
    tracemalloc.start()
    try:
        wav = og_wav(buffer.getvalue(), "x")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert soundfile.info(io.BytesIO(wav)).frames == 16_000 * 1200
    assert peak < 128 << 20, peak >> 20
