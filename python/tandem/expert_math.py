"""What a layer's routed experts compute (``ExpertMath``): the kernels' ``silu(gate) * up``, or
gpt-oss's clamped SwiGLU with biases; the engine is built with it (``_C.Engine``'s
``activation`` / ``swiglu_alpha`` / ``swiglu_limit`` / ``bias``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertMath:
    """What a layer's experts compute: ``silu(gate) * up`` without biases (the default), or
    gpt-oss's experts: biases on gate, up and down and the clamped SwiGLU
    ``g = min(g, limit); u = clamp(u, -limit, limit); h = g * sigmoid(alpha g) * (u + 1)``."""
    activation: str = "silu"   # "silu" or "swiglu_oai"
    alpha: float = 1.702
    limit: float = 7.0
    bias: bool = False

    @property
    def plain(self) -> bool:
        return self.activation == "silu" and not self.bias

    def engine_args(self) -> dict:
        """The keyword arguments of ``_C.Engine`` that select this math."""
        return dict(activation=self.activation, swiglu_alpha=self.alpha, swiglu_limit=self.limit, bias=self.bias)

    def describe(self) -> str:
        if self.plain:
            return "silu(gate) * up"
        return f"gpt-oss's clamped SwiGLU (alpha {self.alpha:g}, limit {self.limit:g}) with biases"


PLAIN = ExpertMath()
