"""Client optimizers: GaLore-AdamW and its projector bases (paper App. B, App. E; docs/design.md §3.1)."""
from fedgalore.optim.client_protocol import GaLoreStateEntry, rebuild_delta
from fedgalore.optim.galore_adamw import GaLoreAdamW

__all__ = ["GaLoreAdamW", "GaLoreStateEntry", "rebuild_delta"]
