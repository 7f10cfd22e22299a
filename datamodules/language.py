"""Language modelling: WikiText-2 (raw), TinyStories, and Python's own pydoc topics, packed into blocks.

Text is read with Hugging Face ``datasets`` from local files (nothing is downloaded unless
``download: true``), tokenised once with a GPT-2 byte-level BPE from ``tokenizers`` (a local
tokenizer.json or vocab.json + merges.txt, or one trained on the training split and cached), and packed
into blocks of ``block_size`` tokens. Everything is deterministic and cached on disk, so every DDP rank
builds the same tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from filelock import FileLock
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import Tensor

from lightning_maskprior import priors
from lightning_maskprior.datamodules.base import MaskPriorDataModule
from lightning_maskprior.datamodules.loaders import TensorDictDataset
from lightning_maskprior.objectives import LanguageModelObjective
from lightning_maskprior.task import TaskSpec

SPLITS = ("train", "validation", "test")
END_OF_TEXT = "<|endoftext|>"  # GPT-2's document separator
IGNORE_INDEX = -100  # target of the padded tail of the last block


# ------------------------------------------------------------------------------- tokenizers
def load_tokenizer(path: str | Path) -> Tokenizer:
    """A GPT-2 style tokenizer from ``tokenizer.json``, or a folder holding it or vocab.json + merges.txt."""
    path = Path(path)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            path = path / "tokenizer.json"
        elif (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            return bpe_from_vocab_merges(path / "vocab.json", path / "merges.txt")
        else:
            raise FileNotFoundError(f"{path} has neither tokenizer.json nor vocab.json + merges.txt")
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} does not exist")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - the tokenizers library names no file
        raise ValueError(f"tokenizer file {path} is not a tokenizer.json of the tokenizers library ({err}); "
                         "expected e.g. GPT-2's tokenizer.json, or a folder with vocab.json + merges.txt") from None


def bpe_from_vocab_merges(vocab: str | Path, merges: str | Path) -> Tokenizer:
    """GPT-2's byte-level BPE from its vocab.json and merges.txt."""
    tokenizer = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2's scheme) trained on ``texts``, with ``<|endoftext|>`` as token 0."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


# ----------------------------------------------------------------------------------- packing
def pack_blocks(ids: Tensor, block_size: int, pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Cut a token stream into consecutive blocks of (inputs, next-token targets).

    Block k holds inputs ``ids[k*B : (k+1)*B]`` and targets ``ids[k*B+1 : (k+1)*B+1]``: every token
    after the first is predicted exactly once. The last block is padded (inputs ``pad_id``, targets
    ``IGNORE_INDEX``); the padding sits after the real tokens, so causal attention never sees it.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if ids.numel() < 2:
        raise ValueError(f"a split needs at least 2 tokens to predict one, got {ids.numel()}")
    ids = ids.long()
    pairs = ids.numel() - 1
    num_blocks = -(-pairs // block_size)
    inputs = torch.full((num_blocks * block_size,), pad_id, dtype=torch.long)
    targets = torch.full((num_blocks * block_size,), IGNORE_INDEX, dtype=torch.long)
    inputs[:pairs], targets[:pairs] = ids[:-1], ids[1:]
    return inputs.view(num_blocks, block_size), targets.view(num_blocks, block_size)


def _digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lightning_maskprior" / "language"


def _atomic_save(write, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------ datamodules
class LanguageModelDataModule(MaskPriorDataModule):
    """Next-token prediction on a text corpus, packed into blocks. Subclasses say where the text is.

    Args:
        block_size: Tokens per block: the attention's sequence length (paper: 64).
        batch_size: Training batch size in blocks (paper: 128).
        eval_batch_size: Batch size for validation and test.
        tokenizer: A GPT-2 tokenizer.json, or a folder with tokenizer.json or vocab.json + merges.txt;
            ``gpt2`` fetches GPT-2's from the Hugging Face Hub when ``download`` is true. Default: train a
            byte-level BPE of ``vocab_size`` tokens on the training split (cached, and saved beside
            the run as tokenizer.json).
        vocab_size: Vocabulary of the trained BPE (ignored when ``tokenizer`` is given).
        cache_dir: Where the trained tokenizer and the token ids are cached (default
            ``$XDG_CACHE_HOME/lightning_maskprior/language``). Keys hash the text and the tokenizer.
        download: Allow fetching the corpus (and ``tokenizer: gpt2``) from the Hugging Face Hub.
        seed: Seed of the training shuffle.
        num_workers: DataLoader worker processes.
    """

    name = "language"
    # Append <|endoftext|> after each document (separate stories), or not (one running text).
    separate_documents = True

    def __init__(
        self,
        block_size: int = 64,
        batch_size: int = 128,
        eval_batch_size: int = 256,
        tokenizer: str | None = None,
        vocab_size: int = 8192,
        cache_dir: str | None = None,
        download: bool = False,
        seed: int = 1337,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if block_size < 1 or batch_size < 1 or eval_batch_size < 1:
            raise ValueError(f"block and batch sizes must be positive, got {block_size}, {batch_size}, "
                             f"{eval_batch_size}")
        if tokenizer is None and vocab_size < 257:
            raise ValueError(f"a byte-level BPE needs vocab_size > 256 (256 bytes + <|endoftext|>), got {vocab_size}")
        self.block_size, self.batch_size, self.eval_batch_size = block_size, batch_size, eval_batch_size
        self.tokenizer_path, self.vocab_size = tokenizer, vocab_size
        self.cache_dir = Path(cache_dir) if cache_dir else _default_cache_dir()
        self.download, self.seed, self.num_workers = download, seed, num_workers
        self.tokenizer: Tokenizer | None = None
        self.ids: dict[str, Tensor] = {}
        self.datasets: dict[str, TensorDictDataset] = {}

    # ------------------------------------------------------------------- what subclasses give
    def documents(self) -> dict[str, list[str]]:
        """The text of each split (train, validation, test) as a list of documents."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------ the task
    def task_spec(self) -> TaskSpec:
        self._build()
        return TaskSpec(
            name=f"language/{self.name}",
            seq_len=self.block_size,
            vocab_size=self.tokenizer.get_vocab_size(),
            num_outputs=self.tokenizer.get_vocab_size(),
            objective=LanguageModelObjective(IGNORE_INDEX),
            structure=priors.causal_relative_distance(self.block_size),
            # arXiv 2608.00418: M_ij = -max(i - j, 0), applied as log sigmoid(10 M) with the causal mask.
            init_defaults={m: {"scale": 10.0} for m in ("mask", "fixed")},
        )

    # ------------------------------------------------------------------------------ the data
    def _build(self) -> None:
        if self.datasets:
            return
        docs = self.documents()
        missing = [s for s in SPLITS if not any(doc.strip() for doc in docs.get(s) or [])]
        if missing:
            raise ValueError(f"{self.name}: the {missing} split(s) have no text")
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        # One lock per cache folder: concurrent ranks (torchrun) wait for the first to fill the cache.
        with FileLock(str(self.cache_dir / ".lock")):
            self.tokenizer = self._tokenizer(docs["train"])
            tok_key = _digest(self.tokenizer.to_str())
            for split in SPLITS:
                self.ids[split] = self._token_ids(split, docs[split], tok_key)
        for split in SPLITS:
            inputs, targets = pack_blocks(self.ids[split], self.block_size)
            self.datasets[split] = TensorDictDataset(inputs=inputs, target=targets)

    def _tokenizer(self, train_docs: list[str]) -> Tokenizer:
        if self.tokenizer_path == "gpt2" and not Path("gpt2").exists():
            if not self.download:
                raise ValueError("tokenizer 'gpt2' comes from the Hugging Face Hub: set download: true, "
                                 "or give a local tokenizer.json / folder with vocab.json + merges.txt")
            return Tokenizer.from_pretrained("gpt2")
        if self.tokenizer_path is not None:
            return load_tokenizer(self.tokenizer_path)
        path = self.cache_dir / f"bpe-{self.vocab_size}-{_digest(*train_docs)}.json"
        if not path.is_file():
            tokenizer = train_bpe(train_docs, self.vocab_size)
            _atomic_save(lambda p: tokenizer.save(str(p)), path)
        return Tokenizer.from_file(str(path))

    def _token_ids(self, split: str, docs: list[str], tok_key: str) -> Tensor:
        path = self.cache_dir / f"ids-{self.name}-{split}-{tok_key}-{_digest(str(self.separate_documents), *docs)}.pt"
        if path.is_file():
            return torch.load(path, weights_only=True)
        ids = self.tokenize(docs)
        _atomic_save(lambda p: torch.save(ids, p), path)
        return ids

    def tokenize(self, docs: list[str]) -> Tensor:
        """One token stream for a split: the documents' ids in order (<|endoftext|> after each, if separate)."""
        eot = self.tokenizer.token_to_id(END_OF_TEXT)
        if self.separate_documents and eot is None:
            raise ValueError(f"the tokenizer has no {END_OF_TEXT} token to separate documents")
        stream: list[int] = []
        for encoding in self.tokenizer.encode_batch(docs, add_special_tokens=False):
            stream.extend(encoding.ids)
            if self.separate_documents:
                stream.append(eot)
        dtype = torch.int32 if self.tokenizer.get_vocab_size() > 32767 else torch.int16
        return torch.tensor(stream, dtype=dtype)

    def setup(self, stage: str | None = None) -> None:
        self._build()
        trainer = getattr(self, "trainer", None)
        if trainer is not None and stage == "fit":
            log_dir = trainer.log_dir  # a collective call: every rank makes it
            if trainer.global_rank == 0 and log_dir is not None:
                Path(log_dir).mkdir(parents=True, exist_ok=True)
                self.tokenizer.save(str(Path(log_dir) / "tokenizer.json"))

    def dataset(self, split: str) -> TensorDictDataset:
        """The blocks of a split; predict reads the test split (the most likely next token at each position)."""
        return self.datasets[{"val": "validation", "predict": "test"}.get(split, split)]

    def decode(self, ids: Tensor | list[int]) -> str:
        """Token ids back to text (for inspecting samples)."""
        self._build()
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def _files(data_dir: Path, patterns: Iterable[str]) -> list[str]:
    for pattern in patterns:
        found = sorted(str(p) for p in data_dir.glob(pattern) if p.is_file())
        if found:
            return found
    return []


def _text_column(rows: Iterable[dict], column: str = "text") -> Iterator[str]:
    for row in rows:
        yield row[column]


class WikiText2DataModule(LanguageModelDataModule):
    """WikiText-2 (raw), as one running text per split (no document separators), GPT-2 BPE.

    Reads, under ``data_dir`` (searched recursively), either the standard ``wiki.{train,valid,test}.raw``
    files or the Hugging Face parquet layout (``train-*.parquet``, ``validation-*.parquet``,
    ``test-*.parquet`` of ``wikitext-2-raw-v1``). With ``download: true`` and no local files it loads
    ``Salesforce/wikitext`` / ``wikitext-2-raw-v1`` from the Hub.

    Args:
        data_dir: Folder holding the files.
        **kwargs: See :class:`LanguageModelDataModule`.
    """

    name = "wikitext2"
    separate_documents = False

    def __init__(self, data_dir: str = "data/wikitext-2-raw", **kwargs) -> None:
        super().__init__(**kwargs)
        self.data_dir = Path(data_dir)

    def documents(self) -> dict[str, list[str]]:
        import datasets

        raw = {s: _files(self.data_dir, [f"**/wiki.{f}.raw"]) for s, f in zip(SPLITS, ("train", "valid", "test"),
                                                                             strict=True)}
        parquet = {s: _files(self.data_dir, [f"**/{s}-*.parquet", f"**/{s}.parquet"]) for s in SPLITS}
        if all(raw.values()):
            for path in (p for paths in raw.values() for p in paths):
                _check_utf8(path, "WikiText-2 file", "the raw UTF-8 text of wikitext-2-raw-v1")
            ds = datasets.load_dataset("text", data_files=raw, keep_linebreaks=True, streaming=True)
            sources = raw
        elif all(parquet.values()):
            ds = datasets.load_dataset("parquet", data_files=parquet, streaming=True)
            sources = parquet
        elif self.download:
            ds = datasets.load_dataset("Salesforce/wikitext", "wikitext-2-raw-v1", streaming=True)
            sources = {s: ["Salesforce/wikitext (wikitext-2-raw-v1) from the Hub"] for s in SPLITS}
        else:
            raise FileNotFoundError(
                f"no WikiText-2 under {self.data_dir}: expected wiki.train.raw / wiki.valid.raw / "
                "wiki.test.raw, or train-/validation-/test-*.parquet (or set download: true)"
            )
        # The lines keep their line breaks (HF's rows are lines ending in "\n"): joined, they are the file.
        texts = {s: "".join(_lines(_text_column(ds[s]))) for s in SPLITS}
        for split, text in texts.items():
            if not text.strip():
                raise ValueError(f"WikiText-2 {split} split is empty: {', '.join(sources[split])} holds no text; "
                                 "expected the wikitext-2-raw-v1 text of that split")
        return {s: [text] for s, text in texts.items()}


def _check_utf8(path: str, what: str, expected: str) -> None:
    """Raise naming ``path`` and the byte offset if the file is not UTF-8 (the datasets reader names neither)."""
    try:
        Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} {path} is not UTF-8 text: byte 0x{err.object[err.start]:02x} at offset "
                         f"{err.start} cannot be decoded; expected {expected}") from None


def _lines(lines: Iterable[str]) -> Iterator[str]:
    for line in lines:
        yield line if line.endswith("\n") else line + "\n"


class TinyStoriesDataModule(LanguageModelDataModule):
    """TinyStories: the first ``num_stories`` training stories, split 90/10 into train / validation.

    The test split is the first ``num_test_stories`` stories of TinyStories' own validation set. Reads,
    under ``data_dir`` (searched recursively), the Hugging Face parquet layout (``train-*.parquet``,
    ``validation-*.parquet``, column ``text``) or the text files (``TinyStories-train.txt``,
    ``TinyStories-valid.txt``, stories separated by ``<|endoftext|>``). With ``download: true`` and no
    local files it streams ``roneneldan/TinyStories`` from the Hub.

    Args:
        data_dir: Folder holding the files.
        num_stories: Stories taken from the start of the training set (paper: 12,000).
        val_fraction: Fraction of those held out for validation, from the end (paper: 0.1).
        num_test_stories: Stories taken from the start of the official validation set (None: all).
        **kwargs: See :class:`LanguageModelDataModule`.
    """

    name = "tinystories"
    separate_documents = True

    def __init__(self, data_dir: str = "data/TinyStories", num_stories: int = 12_000, val_fraction: float = 0.1,
                 num_test_stories: int | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.data_dir = Path(data_dir)
        self.num_stories, self.val_fraction, self.num_test_stories = num_stories, val_fraction, num_test_stories

    def _stories(self, split: str, limit: int | None) -> list[str]:
        import datasets

        stem = "train" if split == "train" else "valid"
        parquet = _files(self.data_dir, [f"**/{split}-*.parquet", f"**/{split}.parquet"])
        text = _files(self.data_dir, [f"**/TinyStories*-{stem}.txt", f"**/*{stem}*.txt"])
        if parquet:
            rows = _text_column(datasets.load_dataset("parquet", data_files=parquet, split="train", streaming=True))
            source = ", ".join(parquet)
        elif text:
            rows = _stories_from_text(text[0])
            source = text[0]
        elif self.download:
            rows = _text_column(datasets.load_dataset("roneneldan/TinyStories", split=split, streaming=True))
            source = "roneneldan/TinyStories from the Hub"
        else:
            raise FileNotFoundError(
                f"no TinyStories {split} split under {self.data_dir}: expected {split}-*.parquet or "
                f"TinyStories-{stem}.txt (or set download: true)"
            )
        stories = []
        try:
            for story in rows:
                story = story.strip()
                if story:
                    stories.append(story)
                    if limit is not None and len(stories) == limit:
                        break
        except UnicodeDecodeError as err:
            raise ValueError(f"TinyStories file {source} is not UTF-8 text: byte 0x{err.object[err.start]:02x} "
                             "cannot be decoded; expected the UTF-8 TinyStories text") from None
        if not stories:
            raise ValueError(f"TinyStories {split} split is empty: {source} holds no story; expected stories "
                             f"separated by {END_OF_TEXT} (text) or a 'text' column (parquet)")
        return stories

    def documents(self) -> dict[str, list[str]]:
        stories = self._stories("train", self.num_stories)
        if len(stories) < self.num_stories:
            warnings.warn(f"TinyStories has only {len(stories)} training stories, fewer than {self.num_stories}",
                          stacklevel=2)
        num_val = max(1, round(self.val_fraction * len(stories)))
        return {"train": stories[:-num_val], "validation": stories[-num_val:],
                "test": self._stories("validation", self.num_test_stories)}


def _stories_from_text(path: str) -> Iterator[str]:
    """Stories of a TinyStories .txt file, separated by <|endoftext|>, read lazily (the file is 2 GB)."""
    story: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            while END_OF_TEXT in line:
                before, line = line.split(END_OF_TEXT, 1)
                story.append(before)
                yield "".join(story)
                story = []
            story.append(line)
    if "".join(story).strip():
        yield "".join(story)


class PydocDataModule(LanguageModelDataModule):
    """Offline English text that ships with Python: the help topics in ``pydoc_data.topics``.

    Each topic is one document (topics with the same text once). Topics are shuffled with ``split_seed``
    and dealt to test, then validation, until each holds ``eval_fraction`` of the characters; the rest
    is training text.

    Args:
        eval_fraction: Share of the characters in each of validation and test.
        split_seed: Seed of the topic shuffle (fixed: the split should not change with the training seed).
        **kwargs: See :class:`LanguageModelDataModule`.
    """

    name = "pydoc"
    separate_documents = True

    def __init__(self, eval_fraction: float = 0.1, split_seed: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        if not 0 < eval_fraction < 0.5:
            raise ValueError(f"eval_fraction must be in (0, 0.5), got {eval_fraction}")
        self.eval_fraction, self.split_seed = eval_fraction, split_seed

    def documents(self) -> dict[str, list[str]]:
        from pydoc_data.topics import topics

        unique = {topics[name]: name for name in sorted(topics, reverse=True)}  # some topics share a text
        names = sorted(unique.values())
        random.Random(self.split_seed).shuffle(names)
        total = sum(len(topics[n]) for n in names)
        splits: dict[str, list[str]] = {s: [] for s in SPLITS}
        filled = {"test": 0, "validation": 0}
        for name in names:
            target = next((s for s in ("test", "validation") if filled[s] < self.eval_fraction * total), "train")
            splits[target].append(topics[name])
            if target != "train":
                filled[target] += len(topics[name])
        return splits


def describe(datamodule: LanguageModelDataModule) -> str:
    """One line per split: documents, tokens and blocks (for notes and logs)."""
    datamodule._build()
    return json.dumps({s: {"tokens": int(datamodule.ids[s].numel()), "blocks": len(datamodule.datasets[s])}
                       for s in SPLITS})


__all__ = [
    "LanguageModelDataModule", "PydocDataModule", "TinyStoriesDataModule", "WikiText2DataModule",
    "describe", "load_tokenizer", "pack_blocks", "train_bpe",
]
