"""The tokenizer: a thin wrapper over a Hugging Face tokenizer with the few
calls the engine makes, loaded from a HF directory or a GGUF file."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pipeserve.chat_options import check_chat_options
from pipeserve.config import cache_root
from pipeserve.model.loader.gguf import open_gguf
from pipeserve.model.loader.resolve import ModelSource

log = logging.getLogger(__name__)


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, extra_eos_ids: tuple[int, ...] = ()) -> None:
        self._tok = hf_tokenizer
        eos = [] if hf_tokenizer.eos_token_id is None else [int(hf_tokenizer.eos_token_id)]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos + [int(i) for i in extra_eos_ids]))
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.all_special_ids: list[int] = list(hf_tokenizer.all_special_ids)
        self.vocab_size: int = len(hf_tokenizer)
        self._direct_decode = _direct_decoder(hf_tokenizer)

    @property
    def hf_tokenizer(self) -> Any:
        """The wrapped Hugging Face tokenizer (grammar engines build their token tables from it)."""
        return self._tok

    @property
    def chat_template(self) -> str | None:
        return self._tok.chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """``ids``: a list of ints (the detokenizer's windows, twice per generated token)."""
        if self._direct_decode is not None:
            return self._direct_decode(ids, skip_special_tokens=skip_special_tokens)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
        return self._tok.convert_ids_to_tokens(ids, skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self._tok.convert_tokens_to_string(tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, continue_final_message: bool = False,
                            chat_template_kwargs: dict[str, Any] | None = None,
                            chat_template: str | None = None) -> list[int]:
        """The conversation's ids through the model's template (or ``chat_template``), as vLLM
        renders them: ``continue_final_message`` leaves the last (assistant) message open for
        the model to go on with, instead of a new turn; ``chat_template_kwargs`` are the
        template's own variables (Qwen3's ``enable_thinking``, for one). Bad combinations
        raise ValueError."""
        if not (chat_template or self._tok.chat_template):
            raise ValueError("this model has no chat template; send a plain prompt (completions) instead "
                             "of chat messages, or give one (--chat-template)")
        check_chat_options(messages, add_generation_prompt, continue_final_message, chat_template_kwargs)
        # Render to text, then encode without adding BOS again: the template
        # already writes every special token it wants.
        text = self._tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, tokenize=False,
                                             **({"tools": tools} if tools else {}),
                                             **({"chat_template": chat_template} if chat_template else {}),
                                             **(chat_template_kwargs or {}))
        return self.encode(text, add_special_tokens=False)


def _direct_decoder(hf_tokenizer: Any):
    """The Rust tokenizer's own ``decode`` where the Hugging Face wrapper adds nothing to
    it: a fast tokenizer whose class decodes as the library's fast base class does and
    that does not clean up spaces afterwards. The wrapper's input conversion and
    dispatch cost about 4x the decode itself, paid twice per generated token on the
    driver. None where it adds something (the wrapper's ``decode`` is then used)."""
    from transformers import PreTrainedTokenizerFast  # heavy import, only where a tokenizer is built

    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    cls = type(hf_tokenizer)
    if (backend is None or not isinstance(hf_tokenizer, PreTrainedTokenizerFast)
            or getattr(hf_tokenizer, "clean_up_tokenization_spaces", True)
            or cls.decode is not PreTrainedTokenizerFast.decode or cls._decode is not PreTrainedTokenizerFast._decode):
        return None
    return backend.decode


def load_tokenizer(source: ModelSource, extra_eos_ids: tuple[int, ...] = ()) -> Tokenizer:
    """``extra_eos_ids``: the model config's end-of-sequence ids, merged with the tokenizer's."""
    from transformers import AutoTokenizer  # heavy import, only where a tokenizer is built

    if source.kind == "hf":
        return Tokenizer(AutoTokenizer.from_pretrained(str(source.path)), extra_eos_ids)
    return Tokenizer(_gguf_tokenizer(source), extra_eos_ids)


def _gguf_tokenizer(source: ModelSource) -> Any:
    """A GGUF's tokenizer as transformers converts it (its vocabulary and merges into a fast
    tokenizer: ~9 s for SmolLM2's 49k tokens, paid by every engine start), with the file's
    chat template. The conversion is saved once per file version and transformers release
    under the cache directory and loaded from there afterwards (~0.5 s); the saved form
    round-trips exactly (encode, decode, special tokens, template). A cache that cannot
    be read or written only costs the conversion."""
    import transformers
    from transformers import AutoTokenizer

    path = source.path.resolve()
    stat = path.stat()
    key = hashlib.sha256("\0".join([str(path), str(stat.st_mtime_ns), str(stat.st_size),
                                    transformers.__version__]).encode()).hexdigest()[:16]
    saved = cache_root() / "tokenizers" / f"{path.stem}-{key}"
    if (saved / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(saved))
        except (OSError, ValueError) as exc:
            log.warning("cached tokenizer %s unreadable (%s); converting the GGUF's again", saved, exc)
            shutil.rmtree(saved, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(str(source.directory), gguf_file=source.gguf_file)
    template = _gguf_chat_template(source)
    if template:  # the GGUF metadata is the model's own template
        tok.chat_template = template
    staging = None
    try:   # written aside, then renamed into place: another process may convert at once
        saved.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=saved.parent))
        tok.save_pretrained(str(staging))
        os.replace(staging, saved)
    except OSError as exc:   # unwritable, or another process's copy is in place already
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        log.info("tokenizer conversion not cached (%s)", exc)
    return tok


def _gguf_chat_template(source: ModelSource) -> str | None:
    field = open_gguf(source.path).get_field("tokenizer.chat_template")
    return None if field is None else str(field.contents())
