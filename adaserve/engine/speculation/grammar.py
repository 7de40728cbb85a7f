"""Structured output: a grammar (a JSON schema, a regular expression, a Lark grammar, a list of choices)
constrains the target's distribution at every tree node, by the grammar's state after that node's path.

Speculative decoding stays lossless only if verification draws, at every tree node, from the distribution plain
constrained decoding would draw from at that node's context. The output so far at node v is the request's
committed output plus the tokens on the path from the root to v (the root is the last token already emitted), so
v's row is masked by the matcher that has consumed that path: tokens the grammar does not allow there get -inf,
and so probability 0 (docs/architecture.md §17). The engine masks the verification rows of every walk, plain
decoding (a tree of one root) included, so the two draw from the same rows; the draft's rows are masked the same
way, so it proposes only tokens the grammar allows (speculate.beam_search). The emitted tokens advance the
request's matcher. End-of-sequence is allowed only where the grammar can end (llguidance's mask holds the stop
tokens there and only there).

A node whose path the grammar refuses (the draft proposed a token it does not allow, which a masked draft does
only when fewer tokens are allowed than a level's width) keeps its unmasked row: the walk never reaches it, since
its token has probability 0 at its parent.

The grammar engine is llguidance (the choice and why: docs/architecture.md §17). Matchers are copied per node
(``deep_copy``, about 2 microseconds) rather than rolled back, and a request's masks are computed once per path
and iteration: the draft's levels and the verification share them.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    import llguidance

KINDS = ("json", "regex", "grammar", "choice")
MAX_CHOICES = 1024


def _llguidance() -> ModuleType:
    """llguidance, imported on the first structured-output request: a worker that never gets one does not hold its
    library's pages (issue 35's resident memory)."""
    import llguidance

    return llguidance


@dataclass(frozen=True)
class GrammarSpec:
    """What constrains a request's output.

    ``json``: a JSON schema, as JSON text (``{"type": "object"}`` is OpenAI's ``json_object``); ``regex``: a
    regular expression the whole output matches; ``grammar``: a Lark grammar (llguidance's dialect); ``choice``:
    a JSON list of strings, the output being exactly one of them.
    """

    kind: str
    source: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {KINDS}, got {self.kind!r}")
        if not self.source:
            raise ValueError(f"structured output ({self.kind}): must not be empty")


JSON_OBJECT = GrammarSpec("json", '{"type": "object"}')


def grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar for ``spec``; ValueError, with llguidance's message, when it is not even well formed
    (the compiler's ``check`` finds the rest)."""
    if spec.kind == "json":
        try:
            schema = json.loads(spec.source)
        except ValueError as e:
            raise ValueError(f"structured output (json schema): not JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("structured output (json schema): a schema is a JSON object")
        return _llguidance().LLMatcher.grammar_from_json_schema(json.dumps(schema))
    if spec.kind == "regex":
        return _llguidance().LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "grammar":
        return _llguidance().LLMatcher.grammar_from_lark(spec.source)
    try:
        choices = json.loads(spec.source)
    except ValueError as e:
        raise ValueError(f"structured output (choice): not JSON: {e}") from None
    if (not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES
            or not all(isinstance(c, str) and c for c in choices)):
        raise ValueError(f"structured output (choice): a list of 1 to {MAX_CHOICES} non-empty strings")
    # Lark string literals take JSON's escapes
    return _llguidance().LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


class GrammarCompiler:
    """Grammars for one model's vocabulary: checks a spec and starts a request's matcher.

    ``tokenizer``: llguidance's view of the model's tokenizer, or a function that builds it (a Hugging Face
    tokenizer takes about a second to convert: it is built on first use, once). ``stop_ids``: the model's
    end-of-sequence tokens, which a grammar allows where it can end."""

    def __init__(self, tokenizer: llguidance.LLTokenizer | Callable[[], llguidance.LLTokenizer], *, vocab_size: int,
                 stop_ids: Iterable[int]) -> None:
        self._tokenizer = None if callable(tokenizer) else tokenizer  # a function builds it on first use
        self._make = tokenizer if callable(tokenizer) else None
        self._lock = threading.Lock()
        self.vocab_size = vocab_size
        self.stop_ids = tuple(sorted(t for t in stop_ids if 0 <= t < vocab_size))
        self._executor: llguidance.LLExecutor | None = None

    @classmethod
    def from_hf(cls, hf_tokenizer: object, *, vocab_size: int, stop_ids: Iterable[int]) -> GrammarCompiler:
        """A compiler over the model's tokenizer (converted on first use): adaserve's own (loading/tokenizer.py)
        or a transformers fast tokenizer. Both reach llguidance as the Rust tokenizer's JSON; llguidance.hf,
        which imports transformers, is used only for the second."""
        stops = sorted(stop_ids)

        def make() -> llguidance.LLTokenizer:
            backend_json = getattr(hf_tokenizer, "backend_json", None)
            if callable(backend_json):  # what llguidance.hf does with a transformers tokenizer, without it
                eos = stops or getattr(hf_tokenizer, "eos_token_id", None)
                return _llguidance().LLTokenizer(backend_json(), n_vocab=vocab_size, eos_token=eos)
            import llguidance.hf

            return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=stops or None)

        return cls(make, vocab_size=vocab_size, stop_ids=stops)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                assert self._make is not None
                self._tokenizer = self._make()
                self._make = None
            return self._tokenizer

    @property
    def executor(self) -> llguidance.LLExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = _llguidance().LLExecutor()
            return self._executor

    def check(self, spec: GrammarSpec) -> str:
        """The grammar's text; ValueError with llguidance's message when it is invalid (an unknown type in a
        schema, an unclosed group in a regex, an undefined rule)."""
        text = grammar_text(spec)
        error = _llguidance().LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise ValueError(f"structured output ({spec.kind}): {error.strip()}")
        return text

    def start(self, spec: GrammarSpec, consumed: Sequence[int] = ()) -> GrammarState:
        """A request's matcher, past ``consumed`` (a continuation's earlier output); ValueError when the grammar is
        invalid or refuses ``consumed``."""
        matcher = _llguidance().LLMatcher(self.tokenizer, self.check(spec), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured output ({spec.kind}): {matcher.get_error()}")
        state = GrammarState(matcher, self)
        if consumed and not state.advance(consumed):
            raise ValueError(f"structured output ({spec.kind}): the output so far does not match the grammar")
        return state


Path = tuple[int, ...]


class GrammarState:
    """One request's matcher at its committed output, and the matchers and masks after paths from there."""

    def __init__(self, matcher: llguidance.LLMatcher, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.words = (compiler.vocab_size + 31) // 32
        self.broken = False  # the output left the grammar (it cannot, but an engine thread must not crash on it)
        self._matchers: dict[Path, llguidance.LLMatcher | None] = {(): matcher}
        self._masks: dict[Path, np.ndarray] = {}

    @property
    def matcher(self) -> llguidance.LLMatcher:
        m = self._matchers[()]
        assert m is not None
        return m

    def advance(self, tokens: Sequence[int]) -> bool:
        """The request emitted ``tokens``: consume them (the masks after paths start again from there).
        False (and the state ``broken``) when the grammar refuses them."""
        root = self.matcher
        self._matchers, self._masks = {(): root}, {}
        if tokens and not self.broken and not root.consume_tokens(list(tokens)):
            self.broken = True
        return not self.broken

    @property
    def accepting(self) -> bool:
        """The output so far is a complete match."""
        return self.matcher.is_accepting()

    def _after(self, path: Path) -> llguidance.LLMatcher | None:
        """The matcher after ``path``, None if the grammar refuses it."""
        if path in self._matchers:
            return self._matchers[path]
        parent = self._after(path[:-1])
        m = None
        if parent is not None:
            m = parent.deep_copy()
            if not m.consume_token(path[-1]):
                m = None
        self._matchers[path] = m
        return m

    def allowed(self, paths: Sequence[Path]) -> torch.Tensor:
        """bool [len(paths), vocab]: the tokens the grammar allows after each path; a path the grammar refuses
        gets a row of True (it is never reached, see the module docstring)."""
        todo = []
        for p in paths:
            if p not in self._masks and not self.broken and self._after(p) is not None:
                todo.append(p)
        todo = list(dict.fromkeys(todo))
        if todo:
            bits = np.full((len(todo), self.words), -1, np.int32)
            # one call for every path, on llguidance's threads (its torch helper would import torch.compile)
            self.compiler.executor.unsafe_compute_mask_ptr(
                [(self._matchers[p], i) for i, p in enumerate(todo)], bits.ctypes.data, self.words * 4, len(todo))
            for p, row in zip(todo, unpack(bits, self.compiler.vocab_size), strict=True):
                if not row.any():  # nothing allowed (a grammar in an odd state): let the request end
                    row[list(self.compiler.stop_ids)] = True
                self._masks[p] = row
        out = np.ones((len(paths), self.compiler.vocab_size), bool)
        for i, p in enumerate(paths):
            row = self._masks.get(p)
            if row is not None:
                out[i] = row
            elif self.broken:
                out[i] = False
                out[i, list(self.compiler.stop_ids)] = True
        return torch.from_numpy(out)


def unpack(bits: np.ndarray, vocab: int) -> np.ndarray:
    """llguidance's bitmask [n, ceil(V/32)] int32 (token t: bit t % 32 of word t // 32) -> bool [n, V]."""
    b = np.unpackbits(np.ascontiguousarray(bits).view(np.uint8), axis=1, bitorder="little")
    return b[:, :vocab].astype(bool)


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [M, V] with the tokens ``allowed`` [M, V] does not allow at -inf, in float32 (a copy)."""
    return logits.to(torch.float32).masked_fill(~allowed.to(logits.device, non_blocking=True), float("-inf"))
