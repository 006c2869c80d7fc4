"""fedgalore on Flower (Message API): a ServerApp/ClientApp pair running any fedgalore method.

``fedgalore.flower.server_app:app`` and ``fedgalore.flower.client_app:app`` are the app
components for ``flwr run`` (see examples/flower/); :class:`FedGaLoreStrategy` maps the method's
broadcast/uploads onto Flower messages and runs fedgalore's round loop (A and S on the server,
T on SuperNodes). Telemetry is off unless FLWR_TELEMETRY_ENABLED is set.
Needs the ``flower`` extra: ``pip install 'fedgalore[flower]'``.
"""
import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from fedgalore.flower.codec import blob_to_record, record_to_blob, record_to_tensors, tensors_to_record  # noqa: E402
from fedgalore.flower.strategy import FedGaLoreStrategy, GridBackend  # noqa: E402

__all__ = ["FedGaLoreStrategy", "GridBackend", "blob_to_record", "record_to_blob", "tensors_to_record", "record_to_tensors"]
