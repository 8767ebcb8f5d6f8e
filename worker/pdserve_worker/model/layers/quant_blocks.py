"""The GGUF block types the engine keeps quantized, as the kinds they become (`quant.py`).

Without torch, so that `pdserve info` (model/loading/sizing.py) and the weight routes can size
a quantized model on a machine that cannot run it.
"""

from __future__ import annotations

from typing import Literal

Kind = Literal["q4", "q8"]
# Values per block along a row (ggml-common.h: QK4_0 = QK4_1 = QK8_0 = 32).
GROUP = 32
# GGUF tensor type name -> the kind it is kept as.
QUANTIZED_TYPES: dict[str, Kind] = {"Q4_0": "q4", "Q4_1": "q4", "Q8_0": "q8"}
