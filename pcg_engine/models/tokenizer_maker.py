"""Train a small Qwen-style byte-level BPE tokenizer from text already on this machine.

No hub is reachable, so the corpus is Python's own standard library source (English prose in
docstrings plus code) and an embedded multilingual passage, so that merges of multi-byte UTF-8
sequences (accents, CJK, emoji) exist and the decode path for them is exercised. The same Python
and `tokenizers` versions give the same vocabulary: the module list is fixed and read in order.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Trainer order fixes their ids: 0, 1, 2, the same for every vocabulary size.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Qwen2/Qwen3's pre-tokenizer split: contractions, letter runs with one leading non-letter,
# single digits, punctuation runs, newlines, spaces (the last space stays with the next word).
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Same shape as Qwen's template minus tools/thinking: what the engine's chat path needs.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# A fixed, sorted list of prose-heavy and code-heavy modules, about 0.6 MB: enough pairs for an
# 8192-token vocabulary while training stays well under a second.
CORPUS_MODULES = (
    "calendar", "collections", "dataclasses", "difflib", "fractions", "functools", "heapq",
    "json.decoder", "json.encoder", "pathlib", "pprint", "random", "shutil", "statistics",
    "string", "textwrap",
)

MULTILINGUAL_TEXT = """\
Café, naïve, façade, jalapeño, Straße, Ærøskøbing, crème brûlée, São Paulo, Zürich, Kraków.
Les élèves étudient à l'université; où est la bibliothèque? Ça dépend de l'été.
Größere Übungen für schöne Bücher. ¿Qué hora es? ¡Mañana será otro día, señor!
Русский текст: привет, мир. Ελληνικά: καλημέρα κόσμε. עברית: שלום עולם. العربية: مرحبا بالعالم.
中文：你好，世界。我们今天学习机器学习和自然语言处理。模型生成文本。
日本語：こんにちは世界。東京は日本の首都です。カタカナとひらがな。
한국어: 안녕하세요 세계. 오늘은 좋은 날입니다.
हिन्दी: नमस्ते दुनिया। ไทย: สวัสดีชาวโลก
Emoji: 🙂 😀 🚀 🌍 ✨ 🎉 👍 ❤️ 🔥 🐍 🤖 👩‍💻 🇫🇷 — “quotes”, ‘single’, «guillemets», … and • bullets.
Math: ∑ ∫ √ ∞ ≈ ≠ ≤ ≥ π θ λ µ ± × ÷ ° € £ ¥ ₹.
"""


def _module_source(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return ""  # a stripped-down Python without sources: the other modules still train
    return Path(spec.origin).read_text(encoding="utf-8")


def corpus() -> list[str]:
    """The training texts, in a fixed order; the multilingual passage repeated so its pairs merge."""
    texts = [_module_source(name) for name in CORPUS_MODULES]
    texts.extend([MULTILINGUAL_TEXT] * 20)
    return [t for t in texts if t]


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` with exactly `vocab_size` entries."""
    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab_size <= minimum:
        raise ValueError(f"vocab_size: must be > {minimum} (256 bytes + special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte gets a token even if the corpus lacks it, so any text encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"trained {tok.get_vocab_size()} tokens, asked for {vocab_size}: corpus too small")
    return tok


def special_token_ids() -> dict[str, int]:
    """Ids fixed by SPECIAL_TOKENS' order, valid for every vocabulary this module trains."""
    return {
        "pad_token_id": SPECIAL_TOKENS.index(ENDOFTEXT),
        "bos_token_id": SPECIAL_TOKENS.index(ENDOFTEXT),
        "eos_token_id": SPECIAL_TOKENS.index(IM_END),
        "im_start_token_id": SPECIAL_TOKENS.index(IM_START),
    }


def save_tokenizer(out_dir: str | Path, vocab_size: int, model_max_length: int = 4096) -> Path:
    """Train and write tokenizer.json + tokenizer_config.json (+ chat template) into `out_dir`."""
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(vocab_size),
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        # Like Qwen: no BOS is prepended; <|endoftext|> only separates documents.
        bos_token=None,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out_dir))
    return out_dir
