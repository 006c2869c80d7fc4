"""The federated protocol's types: the bottom layer every other package stands on.

* :mod:`~fedgalore.protocol.bases` — seeded Haar bases and the SHA-256 basis seed (paper App. E,
  Alg. 1 line 13: the bases a seed stands for on the wire);
* :mod:`~fedgalore.protocol.payload` — typed payload entries, :class:`Payload`, the safetensors
  wire format and the communication :class:`Ledger` (docs/design.md §2);
* :mod:`~fedgalore.protocol.state` — what the server owns (:class:`ServerState`) and what a
  round and a client are told (:class:`RoundContext`, :class:`ClientContext`);
* :mod:`~fedgalore.protocol.train_config` — the local-training hyperparameters every method
  shares (:class:`TrainConfig`, the config's ``train`` section).

Nothing here imports another fedgalore package (torch, numpy and safetensors only).
"""
