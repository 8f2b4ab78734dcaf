"""A placement with model-free groups whose loop a test plays step by step
(``PlacementCluster``): the server's part, KV transfers included, without sockets."""

from __future__ import annotations

from interfaces import TextContext
from interfaces.handshake import PROTOCOL_VERSION
from interfaces.scheduler_to_worker import KVSend, ScheduledStep
from interfaces.worker_to_scheduler import KVReceived, WorkerOutput, WorkerReady, WorkerRole
from scheduler.config import SchedulerConfig
from scheduler.counters import SchedulerCounters
from scheduler.disaggregation import DisaggregatedPlacement
from scheduler.hybrid import HybridPlacement
from scheduler.worker_group import WorkerGroups
from tests.support.fake_worker import FakeTokenGenerator
from tests.support.kv_caches import BLOCK_SIZE, LAYOUT

HYBRID = {"h": WorkerRole.HYBRID}
DISAGGREGATED = {"p": WorkerRole.PREFILL, "d": WorkerRole.DECODE}
VOCAB_SIZE = 2048
"""Above every token ``FakeTokenGenerator`` produces."""


class PlacementCluster:
    """A placement with fake groups; ``run`` plays the server's loop, transfers included."""

    def __init__(self, roles: dict[str, WorkerRole], num_blocks: int = 64, **config) -> None:
        config = {"max_num_batched_tokens": 8, **config}
        hybrid = all(role is WorkerRole.HYBRID for role in roles.values())
        kind = HybridPlacement if hybrid else DisaggregatedPlacement
        self.placement = kind(SchedulerConfig(**config), SchedulerCounters())
        self.workers = WorkerGroups()
        self.generators: dict[str, FakeTokenGenerator] = {}
        self.sent: list[tuple[str, object]] = []
        self.deliver_transfers = True
        self.tokens: dict[str, list[int]] = {}
        """Every token each request streamed, in order."""
        self.num_blocks = num_blocks
        self._num_registrations = 0
        for name, role in roles.items():
            self.serve(name, role)

    def serve(self, name: str, role: WorkerRole) -> None:
        """A one-rank group ``name`` registers and serves, with a fresh model-free worker (as
        a group started again after it died)."""
        ready = WorkerReady(
            PROTOCOL_VERSION, "m", self.num_blocks, BLOCK_SIZE, 256, role=role, group=name,
            kv_layout=LAYOUT, transfer_addr=f"inproc://{name}", vocab_size=VOCAB_SIZE,
        )  # fmt: skip
        self._num_registrations += 1
        identity = f"{name}#{self._num_registrations}".encode()
        assert self.workers.register(identity, ready).now_serving
        assert self.placement.add_group(self.workers.groups[name]) is None
        self.generators[name] = FakeTokenGenerator(BLOCK_SIZE)

    def remove(self, name: str, reason: str = "the worker serving this request died") -> dict:
        """Group ``name`` died: the placement lets it go; the results it sends, by request."""
        self.workers.remove(name)
        results = self.placement.remove_group(name, reason)
        return results.get(b"client", {})

    def submit(self, request_id: str, prompt: list[int], max_new_tokens: int = 6) -> None:
        context = TextContext(request_id, prompt, len(prompt) + max_new_tokens)
        assert self.placement.add_request(context, b"client") is None

    def step(self) -> dict:
        """One round of the loop: every group runs its next step; returns the results (the
        last of each request's)."""
        results: dict = {}
        for name, message in self.placement.schedule(list(self.placement.groups)):
            self.sent.append((name, message))
            if not isinstance(message, ScheduledStep):
                continue
            outputs = self.generators[name].next_token(message)
            output = WorkerOutput(message.step_id, outputs)
            update = self.placement.update_from_output(name, output)
            for request_id, result in update.get(b"client", {}).items():
                if result.result is not None:
                    self.tokens.setdefault(request_id, []).extend(result.result.tokens)
                results[request_id] = result
            if self.deliver_transfers:
                for send in message.kv_sends:
                    self.receive(send)
        self.placement.check_integrity()
        return results

    def receive(self, send: KVSend) -> None:
        """The decode group reports the transfer done (its generator learns nothing: the fake
        model needs only the tokens, which the decode side's first step carries)."""
        split = self.placement.requests.get(send.request_id)
        if split is None:
            return  # it ended at its first token after all (a stop token): nothing to decode
        report = KVReceived(send.transfer_id, 0, 100 * len(send.block_ids), 0.002)
        self.placement.on_kv_received(split.decode, report)

    def run(self, max_rounds: int = 200) -> dict[str, list[int]]:
        """Step until every request finished; every token each streamed."""
        for _ in range(max_rounds):
            self.step()
            split = isinstance(self.placement, DisaggregatedPlacement) and self.placement.requests
            if not split and not any(
                group.scheduler.requests for group in self.placement.groups.values()
            ):
                self.sent += self.placement.schedule([])  # the last news for decode groups
                return self.tokens
        raise AssertionError("requests did not finish")

    def used_blocks(self) -> dict[str, int]:
        return {
            name: group.scheduler.block_manager.num_used_blocks
            for name, group in self.placement.groups.items()
        }
