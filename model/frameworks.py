"""What oomcast's callbacks for training frameworks share (the in-job hook's,
``collectors/integrations.py``, and preflight's, ``preflight/callbacks.py``). Nothing here
imports a framework until a callback is made.

- Hugging Face ``Trainer`` calls callbacks by method name, so a plain class will do; one
  that derives from ``HFCallback`` answers every ``on_*`` event it does not handle.
- A Lightning callback must subclass Lightning's ``Callback``, so its class is made on first
  use by ``lightning_class``, from whichever of ``lightning`` and ``pytorch_lightning`` is
  installed (once per ``Callback`` class: both may be, and a trainer of one rejects the
  other's callbacks).
"""

from __future__ import annotations

from typing import Any


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


class HFCallback:
    """A base for ``transformers`` callbacks: events the subclass does not define do nothing
    (the ``Trainer`` calls ``on_*`` methods by name, more of them in newer releases)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("on_"):
            return _noop
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


_LIGHTNING_CLASSES: dict[tuple[type, type], type] = {}


def lightning_class(logic: type, name: str, module: str, missing: str) -> type:
    """``logic`` mixed with Lightning's ``Callback`` into a class called ``name`` (of
    ``module``), made once. ImportError, with ``missing`` and how to install Lightning,
    where neither ``lightning`` nor ``pytorch_lightning`` imports."""
    try:
        from lightning.pytorch import Callback
    except ImportError:
        try:
            from pytorch_lightning import Callback
        except ImportError as exc:
            raise ImportError(
                f"{name} needs PyTorch Lightning: pip install lightning (or pytorch-lightning)"
                + (f"; {missing}" if missing else "")
            ) from exc
    cls = _LIGHTNING_CLASSES.get((logic, Callback))
    if cls is None:
        cls = type(name, (logic, Callback), {"__module__": module, "__doc__": logic.__doc__})
        _LIGHTNING_CLASSES[(logic, Callback)] = cls
    return cls
