// Reference token ids from the Hugging Face tokenizer (Rust `tokenizers`, Node bindings from npm).
//
// usage: node tools/tokenizer_ref.mjs <tokenizer.json> <corpus.jsonl> [<corpus_b64.jsonl>...]
//   corpus.jsonl:     one JSON string per line (valid UTF-8 text).
//   corpus_b64.jsonl: (any number of files) one JSON string per line holding base64 bytes (possibly invalid UTF-8). The bytes
//                     are turned into a JS string with Buffer.toString('utf8'), which replaces each
//                     maximal ill-formed subsequence by U+FFFD: that string is what the HF tokenizer sees.
// Writes one JSON object per case to stdout, in corpus order (text cases first, then each base64 file's):
//   {"ids": [...], "decoded": "<decode(ids)>", "decoded_skip": "<decode(ids, skip_special)>"}
// Encoding adds no special tokens (addSpecialTokens: false), like hypic's Tokenizer::encode.
import { createRequire } from 'node:module';
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(path.join(here, 'npm', 'package.json'));
const { Tokenizer } = require('tokenizers');

const [tokPath, corpusPath, ...b64Paths] = process.argv.slice(2);
if (!tokPath || !corpusPath) {
  console.error('usage: node tools/tokenizer_ref.mjs <tokenizer.json> <corpus.jsonl> [<corpus_b64.jsonl>...]');
  process.exit(2);
}

const lines = (p) =>
  readFileSync(p, 'utf8')
    .split('\n')
    .filter((l) => l.length > 0)
    .map((l) => JSON.parse(l));

const texts = lines(corpusPath);
for (const p of b64Paths) for (const b of lines(p)) texts.push(Buffer.from(b, 'base64').toString('utf8'));

const tok = Tokenizer.fromFile(tokPath);
const out = [];
for (const t of texts) {
  const enc = await tok.encode(t, null, { addSpecialTokens: false });
  const ids = enc.getIds();
  const decoded = await tok.decode(ids, false);
  const decodedSkip = await tok.decode(ids, true);
  out.push(JSON.stringify({ ids, decoded, decoded_skip: decodedSkip }));
}
process.stdout.write(out.join('\n') + '\n');
