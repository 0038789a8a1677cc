"""Which module's forward is running: what both allocation trackers (the simulator's capture,
``training/capture.py``, and preflight's, ``preflight/tracker.py``) label an allocation with.

Forward pre- and post-hooks on every submodule of a watched model push and pop its name
(``named_modules``; the root, which has none, by its class name), so ``current`` is the
innermost module whose forward is running, or "" outside any.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


class ModuleStack:
    def __init__(self) -> None:
        self._stack: list[str] = []
        self._handles: list[Any] = []

    @property
    def current(self) -> str:
        return self._stack[-1] if self._stack else ""

    def watch(self, model: nn.Module) -> None:
        """Label what runs inside ``model``'s forward, and its submodules', with their names."""
        for name, mod in model.named_modules():
            label = name or type(mod).__name__
            self._handles.append(mod.register_forward_pre_hook(self._enter(label)))
            self._handles.append(mod.register_forward_hook(self._leave))

    def _enter(self, label: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any) -> None:
            self._stack.append(label)

        return hook

    def _leave(self, mod: nn.Module, args: Any, out: Any) -> None:
        if self._stack:
            self._stack.pop()

    def height(self) -> int:
        return len(self._stack)

    def cut(self, height: int) -> None:
        """Back to ``height`` entries: forwards that never ended (a checkpoint's
        recomputation stopped part-way) leave their labels behind."""
        del self._stack[height:]

    def close(self) -> None:
        """Remove every hook (the run is over)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._stack.clear()
