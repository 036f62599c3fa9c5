"""A model class of `attnres.models.modeling_attnres` named before it is imported, for transformers' Auto mappings."""

from __future__ import annotations

import importlib

from attnres.models.configuration_attnres import AttnResConfig


class LazyModelClass:
    """Stands for the model class `name` in an Auto mapping: every attribute (`from_pretrained`, `_from_config`, ...)
    is the class's own, imported on first use. The Auto classes only call the class's methods; registering the class
    itself would import transformers' modeling code (seconds) with `import attnres`."""

    config_class = AttnResConfig  # read by `AutoModel.register`

    def __init__(self, name: str):
        self.__name__ = name

    def load(self) -> type:
        return getattr(importlib.import_module("attnres.models.modeling_attnres"), self.__name__)

    def __getattr__(self, attr: str):
        if attr.startswith("__"):  # copy and pickle probes, before `__name__` is set
            raise AttributeError(attr)
        return getattr(self.load(), attr)

    def __repr__(self) -> str:
        return f"LazyModelClass({self.__name__!r})"
