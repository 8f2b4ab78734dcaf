"""Hybrid placement: every group runs requests from prompt to last token.

A request runs wholly on the group that holds the fewest requests (waiting or running) when it
arrives, and stays there; its group's ``Scheduler`` does the rest.
"""

from __future__ import annotations

from interfaces import TextContext
from interfaces.worker_to_scheduler import WorkerRole
from scheduler.placement import Placement
from scheduler.scheduler import TextResult


class HybridPlacement(Placement):
    """Requests over ``hybrid`` groups, each wholly on one group (see the module)."""

    roles = (WorkerRole.HYBRID,)

    @property
    def is_serving(self) -> bool:
        return bool(self.groups)

    def _place(self, context: TextContext, client_id: bytes) -> TextResult | None:
        group = min(self.groups.values(), key=lambda g: g.load)
        return group.scheduler.add_request(context, client_id)
