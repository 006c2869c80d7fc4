"""Tiny random checkpoints and data files for the generic tasks' tests (the ``bert_dir``,
``llama_dir`` and ``vit_dir`` fixtures of conftest.py save them once per session): a BERT with a
WordPiece tokenizer, a Llama with a BPE tokenizer and a chat template, a ViT with an image
processor, and ``body, topic, site`` news rows written in every supported format."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch

TOPICS = ["politics", "sport", "tech"]
WORDS = {"politics": ["vote", "party", "minister"], "sport": ["goal", "match", "team"], "tech": ["chip", "phone", "code"]}
FILL = ["the", "a", "news", "today", "said", "new", "report", "on"]
CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


# ============================================================================ tiny checkpoints
def _no_global_rng(fn):
    state = torch.random.get_rng_state()
    try:
        return fn()
    finally:
        torch.random.set_rng_state(state)


def save_tiny_bert(d: Path) -> Path:
    """A tiny random BertModel (no classification head) + a WordPiece tokenizer, saved to ``d``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, BertTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    corpus = [" ".join(FILL + [w for ws in WORDS.values() for w in ws] + TOPICS + ["yes", "no", "is", "it"])] * 5
    tok.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=200, special_tokens=special))
    tok.post_processor = processors.BertProcessing(("[SEP]", tok.token_to_id("[SEP]")), ("[CLS]", tok.token_to_id("[CLS]")))
    fast = BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                             mask_token="[MASK]")
    fast.save_pretrained(d)
    cfg = BertConfig(vocab_size=len(fast), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    _no_global_rng(lambda: BertModel(cfg).save_pretrained(d))
    return d


def save_tiny_llama(d: Path) -> Path:
    """A tiny random LlamaForCausalLM + a BPE tokenizer with a chat template, saved to ``d``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["What is 2 plus 3? The answer is 5. Question: Answer: #### <|user|> <|assistant|> 0 1 2 3 4 5 6 7 8 9"] * 10
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT
    fast.save_pretrained(d)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, bos_token_id=fast.bos_token_id,
                      eos_token_id=fast.eos_token_id, tie_word_embeddings=False)
    _no_global_rng(lambda: LlamaForCausalLM(cfg).save_pretrained(d))
    return d


def save_tiny_vit(d: Path) -> Path:
    """A tiny random ViTForImageClassification with a 5-way head + a ViT image processor (16x16),
    saved to ``d``."""
    from transformers import ViTConfig, ViTForImageClassification
    from transformers import ViTImageProcessorPil

    cfg = ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    _no_global_rng(lambda: ViTForImageClassification(cfg).save_pretrained(d))
    ViTImageProcessorPil(size={"height": 16, "width": 16}).save_pretrained(d)
    return d


# ============================================================================ tiny data
def news_rows(n: int = 60, seed: int = 0) -> pd.DataFrame:
    """``body, topic, site`` rows: the topic's words in filler text; sites s0..s3."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        t = TOPICS[i % 3]
        words = list(rng.choice(FILL, 4)) + list(rng.choice(WORDS[t], 2))
        rng.shuffle(words)
        rows.append({"body": " ".join(words), "topic": t, "site": f"s{i % 4}"})
    return pd.DataFrame(rows)


def write(df: pd.DataFrame, path: Path) -> Path:
    """``df`` in the format ``path``'s extension names (a folder without one: ``save_to_disk``)."""
    ext = path.suffix
    if ext == ".csv":
        df.to_csv(path, index=False)
    elif ext == ".tsv":
        df.to_csv(path, sep="\t", index=False)
    elif ext == ".json":
        path.write_text(json.dumps(df.to_dict(orient="records")))
    elif ext == ".jsonl":
        df.to_json(path, orient="records", lines=True)
    elif ext == ".parquet":
        df.to_parquet(path)
    else:
        import datasets

        datasets.Dataset.from_pandas(df, preserve_index=False).save_to_disk(str(path))
    return path


def news_site_files(root: Path, sites=("s1", "s0", "s2"), n: int = 90, fmt: str = ".csv", whole=("s2",)) -> dict:
    """Per-site files of :func:`news_rows` (the site column dropped: per-site data adds its own):
    each site's last 6 rows are its test file, except the ``whole`` sites, which hold one file
    (their test rows are drawn from it). ``{site: {"train": path, "test": path}}`` or ``{site: path}``."""
    df = news_rows(n)
    data: dict = {}
    for s in sites:
        d = df[df.site == s].drop(columns=["site"]).reset_index(drop=True)
        if s in whole:
            data[s] = str(write(d, root / f"{s}_all{fmt}"))
        else:
            data[s] = {"train": str(write(d.iloc[:-6], root / f"{s}_train{fmt}")),
                       "test": str(write(d.iloc[-6:], root / f"{s}_test{fmt}"))}
    return data
