"""An in-process Flower Grid: the ClientApp's handlers as SuperNodes, each with its own Context."""
from __future__ import annotations

import copy

import pytest
from flwr.app import Context, MessageType, RecordDict
from flwr.serverapp import Grid


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch):
    """What a ServerApp process has set when it creates messages (flwr's TaskIdentity)."""
    from flwr.supercore.task_identity import TaskIdentity

    for k, v in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, k, v)


class LocalGrid(Grid):
    """A Grid whose SuperNodes are the ClientApp's handlers called in this process, each with its
    own Context (node config, state), as a SuperNode process would hold it."""

    def __init__(self, node_configs: dict[int, dict]) -> None:
        self.contexts = {n: Context(run_id=1, node_id=n, node_config=c, state=RecordDict(), run_config={})
                         for n, c in node_configs.items()}
        self.down = self.sent = 0

    # the Grid interface the strategy uses
    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None):
        from fedgalore.flower import client_app

        handlers = {MessageType.QUERY: client_app.whoami, MessageType.TRAIN: client_app.train,
                    MessageType.EVALUATE: client_app.evaluate}
        out = []
        for m in messages:
            node = int(m.metadata.dst_node_id)
            if node not in self.contexts:  # a node that is gone never replies
                continue
            rep = handlers[m.metadata.message_type](m, self.contexts[node])
            out.append(rep)
        return out

    # unused by the strategy
    def create_message(self, *a, **k):  # pragma: no cover
        raise NotImplementedError

    def push_messages(self, messages):  # pragma: no cover
        raise NotImplementedError

    def pull_messages(self, message_ids):  # pragma: no cover
        raise NotImplementedError

    def set_run(self, run_id):  # pragma: no cover
        pass

    @property
    def run(self):  # pragma: no cover
        raise NotImplementedError


class SecAggGrid(LocalGrid):
    """The LocalGrid with the ClientApp's train handler behind its mod (fedgalore.flower.secagg.
    secagg_mod → Flower's secaggplus_mod), as a SuperNode runs it; ``lose``: a node that stops
    answering from the ``lose_at``-th train wave of the run on (after sharing its keys)."""

    def __init__(self, node_configs, lose: int | None = None, lose_at: int = 0):
        super().__init__(node_configs)
        self.lose, self.lose_at, self.waves = lose, lose_at, 0

    def send_and_receive(self, messages, *, timeout=None):
        from fedgalore.flower import client_app

        messages = list(messages)
        out = []
        if messages and messages[0].metadata.message_type == MessageType.TRAIN:
            self.waves += 1
        for m in messages:
            node = int(m.metadata.dst_node_id)
            if node not in self.contexts or (node == self.lose and self.waves >= self.lose_at):
                continue
            if m.metadata.message_type == MessageType.TRAIN:  # a copy, as the wire gives each node (the mod pops keys)
                from fedgalore.flower.secagg import secagg_mod

                out.append(secagg_mod(copy.deepcopy(m), self.contexts[node], client_app.train))
            else:
                out.append({MessageType.QUERY: client_app.whoami, MessageType.EVALUATE: client_app.evaluate}
                           [m.metadata.message_type](m, self.contexts[node]))
        return out
