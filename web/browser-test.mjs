// The browser tests: serve web/dist on 127.0.0.1, open the WebGPU suite and
// the demo page in Debian's headless chromium (WebGPU on SwiftShader), and
// fail unless every suite case matches the native values and the demo's
// accuracy equals the native CLI's. Never skips: no adapter is a failure.
//
//   node web/browser-test.mjs DIST_DIR EXPECTED_ACCURACY SCREENSHOT.png [MINILM_FIXTURE.json]
//
// With a MiniLM fixture (the native similarities, from web-fixtures), the
// demo page also runs its MiniLM panel and must match it within 1e-4.
import { chromium } from "playwright-core";
import http from "node:http";
import fs from "node:fs";
import path from "node:path";

const [dist, expectedAccuracy, screenshot, minilmFixture] = process.argv.slice(2);
if (!dist || expectedAccuracy === undefined || !screenshot) {
  console.error("usage: node browser-test.mjs DIST_DIR EXPECTED_ACCURACY SCREENSHOT.png");
  process.exit(2);
}
const types = { ".html": "text/html", ".js": "text/javascript", ".wasm": "application/wasm", ".json": "application/json" };
const root = path.resolve(dist);
const server = http.createServer((req, res) => {
  const file = path.join(root, decodeURIComponent(new URL(req.url, "http://x").pathname));
  if (!file.startsWith(root) || !fs.existsSync(file) || fs.statSync(file).isDirectory()) {
    res.writeHead(404).end();
    return;
  }
  res.writeHead(200, { "content-type": types[path.extname(file)] || "application/octet-stream" });
  fs.createReadStream(file).pipe(res);
});
await new Promise((r) => server.listen(0, "127.0.0.1", r));
const base = `http://127.0.0.1:${server.address().port}`;

const launch = (webgpu) => chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu-sandbox", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-quic", ...(webgpu ? ["--enable-unsafe-webgpu"] : [])],
});
let browser = await launch(true);
let failed = false;
const fail = (msg) => { console.error(`browser-test: FAIL ${msg}`); failed = true; };

async function open(url, timeout) {
  const page = await browser.newPage({ viewport: { width: 1180, height: 900 } });
  page.on("console", (m) => { if (m.type() === "error") console.error(`  [page] ${m.text()}`); });
  page.on("pageerror", (e) => console.error(`  [page] ${e}`));
  await page.goto(url);
  await page.waitForSelector("body[data-done]", { timeout });
  return [page, await page.evaluate(() => window.__result)];
}

try {
  const t0 = Date.now();
  const [suitePage, suite] = await open(`${base}/suite.html?device=gpu`, 300_000);
  console.log(`browser-test: suite on ${suite.adapter ?? "no adapter"} (${((Date.now() - t0) / 1000).toFixed(1)} s)`);
  for (const c of suite.cases ?? []) {
    console.log(`  ${c.ok ? "ok  " : "FAIL"} ${c.name} (worst ${c.worst === null ? "inf" : Number(c.worst).toExponential(2)} of tolerance)${c.error ? ": " + c.error : ""}`);
  }
  if (!suite.ok) fail(`WebGPU suite: ${suite.error ?? "a case differs from the native values"}`);
  if (!String(suite.device ?? "").startsWith("Gpu")) fail(`the suite ran on ${suite.device}, not the browser's WebGPU adapter`);
  await suitePage.close();

  const t1 = Date.now();
  const [demo, res] = await open(`${base}/index.html?device=gpu&limit=1000${minilmFixture ? "&minilm=1" : ""}`, 600_000);
  await demo.screenshot({ path: screenshot, fullPage: true });
  if (!res.ok) {
    fail(`demo page: ${res.error}`);
  } else {
    console.log(`browser-test: demo ${res.model} on ${res.adapter}: accuracy ${res.accuracy} on ${res.labels.length} images (${((Date.now() - t1) / 1000).toFixed(1)} s); native CLI: ${expectedAccuracy}`);
    if (res.labels.length !== 1000) fail(`the demo classified ${res.labels.length} images, not 1000`);
    if (Math.abs(res.accuracy - Number(expectedAccuracy)) > 1e-9) fail(`demo accuracy ${res.accuracy} differs from the native CLI's ${expectedAccuracy}`);
    if (minilmFixture) {
      const want = JSON.parse(fs.readFileSync(minilmFixture, "utf8")).similarity;
      const got = res.minilm?.similarity ?? [];
      const worst = got.length === want.length ? Math.max(...got.map((v, i) => Math.abs(v - want[i]))) : Infinity;
      console.log(`browser-test: MiniLM similarities of ${Math.round(Math.sqrt(got.length))} sentences on ${res.minilm?.adapter}: largest difference from native ${worst.toExponential(2)}`);
      if (!(worst <= 1e-4)) fail(`MiniLM similarities differ from the native ones by ${worst}`);
    }
  }
  console.log(`browser-test: screenshot ${screenshot}`);

  // Without WebGPU (Chromium on Linux offers none unless asked), the page
  // falls back to the CPU executor, single-threaded in WebAssembly.
  await browser.close();
  browser = await launch(false);
  const t2 = Date.now();
  const [, cpu] = await open(`${base}/index.html?device=auto&limit=1000`, 300_000);
  if (!cpu.ok) {
    fail(`demo page without WebGPU: ${cpu.error}`);
  } else {
    console.log(`browser-test: demo without WebGPU on ${cpu.adapter}: accuracy ${cpu.accuracy} (${((Date.now() - t2) / 1000).toFixed(1)} s)`);
    if (!cpu.adapter.startsWith("CPU executor")) fail(`without WebGPU the page ran on ${cpu.adapter}, not the CPU executor`);
    if (Math.abs(cpu.accuracy - Number(expectedAccuracy)) > 1e-9) fail(`CPU-fallback accuracy ${cpu.accuracy} differs from the native CLI's ${expectedAccuracy}`);
  }
} catch (e) {
  fail(String(e));
} finally {
  await browser.close();
  server.close();
}
process.exit(failed ? 1 : 0);
