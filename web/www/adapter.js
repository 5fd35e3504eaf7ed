// The browser's own words for its adapter (wgpu sees only a description,
// which Chromium leaves empty).
export async function browserAdapter(fallback) {
  const a = navigator.gpu ? await navigator.gpu.requestAdapter() : null;
  if (!a || !fallback.includes("BrowserWebGpu")) return fallback;
  const i = a.info || {};
  return `WebGPU: ${[i.vendor, i.architecture, i.description].filter(Boolean).join(" ")}${a.isFallbackAdapter || i.isFallbackAdapter ? " (software)" : ""}`;
}
