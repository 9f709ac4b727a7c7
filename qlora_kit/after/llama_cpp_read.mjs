// llama.cpp itself reading a GGUF export, for the parity report (qlora_kit/after/llama_cpp_reader.py).
// Usage: node llama_cpp_read.mjs <node-llama-cpp entry (dist/index.js)> <job.json> <out folder>
// job: {model, lora?, texts: [...], items: [{prompt: [ids], answer: [ids], greedy: n}]}
// out: result.json ({served: [[ids]], greedy: [[ids]], bos, vocab}) and logits.f32, the raw logits that
// predict each answer token under teacher forcing, item after item, (sum of answer lengths, vocab) rows.
import {writeFileSync, readFileSync} from "node:fs";
import {join} from "node:path";
import {pathToFileURL} from "node:url";

const [entry, jobPath, outDir] = process.argv.slice(2);
const {getLlama, LlamaLogLevel} = await import(pathToFileURL(entry).href);
const job = JSON.parse(readFileSync(jobPath, "utf8"));
// the prebuilt CPU binary only: never a download or a build at run time
const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error});
const model = await llama.loadModel({modelPath: job.model});
let vocab = 0; // the full logits map of the first answer position: every token of the vocabulary
const lora = job.lora ? {adapters: [{filePath: job.lora, scale: 1}]} : undefined;
const context = await model.createContext({contextSize: 1024, batchSize: 1024, lora, threads: 2});
const bos = model.tokens.bos;
const prepend = model.tokens.shouldPrependBosToken && bos != null;
// what a server sends: the text with special tokens parsed, BOS first where the GGUF asks for it
const served = job.texts.map((text) => [...(prepend ? [bos] : []), ...model.tokenize(text, true)]);

const rows = [];
const greedy = [];
for (const item of job.items) {
    const sequence = context.getSequence();
    const tokens = [...item.prompt, ...item.answer];
    const wanted = new Set(item.answer.map((_, i) => item.prompt.length - 1 + i));
    const input = tokens.map((t, i) => (wanted.has(i) ? [t, {generateNext: {logits: true}}] : t));
    const output = await sequence.controlledEvaluate(input);
    for (let i = item.prompt.length - 1; i < tokens.length - 1; i++) {
        if (!vocab) vocab = output[i].next.logits.size;
        const row = new Float32Array(vocab);
        for (const [token, logit] of output[i].next.logits) row[token] = logit;
        rows.push(row);
    }
    await sequence.clearHistory();
    // N argmax steps with no stop token, as the transformers reader takes them
    const got = [];
    if (item.greedy > 0) {
        for await (const token of sequence.evaluate(item.prompt, {temperature: 0, yieldEogToken: true})) {
            got.push(token);
            if (got.length >= item.greedy) break;
        }
    }
    greedy.push(got);
    sequence.dispose();
}
const flat = new Float32Array(rows.length * vocab);
rows.forEach((row, i) => flat.set(row, i * vocab));
writeFileSync(join(outDir, "logits.f32"), Buffer.from(flat.buffer));
writeFileSync(join(outDir, "result.json"), JSON.stringify({served, greedy, bos: prepend ? bos : null, vocab}));
await context.dispose();
await model.dispose();
await llama.dispose();
