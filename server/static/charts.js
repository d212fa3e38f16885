// Pure chart builders for the dashboard: data in, SVG text out, no DOM. Every string
// that came from the server passes through esc(). Loaded by the page as a plain script
// (window.DstackCharts) and by node in the tests (module.exports).
(function (root) {
  "use strict";

  var PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
                 "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];

  function esc(s) {
    return String(s).replace(/[&<>"']/g, function (c) {
      return {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c];
    });
  }

  // A replica "m#1" is drawn in its model's colour.
  function baseName(name) { return String(name).split("#")[0]; }

  function colors(names) {
    var out = {};
    names.forEach(function (n, i) { out[n] = PALETTE[i % PALETTE.length]; });
    return out;
  }

  function fmt(v, digits) {
    if (v === null || v === undefined || !isFinite(v)) return "–";
    var d = digits === undefined ? (Math.abs(v) >= 100 ? 0 : Math.abs(v) >= 10 ? 1 : 2) : digits;
    return Number(v).toFixed(d);
  }

  // Each slot gets a vertical place [y0, y0 + percent): the lowest one that no slot
  // overlapping it in time already holds (first fit, slots by start), so side-by-side
  // lanes stack and the turns within a lane line up.
  function layoutSlots(schedule) {
    var slots = (schedule && schedule.slots ? schedule.slots : []).slice();
    slots.sort(function (a, b) { return a.start_ms - b.start_ms || b.percent - a.percent; });
    var placed = [];
    slots.forEach(function (s) {
      var end = s.start_ms + s.duration_ms;
      var busy = placed.filter(function (p) { return p.start_ms < end && s.start_ms < p.end_ms; })
        .map(function (p) { return [p.y0, p.y0 + p.percent]; })
        .sort(function (a, b) { return a[0] - b[0]; });
      var y = 0;
      busy.forEach(function (b) { if (b[0] < y + s.percent - 1e-9 && b[1] > y + 1e-9) y = b[1]; });
      placed.push({model: s.model, start_ms: s.start_ms, end_ms: end, percent: s.percent, y0: y});
    });
    return placed;
  }

  // The cycle as a time x slice chart: x is time in the cycle, y the share of the device.
  function scheduleSvg(schedule, colorOf, W, H) {
    W = W || 720; H = H || 220;
    var L = 44, R = 8, T = 8, B = 26, pw = W - L - R, ph = H - T - B;
    var cycle = schedule.cycle_ms || 1;
    var out = ['<svg viewBox="0 0 ' + W + " " + H +
               '" class="chart" role="img" aria-label="schedule">'];
    [0, 25, 50, 75, 100].forEach(function (p) {
      var y = T + ph * (1 - p / 100);
      out.push('<line class="grid" x1="' + L + '" x2="' + (W - R) + '" y1="' + y + '" y2="' + y + '"/>');
      out.push('<text class="tick" x="' + (L - 4) + '" y="' + (y + 4) + '" text-anchor="end">' + p + "%</text>");
    });
    for (var k = 0; k <= 4; k++) {
      var x = L + pw * k / 4;
      out.push('<text class="tick" x="' + x + '" y="' + (H - 8) + '" text-anchor="middle">' +
               fmt(cycle * k / 4) + " ms</text>");
    }
    layoutSlots(schedule).forEach(function (s) {
      var x0 = L + pw * s.start_ms / cycle, x1 = L + pw * Math.min(s.end_ms, cycle) / cycle;
      var y1 = T + ph * (1 - s.y0 / 100), y0 = T + ph * (1 - (s.y0 + s.percent) / 100);
      var w = Math.max(1, x1 - x0), h = Math.max(1, y1 - y0);
      var tip = s.model + ": " + fmt(s.start_ms) + "–" + fmt(s.end_ms) + " ms, " + fmt(s.percent) + "%";
      out.push('<g class="slot"><title>' + esc(tip) + "</title>" +
               '<rect x="' + x0.toFixed(1) + '" y="' + y0.toFixed(1) + '" width="' + w.toFixed(1) +
               '" height="' + h.toFixed(1) + '" fill="' + (colorOf[baseName(s.model)] || "#888") + '"/>');
      if (w > 8 * String(s.model).length && h > 14) {
        out.push('<text class="label" x="' + (x0 + 4).toFixed(1) + '" y="' + (y0 + 14).toFixed(1) + '">' +
                 esc(s.model) + "</text>");
      }
      out.push("</g>");
    });
    out.push("</svg>");
    return out.join("");
  }

  // Lines over time. t: seconds before now (<= 0); lines: [{label, color, values, dash}],
  // a null value is a gap. opts: {windowS, yMax (fixed top), unit}.
  function lineSvg(t, lines, opts) {
    opts = opts || {};
    var W = 360, H = 150, L = 40, R = 14, T = 8, B = 20, pw = W - L - R, ph = H - T - B;
    var win = opts.windowS || 300;
    var top = opts.yMax;
    if (top === undefined) {
      top = 0;
      lines.forEach(function (l) { l.values.forEach(function (v) { if (v !== null && v > top) top = v; }); });
      top = top > 0 ? top * 1.1 : 1;
    }
    function X(s) { return L + pw * (1 + s / win); }
    function Y(v) { return T + ph * (1 - Math.min(v, top) / top); }
    var out = ['<svg viewBox="0 0 ' + W + " " + H +
               '" class="chart" role="img">'];
    [0, 0.5, 1].forEach(function (f) {
      var y = T + ph * (1 - f);
      out.push('<line class="grid" x1="' + L + '" x2="' + (W - R) + '" y1="' + y + '" y2="' + y + '"/>');
      out.push('<text class="tick" x="' + (L - 4) + '" y="' + (y + 4) + '" text-anchor="end">' +
               esc(fmt(top * f) + (opts.unit || "")) + "</text>");
    });
    for (var m = 0; m <= win / 60; m++) {
      out.push('<text class="tick" x="' + X(-m * 60).toFixed(1) + '" y="' + (H - 5) +
               '" text-anchor="middle">' + (m ? "-" + m + "m" : "now") + "</text>");
    }
    lines.forEach(function (l) {
      var d = "", pen = "M";
      for (var i = 0; i < t.length; i++) {
        var v = l.values[i];
        if (v === null || v === undefined || t[i] < -win) { pen = "M"; continue; }
        d += pen + X(t[i]).toFixed(1) + " " + Y(v).toFixed(1) + " ";
        pen = "L";
      }
      if (d) {
        out.push('<path class="line" d="' + d.trim() + '" stroke="' + l.color + '"' +
                 (l.dash ? ' stroke-dasharray="' + l.dash + '"' : "") + "><title>" +
                 esc(l.label) + "</title></path>");
      }
    });
    out.push("</svg>");
    return out.join("");
  }

  // The mean of the non-null values among the last n (null if none).
  function recent(values, n) {
    var xs = values.slice(-n).filter(function (v) { return v !== null && v !== undefined; });
    if (!xs.length) return null;
    return xs.reduce(function (a, b) { return a + b; }, 0) / xs.length;
  }

  var api = {esc: esc, colors: colors, baseName: baseName, fmt: fmt, layoutSlots: layoutSlots,
             scheduleSvg: scheduleSvg, lineSvg: lineSvg, recent: recent};
  if (typeof module !== "undefined" && module.exports) module.exports = api;
  else root.DstackCharts = api;
})(this);
