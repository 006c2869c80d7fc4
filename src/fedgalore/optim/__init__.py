"""Client optimizers: GaLore-AdamW and its projector bases (paper App. B, App. E; docs/design.md §3.1)."""
from fedgalore.optim.galore_adamw import GaLoreAdamW, GaLoreStateEntry, rebuild_delta

__all__ = ["GaLoreAdamW", "GaLoreStateEntry", "rebuild_delta"]
