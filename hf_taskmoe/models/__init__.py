"""Model families. Each subpackage (`configuration_<family>.py`, `modeling_<family>.py`) registers itself with
`registry.register_family` when imported; importing this package imports every subpackage, so a new family is a
new folder here (or a `register_family` call anywhere)."""

import importlib
import pkgutil

from .registry import FAMILIES, Family, family_for, family_of, get_family, register_family

for _module in pkgutil.iter_modules(__path__):
    if _module.ispkg:
        importlib.import_module(f"{__name__}.{_module.name}")


__all__ = ["FAMILIES", "Family", "family_for", "family_of", "get_family", "register_family"]
