"""A KV cache for CPU generation that appends in place: ``GrowingCache``.

transformers' ``DynamicCache`` appends a step's keys and values with ``torch.cat``, which
copies the whole cache at every step of every layer: decoding after a 4096-token prompt, a
4-layer Qwen3-30B-A3B-shaped model spent 4.9 ms of each token in those copies (1.2 ms per
layer; 48 layers would spend ~60 ms). ``StaticCache`` avoids the copies but allocates the
whole length up front and makes every step attend over it, unfilled positions masked.

``GrowingCache`` is a ``DynamicCache`` whose full-attention layers (``GrowingLayer``) keep
their keys and values in buffers with room to spare (grown by a quarter plus 256 positions
when full) and hand out views of the filled part: a step copies only its own states, and
attention reads exactly the filled positions, as with ``DynamicCache``. The values, and so
every result, are the same as ``DynamicCache``'s; only the views' strides differ. Layers of
other kinds (sliding windows) stay transformers' own. A method that replaces the tensors
(beam search's reordering, batch repeats, ``crop``) is followed at the next update by a new
buffer holding them.

``load_model`` makes ``model.generate`` use one by default for CPU inference
(``use_growing_cache``); ``tandem chat`` keeps one across turns.
"""
from __future__ import annotations

import functools

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

GROW_FRACTION = 4   # a full buffer grows by 1 / GROW_FRACTION of what it must hold
GROW_MIN = 256      # and by at least this many positions


def _view_attr(name: str) -> property:
    """``GrowingLayer.keys`` / ``values``: the tensor stored under `name`, read or replaced
    after any pending views are made."""
    def get(self) -> torch.Tensor | None:
        self._pending_views()
        return self.__dict__.get(name)

    def set_(self, t: torch.Tensor | None) -> None:
        self._pending_views()
        self.__dict__[name] = t
    return property(get, set_)


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends into spare room instead of concatenating.

    ``keys`` / ``values`` are views of the buffers' filled part. ``filled(n)`` records n and
    the views are made when next read: the model step (``tandem.decode_step``) marks every
    layer filled at each token and mostly nobody reads them before the next one (a 48-layer
    model's 96 views cost ~0.5 ms of Python a token, on caches the token's weights had just
    gone through). Any other assignment of ``keys`` / ``values`` first makes the pending
    views, so transformers' methods see the tensors they would have seen."""

    def _pending_views(self) -> None:
        n = self.__dict__.get("_pending")
        if n is not None:
            kb, vb = self._buffers
            k, v = kb[..., :n, :], vb[..., :n, :]
            self.__dict__.update(_keys=k, _values=v, _pending=None)
            self._views = (k, v)

    keys = _view_attr("_keys")
    values = _view_attr("_values")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._buffers = None  # (keys buffer, values buffer): [..., capacity, D]
        self._views = None    # the (keys, values) objects this layer last handed out

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.reserve(key_states.shape[-2], key_states, value_states)
        need = n + key_states.shape[-2]
        kb, vb = self._buffers
        kb[..., n:need, :].copy_(key_states)
        vb[..., n:need, :].copy_(value_states)
        self.filled(need)
        return self.keys, self.values

    def reserve(self, extra: int, like_k: torch.Tensor | None = None, like_v: torch.Tensor | None = None) -> int:
        """Buffers (``_buffers``) holding the n positions cached so far with room for `extra`
        more, shaped like `like_k` / `like_v` (default: the cached keys and values) but for
        their positions; returns n. Still the views handed out? Another method may have
        replaced them (reorder_cache, batch_repeat_interleave, crop): then they move into new
        buffers."""
        n = self.__dict__.get("_pending")
        if n is not None and n + extra <= self._buffers[0].shape[-2]:
            return n  # views not made yet: still the buffers', with room
        v = self._views
        owned = v is not None and v[0] is self.keys and v[1] is self.values
        n = self.keys.shape[-2] if owned or self.keys.numel() else 0
        need = n + extra
        if not owned or need > self._buffers[0].shape[-2]:
            cap = need + max(need // GROW_FRACTION, GROW_MIN)
            bufs = []
            for old, new in ((self.keys, self.keys if like_k is None else like_k),
                             (self.values, self.values if like_v is None else like_v)):
                buf = new.new_empty(*new.shape[:-2], cap, new.shape[-1])
                if n:
                    buf[..., :n, :].copy_(old)
                bufs.append(buf)
            self._buffers = tuple(bufs)
        return n

    def filled(self, n: int) -> None:
        """The first n positions of the buffers are the cache's keys and values (the views
        made when next read)."""
        self.__dict__["_pending"] = n

    def get_seq_length(self) -> int:
        n = self.__dict__.get("_pending")
        return n if n is not None else super().get_seq_length()

    def reset(self) -> None:
        self.__dict__["_pending"] = None
        self._buffers = self._views = None
        super().reset()


class GrowingCache(DynamicCache):
    """``DynamicCache`` (same arguments) with ``GrowingLayer`` for its full-attention layers."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.layers = [GrowingLayer() if type(layer) is DynamicLayer and not layer.is_initialized else layer
                       for layer in self.layers]
        if getattr(self, "layer_class_to_replicate", None) is DynamicLayer:
            self.layer_class_to_replicate = GrowingLayer


def default_cache_is_dynamic(model) -> bool:
    """Whether transformers' generate would make this model a ``DynamicCache`` (not an
    encoder-decoder, Mamba-style, or a model with a cache of its own such as MiniMax's)."""
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    return (not getattr(model.config, "is_encoder_decoder", False) and "mamba" not in type(model).__name__.lower()
            and (supports is None or bool(supports())))


def use_growing_cache(model) -> None:
    """``model.generate`` gets a fresh ``GrowingCache`` unless the call passes its own cache,
    a ``cache_implementation`` (or the generation config names one), or ``use_cache=False``.
    Models that generate would not give a ``DynamicCache`` are left alone."""
    if not default_cache_is_dynamic(model):
        return
    gen = model.generate

    @functools.wraps(gen)
    def generate(*args, **kwargs):
        config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
        if (kwargs.get("past_key_values") is None and kwargs.get("cache_implementation") is None
                and getattr(config, "cache_implementation", None) is None
                and kwargs.get("use_cache", getattr(config, "use_cache", True)) is not False):
            kwargs["past_key_values"] = GrowingCache(config=model.config)
        return gen(*args, **kwargs)

    model.generate = generate
