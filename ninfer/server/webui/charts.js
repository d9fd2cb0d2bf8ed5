// A small line chart on a canvas: the last few minutes of samples, several series, own y scale.
"use strict";

function drawLineChart(canvas, samples, series) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  if (canvas.width !== width * ratio || canvas.height !== height * ratio) {
    canvas.width = width * ratio;
    canvas.height = height * ratio;
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const left = 44, right = 8, top = 8, bottom = 18;
  const w = width - left - right, h = height - top - bottom;
  let max = 0;
  for (const s of samples) for (const line of series) {
    const v = s[line.key];
    if (typeof v === "number" && v > max) max = v;
  }
  max = niceCeiling(max);
  ctx.strokeStyle = "#2a3640";
  ctx.fillStyle = "#8b98a5";
  ctx.font = "11px system-ui, sans-serif";
  ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const y = top + h - (h * i) / 4;
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(left + w, y); ctx.stroke();
    ctx.fillText(shortNumber((max * i) / 4), 4, y + 4);
  }
  if (samples.length < 2) return;
  const t0 = samples[0].t, t1 = samples[samples.length - 1].t;
  const span = Math.max(t1 - t0, 1);
  ctx.fillText(Math.round(span) + " s", left + w - 30, top + h + 14);
  for (const line of series) {
    ctx.strokeStyle = line.color;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let started = false;
    for (const s of samples) {
      const v = s[line.key];
      if (typeof v !== "number") { started = false; continue; }
      const x = left + ((s.t - t0) / span) * w;
      const y = top + h - (max ? (v / max) * h : 0);
      if (started) ctx.lineTo(x, y); else { ctx.moveTo(x, y); started = true; }
    }
    ctx.stroke();
  }
}

function niceCeiling(v) {
  if (v <= 0) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function shortNumber(v) {
  if (v >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (v >= 1e3) return (v / 1e3).toFixed(1) + "k";
  return String(Math.round(v * 10) / 10);
}
