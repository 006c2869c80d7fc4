"""Federated methods. Importing this package registers the built-in methods by name."""
from fedgalore.methods.base import Method, MethodError, available_methods, get_method, register  # noqa: F401
from fedgalore.methods import fedavg_full, fedgalore  # noqa: F401,E402  (registration)
from fedgalore.methods import fedit, ffa_lora, flora, fr_lora, lora_fair  # noqa: F401,E402  (registration)
from fedgalore.methods import fed_sb, fedex_lora, fedsa_lora, flexlora, hetlora  # noqa: F401,E402  (registration)
