"""Federated methods. Importing this package registers the built-in methods by name."""
from fedgalore.methods.base import (  # noqa: F401
    ClientContext,
    Method,
    MethodError,
    RoundContext,
    ServerState,
    TrainConfig,
    available_methods,
    get_method,
    register,
)
from fedgalore.methods import fedavg_full, fedgalore  # noqa: F401,E402  (registration)
from fedgalore.methods import fedit, ffa_lora, flora, fr_lora, lora_fair  # noqa: F401,E402  (registration)
