"""Shared by the examples: which model folder to serve and on which port.

`ORTSERVE_EXAMPLE_MODEL` names a genai model folder (default: the tiny test model of this
checkout), `ORTSERVE_EXAMPLE_VISION_MODEL` and `ORTSERVE_EXAMPLE_SPEECH_MODEL` an image
chat and a Whisper folder (default: the tiny ones); `PORT` the port (default 8000; 0 picks
a free one).
"""

from __future__ import annotations

import os
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
MODEL_DIR = Path(os.environ.get("ORTSERVE_EXAMPLE_MODEL", FIXTURES / "tiny-qwen2"))
VISION_MODEL_DIR = Path(os.environ.get("ORTSERVE_EXAMPLE_VISION_MODEL", FIXTURES / "tiny-phi3v"))
SPEECH_MODEL_DIR = Path(os.environ.get("ORTSERVE_EXAMPLE_SPEECH_MODEL", FIXTURES / "tiny-whisper"))
PORT = int(os.environ.get("PORT", "8000"))
