"""Text in and out of a Hugging Face checkpoint folder: ``tokenizer.json`` through the ``tokenizers`` library, the
chat template rendered the way transformers renders it, and a streaming detokenizer.

    tok = Tokenizer.from_folder("Qwen3.6-35B-A3B")
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], enable_thinking=False)
    ids = tok.encode(text)                        # list[int]; the template already holds the special tokens
    dec = tok.stream_decoder()
    for t in new_ids: print(dec.push(t), end="")  # whole characters only, never half of a UTF-8 sequence
    print(dec.flush())

Files read, as transformers 5 reads them: ``tokenizer.json`` (required), ``tokenizer_config.json`` (special tokens,
``added_tokens_decoder``, ``chat_template``), ``chat_template.jinja`` and ``chat_templates/*.jinja`` (which take
precedence over the config's template), ``generation_config.json`` (its ``eos_token_id`` are stop tokens).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from .validation import MAX_TOKEN_ID, MAX_TOKENIZER_BYTES, Fields, confined, read_json, read_regular, show

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "chat_templates"
GENERATION_CONFIG_FILE = "generation_config.json"

# the named special tokens transformers passes to every template (``special_tokens_map``)
SPECIAL_TOKEN_ATTRS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# ChatML turn ends, stop tokens of every Qwen model whatever the checkpoint's config says
CHATML_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")

# Used when a folder ships no template. Plain ChatML; for vocabularies with Qwen3.5/3.6's think tags the generation
# prompt opens a thinking block, or closes an empty one when enable_thinking is false, as the official template does.
CHATML_FALLBACK_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    # images and videos as the official Qwen3.5/Qwen3-VL template marks them (a 'type' or a key naming the medium);
    # qjax.multimodal.positions.expand_image_tokens later widens each image pad to the image's token count
    "{%- if part is mapping and (part['type'] in ('image', 'image_url') or 'image' in part or 'image_url' in part) %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part is mapping and (part['type'] in ('video', 'video_url') or 'video' in part) %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if qjax_think_tags %}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endif %}"
)

# the messages' alternative names for a reasoning trace; templates read ``reasoning_content`` (transformers aliases)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TokenizerError(ValueError):
    """A tokenizer folder or chat template qjax cannot use; the message names the folder or file at fault."""


# Bounds on one rendering of a chat template (templates come with checkpoints from the internet, and with requests when
# a server trusts them): the prompt it writes and any one string or list it builds; the steps it takes (every loop
# iteration and every call, macros included), counted as they happen, so nested loops that write nothing are stopped
# too; the characters and items of all the strings and lists it builds together, which bounds its peak memory (a
# string doubled in a loop, a ``center`` filter in a loop); and its wall time, checked at every step. A real template
# renders a 256k-token conversation (~1 M characters, a few hundred messages) in a few thousand steps and builds a few
# times its output.
MAX_TEMPLATE_CHARS = 16 << 20  # the output, and any one string
MAX_TEMPLATE_ITEMS = 1 << 20  # any one list, tuple or dict (8 bytes a reference at least)
MAX_TEMPLATE_STEPS = 1_000_000  # ~2-3 s of a CPU core at jinja's speed
MAX_TEMPLATE_BUILT = 128 << 20  # bytes, counting a character as 1 and an item as 8
MAX_TEMPLATE_SECONDS = 10.0
_render = threading.local()  # the budget of the rendering in progress on this thread
# texts from this length on are tokenized by the batch call, which releases the GIL (Tokenizer.encode)
_GIL_FREE_CHARS = 1 << 16


@dataclasses.dataclass
class _Budget:
    steps: int = MAX_TEMPLATE_STEPS
    built: int = MAX_TEMPLATE_BUILT
    deadline: float = 0.0


def _spend(steps: int = 1, built: int = 0) -> None:
    """Charge the rendering in progress on this thread ``steps`` steps and ``built`` characters/items; a
    ``SecurityError`` once any bound is passed (no rendering in progress: nothing to charge)."""
    budget = getattr(_render, "budget", None)
    if budget is None:
        return
    budget.steps -= steps
    budget.built -= built
    if budget.steps < 0:
        raise SecurityError(f"the template takes more than {MAX_TEMPLATE_STEPS:,} steps (loop iterations and calls)")
    if budget.built < 0:
        raise SecurityError(f"the template builds more than {MAX_TEMPLATE_BUILT:,} bytes of strings and lists")
    if time.monotonic() > budget.deadline:
        raise SecurityError(f"rendering took longer than {MAX_TEMPLATE_SECONDS:g} s")


def _built(value):
    """Charge a value a template operation just built and refuse one larger than :data:`MAX_TEMPLATE_CHARS`
    characters or :data:`MAX_TEMPLATE_ITEMS` items; returns it."""
    if isinstance(value, str):
        if len(value) > MAX_TEMPLATE_CHARS:
            raise SecurityError(f"a string of {len(value):,} characters is too big (the limit is "
                                f"{MAX_TEMPLATE_CHARS:,})")
        _spend(0, len(value))
    elif isinstance(value, (list, tuple, dict)):
        if len(value) > MAX_TEMPLATE_ITEMS:
            raise SecurityError(f"a {type(value).__name__} of {len(value):,} items is too big (the limit is "
                                f"{MAX_TEMPLATE_ITEMS:,})")
        _spend(0, 8 * len(value))
    return value


def _too_big_int(values) -> int | None:
    """The first integer argument over :data:`MAX_TEMPLATE_CHARS` (a width, a count) among ``values``."""
    return next((v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > MAX_TEMPLATE_CHARS),
                None)


class _Steps:
    """A loop's iterable that charges one step per item (sized when the iterable is, so ``loop.length`` works the
    same)."""

    def __init__(self, iterable):
        self.iterable = iterable

    def __len__(self):
        return len(self.iterable)

    def __iter__(self):
        for item in self.iterable:
            _spend()
            yield item


def _concat(items: list) -> str:
    """Jinja's ``~`` (``"".join(map(str, items))``), charged and bounded like every string a template builds."""
    parts = [str(x) for x in items]
    n = sum(len(x) for x in parts)
    if n > MAX_TEMPLATE_CHARS:
        raise SecurityError(f"a concatenation of {n:,} characters is too big")
    _spend(1, n)
    return "".join(parts)


def _bounded_filter(f):
    """A jinja filter that refuses a width or count over :data:`MAX_TEMPLATE_CHARS` (``center``, ``indent``,
    ``wordwrap``, …) before it runs and charges what it builds (``functools.wraps`` keeps jinja's ``pass_context``
    marks)."""
    @functools.wraps(f)
    def bounded(*args, **kwargs):
        big = _too_big_int((*args, *kwargs.values()))
        if big is not None:
            raise SecurityError(f"filter {getattr(f, '__name__', '?')} with a size of {big:,} (over "
                                f"{MAX_TEMPLATE_CHARS:,})")
        _spend()
        return _built(f(*args, **kwargs))
    return bounded


# ---------------------------------------------------------------------------------------------------------------------
# chat templates: jinja2 set up as transformers' chat_template_utils sets it up
# ---------------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def _compile_template(source: str):
    """Compile ``source`` in transformers' sandbox (``ImmutableSandboxedEnvironment``, ``trim_blocks``,
    ``lstrip_blocks``, loop controls, ``raise_exception``/``strftime_now``/``namespace``/``dict``, JSON ``tojson``)."""
    class GenerationTag(jinja2.ext.Extension):
        # ``{% generation %}…{% endgeneration %}`` marks assistant text for training masks; rendering keeps the body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class TemplateNamespace(jinja2.utils.Namespace):
        # as transformers: no underscore attributes, which would reach CPython internals
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"templates cannot set underscore attributes ({name!r})")

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own filter HTML-escapes and sorts keys; templates expect plain json.dumps
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Sandbox(ImmutableSandboxedEnvironment):
        """transformers' sandbox, plus bounds on what one expression can build (``'x' * 10**9``, ``9 ** 10**9``,
        ``'%999999999s' % x``, ``'x'.ljust(10**9)``, a ``center(10**9)`` filter are refused before they take the
        memory or the time) and the rendering's budget (:func:`_spend`): every call, every loop iteration and every
        string or list built by ``~``, ``+``, ``*``, ``%``, a filter or a method is charged as it happens."""

        intercepted_binops = frozenset({"*", "**", "%", "+"})

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.filters = {name: _bounded_filter(f) for name, f in self.filters.items()}
            self.budget_steps = _Steps
            self.budget_concat = _concat

        def _parse(self, source, name, filename):
            # loops iterate through _Steps and ``~`` joins through _concat (both reached as environment attributes,
            # which a template cannot shadow the way it can shadow a global name)
            tree = super()._parse(source, name, filename)
            for node in tree.find_all(jinja2.nodes.For):
                node.iter = jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute("budget_steps"), [node.iter], [],
                                              None, None, lineno=node.lineno)
            for node in tree.find_all(jinja2.nodes.Concat):
                node.nodes = [jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute("budget_concat"),
                                                [jinja2.nodes.List(node.nodes, lineno=node.lineno)], [], None, None,
                                                lineno=node.lineno)]
            return tree

        def call_binop(self, context, operator, left, right):
            big = MAX_TEMPLATE_CHARS

            def limit(seq) -> int:
                return MAX_TEMPLATE_CHARS if isinstance(seq, str) else MAX_TEMPLATE_ITEMS

            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > limit(seq):
                        raise SecurityError(f"a repetition of {n:,} × {len(seq):,} items is too big")
            elif operator == "+":
                if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) and \
                        len(left) + len(right) > limit(left):
                    raise SecurityError(f"a concatenation of {len(left) + len(right):,} items is too big")
            elif operator == "**":
                if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and \
                        right * math.log2(abs(left)) > 4096:
                    raise SecurityError(f"{left} ** {right} is too big")
            elif isinstance(left, str):  # printf-style formatting: widths and precisions, written or passed by *
                values = right if isinstance(right, tuple) else (right,)
                sizes = [int(n) for n in re.findall(r"%[-+ #0]*(\d*)(?:\.(\d*))?", left) for n in n if n]
                if any(n > big for n in sizes) or ("*" in left and _too_big_int(values) is not None):
                    raise SecurityError("a formatted width is too big")
            _spend()
            return _built(super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            if isinstance(getattr(__obj, "__self__", None), str) and \
                    _too_big_int((*args, *kwargs.values())) is not None:
                raise SecurityError(f"str.{getattr(__obj, '__name__', '?')} with a size over {MAX_TEMPLATE_CHARS:,}")
            _spend()
            return _built(super().call(__context, __obj, *args, **kwargs))

    def bounded_range(*args):
        r = range(*args)
        if len(r) > MAX_RANGE:
            raise SecurityError(f"range of {len(r):,} items (the sandbox allows {MAX_RANGE:,})")
        return r

    class BlockedUndefined(jinja2.Undefined):
        # what the sandbox returns for a blocked attribute (``''.__class__``) renders as an error, not as ""
        def __str__(self):
            if self._undefined_exception is SecurityError:
                self._fail_with_undefined_error()
            return super().__str__()

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols],
                  undefined=BlockedUndefined)
    env.globals["range"] = bounded_range
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)


def _plain(value):
    """JSON-like copy of template inputs (the sandbox should only ever see plain data, and callers' messages must not
    be modified); ``None`` values inside messages are dropped as transformers drops them."""
    if value is None or type(value) in (str, int, float, bool):
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
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _normalize_messages(messages: Sequence[Mapping]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TokenizerError(f"chat message {i} must be a dict with 'role' and 'content', got {type(m).__name__}")
        m = {k: _plain(v) for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# streaming detokenizer
# ---------------------------------------------------------------------------------------------------------------------
class StreamDecoder:
    """Turns token ids pushed one at a time into text pieces whose concatenation is ``decode(all ids)``.

    Byte-level BPE splits multi-byte characters across tokens, so a token alone may decode to U+FFFD; such text is held
    back until a later token completes the character. Only a short window of recent tokens is re-decoded per push
    (the window starts where the last emitted text ended, so decoders that treat the first token specially — a
    leading-space strip — act on both the old and the new decode alike and cancel out).
    """

    def __init__(self, tokenizer: "Tokenizer", *, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens whose text has been emitted

    def push(self, token_id: int) -> str:
        """Add one token; returns the text it completes ('' while a character is still incomplete)."""
        self.ids.append(int(token_id))
        return self._advance(final=False)

    def extend(self, token_ids: Iterable[int]) -> str:
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end decodes to U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        prefix_text = self._tok.decode(self.ids[self._prefix:self._read], skip_special_tokens=self._skip)
        text = self._tok.decode(self.ids[self._prefix:], skip_special_tokens=self._skip)
        if not final and (len(text) <= len(prefix_text) or text.endswith("\ufffd")):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(prefix_text):]


# ---------------------------------------------------------------------------------------------------------------------
# the tokenizer
# ---------------------------------------------------------------------------------------------------------------------
def _read_json(folder: str, name: str) -> dict | None:
    """``folder/name`` as a JSON object (None when absent), confined to the folder and bounded (qjax.validation)."""
    path = confined(folder, name, what=folder, error=TokenizerError)
    if not os.path.lexists(path):
        return None
    return read_json(path, error=TokenizerError)


def _added_tokens(cfg: dict, where: str) -> list[tuple[str, Mapping]]:
    """``added_tokens_decoder`` as (id, spec) pairs in id order; malformed entries are a :class:`TokenizerError`."""
    raw = cfg.get("added_tokens_decoder") or {}
    if not isinstance(raw, Mapping):
        raise TokenizerError(f"{where}: added_tokens_decoder must be an object of id → token, got "
                             f"{type(raw).__name__}")
    for idx in raw:
        if not (isinstance(idx, str) and idx.isdigit()):
            raise TokenizerError(f"{where}: added_tokens_decoder key {show(idx)} is not a token id")
    return sorted(raw.items(), key=lambda kv: int(kv[0]))


def _token_content(value) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class Tokenizer:
    """A checkpoint's tokenizer: ``tokenizers`` for the text ↔ id mapping, jinja2 for the chat template."""

    def __init__(self, backend, *, special_tokens: Mapping[str, str] | None = None,
                 chat_template: str | Mapping[str, str] | None = None, generation_eos_ids: Sequence[int] = (),
                 source: str = "<tokenizer>"):
        """``backend``: a ``tokenizers.Tokenizer``; ``special_tokens``: name → content (``eos_token``, …) as passed to
        the template; ``chat_template``: one template, or named templates (``default``, ``tool_use``, …)."""
        self.backend = backend
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self.source = source
        self._generation_eos = tuple(int(t) for t in generation_eos_ids)

    # ---- loading ----------------------------------------------------------------------------------------------------
    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> "Tokenizer":
        """Read a HF checkpoint folder's tokenizer files (see the module docstring)."""
        folder = os.fspath(path)
        if not os.path.isdir(folder):
            raise TokenizerError(f"{folder}: no such folder")
        tj = confined(folder, TOKENIZER_FILE, what=folder, error=TokenizerError)
        if not os.path.lexists(tj):
            raise TokenizerError(f"{folder}: no {TOKENIZER_FILE} (the fast-tokenizer file is needed to encode text)")
        # a regular file of at most MAX_TOKENIZER_BYTES, read before the tokenizers library parses it (it holds
        # several times the file while it does)
        data = read_regular(tj, what=TOKENIZER_FILE, max_bytes=MAX_TOKENIZER_BYTES, error=TokenizerError)
        try:
            backend = Backend.from_buffer(data)
        except Exception as e:  # the tokenizers library raises a bare Exception on malformed files
            raise TokenizerError(f"{tj}: cannot load ({e})") from None

        cfg_path = os.path.join(folder, CONFIG_FILE)
        cfg = _read_json(folder, CONFIG_FILE) or {}
        # tokens transformers adds from the config when tokenizer.json lacks them
        missing = []
        for idx, spec in _added_tokens(cfg, cfg_path):
            f = Fields(spec, f"{cfg_path}: added_tokens_decoder[{idx!r}]", TokenizerError)
            content = f.str("content")
            special = f.bool("special", False)
            if backend.token_to_id(content) is None:
                missing.append(AddedToken(content, single_word=f.bool("single_word", False),
                                          lstrip=f.bool("lstrip", False), rstrip=f.bool("rstrip", False),
                                          normalized=f.bool("normalized", not special), special=special))
        if missing:
            backend.add_tokens(missing)

        # the template variables of transformers' special_tokens_map: the named tokens, model-specific ``*_token`` keys
        # (image_token, …) and the entries of a dict-valued extra_special_tokens
        special = {k: _token_content(v) for k, v in cfg.items() if k in SPECIAL_TOKEN_ATTRS or k.endswith("_token")}
        extra = cfg.get("extra_special_tokens")
        if isinstance(extra, Mapping):
            special.update({k: _token_content(v) for k, v in extra.items()})
        special = {k: v for k, v in special.items() if v is not None}

        templates: dict[str, str] = {}
        raw = cfg.get("chat_template")
        if isinstance(raw, str):
            templates["default"] = raw
        elif isinstance(raw, list):  # older configs: [{"name": ..., "template": ...}]
            for i, entry in enumerate(raw):
                f = Fields(entry, f"{cfg_path}: chat_template[{i}]", TokenizerError)
                templates[f.str("name")] = f.str("template")
        elif raw is not None:
            raise TokenizerError(f"{os.path.join(folder, CONFIG_FILE)}: chat_template must be a string or a list of "
                                 f"{{name, template}}, got {type(raw).__name__}")
        files = {}
        if os.path.lexists(os.path.join(folder, TEMPLATE_FILE)):
            files["default"] = TEMPLATE_FILE
        tdir = confined(folder, TEMPLATE_DIR, what=folder, error=TokenizerError)
        if os.path.isdir(tdir):
            files.update({n[:-len(".jinja")]: os.path.join(TEMPLATE_DIR, n) for n in sorted(os.listdir(tdir))
                          if n.endswith(".jinja")})
        if files:  # template files replace the config's templates (transformers 5)
            templates = {}
            for name, rel in files.items():
                p = confined(folder, rel, what=folder, error=TokenizerError)
                data = read_regular(p, what="a chat template", max_bytes=MAX_TEMPLATE_CHARS, error=TokenizerError)
                try:
                    templates[name] = data.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise TokenizerError(f"{p}: the chat template is not UTF-8 text (byte {e.start})") from None
        chat_template = templates.get("default") if set(templates) <= {"default"} else templates

        gen = _read_json(folder, GENERATION_CONFIG_FILE) or {}
        eos = Fields(gen, os.path.join(folder, GENERATION_CONFIG_FILE), TokenizerError).int_list(
            "eos_token_id", [], min=0, max=MAX_TOKEN_ID, scalar=True)
        return cls(backend, special_tokens=special, chat_template=chat_template or None, generation_eos_ids=eos,
                   source=folder)

    # ---- ids ↔ text -------------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) become their ids. Long texts
        go through the library's batch call, which releases Python's GIL while it works (its single-text call holds
        it: a server thread tokenizing megabytes would stop every other thread, the event loop included)."""
        if len(text) < _GIL_FREE_CHARS:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if len(ids) < _GIL_FREE_CHARS // 4:
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for: the longest vocabulary entry (a byte-level BPE entry is one
        character per byte, so this bounds the characters, and the bytes, of a token's text). A text of ``n``
        characters is at least ``n / max_token_chars`` tokens: a server refuses a prompt too long for its context
        from its length alone, before tokenizing it."""
        return max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)

    def stream_decoder(self, *, skip_special_tokens: bool = False) -> StreamDecoder:
        """A fresh incremental detokenizer (see :class:`StreamDecoder`)."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Entries of the vocabulary including added tokens (a model's embedding may have more rows: padding)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def _special_id(self, name: str) -> int | None:
        content = self.special_tokens.get(name)
        return None if content is None else self.token_to_id(content)

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def stop_token_ids(self) -> list[int]:
        """Ids that end an answer: generation_config's eos ids, the tokenizer's eos, and ChatML's ``<|im_end|>`` and
        ``<|endoftext|>`` when the vocabulary has them (in that order, without repeats)."""
        ids = list(self._generation_eos)
        ids.append(self.eos_token_id)
        ids.extend(self.token_to_id(t) for t in CHATML_STOP_TOKENS)
        return list(dict.fromkeys(i for i in ids if i is not None))

    # ---- chat -------------------------------------------------------------------------------------------------------
    def get_chat_template(self, chat_template: str | None = None, tools=None) -> str:
        """The template source to render: a named one, the folder's (``tool_use`` when tools are given and it exists),
        or the ChatML fallback when the folder has none."""
        own = self.chat_template
        if isinstance(own, Mapping):
            if chat_template is not None:
                return own.get(chat_template, chat_template)
            if tools is not None and "tool_use" in own:
                return own["tool_use"]
            if "default" in own:
                return own["default"]
            raise TokenizerError(f"{self.source}: several chat templates ({', '.join(sorted(own))}) and no 'default'; "
                                 "name one")
        if chat_template is not None:
            return chat_template
        return own if own is not None else CHATML_FALLBACK_TEMPLATE

    def apply_chat_template(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = True,
                            enable_thinking: bool | None = None, tools=None, chat_template: str | None = None,
                            **kwargs) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) to the prompt text, as transformers'
        ``apply_chat_template(..., tokenize=False)`` does.

        ``enable_thinking`` is passed to the template only when set (templates test ``enable_thinking is defined``);
        other keyword arguments reach the template as variables, next to the special tokens (``eos_token``, …).
        ``tools`` are JSON-schema dicts (transformers also converts Python functions; qjax does not).
        """
        if isinstance(messages, Mapping) or not isinstance(messages, Sequence) or not messages:
            raise TokenizerError("apply_chat_template needs a non-empty list of messages")
        source = self.get_chat_template(chat_template, tools)
        if not isinstance(source, str):
            raise TokenizerError(f"{self.source}: the chat template is {type(source).__name__}, not text")
        try:
            template = _compile_template(source)
        except jinja2.TemplateSyntaxError as e:
            raise TokenizerError(f"{self.source}: chat template does not parse (line {e.lineno}: {e.message})") \
                from None
        except Exception as e:  # noqa: BLE001 (anything a hostile template does to the compiler is its fault)
            raise TokenizerError(f"{self.source}: chat template does not compile ({type(e).__name__}: {e})") from None
        variables = dict(self.special_tokens)
        if source == CHATML_FALLBACK_TEMPLATE:
            variables["qjax_think_tags"] = (self.token_to_id("<think>") is not None
                                            and self.token_to_id("</think>") is not None)
        if enable_thinking is not None:
            variables["enable_thinking"] = bool(enable_thinking)
        own = {"messages", "tools", "documents", "add_generation_prompt", "chat_template", "enable_thinking"}
        clash = sorted(own & set(kwargs))
        if clash:  # transformers' render would fail with a TypeError; name the argument instead
            raise TokenizerError(f"template variable {clash[0]!r} is an argument of apply_chat_template itself; "
                                 "pass it as that argument")
        variables.update(_plain(kwargs))
        context = {**variables, "messages": _normalize_messages(messages), "tools": _plain(tools), "documents": None,
                   "add_generation_prompt": add_generation_prompt}
        _render.budget = _Budget(deadline=time.monotonic() + MAX_TEMPLATE_SECONDS)
        try:
            pieces, size = [], 0
            for piece in template.generate(**context):  # streamed, so size and time are checked as it goes
                size += len(piece)
                if size > MAX_TEMPLATE_CHARS:
                    raise TokenizerError(f"{self.source}: chat template wrote more than {MAX_TEMPLATE_CHARS:,} "
                                         "characters; refused")
                _spend(0)
                pieces.append(piece)
            return "".join(pieces)
        except TokenizerError:
            raise
        except jinja2.TemplateError as e:  # raise_exception(...) of the template, a sandbox refusal, …
            raise TokenizerError(f"{self.source}: chat template: {e}") from None
        except Exception as e:  # noqa: BLE001 (RecursionError, TypeError of a bad include, …)
            raise TokenizerError(f"{self.source}: chat template failed ({type(e).__name__}: {e})") from None
        finally:
            _render.budget = None
