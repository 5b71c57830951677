// Reference chat-template renderings from @huggingface/jinja (npm; the Jinja implementation of
// transformers.js), used by tests/tokenizer/chat_template_conformance_test.cpp.
//
// usage: node tools/chat_template_ref.mjs <conversations.json> <name>=<tokenizer_config.json>...
// For every template, every conversation and every combination of add_generation_prompt
// (false/true) and enable_thinking (absent/true/false), renders the template with the context
//   { [bos_token], eos_token, [tools], [enable_thinking], messages, add_generation_prompt }
// (bos_token/eos_token from the tokenizer_config.json when they are strings; tools from the
// conversation when present and non-empty) and writes one JSON object per line:
//   {"template": name, "case": index, "add_generation_prompt": b, "enable_thinking": b|null,
//    "output": "..."}   or   {..., "error": "message"} when rendering throws.
import { createRequire } from 'node:module';
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(path.join(here, 'npm', 'package.json'));
const { Template } = require('@huggingface/jinja');

const [convPath, ...tmplArgs] = process.argv.slice(2);
if (!convPath || tmplArgs.length === 0) {
  console.error('usage: node tools/chat_template_ref.mjs <conversations.json> <name>=<tokenizer_config.json>...');
  process.exit(2);
}

const cases = JSON.parse(readFileSync(convPath, 'utf8')).cases;
const lines = [];
for (const arg of tmplArgs) {
  const eq = arg.indexOf('=');
  const name = arg.slice(0, eq);
  const cfg = JSON.parse(readFileSync(arg.slice(eq + 1), 'utf8'));
  const tmpl = new Template(cfg.chat_template);
  cases.forEach((c, i) => {
    for (const agp of [false, true]) {
      for (const thinking of [null, true, false]) {
        const ctx = {};
        if (typeof cfg.bos_token === 'string') ctx.bos_token = cfg.bos_token;
        if (typeof cfg.eos_token === 'string') ctx.eos_token = cfg.eos_token;
        if (Array.isArray(c.tools) && c.tools.length > 0) ctx.tools = c.tools;
        if (thinking !== null) ctx.enable_thinking = thinking;
        ctx.messages = c.messages;
        ctx.add_generation_prompt = agp;
        const rec = { template: name, case: i, add_generation_prompt: agp, enable_thinking: thinking };
        try {
          rec.output = tmpl.render(ctx);
        } catch (e) {
          rec.error = String(e && e.message ? e.message : e);
        }
        lines.push(JSON.stringify(rec));
      }
    }
  });
}
process.stdout.write(lines.join('\n') + '\n');
