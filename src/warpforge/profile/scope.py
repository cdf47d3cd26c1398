"""Which module is running: a stack of module paths kept by forward pre/post hooks.

The FLOP counter reads it to file each operator under its module, and the profiled window uses
the same hooks to open a profiler range and an NVTX range per module (so a Kineto or Nsight
Systems timeline reads like the model) and to time module boundaries. Paths are those of
``named_modules()`` ("layer3.1.conv2"); the root is "" and displays as its class name.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

ModuleCallback = Callable[[str], None]  # called with the module path


def fast_range(name: str):
    """A profiler range (a context manager): the C++ fast record function (no op dispatch, ~0.3 us)
    when torch has it, else ``torch.profiler.record_function``. Costs next to nothing with no profiler on."""
    fast = getattr(torch._C._profiler, "_RecordFunctionFast", None)
    return fast(name) if fast is not None else torch.profiler.record_function(name)


def module_depth(path: str) -> int:
    """0 for the root (""), 1 for "layer1", 2 for "layer1.0", ..."""
    return 0 if not path else path.count(".") + 1


class ModuleScope:
    """Context manager: while active, ``current()`` is the innermost running module's path.

    ``on_enter``/``on_exit`` run at each module boundary (after the push, before the pop). The exit
    hook is registered with ``always_call=True`` so an exception inside a forward still pops.
    """

    def __init__(self, root: torch.nn.Module, *, on_enter: ModuleCallback | None = None,
                 on_exit: ModuleCallback | None = None, max_depth: int | None = None):
        if not isinstance(root, torch.nn.Module):
            raise ValueError(f"root: expected a torch.nn.Module, got {type(root).__name__}")
        self.root_type = type(root).__name__
        # named_modules() lists a module shared by several parents once, under its first path.
        self._modules = [(name, m) for name, m in root.named_modules()
                         if max_depth is None or module_depth(name) <= max_depth]
        self.types = {name: type(m).__name__ for name, m in self._modules}
        self.stack: list[str] = []
        self.calls: Counter[str] = Counter()
        self._on_enter = on_enter
        self._on_exit = on_exit
        self._handles: list = []

    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    def display(self, path: str) -> str:
        return path or self.root_type

    def _pre(self, path: str):
        def hook(_module, _args):
            self.stack.append(path)
            self.calls[path] += 1
            if self._on_enter is not None:
                self._on_enter(path)
        return hook

    def _post(self, path: str):
        def hook(_module, _args, _out):
            if self._on_exit is not None:
                self._on_exit(path)
            # An exception deeper down may have skipped inner pops; unwind to this module.
            while self.stack and self.stack.pop() != path:
                pass
        return hook

    def __enter__(self) -> ModuleScope:
        for path, m in self._modules:
            self._handles.append(m.register_forward_pre_hook(self._pre(path)))
            self._handles.append(m.register_forward_hook(self._post(path), always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.stack.clear()
