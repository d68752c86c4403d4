"""Model families. Each subpackage (`configuration_<family>.py`, `modeling_<family>.py`) registers itself with
`registry.register_family` when imported; importing this package imports every subpackage, so a new family is a
new folder here (or a `register_family` call anywhere)."""

import importlib
import pkgutil
import warnings

from .registry import FAMILIES, Family, family_of, get_family, register_family

for _module in pkgutil.iter_modules(__path__):
    if _module.ispkg:
        importlib.import_module(f"{__name__}.{_module.name}")


def __getattr__(name):
    # the tables this registry replaced, kept for one release
    if name == "AUTO_REGISTRY":
        warnings.warn("hf_taskmoe.models.AUTO_REGISTRY is deprecated; use hf_taskmoe.models.FAMILIES.", FutureWarning, stacklevel=2)
        return [(f.config_class, f.model_class) for f in FAMILIES.values()]
    if name == "MODEL_FAMILIES":
        warnings.warn("hf_taskmoe.models.MODEL_FAMILIES is deprecated; use hf_taskmoe.models.FAMILIES.", FutureWarning, stacklevel=2)
        return {f.name: f.model_class for f in FAMILIES.values() if f.buildable_from_dense}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FAMILIES", "Family", "family_of", "get_family", "register_family"]
