"""Counting the bytes of live CPU tensor storages while code runs: the CPU stand-in for
torch.cuda.max_memory_allocated in tests of load peaks.

Every op runs under a TorchDispatchMode; a storage first seen as an op's output (not one of its
inputs': those existed before) is counted until it is freed (a weak reference to the storage's
Python object, which lives exactly as long as the storage). `peak` is the most bytes alive at once
after any op. Storages made before the mode starts are not counted.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[int, weakref.ref]] = {}  # storage data_ptr → (bytes, weak ref to the storage)
        self.peak = 0

    @property
    def current(self) -> int:
        dead = [key for key, (_, ref) in self.live.items() if ref() is None]
        for key in dead:
            del self.live[key]
        return sum(n for n, _ in self.live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            known = self.live.get(key)
            if key in inputs or (known is not None and known[1]() is not None) or storage.nbytes() == 0:
                continue
            self.live[key] = (storage.nbytes(), weakref.ref(storage))
        self.peak = max(self.peak, self.current)
        return out
