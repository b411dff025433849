"""A lab's sizes by profile, written once (``labs/labN_*/labN_settings.py``).

Each lab keeps one :class:`Settings`: every size that differs between the ``quick``,
``cpu`` and ``gpu`` profiles is a :class:`By`, every other a plain value. Its notebooks
read it (``S = settings.of()``, then ``S.d_model``), its scripts take their defaults
from it, and a notebook turns the same values into the script's command line
(``options(d_model=D_MODEL, layers=LAYERS)`` -> ``["--d-model", "64", "--layers", "2"]``,
from the names its ``parameters`` cell read; ``settings.args("d_model", "layers")`` where
no name is needed), so a size is never written twice, and a notebook and the script it
launches cannot disagree::

    MODEL = Settings(d_model=By(quick=64, cpu=128, gpu=512), heads=4)
    MODEL.of("cpu").d_model        # 128
    MODEL.args("d_model", "heads") # ["--d-model", "64", "--heads", "4"] in the quick profile
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from lab_utils import profile as lab_profile

T = TypeVar("T")


@dataclass(frozen=True)
class By(Generic[T]):
    """A value for each profile."""

    quick: T
    cpu: T
    gpu: T

    def of(self, name: str) -> T:
        if name not in lab_profile.PROFILES:
            raise ValueError(f"no profile {name!r}: one of {', '.join(lab_profile.PROFILES)}")
        return getattr(self, name)


class Values(Mapping[str, Any]):
    """The settings of one profile: read as attributes (``S.d_model``) or by name."""

    def __init__(self, profile: str, values: Mapping[str, Any]) -> None:
        self._profile = profile
        self._values = MappingProxyType(dict(values))

    @property
    def profile(self) -> str:
        return self._profile

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(
                f"no setting {name!r}; this lab's settings are: {', '.join(self._values)}"
            ) from None

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._values.items())
        return f"Values({self._profile}: {inner})"


def option(name: str) -> str:
    """The command-line option of a setting: ``d_model`` -> ``--d-model``."""
    return "--" + name.replace("_", "-")


def _arg(value: Any) -> list[str]:
    if isinstance(value, bool):
        raise TypeError("a flag is not a value: pass it by hand (--no-augment, ...)")
    if isinstance(value, list | tuple):
        return [str(v) for v in value]
    return [str(value)]


class Settings:
    """A lab's settings: ``name=By(quick=..., cpu=..., gpu=...)`` or ``name=value``."""

    def __init__(self, **values: Any) -> None:
        if not values:
            raise ValueError("Settings() needs at least one value")
        self._values = dict(values)

    def names(self) -> list[str]:
        return list(self._values)

    def of(self, profile: str | None = None) -> Values:
        """Every value for ``profile`` (default: the current one, ``$LABS_PROFILE``)."""
        name = profile or lab_profile.current().name
        return Values(
            name, {k: v.of(name) if isinstance(v, By) else v for k, v in self._values.items()}
        )

    def args(self, *names: str, profile: str | None = None) -> list[str]:
        """The options a script takes for these settings (lists become several values:
        ``--sizes-kb 4 16``), in the order given."""
        values = self.of(profile)
        unknown = [n for n in names if n not in values]
        if unknown:
            raise KeyError(f"no setting {', '.join(unknown)}; there are: {', '.join(values)}")
        return options(**{n: values[n] for n in names})


def options(**values: Any) -> list[str]:
    """A script's command line from named values, in the order given: lists become
    several values, ``options(d_model=64, sizes_kb=[4, 16])`` ->
    ``["--d-model", "64", "--sizes-kb", "4", "16"]``. A notebook builds its launch from
    the names its ``parameters`` cell set, so editing a name there changes the run."""
    out: list[str] = []
    for name, value in values.items():
        out += [option(name), *_arg(value)]
    return out
