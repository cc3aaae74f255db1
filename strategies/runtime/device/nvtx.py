"""NVTX through one helper: domain ``slotbench``, one range per phase inside a per-iteration range.

Every range slotbench emits goes through :class:`Nvtx`, so nothing is annotated twice. With no NVTX
tool attached the ``nvtx`` package hands out a dummy domain and a push costs a function call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import nvtx

DOMAIN = "slotbench"
# encode: an encoder–decoder model's encoder piece; finalize: finished beams' hypotheses read back; hold: the
# device kept busy on purpose (DeviceStream.hold, for checks); kv_send / kv_recv: disaggregated serving's KV
# transfer pieces (a block chunk through the staging buffer); kv_host_copy: the host KV tier's offloads and onloads
PHASES = ("schedule", "prepare", "encode", "forward", "sample", "postprocess", "finalize", "hold", "kv_send",
          "kv_recv", "kv_host_copy")


class Nvtx:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._domain = nvtx.get_domain(DOMAIN)
        self._attrs = {name: self._domain.get_event_attributes(message=name) for name in (*PHASES, "iteration")}

    @contextmanager
    def range(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self._domain.push_range(self._attrs[name])
        try:
            yield
        finally:
            self._domain.pop_range()

    def push(self, name: str) -> None:
        if self.enabled:
            self._domain.push_range(self._attrs[name])

    def pop(self) -> None:
        if self.enabled:
            self._domain.pop_range()
