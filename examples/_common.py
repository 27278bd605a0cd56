"""Shared by the examples: which model folder to serve and on which port.

`ORTSERVE_EXAMPLE_MODEL` names a genai model folder (default: the tiny test model of this
checkout); `PORT` the port (default 8000; 0 picks a free one).
"""

from __future__ import annotations

import os
from pathlib import Path

MODEL_DIR = Path(
    os.environ.get("ORTSERVE_EXAMPLE_MODEL", Path(__file__).resolve().parent.parent / "tests/fixtures/tiny-qwen2")
)
PORT = int(os.environ.get("PORT", "8000"))
