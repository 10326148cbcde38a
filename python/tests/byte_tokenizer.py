"""A byte-level tokenizer for the tests that run kvpress's pipeline on tiny random models."""

import transformers


class ByteTokenizer(transformers.PreTrainedTokenizer):
    """A byte-level tokenizer (no files): the pipeline needs one, the hub is unreachable."""

    def __init__(self, **kw):
        super().__init__(eos_token="\x00", pad_token="\x00", bos_token="\x01", **kw)

    @property
    def vocab_size(self):
        return 256

    def get_vocab(self):
        return {chr(i): i for i in range(256)}

    def _tokenize(self, text):
        return list(text)

    def _convert_token_to_id(self, t):
        return ord(t) % 256

    def _convert_id_to_token(self, i):
        return chr(i)

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)

    def apply_chat_template(self, *a, **k):
        raise ValueError("no chat template")
