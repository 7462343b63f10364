"""Tokenizer and chat template from the GGUF, through llama-cpp-python (vocab-only load).

Only the root tokenizes; workers never import this module.
"""

from __future__ import annotations

import codecs
import contextlib
import os
from typing import Iterable

from .errors import DllamaError, ModelError


@contextlib.contextmanager
def _quiet_stderr():
    """llama.cpp prints its load log on fd 2; keep a user's terminal clean."""
    fd = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(fd, 2)
        os.close(fd)


class Tokenizer:
    def __init__(self, model_path: str, chat_template: str | None, bos_id: int | None, eos_id: int | None):
        try:
            from llama_cpp import Llama
        except ImportError:
            raise DllamaError("the root needs llama-cpp-python: pip install 'dllama[root]'") from None
        try:
            with _quiet_stderr():
                self._llama = Llama(model_path=model_path, vocab_only=True, verbose=False)
        except Exception as e:
            raise ModelError(f"cannot load the tokenizer of {model_path}: {e}") from None
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = bool(self._llama._model.add_bos_token()) if hasattr(self._llama._model, "add_bos_token") \
            else bos_id is not None
        self.vocab_size = self._llama.n_vocab()
        self._pieces: dict[int, bytes] = {}  # what libllama answered, per token (see piece_bytes)
        self._eog: dict[int, bool] = {}
        self._template = None
        if chat_template:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            self._template = Jinja2ChatFormatter(
                template=chat_template,
                eos_token=self.piece(eos_id) if eos_id is not None else "",
                bos_token=self.piece(bos_id) if bos_id is not None else "",
            )

    # ------------------------------------------------------------------ text <-> ids

    def encode(self, text: str, add_bos: bool | None = None, special: bool = False) -> list[int]:
        """Token ids of text. BOS is added when the GGUF asks for it (or as add_bos says);
        special=True parses control tokens such as <|im_start|> (used for templated chat)."""
        bos = self.add_bos if add_bos is None else add_bos
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate: bytes that were not UTF-8 (argv, stdin)
            char = text[e.start]
            what = f"byte 0x{ord(char) - 0xDC00:02x}" if 0xDC80 <= ord(char) <= 0xDCFF else f"U+{ord(char):04X}"
            raise DllamaError(f"the text is not valid UTF-8 (it holds {what})") from None
        return self._llama.tokenize(data, add_bos=bos, special=special)

    def piece(self, token: int) -> str:
        return self.piece_bytes(token).decode("utf-8", errors="replace")

    def piece_bytes(self, token: int) -> bytes:
        # each generated token asks (a server's event loop, for every stream): a dictionary's
        # lookup, not a call into libllama, whose code and tables a forward step has evicted
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._llama.detokenize([token], special=True)
        return piece

    def decode(self, tokens: Iterable[int]) -> str:
        return self._llama.detokenize(list(tokens)).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        """End of generation: EOS or any token the vocabulary marks as end-of-generation (<|im_end|>)."""
        eog = self._eog.get(token)
        if eog is None:
            eog = self._eog[token] = self._ask_eog(token)
        return eog

    def _ask_eog(self, token: int) -> bool:
        if token == self.eos_id:
            return True
        vocab = self._llama._model.vocab if hasattr(self._llama._model, "vocab") else None
        if vocab is not None:
            from llama_cpp import llama_cpp as lib

            return bool(lib.llama_vocab_is_eog(vocab, token))
        return False

    # ------------------------------------------------------------------ chat

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The prompt for the assistant's next turn (the formatter adds the generation prompt)."""
        if self._template is None:
            raise ModelError("this model has no chat template")
        try:
            return self._template(messages=messages).prompt
        except Exception as e:  # jinja2's TemplateError, or the template's own raise_exception()
            raise ModelError(f"the model's chat template rejected the messages: {e}") from None

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """The token ids of that prompt: its control tokens (<|im_start|>) parsed, no BOS added (a
        template that wants one writes it)."""
        return self.encode(self.apply_chat_template(messages), add_bos=False, special=True)


class StreamDecoder:
    """Turns generated tokens into text as they come, never splitting a multi-byte UTF-8
    character that spans token pieces."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        return self._utf8.decode(self._tokenizer.piece_bytes(token))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
