"""What a layer's routed experts compute (``ExpertMath``): the kernels' ``silu(gate) * up``, or
gpt-oss's clamped SwiGLU with biases; the engine is built with it (``_C.Engine``'s
``activation`` / ``swiglu_alpha`` / ``swiglu_limit`` / ``bias``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertMath:
    """What a layer's experts compute: ``silu(gate) * up`` without biases (the default), or a
    clamped SwiGLU ``g = min(g, limit); u = clamp(u, -limit, limit); h = g * sigmoid(alpha g) *
    (u + up_offset)``, with or without biases on gate, up and down: gpt-oss (alpha 1.702, up + 1,
    biases), MiniMax-M3 (its alpha, up + 1), DeepSeek-V4 and HY-V4 (alpha 1, up + 0)."""
    activation: str = "silu"   # "silu" or "clamped_swiglu"
    alpha: float = 1.0
    limit: float = 7.0
    up_offset: float = 0.0
    bias: bool = False

    @property
    def plain(self) -> bool:
        return self.activation == "silu" and not self.bias

    def engine_args(self) -> dict:
        """The keyword arguments of ``_C.Engine`` that select this math."""
        return dict(activation=self.activation, swiglu_alpha=self.alpha, swiglu_limit=self.limit,
                    swiglu_up_offset=self.up_offset, bias=self.bias)

    def describe(self) -> str:
        """The engine's own wording (``_C.Engine.activation``)."""
        s = "silu(gate) * up" if self.activation == "silu" else \
            f"a clamped SwiGLU (alpha {self.alpha:g}, limit {self.limit:g}, up + {self.up_offset:g})"
        return s + " with biases" if self.bias else s


PLAIN = ExpertMath()
