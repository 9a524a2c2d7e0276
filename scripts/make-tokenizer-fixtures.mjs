// Writes tests/data/hf_tokenizer_fixtures.json: for each real tokenizer.json in ../shared/tokenizers
// (laid out as <name>/package/models/tokenizer.json) and each text below, the ids @lenml/tokenizers (a JavaScript port of
// the Hugging Face tokenizers) encodes it to, with and without the post-processor's special tokens,
// and the text it decodes those ids back to. The C++ tests compare io::HfTokenizer with them.
//   node scripts/make-tokenizer-fixtures.mjs [tokenizers folder, default ../shared/tokenizers]
import { createRequire } from "node:module";
import { readFileSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const cache = process.argv[2] ?? process.env.SPECDEC_TOKENIZERS_DIR ?? join(root, "../shared/tokenizers");
const require = createRequire(import.meta.url);
const { TokenizerLoader } = require(join(cache, "tokenizers/package/dist/main.js"));

const texts = [
  "",
  "Hello, world! How's it going?",
  "I'm sure they'll've said DON'T and We'RE done.",
  'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n',
  "for (int i = 0; i < 10; ++i) { sum += a[i] * 0x1F; }  // 12345678",
  "我爱自然语言处理。東京は日本の首都です。한국어 텍스트",
  "Ünïcödé: Привет, мир! ελληνικά عربى हिन्दी",
  "e\u0301cole cafe\u0301 — NFD accents",
  "Emoji: 🤖🚀👍🏽 and a family 👨‍👩‍👧 !!",
  "  leading spaces,\ttabs\t\tand\r\nCRLF  \n\n\n trailing   ",
  " ",
  "\n",
  "Numbers 1234567 3.14159 1e-10 and 2024-11-23",
  "<s>Hello</s> world <unk>",
  "<|begin_of_text|>Hello<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi",
  "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>x</think>",
];

const fixtures = { generator: "@lenml/tokenizers " + require(join(cache, "tokenizers/package/package.json")).version, texts, tokenizers: {} };
for (const name of ["llama3", "qwen3", "llama2"]) {
  const models = join(cache, `tokenizer-${name}/package/models`);
  const tokenizer = TokenizerLoader.fromPreTrained({
    tokenizerJSON: JSON.parse(readFileSync(join(models, "tokenizer.json"), "utf8")),
    tokenizerConfig: JSON.parse(readFileSync(join(models, "tokenizer_config.json"), "utf8")),
  });
  fixtures.tokenizers[name] = texts.map((text) => {
    const ids = tokenizer.encode(text, { add_special_tokens: false });
    const decode = (skip) =>
      ids.length === 0 ? "" : tokenizer.decode(ids, { skip_special_tokens: skip, clean_up_tokenization_spaces: false });
    return {
      ids,
      ids_with_special_tokens: tokenizer.encode(text),
      decoded: decode(false),
      decoded_skipping_special: decode(true),
    };
  });
}
const out = join(root, "tests/data/hf_tokenizer_fixtures.json");
writeFileSync(out, JSON.stringify(fixtures, null, 1) + "\n");
console.log(`wrote ${out}`);
