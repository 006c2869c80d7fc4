"""The generic tasks: your model and your data, configured by YAML alone (docs/data.md).

* ``text_classification`` — :class:`~fedgalore.tasks.generic.text.GenericTextClassificationTask`:
  any ``AutoModelForSequenceClassification`` checkpoint on a text (or sentence-pair) column and a
  label column; a float label column is regression.
* ``causal_lm`` — :class:`~fedgalore.tasks.generic.causal.GenericCausalLMTask`: instruction
  tuning of any ``AutoModelForCausalLM`` on prompt/response columns, chat messages or a template,
  loss on the response tokens only; exact match of an extracted answer when asked.
* ``image_classification`` — :class:`~fedgalore.tasks.generic.image.GenericImageClassificationTask`:
  any ``AutoModelForImageClassification`` checkpoint on an image folder or an image column.

They are thin, option-driven front ends over the paper's task machinery
(:mod:`fedgalore.tasks.paper_text.base`, :mod:`fedgalore.tasks.paper_math`,
:mod:`fedgalore.tasks.paper_vision`) with one data loader
(:mod:`~fedgalore.tasks.generic.data`, through ``datasets``) and one place that knows
architectures (:mod:`~fedgalore.tasks.generic.architectures`: target modules, heads, tokenizers).
:mod:`~fedgalore.tasks.generic.common` holds what the three share.
"""
