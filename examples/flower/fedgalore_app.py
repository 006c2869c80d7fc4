"""The app components named in pyproject.toml: fedgalore's ServerApp and ClientApp.

The ServerApp resolves the run config's ``config`` (a pipeline YAML) relative to this folder.
"""
from pathlib import Path

from fedgalore.flower import client_app as _client
from fedgalore.flower.server_app import make_server_app

clientapp = _client.app
serverapp = make_server_app(app_dir=Path(__file__).resolve().parent)
