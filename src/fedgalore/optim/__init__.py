"""Client optimizers: GaLore-AdamW and its projector bases (paper App. B, App. E; docs/design.md §3.1)."""
from fedgalore.optim.galore_adamw import GaLoreAdamW, GaLoreStateEntry, rebuild_delta
from fedgalore.optim.projector import derive_seed, seeded_basis

__all__ = ["GaLoreAdamW", "GaLoreStateEntry", "rebuild_delta", "seeded_basis", "derive_seed"]
