"""Incremental detokenization and stop strings.

Decoding one token at a time is wrong for byte-level BPE: a multi-byte character (é, 中, an emoji)
can span tokens, and decoding a token alone yields U+FFFD. We decode a short window of recent
tokens and emit only the text past what was already emitted, holding back while the window ends
in an incomplete character (with a byte-level decoder, bytes that can no longer complete one, as
U+FFFD, are released after four tokens). Stop strings are searched in the newly produced text plus enough of
the old to catch a stop string that straddles two deltas (and in the text before a held-back
incomplete character, so the request stops at the token that completes the stop string); the text is
cut before the stop string.
While stop strings are set, the last (longest stop - 1) characters are held back: they might be the
start of a stop string, and text once emitted (streamed) cannot be taken back. `flush` releases them
when the request ends for another reason. With min_tokens m, a stop string counts only where it ends
past the text of the first m output tokens, as vLLM matches it: EOS and stop_token_ids are masked
until m tokens are out, so the text holds at least m tokens' worth either way (min_tokens=1 with
stop ["\n"] gave an empty reply when the first token was a newline). The text before is held back
the same way, so a stop string that starts in it and ends in token m + 1 is found.
"""

import os.path
import weakref

REPLACEMENT = "\ufffd"

_FACTS = weakref.WeakKeyDictionary()     # tokenizer -> _tokenizer_facts(tokenizer)


def _tokenizer_facts(tokenizer) -> tuple[frozenset, bool]:
    """Once per tokenizer: the ids that decode(skip_special_tokens=True) leaves out (the added tokens
    marked special, found by decoding each special or added token both ways), and whether its
    decoder is byte-level (the bytes of all tokens joined, then decoded lossily: Qwen's)."""
    facts = _FACTS.get(tokenizer)
    if facts is None:
        candidates = set(getattr(tokenizer, "all_special_ids", ())) | set(getattr(tokenizer, "added_tokens_decoder", {}))
        skipped = frozenset(i for i in candidates if tokenizer.decode([i], skip_special_tokens=True) == ""
                            and tokenizer.decode([i], skip_special_tokens=False) != "")
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        facts = _FACTS[tokenizer] = (skipped, type(decoder).__name__ == "ByteLevel")
    return facts


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] | None = None,
                 skip_special_tokens: bool = True, min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens
        self.skip_special_tokens = skip_special_tokens
        skipped, self.byte_level = _tokenizer_facts(tokenizer)
        self.skipped = skipped if skip_special_tokens else frozenset()
        self.stop = [s for s in (stop or []) if s]
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.tokens: list[int] = []
        # Start the window a few prompt tokens back, so the first output token decodes in context
        # (leading-space handling of some tokenizers depends on the previous token).
        self.context = list(prompt_token_ids[-4:])
        # A prompt ending inside a character (token-id prompts): the output's first bytes would
        # complete it, and the offsets below would drop that character from the text. The output's
        # text is its own tokens' decoding (leading continuation bytes are U+FFFD), so the window
        # starts after the incomplete character.
        while self.context and self._decode(self.context).endswith(REPLACEMENT):
            self.context.pop()
        self.prefix_offset = 0
        self.read_offset = len(self.context)
        self.text = ""          # emitted so far
        self.held = ""          # decoded but held back: might start a stop string
        self.stopped_by: str | None = None
        # len(context) when output token min_tokens + 1 came: the context tokens before it are
        # those whose text no stop string may end in (see _early).
        self._min_context: int | None = None if min_tokens > 0 else 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token: int) -> str:
        """Append one token; returns the new text it completes ('' while a character is split)."""
        self.tokens.append(token)
        if self._min_context is None and len(self.tokens) == self.min_tokens + 1:
            self._min_context = len(self.context)
        if token in self.skipped:
            # decode() leaves it out, so the window may too. Kept, it grew the window without
            # text: each token of a run of <|endoftext|> (ignore_eos) decoded the whole run.
            return ""
        self.context.append(token)
        prefix = self._decode(self.context[self.prefix_offset:self.read_offset])
        full = self._decode(self.context[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            if self.byte_level and len(self.context) - self.read_offset >= 4:
                # Four tokens and still incomplete: no character is split that far, so bytes that
                # can never complete one (' \xe2' repeated) keep the window open, and every token
                # decoded all of it, quadratic, streaming nothing. With a byte-level decoder, text
                # before a boundary that decodes the same split or joined is final: emit it. (The
                # last token must have bytes: an id past the vocabulary decodes to nothing, and a
                # character could still complete across it.)
                head = self._decode(self.context[self.prefix_offset:-1])
                tail = self._decode(self.context[-1:])
                if tail and head + tail == full and len(head) >= len(prefix):
                    early = self._early(prefix, full)
                    self.prefix_offset, self.read_offset = self.read_offset, len(self.context) - 1
                    out = self._append_text(head[len(prefix):], early)
                    if self.stop and self.stopped_by is None:
                        out += self._stop_before_incomplete(tail)
                    return out
            if self.stop and len(full) > len(prefix):
                return self._stop_before_incomplete(full[len(prefix):], self._early(prefix, full))
            return ""
        delta = full[len(prefix):]
        early = self._early(prefix, full)
        self.prefix_offset, self.read_offset = self.read_offset, len(self.context)
        return self._append_text(delta, early)

    def _early(self, prefix: str, full: str) -> int:
        """How much of the new text (full past prefix) is the final text of the first min_tokens
        tokens: no stop string may end in it. The window can still hold such tokens when
        one of them started a multi-byte character (' \\xe2\\x88'): its complete text (' ') was
        held with the character and reaches the stop search in a later token's delta."""
        if not self.stop or self._min_context is None or self.read_offset >= self._min_context:
            return 0
        alone = self._decode(self.context[self.prefix_offset:self._min_context]).rstrip(REPLACEMENT)
        return max(0, len(os.path.commonprefix([alone, full])) - len(prefix))

    def _stop_before_incomplete(self, delta: str, early: int = 0) -> str:
        """A token can complete a stop string and start a character (' \\xc3', 'r\\xc3' are tokens):
        the text before the incomplete character is final, so a stop string in it stops the request
        at this token, not at the one that completes the character (or never, at max_tokens)."""
        complete = delta.rstrip(REPLACEMENT)
        # The search _append_text makes: a stop string wholly inside the held-back text (one in
        # the first min_tokens tokens) is no stop. Asked "is one anywhere in it", this appended the
        # complete part without moving the offsets, and the next token decoded it again (' val  ').
        if complete and len(self.tokens) > self.min_tokens and self._stops_in(self.held + complete, early):
            return self._append_text(complete, early)
        return ""

    def _stops_in(self, pending: str, early: int = 0) -> list[tuple[int, str]]:
        """(position, stop string) of each stop string that ends past the held-back text in `pending`
        (held + new text). One inside the held-back text ended before (it was searched then, or came
        in the first min_tokens tokens, where none counts). No stop string can start inside emitted
        text, since what is held back covers the longest stop string but one character; one that
        started in the held-back text of the first min_tokens tokens and ends in the next counts (it
        was emitted before, and missed). `early`: that many characters after the held-back text are
        the text of the first min_tokens tokens (_early), where no stop string may end either."""
        end = len(self.held) + early
        return [(i, s) for s in self.stop if (i := pending.find(s, max(0, end - len(s) + 1))) >= 0]

    def _append_text(self, delta: str, early: int = 0) -> str:
        if not self.stop:
            delta, self.held = self.held + delta, ""
            self.text += delta
            return delta
        pending = self.held + delta
        cut = -1
        if len(self.tokens) > self.min_tokens:
            found = self._stops_in(pending, early)     # only a stop string that ends in this delta
            if found:
                cut, self.stopped_by = min(found, key=lambda f: f[0])
        if cut >= 0:
            emitted = pending[:cut]
            self.held = ""
        else:
            keep = min(len(pending), self.max_stop_len - 1)
            emitted, self.held = pending[:len(pending) - keep], pending[len(pending) - keep:]
        self.text += emitted
        return emitted

    def flush(self) -> str:
        """At the end, emit whatever is held back (an incomplete character decodes as U+FFFD)."""
        out = ""
        if self.read_offset < len(self.context) and self.stopped_by is None:
            prefix = self._decode(self.context[self.prefix_offset:self.read_offset])
            full = self._decode(self.context[self.prefix_offset:])
            if len(full) > len(prefix):
                early = self._early(prefix, full)
                self.read_offset = len(self.context)
                out = self._append_text(full[len(prefix):], early)
        if self.stopped_by is None and self.held:
            out += self.held
            self.text += self.held
            self.held = ""
        return out
