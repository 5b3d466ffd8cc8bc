"""Shared pieces of the long-context workload tests: a byte-level tokenizer (with an optional
ChatML template) and a short filler text."""

from __future__ import annotations

TEXT = ("The quick brown fox jumps over the lazy dog. " * 3 + "Rivers run to the sea. Mountains stand still.\n\n") * 40


class ByteTokenizer:
    """Bytes as ids (0-255), BOS 256, EOS 257; ``chatml`` adds a ChatML template."""

    bos_token_id, eos_token_id = 256, 257
    eos_token_ids = {257}

    def __init__(self, chatml: bool = False):
        self.has_chat_template = chatml

    def encode(self, text, add_special_tokens=True):
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def get_vocab(self):
        return {**{bytes([i]).decode("latin-1"): i for i in range(256)}, "<s>": 256, "</s>": 257}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        out = "<|im_start|>system\nBe brief.<|im_end|>\n" + "".join(
            f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def text_source(tmp_path_factory):
    from kvcompress.bench.longctx_text import TextSource

    d = tmp_path_factory.mktemp("text")
    (d / "a.txt").write_text(TEXT)
    (d / "sub").mkdir()
    (d / "sub" / "b.txt").write_text(TEXT.replace("fox", "cat"))
    return TextSource.from_dir(d)
