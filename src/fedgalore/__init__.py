"""fedgalore: robust federated fine-tuning of foundation models under non-IID data.

FedGaLore (GaLore-style gradient-subspace AdamW on clients + AJIVE synchronisation of projected
second moments on the server), the paper's baselines, tasks, experiments and reports.
"""
__version__ = "0.1.0"
