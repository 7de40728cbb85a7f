"""A checkpoint's tokenizer without transformers: ``tokenizers``' tokenizer.json plus what transformers' generic
fast tokenizer (``TokenizersBackend``) takes from tokenizer_config.json, special_tokens_map.json and the chat
template files, so that encoding, decoding, the vocabulary and chat prompts are the same (issue 35: importing
transformers costs a worker ~20 MB of resident memory, and its tokenizer needed a second copy per worker).

loader.load_tokenizer sends a checkpoint here only where transformers itself would load that generic class (its
rule says which); tests/engine/loading/test_tokenizer.py compares the two on the checkpoints the project ships
and on synthetic configurations. Checked against transformers 5.24: another version may load differently, which
those tests would show.

One instance may serve several threads at once: after loading, nothing here changes the Rust tokenizer (the
calls made on it only read it), where transformers' encode may set or clear truncation, padding and special-token
splitting on it inside a call.

May import: the standard library, ``tokenizers``, and ``jinja2`` (on the first chat prompt); never transformers,
torch or the rest of adaserve.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import tokenizers
from tokenizers import AddedToken, processors

if TYPE_CHECKING:
    import jinja2

# transformers' named special tokens, in its order (a checkpoint may name more: see _special_tokens)
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"  # more named templates, one .jinja file each
# arguments of transformers' apply_chat_template that this one does not implement (refused, not passed on to the
# template, where they would change nothing without a word)
_UNSUPPORTED_CHAT_ARGS = frozenset({"continue_final_message", "return_dict", "return_assistant_tokens_mask",
                                    "sanitize_control_tokens", "padding", "truncation", "max_length",
                                    "return_tensors", "tokenizer_kwargs"})
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # a message's reasoning, by its usual names

Token = str | AddedToken


class _NamedToken:
    """A named special token's text (``bos_token``), or with an ``_id`` name its id (``bos_token_id``); None when
    the checkpoint names none. The id of a token outside the vocabulary is the unknown token's, as in
    transformers."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name.removesuffix("_id")
        self.as_id = name.endswith("_id")

    def __get__(self, tok: Tokenizer | None, owner: type | None = None) -> Any:
        if tok is None:
            return self
        text = tok.special_tokens_map.get(self.name)
        if text is None or not self.as_id:
            return text
        return tok.convert_tokens_to_ids(text)


class Tokenizer:
    """The model's tokenizer, with the part of transformers' interface adaserve uses: ``encode``, ``decode``,
    ``get_vocab``, the named special tokens and their ids, ``chat_template`` and ``apply_chat_template``.

    ``backend``: the Rust tokenizer, as loading left it (``from_dir``); it is never changed afterwards.
    ``special``: named special tokens' texts, by name (``bos_token``, ...). ``chat_template``: the template, or
    named templates (``default``, ``tool_use``, ...). ``clean_up_tokenization_spaces``: tokenizer_config.json's
    option, applied to decoded text as transformers applies it (never to a BPE model's, unless
    ``clean_up_bpe``, transformers' explicit override, says so)."""

    bos_token = _NamedToken()
    eos_token = _NamedToken()
    unk_token = _NamedToken()
    sep_token = _NamedToken()
    pad_token = _NamedToken()
    cls_token = _NamedToken()
    mask_token = _NamedToken()
    bos_token_id = _NamedToken()
    eos_token_id = _NamedToken()
    unk_token_id = _NamedToken()
    sep_token_id = _NamedToken()
    pad_token_id = _NamedToken()
    cls_token_id = _NamedToken()
    mask_token_id = _NamedToken()

    def __init__(self, backend: tokenizers.Tokenizer, *, special: Mapping[str, str],
                 extra_special: Sequence[str] = (), chat_template: str | dict[str, str] | None = None,
                 clean_up_tokenization_spaces: bool = False, clean_up_bpe: bool = False,
                 name_or_path: str = "") -> None:
        self._backend = backend
        self.special_tokens_map = dict(special)  # transformers' special_tokens_map: the named ones, as text
        self.extra_special_tokens = list(extra_special)
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self._clean_up = clean_up_tokenization_spaces and (type(backend.model).__name__ != "BPE" or clean_up_bpe)
        self.name_or_path = name_or_path

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """The tokenizer in checkpoint directory ``path`` (tokenizer.json, with tokenizer_config.json,
        special_tokens_map.json and chat template files where present), set up as transformers sets up its
        ``TokenizersBackend`` from the same files (_special_tokens and _add_missing say how)."""
        path = Path(path)
        config = _json_object(path / "tokenizer_config.json")
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        named, extra, added = _special_tokens(path, config, backend)
        # transformers' encode turns off truncation and padding before it encodes; here they are off for good
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        _add_missing(backend, named, extra, added)
        if backend.post_processor is None:  # transformers installs one that adds nothing (add_bos_token is off)
            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1",
                                                                   special_tokens=[])
        return cls(backend, special={name: str(t) for name, t in named.items() if t is not None},
                   extra_special=[str(t) for t in extra], chat_template=_chat_template(path, config),
                   clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
                   clean_up_bpe=bool(config.get(
                       "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)),
                   name_or_path=str(path))

    # ---- tokens ---------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens``: with what tokenizer.json's post-processor adds (a BOS
        token, say). An added token's text in ``text`` becomes that token (special ones too, unless
        tokenizer_config.json's ``split_special_tokens`` says otherwise)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: int | Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (one id or several); ``skip_special_tokens``: without the special ones."""
        ids = [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self._clean_up else text

    def get_vocab(self) -> dict[str, int]:
        """Every token's id by its text, added tokens included."""
        return self._backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary without the added tokens (transformers' ``vocab_size``)."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        """A token's id (a list for a list), the unknown token's id for a token outside the vocabulary."""
        if isinstance(tokens, str):
            index = self._backend.token_to_id(tokens)
            if index is None:
                unk = self.special_tokens_map.get("unk_token")
                return None if unk is None else self._backend.token_to_id(unk)
            return index
        return [self.convert_tokens_to_ids(t) for t in tokens]

    @property
    def all_special_tokens(self) -> list[str]:
        """The named special tokens, then the extra ones, each once."""
        return list(dict.fromkeys([*self.special_tokens_map.values(), *self.extra_special_tokens]))

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    def backend_json(self) -> str:
        """tokenizer.json's text as loaded (the added tokens included): what llguidance builds its view from."""
        return self._backend.to_str()

    # ---- chat -----------------------------------------------------------------------------------------------
    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]]
                            | None = None, documents: Sequence[Mapping[str, Any]] | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            tokenize: bool = True, **kwargs: Any) -> str | list[int]:
        """``conversation`` (one conversation: message dicts) rendered by the model's chat template as
        transformers renders it: the text, or with ``tokenize`` its ids (without added special tokens: the
        template writes its own; transformers returns them in a BatchEncoding unless ``return_dict=False``).
        ``tools`` (JSON schemas), ``documents`` and ``kwargs`` reach the template as variables, as do the named
        special tokens (``bos_token``, ...) and ``add_generation_prompt``. A message's keys whose value is None are
        dropped first (templates handle a missing key better than None)."""
        refused = _UNSUPPORTED_CHAT_ARGS.intersection(kwargs)
        if refused:
            raise TypeError(f"apply_chat_template: {', '.join(sorted(refused))} not supported here")
        template = self._template_source(chat_template, tools)
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        messages = [_without_none(m) for m in _as_dicts(conversation)]
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise ValueError("tools: each tool must be a JSON schema (a dict)")
        if documents is not None and not all(isinstance(d, Mapping) for d in documents):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
        variables = _plain({**self.special_tokens_map, **kwargs})
        text = _compiled(template).render(messages=_with_reasoning_aliases(_plain(messages)), tools=_plain(tools),
                                          documents=_plain(documents), add_generation_prompt=add_generation_prompt,
                                          **variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template_source(self, chat_template: str | None, tools: object) -> str:
        """The template to render: ``chat_template`` itself or its name, else the model's (of several named
        ones, ``tool_use`` when there are tools, else ``default``)."""
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None:
                return own.get(chat_template, chat_template)
            if tools is not None and "tool_use" in own:
                return own["tool_use"]
            if "default" in own:
                return own["default"]
            raise ValueError(f"this model has several chat templates and none is the default: {sorted(own)}")
        if chat_template is not None:
            return chat_template
        if own is None:
            raise ValueError("this model has no chat template (tokenizer.chat_template is not set)")
        return own

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab={len(self)})"


# ---- loading ------------------------------------------------------------------------------------------------
def _json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; {} when there is no such file."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data


def _as_added(value: Any) -> Any:
    """A serialized added token (``{"__type": "AddedToken", ...}``), anywhere in ``value``, as an AddedToken."""
    if isinstance(value, dict):
        if value.get("__type") == "AddedToken":
            return AddedToken(**{k: v for k, v in value.items() if k != "__type"})
        return {k: _as_added(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_as_added(v) for v in value]
    return value


def _special_tokens(path: Path, config: dict[str, Any], backend: tokenizers.Tokenizer
                    ) -> tuple[dict[str, Token | None], list[Token], dict[int, AddedToken]]:
    """The named special tokens (the standard names, then any other ``*_token`` the checkpoint names), the extra
    ones, and the added tokens by id, read as transformers reads them.

    Its rules: tokenizer_config.json's ``added_tokens_decoder`` lists the added tokens where present, and then
    special_tokens_map.json is not read at all; otherwise special_tokens_map.json's entries override the
    config's, and the added tokens are tokenizer.json's. A standard named token whose text is an added token's
    takes that token's options (lstrip, ...). ``additional_special_tokens`` is the old name of
    ``extra_special_tokens``, and a dict of extra tokens names them. A pad token that only tokenizer.json's
    padding names is the pad token."""
    # what transformers' from_pretrained makes of the files
    init = {k: v for k, v in config.items() if k not in ("tokenizer_class", "add_bos_token", "add_eos_token")}
    if "additional_special_tokens" in init and not init.get("extra_special_tokens"):
        init["extra_special_tokens"] = init.pop("additional_special_tokens")
    explicit = {k: init.pop(k) for k in list(init)
                if k not in SPECIAL_NAMES and k.endswith("_token") and isinstance(init[k], str)}
    if isinstance(init.get("extra_special_tokens"), dict):
        explicit.update(init.pop("extra_special_tokens"))
    if "added_tokens_decoder" in init:
        added = {int(i): AddedToken(**t) if isinstance(t, dict) else t
                 for i, t in init.pop("added_tokens_decoder").items()}
    else:
        for key, value in _json_object(path / "special_tokens_map.json").items():
            if isinstance(value, dict) and key != "extra_special_tokens":
                value = AddedToken(**{k: v for k, v in value.items() if k != "special"}, special=True)
            elif key == "extra_special_tokens" and isinstance(value, list):
                merged = list(init.get("extra_special_tokens") or [])
                for t in value:
                    t = AddedToken(**t, special=True) if isinstance(t, dict) else t
                    if t not in merged:
                        merged.append(t)
                value = merged
            init[key] = value
        if isinstance(init.get("extra_special_tokens"), dict):
            explicit.update(init.pop("extra_special_tokens"))
        added = backend.get_added_tokens_decoder()
    init, explicit = _as_added(init), _as_added(explicit)
    by_text = {str(t): t for t in added.values()}
    for name in SPECIAL_NAMES:
        if init.get(name) is not None and by_text:
            init[name] = by_text.get(str(init[name]), init[name])
    if backend.padding is not None:
        init.setdefault("pad_token", backend.padding.get("pad_token"))
    # what its tokenizer's constructor makes of them
    if "additional_special_tokens" in init and "extra_special_tokens" not in init:
        init["extra_special_tokens"] = init.pop("additional_special_tokens")
    named: dict[str, Token | None] = dict.fromkeys(SPECIAL_NAMES)
    extra: list[Token] = []
    auto: dict[str, Token] = {}
    for key, value in init.items():
        if key in named:
            if value is not None and not isinstance(value, str | AddedToken):
                raise TypeError(f"special token {key} must be a string or an AddedToken, not {type(value).__name__}")
            named[key] = value if value is not None else named[key]
        elif key == "extra_special_tokens" and value is not None:
            if isinstance(value, dict):
                named.update(value)
            elif isinstance(value, list | tuple):
                extra = list(value)
            else:
                raise TypeError("extra_special_tokens must be a list of tokens or a dict of named tokens")
        elif key.endswith("_token") and isinstance(value, str | AddedToken):
            auto[key] = value
    named.update({**auto, **explicit})
    return named, extra, added


def _add_missing(backend: tokenizers.Tokenizer, named: Mapping[str, Token | None], extra: Sequence[Token],
                 added: Mapping[int, AddedToken]) -> None:
    """Add to ``backend`` the added tokens _special_tokens found (tokenizer_config.json's options win over
    tokenizer.json's) and every named or extra token it lacks, a plain text as a new special token; an added
    token that is also a named one becomes special. As transformers does at load, in the same order."""
    to_add: list[Token] = [added[i] for i in sorted(added)]
    known = {t.content for t in backend.get_added_tokens_decoder().values()} | {str(t) for t in to_add}
    for token in [*(t for t in named.values() if t is not None), *extra]:
        if str(token) not in known and not any(token is t or (isinstance(token, str) and token == t)
                                               for t in to_add):
            to_add.append(token)
    if not to_add:
        return
    names = {str(t) for t in named.values() if t}
    tokens = []
    for token in to_add:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and token.content in names:
            token.special = True
        tokens.append(token)
    backend.add_tokens(tokens)


def _chat_template(path: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The chat template: from the files where there are any (chat_template.jinja, named ``default``, and
    additional_chat_templates/NAME.jinja), else tokenizer_config.json's (a text, or a list of named ones); one
    template as its text, several by name."""
    files = {}
    if (path / CHAT_TEMPLATE_FILE).is_file():
        files["default"] = (path / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (path / CHAT_TEMPLATE_DIR).is_dir():
        for f in (path / CHAT_TEMPLATE_DIR).glob("*.jinja"):
            files[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if files:
        template = files["default"] if list(files) == ["default"] else files
    if isinstance(template, list | tuple):
        template = {t["name"]: t["template"] for t in template}
    return template


def _clean_up_spaces(text: str) -> str:
    """Spaces a word-piece tokenizer leaves before punctuation and English contractions, taken out
    (transformers' ``clean_up_tokenization``, the same replacements in the same order)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


# ---- chat templates -----------------------------------------------------------------------------------------
# Chat templates come with checkpoints, so they are code from elsewhere: they run in jinja2's immutable sandbox,
# with the options, filters and globals transformers gives them (the same template renders the same text).


def _as_dicts(value: Any) -> Any:
    """Messages as plain containers: mappings, dataclasses and pydantic models (OpenAI's SDK) become dicts."""
    if isinstance(value, Mapping):
        return {k: _as_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_as_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _as_dicts(value.model_dump())
    return value


def _without_none(message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
    return {k: v for k, v in message.items() if v is not None}


def _plain(value: Any) -> Any:
    """``value`` rebuilt from JSON's types only (what a template may see): subclasses of str, int and float
    become the base type, numpy scalars Python's, containers are copied, and any other object becomes
    ``"<TypeName>"``, so the sandboxed template can reach no method of a caller's object."""
    kind = type(value)
    if value is None or kind in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    numpy = sys.modules.get("numpy")  # (not imported: no value can be one of its scalars)
    if numpy is not None and isinstance(value, numpy.generic):
        return _plain(value.item())  # a numpy scalar (np.bool_(False) must stay falsy)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{kind.__name__}>"


def _with_reasoning_aliases(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A message's reasoning, under whichever name it came, also as ``reasoning_content`` (what templates read)
    and first as ``thinking`` (what gpt-oss's template reads)."""
    out = []
    for m in messages:
        reasoning = next((m[k] for k in _REASONING_KEYS if m.get(k) is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out


@lru_cache(maxsize=16)
def _compiled(source: str) -> jinja2.Template:
    """``source`` compiled in the chat-template environment (once per template text)."""
    return _environment().from_string(source)


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    """jinja2's immutable sandbox as transformers configures it for chat templates: block tags take their
    newline and leading spaces with them, ``break``/``continue`` work, ``{% generation %}`` blocks render their
    content, ``tojson`` does not escape HTML, ``raise_exception(msg)`` fails the rendering, ``strftime_now(fmt)``
    gives the local time, and ``dict``/``namespace`` are versions a template cannot break out through."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks what the assistant wrote (for training masks):
        rendered as its content."""

        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser: Any) -> jinja2.nodes.Node:
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_content"), [], [], body).set_lineno(line)

        def _content(self, caller: Any) -> str:
            return caller()

    def check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace: names "
                                                  "starting with an underscore are refused")

    class SafeNamespace(jinja2.utils.Namespace):
        """jinja2's ``namespace()``, refusing attributes whose names start with an underscore."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # no named self: ``namespace(self=1)`` must work
            ns, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                check_name(name)
            jinja2.utils.Namespace.__init__(ns, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check_name(name)
            super().__setitem__(name, value)

    class DictMaker:
        """``dict(...)`` and ``dict.fromkeys(...)`` for templates, without the type itself."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=DictMaker(), namespace=SafeNamespace)
    return env
