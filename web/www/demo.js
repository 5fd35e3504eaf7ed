// The demo page: fetch the checkpoint and the test set, classify on the
// device asked for (?device=auto|gpu|cpu, default auto), draw the images.
import init, { classify, minilm_similarity } from "./pkg/voltaic_web.js";
import { browserAdapter } from "./adapter.js";

const params = new URLSearchParams(location.search);
const device = params.get("device") || "auto";
const limit = Number(params.get("limit") || 1000);
const shown = 48;

async function bytes(url) {
  const r = await fetch(url);
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return new Uint8Array(await r.arrayBuffer());
}

function draw(grid, res) {
  for (let i = 0; i < Math.min(shown, res.predictions.length); i++) {
    const p = res.predictions[i], t = res.labels[i];
    const cell = document.createElement("div");
    cell.className = "cell " + (p === t ? "ok" : "bad");
    const c = document.createElement("canvas");
    c.width = 28; c.height = 28;
    const ctx = c.getContext("2d");
    const img = ctx.createImageData(28, 28);
    for (let k = 0; k < 784; k++) {
      const v = 255 - res.pixels[i * 784 + k];
      img.data.set([v, v, v, 255], 4 * k);
    }
    ctx.putImageData(img, 0, 0);
    cell.append(c);
    cell.insertAdjacentHTML("beforeend", `<div class="pred">${res.classes[p]}</div><div class="truth">${res.classes[t]}</div>`);
    grid.append(cell);
  }
}

async function text(url) {
  return new TextDecoder().decode(await bytes(url));
}

// The MiniLM panel: fetch the model's files, embed, draw the similarities.
async function minilm() {
  const box = document.getElementById("minilm");
  box.textContent = "Loading all-MiniLM-L6-v2…";
  const dir = "data/minilm/";
  const [config, model, tokenizer, sbert] = await Promise.all([
    text(dir + "config.json"), bytes(dir + "model.safetensors"),
    bytes(dir + "tokenizer.json"), text(dir + "sentence_bert_config.json"),
  ]);
  const t0 = performance.now();
  const res = JSON.parse(await minilm_similarity(device, config, model, tokenizer, sbert, ""));
  const ms = performance.now() - t0;
  res.adapter = await browserAdapter(res.adapter);
  const n = res.sentences.length;
  const cell = (v) => `<td style="background: rgba(42,157,75,${Math.max(0, v).toFixed(2)})">${v.toFixed(3)}</td>`;
  let html = `<table class="sim"><tr><th></th>${res.sentences.map((_, j) => `<th>${j + 1}</th>`).join("")}</tr>`;
  for (let i = 0; i < n; i++) {
    html += `<tr><th>${i + 1}. ${res.sentences[i]}</th>${res.similarity.slice(i * n, i * n + n).map(cell).join("")}</tr>`;
  }
  box.innerHTML = html + `</table><div class="sub">${res.adapter}, ${ms.toFixed(0)} ms</div>`;
  return res;
}

async function main() {
  await init();
  const [ckpt, images, labels] = await Promise.all([
    bytes("data/model.safetensors"),
    bytes("data/t10k-images-idx3-ubyte.gz"),
    bytes("data/t10k-labels-idx1-ubyte.gz"),
  ]);
  const t0 = performance.now();
  const res = JSON.parse(await classify(device, ckpt, images, labels, limit));
  const ms = performance.now() - t0;
  res.adapter = await browserAdapter(res.adapter);
  document.getElementById("adapter").textContent = res.adapter;
  document.getElementById("model").textContent = res.model.toUpperCase();
  document.getElementById("accuracy").textContent =
    `${(100 * res.accuracy).toFixed(2)}% of ${res.labels.length}`;
  document.getElementById("time").textContent = `${ms.toFixed(0)} ms`;
  draw(document.getElementById("grid"), res);
  delete res.pixels;
  return res;
}

document.getElementById("load-minilm").onclick = () =>
  minilm().catch((e) => { document.getElementById("minilm").innerHTML = `<div class="error">${e}</div>`; });

main().then(
  async (res) => {
    window.__result = { ok: true, ...res };
    if (params.get("minilm") === "1") {
      try { window.__result.minilm = await minilm(); }
      catch (e) { window.__result = { ok: false, error: `MiniLM: ${e}` }; document.getElementById("minilm").innerHTML = `<div class="error">${e}</div>`; }
    }
    document.body.dataset.done = "1";
  },
  (e) => {
    document.getElementById("error").textContent = String(e);
    window.__result = { ok: false, error: String(e) };
    document.body.dataset.done = "1";
  },
);
