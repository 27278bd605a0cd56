"""The model's og process and its lanes (``_og_process``, ``_og_child``)."""

from __future__ import annotations

import os
import socket

from ortserve_runtime import ModelConfig
from ortserve_runtime._og_process import OgProcess
from serving import TINY_MODEL


def test_the_lanes_send_each_message_at_once() -> None:
    """A lane's message is its length, then its bytes (two writes past 16 KiB): with
    Nagle's algorithm on, the second waited for the first's acknowledgement, which the peer
    delays up to 40 ms, and every og-generator step took 40-44 ms (22.7 tokens/s on the tiny
    vision models, 2,000 with it off: benchmarks/bench_multimodal.py). Measured in the
    benchmark; here, that the lanes are set so."""
    process = OgProcess(TINY_MODEL, ModelConfig(engine="og-generator"))
    try:
        for lane in process._lanes.values():
            with socket.socket(fileno=os.dup(lane.fileno())) as sock:
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        process.close()
