"""Work with a finished (or running) run: its global model at a checkpoint, and what a user does
with it.

* :mod:`~fedgalore.trained.global_model` — a run's global model at one of its checkpoints;
* :mod:`~fedgalore.trained.evaluate` — ``fedgalore evaluate``: a run or an export on any data;
* :mod:`~fedgalore.trained.predict` — ``fedgalore predict``: predictions written as the input came;
* :mod:`~fedgalore.trained.export` — ``fedgalore export``: a PEFT / Hugging Face folder with its
  model card (:mod:`~fedgalore.trained.model_card`);
* :mod:`~fedgalore.trained.lora_exact` / :mod:`~fedgalore.trained.lora_extract` — exact and
  truncated LoRA factors of a global model.
"""
