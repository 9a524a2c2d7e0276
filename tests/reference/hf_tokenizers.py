"""Reference encodings of Hugging Face `tokenizers` (the Rust library) for specdec's HfTokenizer.

For each tokenizer.json named on the command line, encodes a corpus of texts and writes what the
library gives: ids without and with special tokens, and the decoded text of the ids with and
without skipping special tokens. The corpus is the fixture texts of tests/data plus generated
strings (seeded, so the file is the same on every run): random characters across scripts, runs of
whitespace, emoji sequences, digits, code, special-token look-alikes and mixtures of these.

Usage: python hf_tokenizers.py FIXTURES.json OUT.json NAME=PATH/tokenizer.json [NAME=PATH ...]
"""
import json
import random
import sys

import tokenizers
from tokenizers import Tokenizer

GENERATED = 2400  # generated strings, beside the fixture texts

# Code point ranges of several scripts (no surrogates).
SCRIPTS = [
    (0x0020, 0x007E),  # ASCII
    (0x00A0, 0x024F),  # Latin-1 supplement, Latin extended
    (0x0370, 0x03FF),  # Greek
    (0x0400, 0x04FF),  # Cyrillic
    (0x0590, 0x05FF),  # Hebrew
    (0x0600, 0x06FF),  # Arabic
    (0x0900, 0x097F),  # Devanagari
    (0x0E00, 0x0E7F),  # Thai
    (0x1100, 0x11FF),  # Hangul jamo
    (0x3040, 0x30FF),  # Hiragana, Katakana
    (0x4E00, 0x9FFF),  # CJK
    (0xAC00, 0xD7A3),  # Hangul syllables
    (0x0300, 0x036F),  # combining marks
    (0x2000, 0x206F),  # general punctuation (zero-width joiner and friends)
    (0xFF00, 0xFFEF),  # full-width forms
    (0x1D400, 0x1D7FF),  # mathematical alphanumerics
]
WHITESPACE = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000", "\u2009", "\x0b", "\x0c"]
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷", "🇯🇵", "❤️", "🧑🏿‍💻", "✈️", "🤖", "🫠", "1️⃣", "👋🏻"]
CODE = ["def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) {", "    if (a && b) { return -1; }",
        "x = [1, 2, 3]  # list", "SELECT * FROM t WHERE id = 42;", "fn main() -> Result<(), Box<dyn Error>>",
        "<div class=\"a\">&nbsp;</div>", "$ ls -la | grep '.txt'", "λx.x", "i++; j--; k <<= 2;",
        "{\"key\": [true, null, 1.5e-3]}", "#include <vector>\n", "\\n\\t\\\\", "a_b-c.d/e:f"]
SPECIAL_LOOKALIKES = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|im_start|>",
                      "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<unk>", "<|begin_of_text", "|>", "<|", "< s>",
                      "<S>", "</s >", "<|im_start|>user\n", "<think>", "</think>", "[INST]", "<<SYS>>",
                      "<|reserved_special_token_5|>", "<|fim_prefix|>"]
WORDS = ["the", "The", " the", "hello", "world", "don't", "I'm", "we've", "café", "naïve", "Straße", "ﬁne",
         "résumé", "日本語", "中文", "русский", "ελληνικά", "عربي", "हिन्दी", "ไทย", "한국어", "ok", "OK", "A", "a"]


def random_text(rng):
    pieces = []
    for _ in range(rng.randint(1, 12)):
        kind = rng.random()
        if kind < 0.25:
            low, high = rng.choice(SCRIPTS)
            pieces.append("".join(chr(rng.randint(low, high)) for _ in range(rng.randint(1, 8))))
        elif kind < 0.40:
            pieces.append(rng.choice(WHITESPACE) * rng.randint(1, 3))
        elif kind < 0.50:
            pieces.append("".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 4))))
        elif kind < 0.60:
            pieces.append("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 14))))
        elif kind < 0.70:
            pieces.append(rng.choice(CODE))
        elif kind < 0.80:
            pieces.append(rng.choice(SPECIAL_LOOKALIKES))
        elif kind < 0.97:
            pieces.append(rng.choice(WORDS))
        else:
            pieces.append(chr(rng.randint(1, 31)))  # control characters
    joiner = rng.choice(["", " ", "", "\n"])
    return joiner.join(pieces)


def corpus(fixtures):
    rng = random.Random(20261125)
    texts = list(fixtures)
    texts += [random_text(rng) for _ in range(GENERATED)]
    return texts


def main(fixtures_path, out_path, named):
    with open(fixtures_path, encoding="utf-8") as f:
        texts = corpus(json.load(f)["texts"])
    result = {"generator": f"tokenizers {tokenizers.__version__}", "texts": texts, "tokenizers": {}}
    for name, path in named:
        tokenizer = Tokenizer.from_file(path)
        rows = []
        for text in texts:
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            rows.append({"ids": ids,
                         "ids_with_special_tokens": tokenizer.encode(text, add_special_tokens=True).ids,
                         "decoded": tokenizer.decode(ids, skip_special_tokens=False),
                         "decoded_skipping_special": tokenizer.decode(ids, skip_special_tokens=True)})
        result["tokenizers"][name] = rows
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f, ensure_ascii=False)
    print(f"hf_tokenizers: {len(texts)} texts x {len(named)} tokenizers written to {out_path} "
          f"(tokenizers {tokenizers.__version__})")


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit("usage: hf_tokenizers.py FIXTURES.json OUT.json NAME=PATH [NAME=PATH ...]")
    pairs = [argument.split("=", 1) for argument in sys.argv[3:]]
    main(sys.argv[1], sys.argv[2], pairs)
