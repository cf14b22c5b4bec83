"""Faults injected by tests, through an explicit seam: a prefill replica's step hook calls
``after_layer`` only when a test installed one (``PrefillReplica.crash_after_layers``)."""

from __future__ import annotations

import os

from actors.disagg.kv_stream import LayerStreamer


class ExitAfterLayers:
    """Exit the process once the streamer has sent ``layers`` layers in total, after the
    copies already started landed: a prefill replica dying mid-stream."""

    def __init__(self, layers: int) -> None:
        self.layers = layers

    def after_layer(self, streamer: LayerStreamer) -> None:
        if streamer.layers_sent >= self.layers:
            streamer.wait_started()
            os._exit(1)
