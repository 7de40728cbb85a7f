"""tokenizer.py's Tokenizer is the tokenizer transformers' AutoTokenizer loads, without transformers: the same ids,
texts, vocabulary, special tokens, Rust tokenizer (what llguidance reads) and chat prompts, on the checkpoints the
project ships (the default model, the demo pair) and on synthetic configurations of the files it reads; loading
the default model's imports no transformers; and loader's rule sends a checkpoint here only where AutoTokenizer
gives its generic class."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance
import pytest

from adaserve.engine.loading.catalog import committed_models
from adaserve.engine.loading.chat import ChatTemplateError, chat_text
from adaserve.engine.loading.loader import (
    _NATIVE_CLASSES,
    NATIVE_MODEL_TYPES,
    _native_tokenizer,
    load_tokenizer,
)
from adaserve.engine.loading.tokenizer import Tokenizer
from adaserve.engine.speculation.grammar import JSON_OBJECT, GrammarCompiler, GrammarSpec
from tests.models import smollm2_pair

DEMO = committed_models() / "demo"
CORPUS = ["Hello world", "", " ", "   leading", "trailing   ", "many     spaces  and\ttabs\t\t", "\n",
          "\n\nnew\nlines\n\n", "\r\n windows \r\n",
          "ünïcödé çà et là, 漢字とかな, Ελληνικά, русский", "emoji 🙂👩‍👩‍👧‍👦🎉 and 🇳🇴",
          "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<s>bos</s> eos <s></s><pad><unk>",
          "<|endoftext|>text<|endoftext|>", "<<|im_start|>>", "def f(x):\n    return x**2  # comment\n",
          "don't stop . ok ? yes ! a , b 'm 's 've 're n't", "\u200b zero width \ufeff bom", "a" * 300]
CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 2+2? 🙂 <|im_end|>"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "  c\n"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "empty system"}],
]
TOOL_TURNS = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "weather?"},
              {"role": "assistant", "content": "", "tool_calls": [CALL]},
              {"role": "tool", "content": "rain", "tool_call_id": "call_1"}, {"role": "user", "content": "thanks"}]


def default_target() -> Path:
    return smollm2_pair(with_draft=False).target


def shipped() -> list[Path]:
    return [default_target(), DEMO / "target", DEMO / "draft"]


def autotokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def backend_json(hf: Any) -> Any:
    """The transformers tokenizer's Rust tokenizer as llguidance.hf serializes it (no padding or truncation)."""
    backend = copy.copy(hf.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return json.loads(backend.to_str())


def assert_same(ours: Tokenizer, hf: Any, texts: list[str] = CORPUS) -> None:
    assert type(hf).__name__ == "TokenizersBackend"
    assert ours.get_vocab() == hf.get_vocab()
    assert len(ours) == len(hf) and ours.vocab_size == hf.vocab_size
    assert ours.special_tokens_map == hf.special_tokens_map
    assert ours.all_special_tokens == hf.all_special_tokens and ours.all_special_ids == hf.all_special_ids
    for name in ("bos", "eos", "unk", "sep", "pad", "cls", "mask"):
        assert getattr(ours, f"{name}_token") == getattr(hf, f"{name}_token"), name
        assert getattr(ours, f"{name}_token_id") == getattr(hf, f"{name}_token_id"), name
    assert ours.chat_template == hf.chat_template
    assert json.loads(ours.backend_json()) == backend_json(hf)
    specials = hf.all_special_ids[:3]
    for text in texts:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), (text, special)
        for ids in (ours.encode(text), [*specials, *ours.encode(text, add_special_tokens=False), *specials]):
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), \
                    (text, ids, skip)
    for token in list(hf.get_vocab().values())[:: max(1, len(hf) // 500)] + specials:
        assert ours.decode([token]) == hf.decode([token]) and ours.decode(token) == hf.decode(token)


def rendered(tok: Any, conversation: list[dict[str, Any]], **kwargs: Any) -> str:
    """What the template renders, or the error: its type, and the message of an error the template raised (not
    of one the renderer raised, which tokenizer.py words its own way), to compare."""
    from jinja2.exceptions import SecurityError, TemplateError

    try:
        return str(tok.apply_chat_template(conversation, tokenize=False, **kwargs))
    except Exception as e:
        own = isinstance(e, TemplateError) and not isinstance(e, SecurityError)
        return f"{type(e).__name__}: {e}" if own else type(e).__name__


# ---- the checkpoints the project ships ---------------------------------------------------------------------
@pytest.mark.parametrize("which", ["default", "demo target", "demo draft"])
def test_shipped_tokenizers_are_what_autotokenizer_gives(which: str) -> None:
    path = {"default": default_target, "demo target": lambda: DEMO / "target",
            "demo draft": lambda: DEMO / "draft"}[which]()
    ours, hf = load_tokenizer(path), autotokenizer(path)
    assert isinstance(ours, Tokenizer)
    assert_same(ours, hf)


def test_the_default_models_chat_prompts_are_what_transformers_renders() -> None:
    path = default_target()
    ours, hf = load_tokenizer(path), autotokenizer(path)
    assert ours.chat_template
    for conversation in CONVERSATIONS:
        for generation in (True, False):
            text = rendered(ours, conversation, add_generation_prompt=generation)
            assert text == rendered(hf, conversation, add_generation_prompt=generation)
        assert chat_text(ours, conversation) == chat_text(hf, conversation)
        text = chat_text(ours, conversation)
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
        assert ours.apply_chat_template(conversation, add_generation_prompt=True) == \
            hf.apply_chat_template(conversation, add_generation_prompt=True, return_dict=False)
    for tok in (ours, hf):  # its template never reads tool_calls: refused, by both alike
        with pytest.raises(ChatTemplateError, match="tool_calls"):
            chat_text(tok, TOOL_TURNS)


# ---- chat templates: the features transformers' renderer gives them -----------------------------------------
TOOLS_TEMPLATE = """{{ bos_token }}{% set ns = namespace(calls=0) %}
{%- if tools %}Tools: {{ tools | tojson(indent=2) }}
{% endif %}
{%- if documents %}{% for d in documents %}[{{ d.title }}] {{ d.text }}
{% endfor %}{% endif %}
{%- for message in messages %}
  {%- if message.role == 'ignored' %}{% continue %}{% endif %}
  <|{{ message.role }}|>
  {%- if message.content is defined %} {{ message.content }}{% else %} (no content){% endif %}
  {%- if message.tool_calls is defined %}
    {%- for call in message.tool_calls %}{% set ns.calls = ns.calls + 1 %}
 <call {{ ns.calls }}>{{ call.function.name }}{{ call.function.arguments | tojson }}</call>
    {%- endfor %}
  {%- endif %}
  {%- if message.tool_call_id is defined %} (for {{ message.tool_call_id }}){% endif %}
{{ eos_token }}
{% endfor %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""
TEMPLATES = {
    "tools": TOOLS_TEMPLATE,
    "whitespace control": "{% for m in messages %}\n  {% if m.role == 'user' %}\n    U: {{ m.content }}\n  {% else %}"
                          "\n    A: {{ m.content }}\n  {% endif %}\n{% endfor %}\n{%- if add_generation_prompt -%}\n"
                          "  A:\n{%- endif %}",
    "tojson": "{{ messages | tojson }}|{{ messages[0] | tojson(sort_keys=true, separators=(',', ':')) }}"
              "|{{ '<b>&\"é' | tojson }}|{{ tools | tojson }}",
    "loop controls": "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m.role }};{% endfor %}",
    "generation": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]"
                  "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}",
    "raise_exception": "{% if messages[0].role != 'system' %}{{ raise_exception('system first, please') }}{% endif %}"
                       "ok",
    "dict": "{% set d = dict(a=1, b=messages|length) %}{{ d | tojson }}{{ dict.fromkeys(['x', 'y'], 0) | tojson }}",
    "namespace underscore": "{% set ns = namespace(_hidden=1) %}{{ ns._hidden }}",
    "namespace set underscore": "{% set ns = namespace(a=1) %}{% set ns._b = 2 %}{{ ns.a }}",
    "sandbox": "{{ messages.__class__ }}{{ ''.__class__.__mro__ }}",
    "immutable": "{% set x = [] %}{{ x.append(1) }}{{ x }}",
    "strftime": "{{ strftime_now('%Y') }}",
    "special tokens and kwargs": "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|{{ custom }}"
                                 "|{{ add_generation_prompt }}",
    "reasoning": "{% for m in messages %}{{ m | tojson }}\n{% endfor %}",
    "undefined": "{{ messages[0].nope }}|{{ nothing }}|{% if nothing is defined %}x{% endif %}",
}
REASONING = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "hmm"},
             {"role": "assistant", "content": "b", "thinking": "t", "reasoning_content": None, "extra": None}]


@dataclass
class Message:
    role: str
    content: str


class Opaque:
    pass


@pytest.fixture(scope="module")
def demo_pair_tokenizers() -> tuple[Tokenizer, Any]:
    return load_tokenizer(DEMO / "target"), autotokenizer(DEMO / "target")


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_chat_templates_render_as_transformers_renders_them(name: str,
                                                            demo_pair_tokenizers: tuple[Tokenizer, Any]) -> None:
    ours, hf = demo_pair_tokenizers
    template = TEMPLATES[name]
    calls = [{"role": "assistant", "content": None, "tool_calls": [{**CALL, "function": {
        **CALL["function"], "arguments": {"city": "Oslo", "days": [1, 2]}}}]}]
    conversations = [*CONVERSATIONS, TOOL_TURNS, calls, REASONING,
                     [{"role": "user", "content": "ok"}, {"role": "ignored", "content": "x"}],
                     [Message("user", "a dataclass"), {"role": "user", "content": Opaque()}]]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    documents = [{"title": "Doc", "text": "Body"}]
    for conversation in conversations:
        for kwargs in ({"add_generation_prompt": True}, {"add_generation_prompt": False},
                       {"add_generation_prompt": True, "tools": tools, "documents": documents, "custom": "c"}):
            a = rendered(ours, conversation, chat_template=template, **kwargs)
            assert a == rendered(hf, conversation, chat_template=template, **kwargs), (conversation, kwargs)


def test_tool_calls_reach_a_template_as_transformers_gives_them(demo_pair_tokenizers: tuple[Tokenizer, Any]) -> None:
    """chat.py's turns (arguments parsed from JSON) through a template that renders tool calls."""
    ours, hf = demo_pair_tokenizers
    for tok in (ours, hf):
        tok.chat_template = TOOLS_TEMPLATE
    try:
        text = chat_text(ours, TOOL_TURNS)
        assert text == chat_text(hf, TOOL_TURNS)
        assert '<call 1>weather{"city": "Oslo"}</call>' in text and text.endswith("<|assistant|>")
    finally:
        ours.chat_template = hf.chat_template = None


def test_an_empty_conversation_or_no_template_is_refused() -> None:
    tok = load_tokenizer(DEMO / "target")
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    with pytest.raises(ValueError, match="empty conversation"):
        tok.apply_chat_template([], chat_template="x", tokenize=False)
    with pytest.raises(TypeError, match="continue_final_message"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template="x", continue_final_message=True)


# ---- synthetic configurations: what transformers takes from each file ---------------------------------------
def added(content: str, *, special: bool = True, lstrip: bool = False, rstrip: bool = False,
          normalized: bool = False) -> dict[str, Any]:
    return {"content": content, "lstrip": lstrip, "normalized": normalized, "rstrip": rstrip, "single_word": False,
            "special": special}


ADDED_TYPE = {"__type": "AddedToken", **added("<aud>")}
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "TokenizersBackend": {"config": {"tokenizer_class": "TokenizersBackend"}},
    "add_bos_token off, add_eos_token on (ignored with a tokenizer.json)":
        {"config": {"add_bos_token": False, "add_eos_token": True}},
    "missing special tokens are added": {"config": {"pad_token": "<pad>", "unk_token": "<unk>", "sep_token": "</s>"}},
    "added_tokens_decoder overrides tokenizer.json's options and adds tokens": {"config": {
        "added_tokens_decoder": {"0": added("<s>", special=False), "1": added("</s>", rstrip=True),
                                 "4096": added("<|im_start|>"), "4097": added("<tool>", special=False, lstrip=True),
                                 "4098": added("<pad>", special=False)},
        "pad_token": "<pad>"}},
    "special_tokens_map.json": {
        "config": {"pad_token": "<cfgpad>"},
        "special_tokens_map": {"pad_token": added("<pad>", lstrip=True), "eos_token": "</s>",
                               "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}},
    "special_tokens_map.json ignored beside added_tokens_decoder": {
        "config": {"added_tokens_decoder": {"0": added("<s>"), "1": added("</s>")}},
        "special_tokens_map": {"pad_token": "<pad>", "eos_token": "<eos2>"}},
    "extra special tokens, a list": {"config": {"extra_special_tokens": ["<a>", "<b>", "</s>"]}},
    "additional special tokens (the old name)": {"config": {"additional_special_tokens": ["<a>", "<|im_end|>"]}},
    "extra special tokens, named": {"config": {"extra_special_tokens": {"image_token": "<img>"}}},
    "model-specific named tokens": {"config": {"image_token": "<img>", "audio_token": ADDED_TYPE}},
    "serialized AddedToken values": {"config": {"bos_token": {"__type": "AddedToken", **added("<s>", lstrip=True)},
                                                "pad_token": {"__type": "AddedToken", **added("<p>")}}},
    "split special tokens": {"config": {"split_special_tokens": True}},
    "clean-up on a BPE model (transformers skips it)": {"config": {"clean_up_tokenization_spaces": True}},
    "clean-up forced on a BPE model": {"config": {
        "clean_up_tokenization_spaces": True,
        "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True}},
    "chat templates in the config, by name": {"config": {"chat_template": [
        {"name": "default", "template": "{{ messages[0].content }}"},
        {"name": "tool_use", "template": "tools {{ tools | length }}"}]}},
    "chat template in the config": {"config": {"chat_template": "{{ messages | length }}"}},
    "chat template files": {"config": {"chat_template": "config's"},
                            "files": {"chat_template.jinja": "file's {{ messages[0].content }}",
                                      "additional_chat_templates/rag.jinja": "rag {{ documents | length }}"}},
    "only additional chat templates": {"config": {"chat_template": "config's"},
                                       "files": {"additional_chat_templates/rag.jinja": "rag"}},
    "padding and truncation in tokenizer.json": {"tokenizer": {
        "padding": {"strategy": {"Fixed": 64}, "direction": "Left", "pad_to_multiple_of": None, "pad_id": 1,
                    "pad_type_id": 0, "pad_token": "</s>"},
        "truncation": {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}}},
    "no post-processor": {"tokenizer": {"post_processor": None}},
}


def synthetic(tmp_path: Path, variant: dict[str, Any], model_type: str = "llama") -> Path:
    """The demo target's tokenizer with ``variant``'s changes to tokenizer_config.json (merged), tokenizer.json
    (top-level keys replaced), and special_tokens_map.json and other files (written)."""
    src = DEMO / "target"
    out = tmp_path / "tok"
    out.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "model_type": model_type}))
    tok_json = json.loads((src / "tokenizer.json").read_text())
    (out / "tokenizer.json").write_text(json.dumps({**tok_json, **variant.get("tokenizer", {})}))
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, **variant.get("config", {})}))
    if "special_tokens_map" in variant:
        (out / "special_tokens_map.json").write_text(json.dumps(variant["special_tokens_map"]))
    for name, text in variant.get("files", {}).items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    return out


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_synthetic_configurations_load_as_transformers_loads_them(tmp_path: Path, name: str) -> None:
    path = synthetic(tmp_path, VARIANTS[name])
    assert _native_tokenizer(path)
    ours, hf = load_tokenizer(path), autotokenizer(path)
    assert isinstance(ours, Tokenizer)
    extra = ["<a> <b> <img> <aud> <tool> x <tool>y", " <pad> <p> <cfgpad> <unk> <eos2> </s> ", "don 't . , ?"]
    assert_same(ours, hf, CORPUS + extra)
    for template in (None, "default", "tool_use", "rag", "{{ messages[0].role }}"):
        for tools in (None, [{"name": "t"}]):
            kwargs = {"chat_template": template, "tools": tools, "documents": [{"title": "t", "text": "x"}]}
            assert rendered(ours, CONVERSATIONS[1], **kwargs) == rendered(hf, CONVERSATIONS[1], **kwargs)


def test_a_wordpiece_tokenizer_cleans_up_spaces_as_transformers_does(tmp_path: Path) -> None:
    """Clean-up applies to a model other than BPE."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    words = ["[UNK]", "[CLS]", "don", "'", "t", "stop", ".", "ok", "?", "yes", "!", ",", "s", "##s", "m", "ve", "re",
             "n't"]
    backend = RustTokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    out = tmp_path / "wp"
    out.mkdir()
    backend.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": True, "unk_token": "[UNK]",
        "cls_token": "[CLS]"}))
    ours, hf = load_tokenizer(out), autotokenizer(out)
    assert isinstance(ours, Tokenizer)
    assert_same(ours, hf, ["don ' t stop . ok ? yes ! a , b 's 've 're n't", "unknown words", ""])
    assert ours.decode(ours.encode("stop . ok ?")) == "stop. ok?"


# ---- the rule -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", NATIVE_MODEL_TYPES)
@pytest.mark.parametrize("tokenizer_class", _NATIVE_CLASSES)
def test_the_rule_sends_here_only_what_autotokenizer_loads_as_its_generic_class(
        tmp_path: Path, model_type: str, tokenizer_class: str) -> None:
    """Each allowed model type with each allowed class: transformers' tables still give its generic class."""
    path = synthetic(tmp_path, {"config": {"tokenizer_class": tokenizer_class}}, model_type)
    assert _native_tokenizer(path)
    assert type(autotokenizer(path)).__name__ == "TokenizersBackend"
    assert_same(load_tokenizer(path), autotokenizer(path), CORPUS[:6])


@pytest.mark.parametrize("file, change", [
    ("config.json", {"model_type": "qwen2"}),  # transformers replaces the declared class (Qwen2Tokenizer)
    ("config.json", {"model_type": "mistral"}),  # MistralCommonBackend where installed; a pre-tokenizer patch
    ("config.json", {"model_type": "bert"}),  # a tokenizer class of its own
    ("config.json", {"model_name": "qwen2"}),
    ("config.json", {"auto_map": {"AutoConfig": "x.Config"}}),  # remote code
    ("tokenizer_config.json", {"tokenizer_class": "LlamaTokenizerFast"}),
    ("tokenizer_config.json", {"tokenizer_class": "GPT2Tokenizer"}),
    ("tokenizer_config.json", {"tokenizer_class": None}),
    ("tokenizer_config.json", {"auto_map": {"AutoTokenizer": [None, "x.Tok"]}}),  # remote code
    ("tokenizer_config.json", {"fast_tokenizer_files": ["tokenizer.json"]}),  # another tokenizer file
    ("added_tokens.json", {}),  # a legacy file tokenizer.py does not read
    ("tokenizer.json", None),
    ("config.json", None),
    ("tokenizer_config.json", None),
])
def test_anything_else_goes_through_transformers(tmp_path: Path, file: str, change: dict[str, Any] | None) -> None:
    """A change to ``file`` (None: no such file) takes the checkpoint off tokenizer.py's path."""
    path = synthetic(tmp_path, {})
    assert _native_tokenizer(path)
    target = path / file
    if change is None:
        target.unlink()
    else:
        target.write_text(json.dumps({**(json.loads(target.read_text()) if target.exists() else {}), **change}))
    assert not _native_tokenizer(path)


def test_loading_the_default_models_tokenizer_imports_no_transformers() -> None:
    """Nor does its chat prompt, or structured output's view of its vocabulary."""
    code = f"""
import sys
from adaserve.engine.loading.chat import chat_text
from adaserve.engine.loading.loader import load_tokenizer
from adaserve.engine.speculation.grammar import JSON_OBJECT, GrammarCompiler
tok = load_tokenizer({str(default_target())!r})
ids = tok.encode(chat_text(tok, [{{"role": "user", "content": "hi"}}]), add_special_tokens=False)
assert tok.decode(ids).endswith("assistant\\n")
compiler = GrammarCompiler.from_hf(tok, vocab_size=49152, stop_ids=[2])
compiler.start(JSON_OBJECT)
print(type(tok).__name__, sorted(m for m in sys.modules if m.split(".")[0] == "transformers"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "Tokenizer []"


# ---- one tokenizer for several threads; llguidance's view ---------------------------------------------------
def test_threads_share_one_tokenizer() -> None:
    tok = load_tokenizer(default_target())
    expected = {text: (tok.encode(text), tok.decode(tok.encode(text), skip_special_tokens=True)) for text in CORPUS}
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(30):
                for text, (ids, back) in expected.items():
                    assert tok.encode(text) == ids and tok.decode(ids, skip_special_tokens=True) == back
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.parametrize("spec", [JSON_OBJECT, GrammarSpec("regex", r"[a-z ]+\n(<\|im_end\|>)?"),
                                  GrammarSpec("choice", '["yes", "no 🙂", "<|im_start|>"]')])
def test_llguidance_masks_are_what_transformers_tokenizer_gives(spec: GrammarSpec) -> None:
    path = default_target()
    ours = GrammarCompiler.from_hf(load_tokenizer(path), vocab_size=49152, stop_ids=[2])
    hf = GrammarCompiler.from_hf(autotokenizer(path), vocab_size=49152, stop_ids=[2])
    a, b = (llguidance.LLMatcher(c.tokenizer, c.check(spec), log_level=0) for c in (ours, hf))
    tok = load_tokenizer(path)
    prefix = tok.encode({"json": '{"a": [1, 2', "regex": "ab c", "choice": "no"}[spec.kind],
                        add_special_tokens=False)
    assert a.compute_bitmask() == b.compute_bitmask()
    for token in prefix:
        assert a.consume_token(token) == b.consume_token(token)
        assert a.compute_bitmask() == b.compute_bitmask()


def test_a_copied_checkpoint_loads_the_same(tmp_path: Path) -> None:
    """from_dir reads only the directory it is given (no cache, no hub)."""
    out = tmp_path / "copy"
    shutil.copytree(DEMO / "target", out, ignore=shutil.ignore_patterns("*.safetensors"))
    assert load_tokenizer(out).get_vocab() == load_tokenizer(DEMO / "target").get_vocab()
