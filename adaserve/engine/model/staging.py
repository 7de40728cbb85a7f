"""Host arrays bound for the device, sent together in one non-blocking copy (issue 30).

A forward needs a dozen small index arrays on the device (token ids, positions, write slots, the mask's
per-segment vectors, key slots, the logits rows). Each ``torch.as_tensor(x, device=cuda)`` is a blocking
copy; a ``HostStage`` collects them as numpy arrays instead, packs them into one int64 buffer (pinned on
CUDA) and sends it with one ``to(device, non_blocking=True)``. Each array comes back as a view of the
device buffer, in its own dtype and shape.

A tensor the device already holds (``bind``) joins the stage without a copy: a forward whose inputs were
computed on the device (the beam levels, speculate.py) is laid out without bringing them to the host.

Reading any array sends whatever is pending, so a caller that reads early still gets a correct (if
extra) copy; the runner puts everything first and reads after, which makes one copy per forward.

On a CPU the host's memory is the device's: there is nothing to send, and the join cost more than it saved (a
lone request's draft plan of 13 arrays concatenated, sliced and viewed back: ~60 us warm, more in the engine; issue 30).
Each array is then taken as it is put, as its own copy (the stage's arrays are never the caller's). While a
``HostSync`` counts (host_sync.py: the tests and the microbench's crossings, which stand for a GPU's), a CPU stage
joins and sends as a GPU's does, so that what they count is the GPU's one copy per forward.

May import: numpy, torch, model.host_sync.
"""

from __future__ import annotations

import numpy as np
import torch

from adaserve.engine.model.host_sync import HostSync

# the numpy type a CPU stage copies an array into for each torch dtype it hands out (others: int64, then cast)
_NUMPY = {torch.int64: np.int64, torch.bool: np.bool_, torch.int32: np.int32}


class HostStage:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        # name -> (array, dtype) until sent; a name is staged once, pending or sent (issue 30: dict operations are
        # not calls, and a forward stages a dozen arrays: no set to keep beside them)
        self._pending: dict[str, tuple[np.ndarray, torch.dtype]] = {}
        self._sent: dict[str, torch.Tensor] = {}
        self.copies = 0  # transfers made (one per forward when used as meant)
        # one joined copy (a GPU's, or a CPU's while a HostSync counts), else each array taken as it is put
        self.join = self.device.type != "cpu" or bool(HostSync.active)

    def put(self, name: str, array: np.ndarray | list[int], dtype: torch.dtype = torch.int64) -> None:
        """Queue ``array`` (integers or bools) for the device under ``name``; it arrives as ``dtype``."""
        if name in self._pending or name in self._sent:
            raise ValueError(f"{name!r} is already staged")
        if self.join:
            self._pending[name] = (np.asarray(array), dtype)
            return
        kind = _NUMPY.get(dtype)
        own = torch.from_numpy(np.array(array, kind or np.int64))  # a C-contiguous copy of its own
        self._sent[name] = own if kind is not None else own.to(dtype)

    def bind(self, name: str, tensor: torch.Tensor) -> None:
        """Serve ``name`` from a tensor already on the device (beam search's picks): nothing is copied."""
        if name in self:
            raise ValueError(f"{name!r} is already staged")
        if tensor.device != self.device:
            raise ValueError(f"{name!r} is on {tensor.device}, the stage sends to {self.device}")
        self._sent[name] = tensor

    def get(self, name: str) -> torch.Tensor:
        """The device tensor for ``name`` (sends every pending array first if it is one of them)."""
        if name not in self._sent:
            self.send()
        return self._sent[name]

    def __contains__(self, name: str) -> bool:
        return name in self._pending or name in self._sent

    def send(self) -> None:
        """One copy of every pending array to the device, not waited for."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        arrays = [a for a, _ in pending.values()]
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        # axis=None: each array flattened as it is joined (no ravel call per array)
        if self.device.type == "cuda":  # pinned, so that the copy does not wait
            host = torch.empty(max(total, 1), dtype=torch.int64, pin_memory=True)
            joined = np.concatenate(arrays, axis=None, out=host.numpy()[:total], casting="unsafe")
        else:  # the device's own memory: the concatenation is the buffer
            joined = np.concatenate(arrays, axis=None, dtype=np.int64, casting="unsafe")
            host = torch.from_numpy(joined)
        # The pinned host buffer stays referenced by ``self`` until the stage is dropped, after the forward
        # that reads it has been queued behind the copy on the same stream.
        self._host = host
        dev = host.to(self.device, non_blocking=True)
        self.copies += 1
        # a CPU stage: the buffer is the device's; numpy slices cost a third of torch.split's views
        parts = None if dev is host else torch.split(dev[:total], sizes)
        at = 0
        for j, (name, (a, dtype)) in enumerate(pending.items()):
            end = at + sizes[j]
            if parts is None:  # a 1-D array's slice has its shape already
                part = torch.from_numpy(joined[at:end] if a.ndim == 1 else joined[at:end].reshape(a.shape))
            else:
                part = parts[j].view(a.shape)
            self._sent[name] = part if dtype == torch.int64 else part.to(dtype)
            at = end
