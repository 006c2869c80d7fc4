"""fedgalore: robust federated fine-tuning of foundation models under non-IID data.

FedGaLore (GaLore-style gradient-subspace AdamW on clients + AJIVE synchronisation of projected
second moments on the server), the paper's baselines, tasks, experiments and reports.

Python API::

    import fedgalore
    cfg = fedgalore.load_config("conf/pipeline/offline_text.yaml", ["federation.rounds=5"])
    result = fedgalore.run(cfg)          # -> RunResult(run_dir, summary, history)
    fedgalore.resume(result.run_dir)     # continue a stopped run
    fedgalore.export_run(result.run_dir, "exported/model")   # a Hugging Face folder (docs/export.md)
    fedgalore.evaluate("exported/model")                      # its metrics on the task's test split
    fedgalore.predict("exported/model", "new.csv", "predictions.csv")   # predictions of a file (docs/export.md)
    fedgalore.run_state(result.run_dir)                       # running / complete / failed / interrupted, live or not
"""
__version__ = "0.1.0"

__all__ = ["run", "resume", "export_run", "evaluate", "predict", "run_state", "FederatedConfig", "load_config", "RunResult", "GaLoreAdamW"]


def __getattr__(name):  # lazy: importing fedgalore stays cheap
    if name in ("run", "resume"):
        from fedgalore.engine import api

        return getattr(api, name)
    if name == "export_run":
        from fedgalore.trained.export import export_run

        return export_run
    if name == "evaluate":
        from fedgalore.trained.evaluate import evaluate

        return evaluate
    if name == "predict":
        from fedgalore.trained.predict import predict

        return predict
    if name == "run_state":
        from fedgalore.records.liveness import run_state

        return run_state
    if name in ("RunResult", "Federation"):
        from fedgalore.engine import loop

        return getattr(loop, name)
    if name in ("FederatedConfig", "load_config", "ConfigError"):
        from fedgalore.job import config

        return getattr(config, name)
    if name == "GaLoreAdamW":
        from fedgalore.optim import GaLoreAdamW

        return GaLoreAdamW
    raise AttributeError(f"module 'fedgalore' has no attribute {name!r}")
