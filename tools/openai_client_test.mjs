// Drives a running `hypic serve` with the official `openai` npm client, unchanged, and checks the
// shapes it returns. Exits 0 when every check passes, else 1 with one line per mismatch.
//
//   node tools/openai_client_test.mjs http://127.0.0.1:8080/v1
//
// The client is installed in tools/npm by scripts/install-deps.sh (npm ci).
import { createRequire } from "node:module";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(path.join(here, "npm", "package.json"));
let OpenAI;
try {
  OpenAI = (await import(require.resolve("openai"))).default;
} catch (e) {
  console.error(`cannot load the npm 'openai' package from tools/npm (${e.message}): run scripts/install-deps.sh`);
  process.exit(2);
}

const baseURL = process.argv[2];
if (!baseURL) {
  console.error("usage: node tools/openai_client_test.mjs BASE_URL   (e.g. http://127.0.0.1:8080/v1)");
  process.exit(2);
}

const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0, timeout: 120_000 });
const failures = [];
let checks = 0;
function check(cond, what, got) {
  ++checks;
  if (!cond) failures.push(`${what}${got === undefined ? "" : ` (got ${JSON.stringify(got)})`}`);
}
const isInt = (x) => Number.isInteger(x);
const FINISH = ["stop", "length"];

function checkUsage(u, where) {
  check(u && typeof u === "object", `${where}: usage is an object`, u);
  if (!u) return;
  check(isInt(u.prompt_tokens) && u.prompt_tokens > 0, `${where}: usage.prompt_tokens > 0`, u.prompt_tokens);
  check(isInt(u.completion_tokens) && u.completion_tokens >= 0, `${where}: usage.completion_tokens`, u.completion_tokens);
  check(u.total_tokens === u.prompt_tokens + u.completion_tokens, `${where}: total = prompt + completion`, u);
  check(isInt(u.prompt_tokens_details?.cached_tokens), `${where}: usage.prompt_tokens_details.cached_tokens`, u);
}

async function step(name, fn) {
  try {
    await fn();
  } catch (e) {
    ++checks;
    failures.push(`${name}: threw ${e?.constructor?.name ?? "error"}: ${e?.message ?? e}`);
  }
}

let model = "";

await step("models.list", async () => {
  const ids = [];
  for await (const m of client.models.list()) {
    ids.push(m.id);
    check(m.object === "model", "models.list: object == 'model'", m.object);
    check(typeof m.owned_by === "string", "models.list: owned_by is a string", m.owned_by);
    check(isInt(m.created), "models.list: created is an integer", m.created);
  }
  check(ids.length === 1, "models.list: exactly one model", ids);
  model = ids[0] ?? "";
  const one = await client.models.retrieve(model).catch(() => null);
  if (one) check(one.id === model, "models.retrieve: id", one.id);
});

const greedy = { temperature: 0, max_tokens: 8 };

let completionText = null;
await step("completions", async () => {
  const r = await client.completions.create({ model, prompt: "The capital of France is", ...greedy });
  check(typeof r.id === "string" && r.id.startsWith("cmpl-"), "completions: id starts with cmpl-", r.id);
  check(r.object === "text_completion", "completions: object", r.object);
  check(r.model === model, "completions: model", r.model);
  check(isInt(r.created), "completions: created", r.created);
  check(Array.isArray(r.choices) && r.choices.length === 1, "completions: one choice", r.choices);
  const c = r.choices?.[0];
  check(c?.index === 0, "completions: choices[0].index", c?.index);
  check(typeof c?.text === "string", "completions: choices[0].text is a string", c?.text);
  check(FINISH.includes(c?.finish_reason), "completions: finish_reason", c?.finish_reason);
  checkUsage(r.usage, "completions");
  completionText = c?.text ?? null;
});

await step("completions stream", async () => {
  const stream = await client.completions.create({ model, prompt: "The capital of France is", ...greedy, stream: true });
  let text = "";
  let finish = null;
  let n = 0;
  let id = null;
  for await (const ch of stream) {
    ++n;
    check(ch.object === "text_completion", "completions stream: chunk object", ch.object);
    id ??= ch.id;
    check(ch.id === id, "completions stream: one id for every chunk", ch.id);
    check(ch.usage == null, "completions stream: no usage without include_usage", ch.usage);
    for (const c of ch.choices) {
      text += c.text ?? "";
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  check(n >= 1, "completions stream: at least one chunk", n);
  check(FINISH.includes(finish), "completions stream: a finish_reason", finish);
  if (completionText !== null) check(text === completionText, "completions stream: text equals non-streaming", text);
});

const chatMessages = [
  { role: "system", content: "You are a terse assistant." },
  { role: "user", content: "Name a colour." },
];
let chatText = null;
await step("chat.completions", async () => {
  const r = await client.chat.completions.create({ model, messages: chatMessages, ...greedy });
  check(typeof r.id === "string" && r.id.startsWith("chatcmpl-"), "chat: id starts with chatcmpl-", r.id);
  check(r.object === "chat.completion", "chat: object", r.object);
  check(r.model === model, "chat: model", r.model);
  check(r.choices?.length === 1, "chat: one choice", r.choices);
  const c = r.choices?.[0];
  check(c?.index === 0, "chat: choices[0].index", c?.index);
  check(c?.message?.role === "assistant", "chat: message.role", c?.message?.role);
  check(typeof c?.message?.content === "string", "chat: message.content is a string", c?.message?.content);
  check(FINISH.includes(c?.finish_reason), "chat: finish_reason", c?.finish_reason);
  checkUsage(r.usage, "chat");
  check(r.usage?.prompt_tokens > 8, "chat: the template added role tokens", r.usage?.prompt_tokens);
  chatText = c?.message?.content ?? null;
});

await step("chat.completions stream", async () => {
  const stream = await client.chat.completions.create({ model, messages: chatMessages, ...greedy, stream: true });
  let text = "";
  let role = null;
  let finish = null;
  for await (const ch of stream) {
    check(ch.object === "chat.completion.chunk", "chat stream: chunk object", ch.object);
    check(typeof ch.id === "string" && ch.id.startsWith("chatcmpl-"), "chat stream: chunk id", ch.id);
    for (const c of ch.choices) {
      if (c.delta?.role) role = c.delta.role;
      text += c.delta?.content ?? "";
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  check(role === "assistant", "chat stream: a delta with role assistant", role);
  check(FINISH.includes(finish), "chat stream: a finish_reason", finish);
  if (chatText !== null) check(text === chatText, "chat stream: text equals non-streaming", text);
});

await step("chat stream include_usage", async () => {
  const stream = await client.chat.completions.create({
    model,
    messages: chatMessages,
    ...greedy,
    stream: true,
    stream_options: { include_usage: true },
  });
  let usage = null;
  let usageChunks = 0;
  let last = null;
  for await (const ch of stream) {
    last = ch;
    if (ch.usage) {
      ++usageChunks;
      usage = ch.usage;
      check(Array.isArray(ch.choices) && ch.choices.length === 0, "include_usage: the usage chunk has no choices", ch.choices);
    }
  }
  check(usageChunks === 1, "include_usage: exactly one usage chunk", usageChunks);
  check(last?.usage != null, "include_usage: the usage chunk is the last one", last);
  checkUsage(usage, "include_usage");
});

// RAG: the same documents twice (shuffled the second time); the second request reuses them.
const docs = [
  "Document one: the river flows north through the old valley and feeds the lake.",
  "Document two: bakers in the town rise before dawn to prepare bread for the market.",
  "Document three: the lighthouse keeper logs every ship that passes the rocky point.",
];
const ragPrompt = (order) =>
  ["You answer questions using the documents.", ...order.map((i) => docs[i]), "Question: what does the keeper log?"].join(
    "<<PIC_SEP>>",
  );
await step("completions RAG reuse", async () => {
  const r1 = await client.completions.create({ model, prompt: ragPrompt([0, 1, 2]), ...greedy });
  checkUsage(r1.usage, "RAG 1");
  const r2 = await client.completions.create({ model, prompt: ragPrompt([2, 0, 1]), ...greedy });
  checkUsage(r2.usage, "RAG 2");
  const cached = r2.usage?.prompt_tokens_details?.cached_tokens;
  check(cached > 0, "RAG 2: cached_tokens > 0 on the repeated documents", cached);
  check(cached < r2.usage?.prompt_tokens, "RAG 2: cached_tokens < prompt_tokens", r2.usage);
  check(r2.pic?.hit_segments === 4, "RAG 2: pic.hit_segments == 4 (extension field passed through)", r2.pic);
  const full = await client.completions.create({ model, prompt: ragPrompt([1, 2, 0]), ...greedy, pic: { mode: "full" } });
  check(full.usage?.prompt_tokens_details?.cached_tokens === 0, "RAG full mode: cached_tokens == 0", full.usage);
});

await step("chat RAG with cache: segment parts, streamed with usage", async () => {
  const msgs = (order) => [
    { role: "system", content: "Use the documents." },
    {
      role: "user",
      content: [
        ...order.map((i) => ({ type: "text", text: docs[i], cache: "segment" })),
        { type: "text", text: "Which document mentions bread?" },
      ],
    },
  ];
  const r1 = await client.chat.completions.create({ model, messages: msgs([0, 1]), ...greedy });
  checkUsage(r1.usage, "chat RAG 1");
  const stream = await client.chat.completions.create({
    model,
    messages: msgs([1, 0]),
    ...greedy,
    stream: true,
    stream_options: { include_usage: true },
  });
  let usage = null;
  for await (const ch of stream) if (ch.usage) usage = ch.usage;
  checkUsage(usage, "chat RAG 2");
  check(usage?.prompt_tokens_details?.cached_tokens > 0, "chat RAG 2: cached_tokens > 0", usage);
});

await step("error shape", async () => {
  let err = null;
  try {
    await client.completions.create({ model: "no-such-model", prompt: "x", max_tokens: 1 });
  } catch (e) {
    err = e;
  }
  check(err instanceof OpenAI.NotFoundError, "unknown model: the client raises NotFoundError", err?.constructor?.name);
  check(err?.status === 404, "unknown model: status 404", err?.status);
  check(typeof err?.error?.message === "string", "unknown model: error.message", err?.error);
});

if (failures.length) {
  console.error(`openai client test: ${failures.length} of ${checks} checks failed against ${baseURL}:`);
  for (const f of failures) console.error(`  - ${f}`);
  process.exit(1);
}
console.log(`openai client test: ${checks} checks passed against ${baseURL} (model ${model})`);
