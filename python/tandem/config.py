"""Placement configs as the engine factories take them: a YAML path, a dict of the same keys,
or None for the defaults (``ConfigLike``), turned into the C++ engine's arguments
(``config_args``) or the C++ parser's validated JSON (``config_json``)."""
from __future__ import annotations

import os
from typing import Any, Mapping

from . import _C

ConfigLike = str | os.PathLike | Mapping[str, Any] | None


def config_args(config: ConfigLike) -> dict[str, str]:
    """The engine's config_path / config_text arguments for a path, a dict or None."""
    if config is None:
        return {"config_text": "version: 1\n"}
    if isinstance(config, Mapping):
        import yaml

        return {"config_text": yaml.safe_dump(dict(config), sort_keys=False)}
    return {"config_path": os.fspath(config)}


def config_json(config: ConfigLike) -> dict[str, Any]:
    """The validated placement (the C++ parser's JSON) of a path, a dict or None."""
    import json

    args = config_args(config)
    text = _C.parse_config_json(args["config_text"]) if "config_text" in args else _C.load_config_json(args["config_path"])
    return json.loads(text)
